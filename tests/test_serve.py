"""The HTTP service, in process (httpx on the ASGI app): every endpoint and every way a request can be
refused, the metrics it exports, and the `precompile serve` command's own checks."""

from __future__ import annotations

import asyncio
import json
import os
import shutil
import subprocess
import sys
import time
from dataclasses import replace
from pathlib import Path

import httpx
import pytest
import torch
from click.testing import CliRunner
from prometheus_client.parser import text_string_to_metric_families

from loader import GuardError, Live
from loader.artifact import manifest_digest, read_manifest, read_manifest_with_bytes
from loader.manifest import DimRange
from precompile.cli import main
from precompile.serve.app import create_app
from precompile.serve.codec import MIN_BODY_BYTES, body_limit
from precompile.serve.config import ServeConfig
from precompile.serve.metrics import guard_reason, size_bucket

ROOT = Path(__file__).resolve().parent.parent


class AppClient:
    """httpx on the app in process, synchronously (each request on its own event loop).

    ``with AppClient(app)`` starts and stops the service as the app's lifespan does (loading,
    watching, recording); without ``with`` nothing starts.
    """

    def __init__(self, app):
        self.app = app

    def __enter__(self):
        self.app.state.service.start()
        return self

    def __exit__(self, *exc):
        self.app.state.service.stop()

    def request(self, method: str, url: str, **kwargs) -> httpx.Response:
        async def send():
            transport = httpx.ASGITransport(app=self.app)
            async with httpx.AsyncClient(transport=transport, base_url="http://test") as client:
                return await client.request(method, url, **kwargs)

        return asyncio.run(send())

    def get(self, url: str, **kwargs) -> httpx.Response:
        return self.request("GET", url, **kwargs)

    def post(self, url: str, **kwargs) -> httpx.Response:
        return self.request("POST", url, **kwargs)


@pytest.fixture(scope="module")
def live(classifier_artifact):
    return Live(classifier_artifact)


@pytest.fixture
def client(live, classifier_artifact):
    with AppClient(create_app(ServeConfig(str(classifier_artifact), max_body_bytes=64 * 1024), live=live)) as c:
        yield c


def body(batch=2, seq=10, seed=0):
    gen = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, 50, (batch, seq), generator=gen)
    mask = torch.ones(batch, seq, dtype=torch.bool)
    return {"inputs": {"ids": ids.tolist(), "mask": mask.tolist()}}, (ids, mask)


def metrics(client) -> dict[tuple[str, tuple], float]:
    """Every sample as {(name, sorted labels): value}, parsed by prometheus_client."""
    response = client.get("/metrics")
    assert response.status_code == 200
    return {
        (s.name, tuple(sorted(s.labels.items()))): s.value
        for family in text_string_to_metric_families(response.text)
        for s in family.samples
    }


# --- predict ---------------------------------------------------------------------------------


def test_predict_returns_the_models_outputs_and_what_served_them(client, live):
    payload, (ids, mask) = body(3, 17)
    response = client.post("/predict", json=payload)
    assert response.status_code == 200
    data = response.json()
    assert data["outputs"] == live.model(ids, mask).tolist()
    assert data["artifact"] == {"name": "tiny-classifier", "version": 1}
    assert data["variant"] == "dynamic"


def test_predict_keeps_the_output_structure(structured_artifact):
    model = Live(structured_artifact)
    x = torch.randn(3, 8, generator=torch.Generator().manual_seed(0))
    with AppClient(create_app(ServeConfig(str(structured_artifact)), live=model)) as c:
        data = c.post("/predict", json={"inputs": {"x": x.tolist()}}).json()
    expected = model.model(x)
    assert set(data["outputs"]) == {"hidden", "pair"}
    assert data["outputs"]["hidden"] == expected["hidden"].tolist()
    assert data["outputs"]["pair"] == [expected["pair"][0].tolist(), expected["pair"][1].tolist()]


DEEP: list = [1]
for _ in range(40):
    DEEP = [DEEP]


