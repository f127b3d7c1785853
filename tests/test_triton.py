"""`precompile export triton` against a real Triton Inference Server: the session's tagger (a batch
dim, static variants at batch 1 and 2) exported, `tritonserver` started on loopback, and the
published tritonclient over HTTP and gRPC. The server comes from scripts/fetch-triton (`make
triton`, run by `make test` and CI); without it the tests that talk to it are skipped."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import time
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np
import pytest
import torch
from click.testing import CliRunner

import loader
from loader.outputs import flatten
from precompile.cli import main
from tests.conftest import artifact_version, builds
from tests.models import tiny
from tests.ray_cluster import free_port, stop_group, wait_http_ready

ROOT = Path(__file__).resolve().parents[1]
TRITON = ROOT / ".triton"
SERVER = TRITON / "pytriton" / "tritonserver"
NAME = "tiny-tagger"
UNSIGNED = "tiny-tagger-unsigned"  # the tagger under another name, its signature removed after export
OUTPUTS = ("output.0", "output.1")


def export(*args: str):
    return CliRunner().invoke(main, ["export", "triton", *args], catch_exceptions=False)


@pytest.fixture(scope="module")
def repo(tagger_build, structured_artifact, tmp_path_factory) -> Path:
    """The tagger as versions 1, 2 and 3 (a pack), and the structured model (dict and tuple outputs,
    one of them a number per row), in one repository."""
    from precompile.ship.pack import pack

    folder = tmp_path_factory.mktemp("triton")
    tagger_v2 = artifact_version(tagger_build.path, folder / "tagger-v2", 2)
    tagger_v3 = pack(artifact_version(tagger_build.path, folder / "tagger-v3", 3), folder / "tagger-v3.tar.zst")
    out = folder / "repo"
    # A longer queue delay than the default, so that concurrent requests meet on this busy machine.
    args = [
        str(tagger_build.path),
        str(tagger_v2),
        str(tagger_v3),
        str(structured_artifact),
        "-o",
        str(out),
        "--max-queue-delay-us",
        "50000",
    ]
    result = export(*args)
    assert result.exit_code == 0, result.output
    return out


class Server:
    """`tritonserver` on loopback ports, in a process group of its own (stopped as a group).
    ``options``: more tritonserver flags; ``stub_site``: what goes first on the stub's PYTHONPATH (None:
    nothing, so the stub runs on this environment's numpy 2)."""

    def __init__(
        self, repo: Path, log: Path, cache: Path, *options: str, stub_site: Path | None = TRITON / "stub-site"
    ):
        from precompile.ship.triton import tritonserver_command

        self.http, self.grpc = free_port(), free_port()
        command, env = tritonserver_command(
            repo,
            server=SERVER,
            stub_site=stub_site,
            http_port=self.http,
            grpc_port=self.grpc,
            options=["--allow-metrics", "false", "--exit-timeout-secs", "5", *options],
        )
        env["PRECOMPILE_CACHE"] = str(cache)  # where the stub unpacks packs
        env["PRECOMPILE_STATE"] = str(cache.parent / "state")  # the rollback ledger
        self.log = log
        with open(log, "wb") as out:
            self.process = subprocess.Popen(
                command, stdout=out, stderr=subprocess.STDOUT, env=env, start_new_session=True
            )

    def wait_ready(self, timeout: float = 120) -> None:
        url = f"http://127.0.0.1:{self.http}/v2/models/{NAME}/ready"
        wait_http_ready(url, self.process, self.log, "tritonserver", timeout=timeout)

    def stats(self) -> dict:
        """Triton's statistics extension for the tagger, its versions added up."""
        with urllib.request.urlopen(f"http://127.0.0.1:{self.http}/v2/models/{NAME}/stats", timeout=10) as r:
            versions = json.loads(r.read())["model_stats"]
        return {
            "inference_count": sum(v["inference_count"] for v in versions),
            "execution_count": sum(v["execution_count"] for v in versions),
            "batch_sizes": sorted({b["batch_size"] for v in versions for b in v["batch_stats"]}),
        }

    def stop(self) -> None:
        stop_group(self.process, grace=15)  # the backend stubs too, if they outlive it


