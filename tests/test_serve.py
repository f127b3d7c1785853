"""The HTTP service, in process (httpx on the ASGI app): every endpoint and every way a request can be
refused, the metrics it exports, and the `precompile serve` command's own checks."""

from __future__ import annotations

import asyncio
import json
import os
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest
import torch
from click.testing import CliRunner
from prometheus_client.parser import text_string_to_metric_families

from loader import GuardError, Live
from loader.artifact import manifest_digest, read_manifest
from precompile.cli import main
from precompile.serve.app import create_app
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


@pytest.mark.parametrize(
    "inputs, detail, reason",
    [
        ({"ids": [[1] * 49] * 2, "mask": [[True] * 49] * 2}, "input 'ids': dim 'seq' (axis 1) is 49, outside the built range [2, 48]", "out_of_range"),
        ({"ids": [[1] * 10] * 2, "mask": [[True] * 9] * 2}, "input 'mask': dim 'seq' (axis 1) is 9, but another input has seq=10", "dim_mismatch"),
        ({"ids": [[1] * 10] * 2}, "missing input(s): mask (inputs: ids, mask)", "missing_input"),
        ({"ids": [[1] * 10] * 2, "mask": [[True] * 10] * 2, "masks": [[1]]}, "unknown input 'masks' (inputs: ids, mask)", "unknown_input"),
        ({"ids": [1] * 10, "mask": [True] * 10}, "input 'ids': has 1 dimensions (10,), the artifact needs 2", "rank"),
        ({"ids": [[1.5] * 10] * 2, "mask": [[True] * 10] * 2}, "input 'ids': is int64, so its values must be integers", "invalid_body"),
        ({"ids": [[1] * 10] * 2, "mask": [[1] * 10] * 2}, "input 'mask': is bool, so its values must be true or false", "invalid_body"),
        ({"ids": [[1] * 10, [1] * 9], "mask": [[True] * 10] * 2}, "input 'ids': not a rectangular nested list of numbers", "invalid_body"),
        ({"ids": "1 2 3", "mask": [[True] * 10] * 2}, "input 'ids': expected a nested list of numbers, got a string", "invalid_body"),
        ({"ids": [[2**70] * 10] * 2, "mask": [[True] * 10] * 2}, "input 'ids': not a rectangular nested list of numbers (Overflow", "invalid_body"),
    ],
    ids=["out-of-range", "dim-mismatch", "missing", "unknown", "rank", "float-for-int", "int-for-bool", "ragged", "string", "overflow"],
)
def test_bad_inputs_are_422_with_the_guard_text(client, inputs, detail, reason):
    response = client.post("/predict", json={"inputs": inputs})
    assert response.status_code == 422
    assert detail in response.json()["detail"]
    assert response.json()["reason"] == reason


@pytest.mark.parametrize(
    "raw, detail",
    [
        (b"{not json", "the body is not valid JSON"),
        (b'{"ids": [[1]]}', 'expected a JSON object {"inputs":'),
        (b'{"inputs": [[1]]}', '"inputs" must be an object'),
    ],
    ids=["not-json", "no-inputs-key", "inputs-not-object"],
)
def test_malformed_bodies_are_422(client, raw, detail):
    response = client.post("/predict", content=raw, headers={"content-type": "application/json"})
    assert response.status_code == 422
    assert detail in response.json()["detail"]


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
    assert data["digest"] == manifest_digest(read_manifest(classifier_artifact))
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
    assert m[("precompile_predict_seconds_count", (("variant", "dynamic"),))] == 4
    assert m[("precompile_requests_total", (("code", "200"),))] == 4
    assert m[("precompile_requests_total", (("code", "422"),))] == 2
    assert m[("precompile_rejections_total", (("reason", "out_of_range"),))] == 1
    assert m[("precompile_rejections_total", (("reason", "invalid_body"),))] == 1
    assert m[("precompile_shape_calls_total", (("shape", "batch=2,seq=9-16"),))] == 3
    assert m[("precompile_shape_calls_total", (("shape", "batch=2,seq=17-32"),))] == 1
    digest = manifest_digest(read_manifest(classifier_artifact))
    info = (("digest", digest), ("name", "tiny-classifier"), ("version", "1"))
    assert m[("precompile_artifact_info", info)] == 1


def test_size_buckets_are_powers_of_two():
    assert [size_bucket(s) for s in (0, 1, 2, 3, 4, 5, 8, 9, 64, 65, 128, 129)] == [
        "0", "1", "2", "3-4", "3-4", "5-8", "5-8", "9-16", "33-64", "65-128", "65-128", "129-256"
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
        "device": lambda: m(ids.to("meta"), mask),
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
    config = ServeConfig(str(classifier_versions[0]), allow_reload=True)
    with AppClient(create_app(config, live=Live(classifier_versions[0]))) as c:
        response = c.post("/v1/reload", json={"path": str(classifier_versions[1])})
        assert response.status_code == 200
        assert response.json()["serving"]["version"] == 2 and response.json()["previous"]["version"] == 1
        assert c.post("/predict", json=body()[0]).json()["artifact"]["version"] == 2

        response = c.post("/v1/reload", json={"path": str(tmp_path / "missing")})
        assert response.status_code == 422
        assert "no such artifact" in response.json()["detail"]
        assert response.json()["serving"]["version"] == 2

        response = c.post("/v1/reload", json={"path": str(classifier_versions[0])})
        assert response.status_code == 422 and "older than the serving version 2" in response.json()["detail"]
        response = c.post("/v1/reload", json={"path": str(classifier_versions[0]), "allow_rollback": True})
        assert response.status_code == 200 and response.json()["serving"]["version"] == 1

        assert c.post("/v1/reload", json={"path": 3}).status_code == 422
        assert c.get("/v1/artifact").json()["last_attempt"]["ok"] is True
        m = metrics(c)
        assert m[("precompile_reloads_total", (("result", "ok"),))] == 2
        assert m[("precompile_reloads_total", (("result", "failed"),))] == 2


# --- the command -----------------------------------------------------------------------------


def invoke(*args: str):
    return CliRunner().invoke(main, list(args), catch_exceptions=False)


def test_serve_without_the_extra_says_how_to_install_it(classifier_artifact, monkeypatch):
    monkeypatch.setitem(sys.modules, "uvicorn", None)  # what an install without the extra looks like
    result = invoke("serve", str(classifier_artifact))
    assert result.exit_code == 1
    assert "precompile serve needs uvicorn" in result.output
    assert "pip install 'precompile[serve]'" in result.output


def test_serve_refuses_a_missing_artifact_before_starting(tmp_path):
    result = invoke("serve", str(tmp_path / "nope"))
    assert result.exit_code == 1 and "no such artifact" in result.output and "Traceback" not in result.output


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
    assert not {m.split(".")[0] for m in imported(code)} & {"fastapi", "uvicorn", "starlette", "prometheus_client", "ruamel"}


def test_live_and_recorder_stay_in_the_runtime(classifier_artifact, tmp_path):
    code = (
        f"import loader\nlive = loader.Live({str(classifier_artifact)!r})\n"
        f"loader.TrafficRecorder(live, {str(tmp_path / 't.jsonl')!r}, interval=None).close()"
    )
    assert imported(code) == []