@pytest.mark.parametrize(
    "inputs, detail, reason",
    [
        (
            {"ids": [[1] * 49] * 2, "mask": [[True] * 49] * 2},
            "input 'ids': dim 'seq' (axis 1) is 49, outside the built range [2, 48]",
            "out_of_range",
        ),
        (
            {"ids": [[1] * 10] * 2, "mask": [[True] * 9] * 2},
            "input 'mask': dim 'seq' (axis 1) is 9, but another input has seq=10",
            "dim_mismatch",
        ),
        ({"ids": [[1] * 10] * 2}, "missing input(s): mask (inputs: ids, mask)", "missing_input"),
        (
            {"ids": [[1] * 10] * 2, "mask": [[True] * 10] * 2, "masks": [[1]]},
            "unknown input 'masks' (inputs: ids, mask)",
            "unknown_input",
        ),
        ({"ids": [1] * 10, "mask": [True] * 10}, "input 'ids': has 1 dimensions (10,), the artifact needs 2", "rank"),
        (
            {"ids": [[1.5] * 10] * 2, "mask": [[True] * 10] * 2},
            "input 'ids': is int64, so its values must be integers",
            "invalid_body",
        ),
        (
            {"ids": [[1] * 10] * 2, "mask": [[1] * 10] * 2},
            "input 'mask': is bool, so its values must be true or false",
            "invalid_body",
        ),
        (
            {"ids": [[1] * 10, [1] * 9], "mask": [[True] * 10] * 2},
            "input 'ids': not a rectangular nested list of numbers",
            "invalid_body",
        ),
        (
            {"ids": "1 2 3", "mask": [[True] * 10] * 2},
            "input 'ids': expected a nested list of numbers, got a string",
            "invalid_body",
        ),
        (
            {"ids": [[2**70] * 10] * 2, "mask": [[True] * 10] * 2},
            "input 'ids': not a rectangular nested list of numbers (Overflow",
            "invalid_body",
        ),
        (
            {"ids": [[True] + [1] * 9] * 2, "mask": [[True] * 10] * 2},
            "input 'ids': is int64, so its values must be integers",
            "invalid_body",
        ),
        (
            {"ids": [[True] * 10] * 2, "mask": [[True] * 10] * 2},
            "input 'ids': is int64, so its values must be integers",
            "invalid_body",
        ),
        (
            {"ids": [[1e300] * 10] * 2, "mask": [[True] * 10] * 2},
            "input 'ids': is int64, so its values must be integers",
            "invalid_body",
        ),
        ({"ids": DEEP, "mask": [[True]]}, "input 'ids': nested more than 32 lists deep", "invalid_body"),
    ],
    ids=[
        "out-of-range",
        "dim-mismatch",
        "missing",
        "unknown",
        "rank",
        "float-for-int",
        "int-for-bool",
        "ragged",
        "string",
        "overflow",
        "bool-among-ints",
        "bools-for-int",
        "huge-float-for-int",
        "deep",
    ],
)
def test_bad_inputs_are_422_with_the_guard_text(client, inputs, detail, reason):
    response = client.post("/predict", json={"inputs": inputs})
    assert response.status_code == 422
    assert detail in response.json()["detail"]
    assert response.json()["reason"] == reason


@pytest.mark.parametrize(
    "raw, detail",
    [
        (b'{"ids": [[1]]}', 'expected a JSON object {"inputs":'),
        (b'{"inputs": [[1]]}', '"inputs" must be an object'),
    ],
    ids=["no-inputs-key", "inputs-not-object"],
)
def test_a_json_object_that_is_not_a_request_is_422(client, raw, detail):
    response = client.post("/predict", content=raw, headers={"content-type": "application/json"})
    assert response.status_code == 422
    assert detail in response.json()["detail"]