@pytest.fixture(scope="module")
@builds
def server(repo, tmp_path_factory):
    if not (SERVER / "bin" / "tritonserver").exists():
        pytest.skip("no tritonserver in .triton/: run scripts/fetch-triton (make triton)")
    folder = tmp_path_factory.mktemp("triton-server")
    s = Server(repo, folder / "tritonserver.log", folder / "cache")
    try:
        s.wait_ready()
        yield s
    finally:
        s.stop()


@pytest.fixture(scope="module")
def clients(server):
    import tritonclient.grpc as grpcclient
    import tritonclient.http as httpclient

    return {
        "http": (httpclient, httpclient.InferenceServerClient(f"127.0.0.1:{server.http}", concurrency=16)),
        "grpc": (grpcclient, grpcclient.InferenceServerClient(f"127.0.0.1:{server.grpc}")),
    }


def call(client_module, client, ids: np.ndarray, mask: np.ndarray, *, ids_type: str = "INT64", version: str = ""):
    inputs = [
        client_module.InferInput("ids", list(ids.shape), ids_type),
        client_module.InferInput("mask", list(mask.shape), "BOOL"),
    ]
    inputs[0].set_data_from_numpy(ids)
    inputs[1].set_data_from_numpy(mask)
    result = client.infer(NAME, inputs, model_version=version)
    return [result.as_numpy(name) for name in OUTPUTS]


def sample(batch: int, seq: int, seed: int) -> tuple[np.ndarray, np.ndarray]:
    rng = np.random.default_rng(seed)
    return rng.integers(0, 50, (batch, seq), dtype=np.int64), np.ones((batch, seq), dtype=bool)


@pytest.fixture(scope="module")
def references(tagger_build):
    """What eager and the torch loader answer, per (ids, mask)."""
    eager = tiny.tagger().eval()
    compiled = loader.load(tagger_build.path)

    def answer(ids: np.ndarray, mask: np.ndarray):
        args = (torch.from_numpy(ids), torch.from_numpy(mask))
        with torch.no_grad():
            return [t.numpy() for t in flatten(eager(*args))], [t.numpy() for t in flatten(compiled(*args))]

    return answer


def test_the_config_says_what_the_manifest_says(repo):
    config = (repo / NAME / "config.pbtxt").read_text()
    assert "max_batch_size: 8" in config  # the batch dim's largest size
    assert '{ name: "ids", data_type: TYPE_INT64, dims: [ -1 ] }' in config  # seq is dynamic, batch left out
    assert '{ name: "output.0", data_type: TYPE_FP32, dims: [ -1, 3 ] }' in config
    assert "preferred_batch_size: [ 2 ]" in config  # the static variants' batch sizes above 1
    assert "kind: KIND_CPU" in config
    assert "version_policy: { specific: { versions: [ 1, 2, 3 ] } }" in config
    for version in ("1", "2"):
        assert (repo / NAME / version / "model.py").is_file()
        assert json.loads((repo / NAME / version / "artifact" / "manifest.json").read_text())["version"] == int(version)
    assert (repo / NAME / "3" / "artifact.tar.zst").is_file()  # a pack stays a pack
    structured = (repo / "tiny-structured" / "config.pbtxt").read_text()
    assert "max_batch_size: 32" in structured and "dynamic_batching" in structured
    assert '{ name: "hidden", data_type: TYPE_FP32, dims: [ 4 ] }' in structured
    assert '{ name: "pair.1", data_type: TYPE_FP32, dims: [ 1 ], reshape: { shape: [ ] } }' in structured