@pytest.mark.parametrize(
    "raw, said",
    [(b"{not json", "the body is not valid JSON"), (b"[1, 2]", "got list"), (b'"inputs"', "got a string")],
    ids=["not-json", "a-list", "a-string"],
)
def test_a_body_that_is_not_a_json_object_is_400_on_every_route(live, classifier_artifact, raw, said):
    """Not JSON, or not an object: INVALID_ARGUMENT as 400 everywhere, as /v2 always answered it."""
    config = ServeConfig(str(classifier_artifact), allow_reload=True)
    headers = {"content-type": "application/json"}
    with AppClient(create_app(config, live=live)) as c:
        for path, key in [
            ("/predict", "detail"),
            ("/v1/reload", "detail"),
            ("/v2/models/tiny-classifier/infer", "error"),
        ]:
            response = c.post(path, content=raw, headers=headers)
            assert response.status_code == 400, (path, response.text)
            assert said in response.json()[key], path


def test_a_body_over_the_limit_is_413(client):
    payload, _ = body(8, 48)
    big = json.dumps({"inputs": {**payload["inputs"], "pad": [0] * 30_000}}).encode()
    assert client.post("/predict", content=big).status_code == 413

    # without a Content-Length (chunked), the limit holds while reading
    async def chunks():
        for i in range(0, len(big), 4096):
            yield big[i : i + 4096]

    response = client.post("/predict", content=chunks())
    assert response.status_code == 413
    assert "larger than the 65536 bytes" in response.json()["detail"]


def test_whole_numbers_written_as_floats_are_integers(client, live):
    payload, (ids, mask) = body(2, 10)
    payload["inputs"]["ids"] = [[float(v) for v in row] for row in payload["inputs"]["ids"]]  # 3.0: an integer to JSON
    response = client.post("/predict", json=payload)
    assert response.status_code == 200 and response.json()["outputs"] == live.model(ids, mask).tolist()


@pytest.mark.parametrize(
    "value", [b"NaN", b"Infinity", b"-Infinity", b"1e39", b"-1e39", b"1e400"], ids=lambda v: v.decode()
)
def test_float_values_must_be_finite_and_fit_the_dtype(structured_artifact, value):
    raw = b'{"inputs": {"x": [[0.5, 1, 2, 3, 4, 5, 6, ' + value + b"]]}}"
    with AppClient(create_app(ServeConfig(str(structured_artifact)), live=Live(structured_artifact))) as c:
        response = c.post("/predict", content=raw, headers={"content-type": "application/json"})
        assert response.status_code == 422
        assert response.json() == {
            "detail": "input 'x': values must be finite numbers within float32's range (±3.403e+38); "
            "NaN, Infinity and larger numbers are refused",
            "reason": "invalid_body",
        }
        assert c.post("/predict", content=raw.replace(value, b"3.4e38")).status_code == 200


def test_every_endpoint_has_the_body_limit(live, classifier_artifact):
    big = b'{"path": "' + b"x" * 70_000 + b'"}'

    async def chunks():
        for i in range(0, len(big), 4096):
            yield big[i : i + 4096]

    config = ServeConfig(str(classifier_artifact), max_body_bytes=64 * 1024, allow_reload=True)
    with AppClient(create_app(config, live=live)) as c:
        for method, url in [("POST", "/v1/reload"), ("POST", "/predict"), ("GET", "/healthz"), ("GET", "/metrics")]:
            response = c.request(method, url, content=big)  # with Content-Length
            assert response.status_code == 413, (url, response.text)
            assert "larger than the 65536 bytes this server accepts (--max-body-bytes)" in response.json()["detail"]
        for url in ("/v1/reload", "/predict"):  # read while it arrives, without Content-Length
            assert c.post(url, content=chunks()).status_code == 413


def test_the_default_body_limit_fits_the_largest_call_in_range(classifier_artifact):
    manifest = read_manifest(classifier_artifact)
    assert body_limit(manifest) == MIN_BODY_BYTES  # 8 × 48 tokens: far below
    wide = replace(manifest, dims={"batch": DimRange(1, 64), "seq": DimRange(2, 4096)})
    limit = body_limit(wide)
    ids = torch.full((64, 4096), -(2**63), dtype=torch.int64)
    largest = json.dumps({"inputs": {"ids": ids.tolist(), "mask": torch.zeros(64, 4096, dtype=torch.bool).tolist()}})
    assert len(largest) <= limit < 2 * len(largest)
    assert (
        AppClient(create_app(ServeConfig(str(classifier_artifact)))).app.state.service.max_body_bytes == MIN_BODY_BYTES
    )


def test_an_internal_failure_is_500_and_the_server_serves_on(client, live, monkeypatch):
    def explode(*args, **kwargs):
        raise RuntimeError("runner exploded")

    monkeypatch.setattr(live.model, "call_detailed", explode)
    response = client.post("/predict", json=body()[0])
    assert response.status_code == 500
    assert response.json()["detail"] == "internal error: RuntimeError: runner exploded"
    monkeypatch.undo()
    assert client.post("/predict", json=body()[0]).status_code == 200


# --- health, readiness, artifact -------------------------------------------------------------


def test_readyz_is_503_until_loaded_and_warmed(classifier_artifact):
    live = Live()
    app = create_app(ServeConfig(str(classifier_artifact)), live=live)
    c = AppClient(app)  # no lifespan: nothing loads until we say so
    assert c.get("/healthz").json() == {"status": "ok"}
    assert c.get("/readyz").status_code == 503 and c.get("/readyz").json()["status"] == "loading"
    assert c.post("/predict", json=body()[0]).status_code == 503
    live.swap(classifier_artifact)
    assert c.get("/readyz").json() == {"status": "ready", "name": "tiny-classifier", "version": 1}


def readiness(c, timeout=30.0):
    """Poll /readyz as an orchestrator would, until it stops saying "loading"."""
    deadline = time.monotonic() + timeout
    while True:
        response = c.get("/readyz")
        if response.json()["status"] != "loading" or time.monotonic() > deadline:
            return response
        time.sleep(0.02)


def test_start_up_loads_in_the_background(classifier_artifact):
    with AppClient(create_app(ServeConfig(str(classifier_artifact)))) as c:
        assert readiness(c).status_code == 200
        assert c.post("/predict", json=body()[0]).status_code == 200


def test_a_failed_load_keeps_readyz_503_with_the_reason(tmp_path):
    with AppClient(create_app(ServeConfig(str(tmp_path / "nope")))) as c:
        response = readiness(c)
        assert response.status_code == 503
        assert response.json()["status"] == "failed" and "no such artifact" in response.json()["detail"]
        assert c.get("/healthz").status_code == 200


def test_artifact_summary(client, classifier_artifact):
    data = client.get("/v1/artifact").json()
    assert data["name"] == "tiny-classifier" and data["version"] == 1
    assert data["digest"] == manifest_digest(read_manifest_with_bytes(classifier_artifact)[1])
    assert data["inputs"] == [
        {"name": "ids", "dtype": "int64", "shape": ["batch", "seq"]},
        {"name": "mask", "dtype": "bool", "shape": ["batch", "seq"]},
    ]
    assert data["dims"] == {"batch": {"min": 1, "max": 8}, "seq": {"min": 2, "max": 48}}
    assert [v["id"] for v in data["variants"]] == ["dynamic"]
    assert data["output"] == {"kind": "tensor"}


# --- metrics ---------------------------------------------------------------------------------


def test_metrics_count_requests_variants_rejections_and_shapes(live, classifier_artifact):
    with AppClient(create_app(ServeConfig(str(classifier_artifact)), live=live)) as c:
        for seq in (9, 12, 16, 30):
            assert c.post("/predict", json=body(2, seq)[0]).status_code == 200
        c.post("/predict", json={"inputs": {"ids": [[1] * 49], "mask": [[True] * 49]}})
        c.post("/predict", content=b"nope")
        m = metrics(c)
    assert m[("precompile_predict_seconds_count", (("precision", "fp32"), ("variant", "dynamic")))] == 4
    assert m[("precompile_requests_total", (("code", "200"),))] == 4
    assert m[("precompile_requests_total", (("code", "422"),))] == 1
    assert m[("precompile_requests_total", (("code", "400"),))] == 1  # not JSON
    assert m[("precompile_rejections_total", (("reason", "out_of_range"),))] == 1
    assert m[("precompile_rejections_total", (("reason", "invalid_body"),))] == 1
    assert m[("precompile_shape_calls_total", (("shape", "batch=2,seq=9-16"),))] == 3
    assert m[("precompile_shape_calls_total", (("shape", "batch=2,seq=17-32"),))] == 1
    digest = manifest_digest(read_manifest_with_bytes(classifier_artifact)[1])
    info = (("digest", digest), ("name", "tiny-classifier"), ("version", "1"))
    assert m[("precompile_artifact_info", info)] == 1