def test_every_version_and_model_answers(clients, references):
    module, client = clients["grpc"]
    ids, mask = sample(2, 9, seed=7)
    expected = references(ids, mask)[1]
    for version in ("1", "2", "3"):
        for got, want in zip(call(module, client, ids, mask, version=version), expected):
            np.testing.assert_allclose(got, want, rtol=1e-6, atol=1e-6)
    x = np.random.default_rng(0).standard_normal((5, 8)).astype(np.float32)
    inputs = [module.InferInput("x", [5, 8], "FP32")]
    inputs[0].set_data_from_numpy(x)
    result = client.infer("tiny-structured", inputs)
    with torch.no_grad():
        eager = tiny.structured().eval()(torch.from_numpy(x))
    np.testing.assert_allclose(result.as_numpy("hidden"), eager["hidden"].numpy(), rtol=1e-4, atol=1e-5)
    np.testing.assert_allclose(result.as_numpy("pair.0"), eager["pair"][0].numpy(), rtol=1e-4, atol=1e-5)
    # a number per row: [5, 1] on the wire (Triton's dims need an axis), [5] in the model
    np.testing.assert_allclose(result.as_numpy("pair.1"), eager["pair"][1].numpy()[:, None], rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("protocol", ["http", "grpc"])
def test_answers_match_eager_and_the_loader(clients, references, protocol):
    module, client = clients[protocol]
    for batch, seq in [(1, 16), (2, 8), (3, 11), (8, 32), (5, 4)]:
        ids, mask = sample(batch, seq, seed=batch * 100 + seq)
        got = call(module, client, ids, mask)
        eager, compiled = references(ids, mask)
        for g, e, c in zip(got, eager, compiled):
            assert g.shape == e.shape
            np.testing.assert_allclose(g, e, rtol=1e-4, atol=1e-5)
            np.testing.assert_allclose(g, c, rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("wanted", [("output.0",), ("output.1",), OUTPUTS])
@pytest.mark.parametrize("binary", [False, True])
def test_outputs_in_json_and_in_binary_one_or_several_are_the_loaders(clients, references, wanted, binary):
    module, client = clients["http"]
    ids, mask = sample(3, 11, seed=5)
    inputs = [module.InferInput("ids", list(ids.shape), "INT64"), module.InferInput("mask", list(mask.shape), "BOOL")]
    inputs[0].set_data_from_numpy(ids, binary_data=binary)
    inputs[1].set_data_from_numpy(mask, binary_data=binary)
    outputs = [module.InferRequestedOutput(name, binary_data=binary) for name in wanted]
    result = client.infer(NAME, inputs, outputs=outputs)
    described = {o["name"]: o for o in result.get_response()["outputs"]}
    assert set(described) == set(wanted)
    compiled = dict(zip(OUTPUTS, references(ids, mask)[1]))
    for name in wanted:
        assert ("parameters" in described[name]) == binary  # binary_data_size, or the data in the JSON
        np.testing.assert_array_equal(result.as_numpy(name), compiled[name])


def test_a_stub_on_numpy_2_refuses_to_load_and_says_what_to_install(repo, tmp_path):
    """The stub misreads numpy 2's arrays: it answered an output of shape [2, 7] with no data (the
    client: "cannot reshape array of size 0"). model.py now refuses to load there, so the model is
    UNAVAILABLE with the reason, and a call is an error, not an empty answer."""
    if not (SERVER / "bin" / "tritonserver").exists():
        pytest.skip("no tritonserver in .triton/: run scripts/fetch-triton (make triton)")
    import tritonclient.http as httpclient
    from tritonclient.utils import InferenceServerException

    s = Server(repo, tmp_path / "tritonserver.log", tmp_path / "cache", "--exit-on-error", "false", stub_site=None)
    try:
        deadline = time.monotonic() + 120
        index: list = []
        while time.monotonic() < deadline:
            try:
                request = urllib.request.Request(f"http://127.0.0.1:{s.http}/v2/repository/index", data=b"{}")
                with urllib.request.urlopen(request, timeout=5) as r:
                    index = json.loads(r.read())
                if index and all(m.get("state") == "UNAVAILABLE" for m in index):
                    break
            except OSError:
                pass
            time.sleep(0.5)
        assert index and all(m.get("state") == "UNAVAILABLE" for m in index), (index, s.log.read_text()[-3000:])
        for m in index:
            assert "reads arrays through numpy 1.x's C layout" in m["reason"], m
            assert "put a numpy<2 first on PYTHONPATH" in m["reason"] and "stub-site" in m["reason"], m
        client = httpclient.InferenceServerClient(f"127.0.0.1:{s.http}")
        ids, mask = sample(2, 7, seed=1)
        with pytest.raises(InferenceServerException, match="unknown model|not ready|unavailable"):
            call(httpclient, client, ids, mask)
    finally:
        s.stop()


@pytest.mark.parametrize("protocol", ["http", "grpc"])
def test_bad_calls_are_refused_and_the_server_keeps_serving(clients, references, protocol):
    from tritonclient.utils import InferenceServerException

    module, client = clients[protocol]
    ids, mask = sample(2, 40, seed=1)  # seq 40: beyond the artifact's [4, 32]
    with pytest.raises(InferenceServerException, match=r"seq") as refused:
        call(module, client, ids, mask)
    assert refused.value.status() in ("400", "StatusCode.INVALID_ARGUMENT")
    ids, mask = sample(2, 8, seed=2)
    ids[1, 3] = 99  # an integer outside the embedding's rows [0, 49]
    with pytest.raises(InferenceServerException, match=r"99 .*outside the valid range \[0, 49\]") as refused:
        call(module, client, ids, mask)
    assert refused.value.status() in ("400", "StatusCode.INVALID_ARGUMENT")
    # A wrong dtype never reaches the model: Triton checks it against config.pbtxt.
    with pytest.raises(
        InferenceServerException, match=r"'ids' data-type is 'INT32', but model 'tiny-tagger' expects 'INT64'"
    ):
        call(module, client, ids.astype(np.int32), np.ones_like(mask), ids_type="INT32")
    ids, mask = sample(3, 12, seed=3)
    got = call(module, client, ids, mask)
    np.testing.assert_allclose(got[1], references(ids, mask)[1][1], rtol=1e-6, atol=1e-6)


def test_the_dynamic_batcher_batches_and_each_request_is_guarded(server, clients, references):
    """Concurrent requests (with bad ones among them) run in fewer executions than requests, and
    every request gets its own answer: the right one, or its refusal."""
    from tritonclient.utils import InferenceServerException

    module, client = clients["grpc"]  # the gRPC client may be shared by threads (the HTTP one may not)
    calls = [sample(1, 16, seed=i) for i in range(24)]
    for i in (5, 17):
        calls[i][0][0, 0] = 77  # refused by the guards, whatever batch it lands in
    before = server.stats()

    def one(i: int):
        try:
            return call(module, client, *calls[i])
        except InferenceServerException as e:
            return e

    with ThreadPoolExecutor(max_workers=12) as pool:
        answers = list(pool.map(one, range(len(calls))))
    after = server.stats()
    for i, (answer, (ids, mask)) in enumerate(zip(answers, calls)):
        if i in (5, 17):
            assert isinstance(answer, InferenceServerException) and "77" in str(answer), answer
            continue
        assert not isinstance(answer, Exception), answer
        for g, c in zip(answer, references(ids, mask)[1]):
            np.testing.assert_allclose(g, c, rtol=1e-6, atol=1e-6)
    inferences = after["inference_count"] - before["inference_count"]
    executions = after["execution_count"] - before["execution_count"]
    assert inferences >= 22 and executions < inferences, (inferences, executions)
    assert max(after["batch_sizes"]) > 1, after["batch_sizes"]


def test_a_folder_that_is_not_empty_is_refused(tagger_build, tmp_path):
    (tmp_path / "keep.txt").write_text("x")
    result = export(str(tagger_build.path), "-o", str(tmp_path))
    assert result.exit_code == 1
    assert result.output.strip() == f"Error: {tmp_path}: exists and is not an empty folder; give a new or empty one"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["keep.txt"]


def test_a_dtype_triton_cannot_hand_over_is_refused(tagger_build, tmp_path):
    artifact = tmp_path / "artifact"
    shutil.copytree(tagger_build.path, artifact)
    manifest = json.loads((artifact / "manifest.json").read_text())
    mask = next(spec for spec in manifest["inputs"] if spec["name"] == "mask")
    mask["dtype"] = "bfloat16"
    mask.pop("range", None)
    (artifact / "manifest.json").write_text(json.dumps(manifest))
    result = export(str(artifact), "-o", str(tmp_path / "repo"))
    assert result.exit_code == 1
    assert (
        result.output.strip() == f"Error: {artifact}: input 'mask': dtype bfloat16 has no Triton Python-backend type "
        "(supported: bool, uint8, int8, int16, int32, int64, float16, float32, float64)"
    )
    assert not (tmp_path / "repo").exists()


def test_two_artifacts_of_one_version_are_refused(tagger_build, tmp_path):
    result = export(str(tagger_build.path), str(tagger_build.path), "-o", str(tmp_path / "repo"))
    assert result.exit_code == 1
    assert "version 1 is also" in result.output and "give each version once" in result.output
    assert not (tmp_path / "repo").exists()


def test_help():
    result = CliRunner().invoke(main, ["export", "triton", "--help"], catch_exceptions=False)
    assert result.exit_code == 0 and "model repository" in result.output


def test_link_symlinks_the_artifact(tagger_build, tmp_path):
    result = export(str(tagger_build.path), "-o", str(tmp_path / "repo"), "--link")
    assert result.exit_code == 0, result.output
    artifact = tmp_path / "repo" / NAME / "1" / "artifact"
    assert artifact.is_symlink() and artifact.resolve() == Path(tagger_build.path).resolve()


# --- the trust policy: checked at export, written into config.pbtxt, applied again by model.py ---


@pytest.fixture(scope="module")
def other_key(tmp_path_factory) -> tuple[Path, Path]:
    """A second key pair: a signature by it is not one by the trusted key."""
    from precompile.ship.sign import keygen

    private, public, _ = keygen(tmp_path_factory.mktemp("other-key") / "other")
    return private, public


@pytest.fixture(scope="module")
def trusted_repo(tagger_build, structured_artifact, signing_keys, other_key, tmp_path_factory) -> Path:
    """Exported with --trusted-key, everything signed by it: the tagger as a pack (version 1) and a
    folder (version 2), the structured model, and the tagger once more under another name. Then, as
    if replaced in the repository after the export, the structured model is signed by another key
    and the renamed tagger loses its signature."""
    from precompile.ship.pack import pack
    from precompile.ship.sign import sign

    folder = tmp_path_factory.mktemp("triton-trust")
    v1 = pack(tagger_build.path, folder / "tagger-v1.tar.zst")
    v2 = artifact_version(tagger_build.path, folder / "tagger-v2", 2)
    structured = folder / "structured"
    shutil.copytree(structured_artifact, structured)
    renamed = folder / "renamed"
    shutil.copytree(tagger_build.path, renamed)
    manifest = json.loads((renamed / "manifest.json").read_text())
    manifest["name"] = UNSIGNED  # the manifest lists the other files, not itself: they still match
    (renamed / "manifest.json").write_text(json.dumps(manifest, indent=2) + "\n")
    for artifact in (v1, v2, structured, renamed):
        sign(artifact, signing_keys[0])
    out = folder / "repo"
    result = export(
        *map(str, (v1, v2, structured, renamed)),
        "-o",
        str(out),
        "--trusted-key",
        str(signing_keys[1]),
        "--min-version",
        "1",
    )
    assert result.exit_code == 0, result.output
    sign(out / "tiny-structured" / "1" / "artifact", other_key[0])
    (out / UNSIGNED / "1" / "artifact" / "signature.json").unlink()
    return out


@pytest.fixture(scope="module")
@builds
def trusted_server(trusted_repo, tmp_path_factory):
    if not (SERVER / "bin" / "tritonserver").exists():
        pytest.skip("no tritonserver in .triton/: run scripts/fetch-triton (make triton)")
    folder = tmp_path_factory.mktemp("triton-trust-server")
    # A model that fails to load must not stop the server (Triton exits on it by default).
    s = Server(trusted_repo, folder / "tritonserver.log", folder / "cache", "--exit-on-error", "false")
    try:
        s.wait_ready()
        yield s
    finally:
        s.stop()


def parameters(config: str) -> dict[str, object]:
    """config.pbtxt's load.* parameters, their JSON values decoded."""
    import re

    found = re.findall(r'\{ key: "(load\.[a-z_]+)", value: \{ string_value: "((?:[^"\\]|\\.)*)" \} \}', config)
    return {key: json.loads(value.encode().decode("unicode_escape")) for key, value in found}


def test_the_config_carries_the_trust_policy(trusted_repo, signing_keys):
    from cryptography.hazmat.primitives import serialization

    pem = serialization.load_pem_public_key(signing_keys[1].read_bytes())
    openssh = pem.public_bytes(serialization.Encoding.OpenSSH, serialization.PublicFormat.OpenSSH).decode()
    for name in (NAME, "tiny-structured", UNSIGNED):
        assert parameters((trusted_repo / name / "config.pbtxt").read_text()) == {
            "load.trusted_keys": [openssh],  # the key itself: the repository needs no key file
            "load.min_version": 1,
            "load.refuse_rollback": False,
            "load.verify": True,
            "load.precision": "auto",
        }


def test_the_default_policy_is_written_too(repo):
    assert parameters((repo / NAME / "config.pbtxt").read_text()) == {
        "load.trusted_keys": None,
        "load.min_version": None,
        "load.refuse_rollback": False,
        "load.verify": True,
        "load.precision": "auto",
    }


def test_precision_and_no_verify_are_written_as_given(tagger_build, tmp_path):
    result = export(str(tagger_build.path), "-o", str(tmp_path / "repo"), "--precision", "fp32", "--no-verify")
    assert result.exit_code == 0, result.output
    written = parameters((tmp_path / "repo" / NAME / "config.pbtxt").read_text())
    assert written["load.precision"] == "fp32" and written["load.verify"] is False


def repository_index(server: Server) -> dict[tuple[str, str], dict]:
    request = urllib.request.Request(f"http://127.0.0.1:{server.http}/v2/repository/index", data=b"{}", method="POST")
    with urllib.request.urlopen(request, timeout=10) as r:
        return {(m["name"], m.get("version", "")): m for m in json.loads(r.read())}


def test_triton_serves_the_signed_version_and_refuses_the_rest(trusted_server, references):
    """In Triton, model.py applies the exported policy: the model signed by another key and the
    unsigned one are UNAVAILABLE with the loader's reason, and Triton serves on with the rest.
    (Triton 2.51 loads a model's versions all or none: one refused version fails its model.)"""
    import tritonclient.http as httpclient

    index = repository_index(trusted_server)
    assert index[(NAME, "1")]["state"] == index[(NAME, "2")]["state"] == "READY"
    assert index[("tiny-structured", "1")]["state"] == "UNAVAILABLE"
    assert "signed by key" in index[("tiny-structured", "1")]["reason"]
    assert "which is not trusted here" in index[("tiny-structured", "1")]["reason"]
    assert index[(UNSIGNED, "1")]["state"] == "UNAVAILABLE"
    assert "not signed, and this loader only accepts artifacts signed by key(s)" in index[(UNSIGNED, "1")]["reason"]
    client = httpclient.InferenceServerClient(f"127.0.0.1:{trusted_server.http}")
    assert not client.is_model_ready("tiny-structured") and not client.is_model_ready(UNSIGNED)
    ids, mask = sample(2, 9, seed=11)
    for version in ("1", "2"):
        for got, want in zip(call(httpclient, client, ids, mask, version=version), references(ids, mask)[1]):
            np.testing.assert_allclose(got, want, rtol=1e-6, atol=1e-6)
    assert trusted_server.process.poll() is None


def test_an_artifact_the_policy_refuses_is_not_exported(tagger_build, signing_keys, tmp_path):
    result = export(str(tagger_build.path), "-o", str(tmp_path / "repo"), "--trusted-key", str(signing_keys[1]))
    assert result.exit_code == 1
    lines = result.output.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith(f"Error: {tagger_build.path}: not signed"), result.output
    assert not (tmp_path / "repo").exists()
    result = export(str(tagger_build.path), "-o", str(tmp_path / "repo"), "--min-version", "2")
    assert result.exit_code == 1
    assert "tiny-tagger is version 1, older than the minimum 2 asked for" in result.output
    assert not (tmp_path / "repo").exists()


def test_options_that_contradict_each_other_are_refused(tagger_build, signing_keys, tmp_path):
    v2 = artifact_version(tagger_build.path, tmp_path / "v2", 2)
    result = export(str(tagger_build.path), str(v2), "-o", str(tmp_path / "repo"), "--refuse-rollback")
    assert result.exit_code == 1
    assert "--refuse-rollback would refuse all but the newest" in result.output
    result = export(
        str(tagger_build.path), "-o", str(tmp_path / "repo"), "--trusted-key", str(signing_keys[1]), "--no-verify"
    )
    assert result.exit_code == 1
    assert "--no-verify skips the sha256 checks a signature relies on" in result.output
    assert not (tmp_path / "repo").exists()


# --- the serving bench's Triton method (bench/serve_load.py), bounded: one level, two seconds ---


def test_the_serving_bench_runs_triton_and_our_server_over_http_and_grpc(tagger_build, tmp_path):
    """`python -m bench.serve_load --servers triton precompile`: Triton serves the exported artifact
    with its dynamic batcher over both protocols, answering every request; our server over HTTP, and
    over gRPC where `precompile serve` has --grpc-port (else a line says the rows are skipped)."""
    import sys

    from bench.serve_load import serves_grpc

    if not (SERVER / "bin" / "tritonserver").exists():
        pytest.skip("no tritonserver in .triton/: run scripts/fetch-triton (make triton)")
    out = tmp_path / "serve_load.json"
    command = [
        sys.executable, "-m", "bench.serve_load", "--artifact", str(tagger_build.path), "--shape", "batch=1,seq=16",
        "--servers", "triton", "precompile", "--protocol", "http", "grpc", "--concurrency", "3",
        "--seconds", "2", "--requests", "60", "--warmup", "1", "--client-procs", "1",
        "--work", str(tmp_path / "work"), "--out", str(out),
    ]  # fmt: skip
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    result = subprocess.run(command, cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stdout + result.stderr
    rows = json.loads(out.read_text())["cases"][tagger_build.manifest.name][
        "rows"
    ]  # an --artifact case is named by its manifest
    measured = {(r["server"], r["protocol"]): r for r in rows}
    grpc = serves_grpc()
    expected = {("triton", "http"), ("triton", "grpc"), ("precompile", "http")} | (
        {("precompile", "grpc")} if grpc else set()
    )
    assert set(measured) == expected, result.stdout
    if not grpc:
        assert "precompile: gRPC rows skipped: `precompile serve` has no --grpc-port here" in result.stdout
    for row in measured.values():
        assert row["requests"] >= 3 and row["errors"] == 0, row
        assert row["server_cores"] is not None and row["server_cores"] > 0, row
    for protocol in ("http", "grpc"):
        triton = measured[("triton", protocol)]
        # Triton's statistics: every timed request counted in a batch of Triton's dynamic batcher
        assert triton["batches"] >= 1 and triton["mean_batch"] >= 1, triton
        assert sum(triton["batch_sizes"].values()) == triton["batches"], triton