def test_size_buckets_are_powers_of_two():
    assert [size_bucket(s) for s in (0, 1, 2, 3, 4, 5, 8, 9, 64, 65, 128, 129)] == [
        "0",
        "1",
        "2",
        "3-4",
        "3-4",
        "5-8",
        "5-8",
        "9-16",
        "33-64",
        "65-128",
        "65-128",
        "129-256",
    ]


def test_every_guard_message_has_a_reason(live, structured_artifact):
    """Every guard kind carries its own reason, which labels the rejection metric."""
    m = live.model
    ids, mask = torch.zeros(2, 10, dtype=torch.int64), torch.ones(2, 10, dtype=torch.bool)
    cases = {
        "missing_input": lambda: m(ids),
        "too_many_inputs": lambda: m(ids, mask, ids),
        "unknown_input": lambda: m(ids, masks=mask),
        "duplicate_input": lambda: m(ids, mask, ids=ids),
        "not_a_tensor": lambda: m(ids.tolist(), mask),
        "dtype": lambda: m(ids.int(), mask),
        "meta": lambda: m(ids.to("meta"), mask),
        "rank": lambda: m(ids[0], mask),
        "out_of_range": lambda: m(torch.zeros(2, 49, dtype=torch.int64), mask),
        "dim_mismatch": lambda: m(ids, mask[:, :9]),
        "not_contiguous": lambda: m(torch.zeros(10, 2, dtype=torch.int64).t(), mask),
        "static_size": lambda: Live(structured_artifact).model(torch.zeros(2, 7)),
    }
    for reason, call in cases.items():
        with pytest.raises(GuardError) as info:
            call()
        assert guard_reason(info.value) == reason, str(info.value)


# --- reload ----------------------------------------------------------------------------------


def test_reload_is_off_unless_allowed(client, classifier_versions):
    response = client.post("/v1/reload", json={"path": str(classifier_versions[1])})
    assert response.status_code == 403
    assert "--allow-reload" in response.json()["detail"]


def test_reload_swaps_versions_and_refuses_bad_ones(classifier_versions, tmp_path):
    root = classifier_versions[1].parent  # v2, v3, v4 live here; v1 (the served one) elsewhere
    config = ServeConfig(str(classifier_versions[0]), allow_reload=True, reload_root=str(root))
    with AppClient(create_app(config, live=Live(classifier_versions[0]))) as c:
        response = c.post("/v1/reload", json={"path": str(classifier_versions[2])})
        assert response.status_code == 200
        assert response.json()["serving"]["version"] == 3 and response.json()["previous"]["version"] == 1
        assert c.post("/predict", json=body()[0]).json()["artifact"]["version"] == 3

        response = c.post("/v1/reload", json={"path": "missing"})  # relative: under the root
        assert response.status_code == 422
        assert "no such artifact" in response.json()["detail"]
        assert response.json()["serving"]["version"] == 3

        response = c.post("/v1/reload", json={"path": "v2"})
        assert response.status_code == 422 and "older than the serving version 3" in response.json()["detail"]
        response = c.post("/v1/reload", json={"path": str(classifier_versions[0])})  # the served path: always
        assert response.status_code == 422 and "older than the serving version 3" in response.json()["detail"]

        assert c.post("/v1/reload", json={"path": 3}).status_code == 422
        assert c.get("/v1/artifact").json()["last_attempt"]["ok"] is False
        m = metrics(c)
        assert m[("precompile_reloads_total", (("result", "ok"),))] == 1
        assert m[("precompile_reloads_total", (("result", "failed"),))] == 3


def test_a_request_cannot_ask_for_a_rollback(classifier_versions):
    config = ServeConfig(str(classifier_versions[1]), allow_reload=True, reload_root=str(classifier_versions[1].parent))
    live = Live(classifier_versions[2])
    with AppClient(create_app(config, live=live)) as c:
        response = c.post("/v1/reload", json={"path": "v2", "allow_rollback": True})
        assert response.status_code == 422
        assert response.json()["detail"] == (
            '"allow_rollback" is not a request field: the server decides rollbacks (precompile serve --allow-rollback)'
        )
        assert live.serving.version == 3 and live.last_attempt.ok


def test_the_servers_allow_rollback_decides(classifier_versions):
    root = classifier_versions[1].parent
    config = ServeConfig(str(classifier_versions[2]), allow_reload=True, reload_root=str(root), allow_rollback=True)
    with AppClient(create_app(config)) as c:
        assert readiness(c).status_code == 200
        response = c.post("/v1/reload", json={"path": "v2"})
        assert response.status_code == 200 and response.json()["serving"]["version"] == 2


def test_without_a_reload_root_only_the_served_path_reloads(classifier_versions, tmp_path):
    current = tmp_path / "current"
    current.symlink_to(classifier_versions[0])
    config = ServeConfig(str(current), allow_reload=True)
    with AppClient(create_app(config)) as c:
        assert readiness(c).status_code == 200
        response = c.post("/v1/reload", json={"path": str(classifier_versions[1])})
        assert response.status_code == 403
        assert response.json()["detail"] == (
            f"{classifier_versions[1]}: this server reloads only the path it serves ({current}); "
            "start it with --reload-root DIR to allow reloading artifacts under DIR"
        )
        current.unlink()
        current.symlink_to(classifier_versions[1])  # a deploy; the reload picks it up at once
        response = c.post("/v1/reload")
        assert response.status_code == 200 and response.json()["serving"]["version"] == 2
        assert c.post("/v1/reload", json={"path": str(current)}).status_code == 200  # named: the same


SECRET = "hunter2-do-not-leak"


@pytest.fixture
def reload_root(classifier_versions, tmp_path):
    """A reload root holding v2 and, outside it, a secret file and v3; links and a pointer that lead out."""
    root = tmp_path / "root"
    root.mkdir()
    (root / "v2").symlink_to(classifier_versions[1])  # a link to a folder outside: followed, so refused
    shutil.copytree(classifier_versions[1], root / "inside")
    secret = tmp_path / "secret.txt"
    secret.write_text(SECRET + "\n")
    (root / "leak").symlink_to(secret)
    (root / "pointer").write_text(str(classifier_versions[2]) + "\n")
    (root / "notes.txt").write_text(SECRET + "\n")  # inside the root, but not an artifact
    (root / "fake").mkdir()
    (root / "fake" / "manifest.json").write_text(json.dumps({"format": SECRET}))
    return root


@pytest.mark.parametrize(
    "path, code, detail",
    [
        ("../secret.txt", 403, "../secret.txt: not under --reload-root"),
        ("{tmp}/secret.txt", 403, "{tmp}/secret.txt: not under --reload-root"),
        ("leak", 403, "leak: not under --reload-root"),
        ("v2", 403, "v2: not under --reload-root"),
        ("pointer", 403, "pointer: designates an artifact outside --reload-root"),
        ("notes.txt", 422, "not an artifact folder, a pack, or a pointer file naming an existing one"),
        ("fake", 422, "format: not 'precompile-artifact': this is not a precompile artifact's manifest"),
    ],
    ids=["dot-dot", "absolute", "link-to-a-secret", "link-to-an-artifact", "pointer-out", "text-file", "fake-manifest"],
)
def test_reload_is_confined_to_the_root_and_never_echoes_a_file(
    classifier_versions, reload_root, tmp_path, path, code, detail
):
    path, detail = path.format(tmp=tmp_path), detail.format(tmp=tmp_path)
    config = ServeConfig(str(classifier_versions[0]), allow_reload=True, reload_root=str(reload_root))
    with AppClient(create_app(config, live=Live(classifier_versions[0]))) as c:
        response = c.post("/v1/reload", json={"path": path})
        assert response.status_code == code and detail in response.json()["detail"]
        for text in (response.text, c.get("/v1/artifact").text, c.get("/readyz").text, c.get("/metrics").text):
            assert SECRET not in text
        assert c.post("/v1/reload", json={"path": "inside"}).status_code == 200  # what the root holds loads


def test_serve_applies_the_trust_policy_to_the_first_load(classifier_artifact, signing_keys, tmp_path):
    with AppClient(create_app(ServeConfig(str(classifier_artifact), trusted_keys=(str(signing_keys[1]),)))) as c:
        response = readiness(c)
        assert response.status_code == 503 and "not signed" in response.json()["detail"], response.text
    with AppClient(create_app(ServeConfig(str(classifier_artifact), min_version=2))) as c:
        response = readiness(c)
        assert response.status_code == 503 and "version 1" in response.json()["detail"], response.text


def test_serve_applies_the_trust_policy_to_reloads(classifier_versions, signing_keys, tmp_path):
    from precompile.ship.sign import sign

    root = tmp_path / "root"
    for n in (1, 2):
        shutil.copytree(classifier_versions[n - 1], root / f"v{n}")
    sign(root / "v1", signing_keys[0])
    config = ServeConfig(
        str(root / "v1"), allow_reload=True, reload_root=str(root), trusted_keys=(str(signing_keys[1]),)
    )
    with AppClient(create_app(config)) as c:
        assert readiness(c).status_code == 200
        response = c.post("/v1/reload", json={"path": "v2"})
        assert response.status_code == 422 and "not signed" in response.json()["detail"]
        assert c.get("/readyz").json()["version"] == 1


def test_refuse_rollback_keeps_the_hosts_ledger(classifier_versions, tmp_path, monkeypatch):
    monkeypatch.setenv("PRECOMPILE_STATE", str(tmp_path / "state"))
    with AppClient(create_app(ServeConfig(str(classifier_versions[1]), refuse_rollback=True))) as c:
        assert readiness(c).status_code == 200
    with AppClient(create_app(ServeConfig(str(classifier_versions[0]), refuse_rollback=True))) as c:
        response = readiness(c)
        assert response.status_code == 503 and "rollback" in response.json()["detail"], response.text


# --- the command -----------------------------------------------------------------------------


def invoke(*args: str):
    return CliRunner().invoke(main, list(args), catch_exceptions=False)


def test_serve_without_the_extra_says_how_to_install_it(classifier_artifact, monkeypatch):
    monkeypatch.setitem(sys.modules, "uvicorn", None)  # what an install without the extra looks like
    result = invoke("serve", str(classifier_artifact))
    assert result.exit_code == 1
    assert (
        "precompile serve needs the serve extra (uvicorn not installed): pip install 'precompile[serve]'"
        in result.output
    )


def test_serve_refuses_a_missing_artifact_before_starting(tmp_path):
    result = invoke("serve", str(tmp_path / "nope"))
    assert result.exit_code == 1 and "no such artifact" in result.output and "Traceback" not in result.output


@pytest.fixture
def served_config(monkeypatch):
    """What `precompile serve` would start uvicorn with (nothing starts)."""
    seen = {}
    monkeypatch.setattr("precompile.serve.server.run", lambda config, **kw: seen.update(config=config, **kw))
    return seen


def test_serve_takes_a_pack(classifier_pack, served_config):
    result = invoke("serve", str(classifier_pack))
    assert result.exit_code == 0, result.output
    assert served_config["config"].artifact == str(classifier_pack)


def test_serve_passes_the_trust_policy_and_limits_on(
    classifier_artifact, signing_keys, tmp_path, served_config, monkeypatch
):
    args = [
        "--trusted-key",
        str(signing_keys[1]),
        "--trusted-key",
        str(signing_keys[1]),
        "--min-version",
        "3",
        "--refuse-rollback",
        "--allow-reload",
        "--reload-root",
        str(tmp_path),
    ]
    assert invoke("serve", str(classifier_artifact), *args).exit_code == 0
    config = served_config["config"]
    assert config.trusted_keys == (str(signing_keys[1]),) * 2 and config.min_version == 3 and config.refuse_rollback
    assert config.reload_root == str(tmp_path) and config.max_body_bytes == MIN_BODY_BYTES
    assert config.load_options() == {
        "verify": True,
        "trusted_keys": [str(signing_keys[1])] * 2,
        "min_version": 3,
        "refuse_rollback": True,
        "precision": "auto",
    }
    monkeypatch.setenv(*config.to_env().popitem())  # how --workers N hands it to each worker
    assert ServeConfig.from_env() == config


@pytest.mark.parametrize(
    "args, message",
    [
        (["--reload-root", "."], "--reload-root without --allow-reload"),
        (["--allow-rollback", "--refuse-rollback"], "--allow-rollback and --refuse-rollback contradict each other"),
        (["--no-verify", "--trusted-key", "{key}"], "--no-verify skips the sha256 checks a signature relies on"),
    ],
    ids=["root-without-reload", "rollback", "no-verify"],
)
def test_serve_refuses_options_that_contradict(classifier_artifact, signing_keys, args, message):
    result = invoke("serve", str(classifier_artifact), *[a.format(key=signing_keys[1]) for a in args])
    assert result.exit_code == 2 and message in result.output


def test_serve_refuses_a_key_that_is_not_one(classifier_artifact, tmp_path):
    bad = tmp_path / "bad.pub"
    bad.write_text("not a key\n")
    result = invoke("serve", str(classifier_artifact), "--trusted-key", str(bad))
    assert result.exit_code == 1 and str(bad) in result.output and "Traceback" not in result.output


@pytest.mark.parametrize(
    "args, message",
    [
        (["--workers", "2", "--allow-reload"], "a POST /v1/reload reaches one worker only"),
        (["--workers", "2", "--record", "traffic.jsonl"], "each worker writes its own file; put {pid} in the path"),
    ],
    ids=["reload", "record"],
)
def test_serve_refuses_options_that_do_not_fit_several_workers(classifier_artifact, args, message):
    result = invoke("serve", str(classifier_artifact), *args)
    assert result.exit_code == 2 and message in result.output


def test_serve_refuses_a_record_file_that_is_not_traffic(classifier_artifact, tmp_path):
    bad = tmp_path / "traffic.jsonl"
    bad.write_text("hello\n")
    result = invoke("serve", str(classifier_artifact), "--record", str(bad))
    assert result.exit_code == 1 and f"{bad}:1: not valid JSON" in result.output


IMPORTS = r"""
import sys, json
{code}
heavy = ("fastapi", "uvicorn", "starlette", "prometheus_client", "ruamel", "precompile", "click", "yaml", "pydantic")
print(json.dumps(sorted(m for m in sys.modules if m.split(".")[0] in heavy or m.startswith("torch._inductor"))))
"""


def imported(code: str) -> list[str]:
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    out = subprocess.run(
        [sys.executable, "-c", IMPORTS.format(code=code)], capture_output=True, text=True, cwd=ROOT, env=env, check=True
    )
    return json.loads(out.stdout.strip().splitlines()[-1])


def test_precompile_help_imports_no_server_package():
    code = "from click.testing import CliRunner\nfrom precompile.cli import main\nCliRunner().invoke(main, ['--help'])"
    assert not {m.split(".")[0] for m in imported(code)} & {
        "fastapi",
        "uvicorn",
        "starlette",
        "prometheus_client",
        "ruamel",
    }


def test_live_and_recorder_stay_in_the_runtime(classifier_artifact, tmp_path):
    code = (
        f"import loader\nlive = loader.Live({str(classifier_artifact)!r})\n"
        f"loader.TrafficRecorder(live, {str(tmp_path / 't.jsonl')!r}, interval=None).close()"
    )
    assert imported(code) == []
