"""`precompile serve --runtime native`: the server on the torch-free loader (loader.load_native). Real
servers on loopback ports answer /predict and /v2 infer (JSON and binary, with and without --batch)
exactly as the torch runtime's server does, from processes that never import torch; in process, the
codec refuses the same bodies with the same words on both runtimes, and hot swap, batching and stats
work on numpy arrays."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import tempfile
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from pathlib import Path

import httpx
import numpy as np
import pytest

import loader
from loader import SwapError
from loader.threads import cpu_allowance
from precompile.serve.app import create_app
from precompile.serve.config import ServeConfig
from tests.test_batching_section import call as encoder_call
from tests.test_oip import infer as infer_with
from tests.test_serve import AppClient, invoke
from tests.test_serve_load import DEADLINE, free_port, replace_link, stop_server, wait_ready

tritonclient_http = pytest.importorskip("tritonclient.http")

ROOT = Path(__file__).resolve().parent.parent
MODEL = "tiny-classifier"

# `python -m precompile ARGS` in a process where importing torch fails (what a serving image
# without torch's Python package looks like): any import of it on the way would stop the server.
NO_TORCH_SERVE = r"""
import runpy, sys

class NoTorch:
    def find_spec(self, name, path=None, target=None):
        if name == "torch" or name.startswith("torch."):
            raise ImportError(f"{name} is not importable here")
        return None

sys.meta_path.insert(0, NoTorch())
sys.argv = ["precompile", *sys.argv[1:]]
runpy.run_module("precompile", run_name="__main__")
"""


@contextmanager
def serving(artifact: Path, *options: str, no_torch: bool = False, **env: str):
    """`precompile serve ARTIFACT OPTIONS` on a free loopback port, ready, with ``env`` added to an
    environment without OpenMP settings; yields (base URL, pid, the file its output goes to)."""
    port = free_port()
    environ = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "OMP_NUM_THREADS", "OMP_WAIT_POLICY")}
    args = ["serve", str(artifact), "--port", str(port), "--log-level", "warning", *options]
    start = [sys.executable, "-c", NO_TORCH_SERVE] if no_torch else [sys.executable, "-m", "precompile"]
    with tempfile.NamedTemporaryFile("w+", prefix="serve-native-", suffix=".log") as log:
        process = subprocess.Popen(start + args, cwd=ROOT, env={**environ, **env}, stdout=log, stderr=log)
        try:
            try:
                wait_ready(f"http://127.0.0.1:{port}")
            except TimeoutError:
                process.kill()
                process.wait()
                raise AssertionError(Path(log.name).read_text()[-3000:]) from None
            yield f"http://127.0.0.1:{port}", process.pid, Path(log.name)
        finally:
            stop_server(process)  # SIGTERM: a drain, then status 0
        assert process.returncode == 0, Path(log.name).read_text()[-3000:]


def mapped_libraries(pid: int) -> set[str]:
    """The file names of the shared objects process ``pid`` has mapped."""
    text = Path(f"/proc/{pid}/maps").read_text()
    return {line.split()[-1].rsplit("/", 1)[-1] for line in text.splitlines() if ".so" in line}


@pytest.fixture(scope="module")
def torch_server(classifier_artifact):
    with serving(classifier_artifact, "--runtime", "torch") as (base, _, _):
        yield base


@pytest.fixture(scope="module")
def native_server(classifier_artifact):
    # libgomp prints the settings it started with: they must be the server's (passive, the CPUs it gets).
    with serving(classifier_artifact, "--runtime", "native", OMP_DISPLAY_ENV="VERBOSE") as (base, pid, log):
        yield base, pid, log


@pytest.fixture(scope="module")
def native_batch_server(classifier_artifact):
    """The native runtime with --batch, where torch cannot be imported at all."""
    options = ("--runtime", "native", "--batch", "--max-delay-ms", "50")
    with serving(classifier_artifact, *options, no_torch=True) as (base, _, _):
        yield base


def call_inputs(seed: int, batch: int, seq: int) -> tuple[np.ndarray, np.ndarray]:
    rng = np.random.default_rng(seed)
    return rng.integers(0, 50, (batch, seq), dtype=np.int64), rng.random((batch, seq)) < 0.8


CALLS = [(0, 1, 9), (1, 3, 11), (2, 2, 16), (3, 1, 5)]  # (seed, batch, seq)


def predict(base: str, ids: np.ndarray, mask: np.ndarray) -> httpx.Response:
    return httpx.post(
        f"{base}/predict", json={"inputs": {"ids": ids.tolist(), "mask": mask.tolist()}}, timeout=DEADLINE
    )


def infer(base: str, ids: np.ndarray, mask: np.ndarray, *, binary: bool) -> np.ndarray:
    client = tritonclient_http.InferenceServerClient(
        url=base.removeprefix("http://"), connection_timeout=DEADLINE, network_timeout=DEADLINE
    )
    try:
        return infer_with(client, ids, mask, binary=binary)
    finally:
        client.close()


# --- a process without torch ---------------------------------------------------------------------


def test_the_native_server_runs_libtorch_without_importing_torch(native_server):
    _, pid, _ = native_server
    libraries = mapped_libraries(pid)
    assert "libtorch_cpu.so" in libraries  # the compiled code runs on torch's libraries...
    # ...but the Python package never loaded: its extension module and its Python bindings are absent.
    assert not {name for name in libraries if name.startswith("_C.") or name == "libtorch_python.so"}


def descendants(pid: int) -> list[int]:
    """``pid`` and every process under it."""
    out, todo = [], [pid]
    while todo:
        p = todo.pop()
        out.append(p)
        for task in Path(f"/proc/{p}/task").iterdir():
            todo += [int(c) for c in (task / "children").read_text().split()]
    return out


def test_several_native_workers_serve_without_torch(classifier_artifact, torch_server):
    with serving(classifier_artifact, "--runtime", "native", "--workers", "2") as (base, pid, _):
        deadline, ready = time.monotonic() + DEADLINE, 0
        while ready < 12:  # /readyz is the answering worker's: until new connections find both ready
            assert time.monotonic() < deadline, "the workers did not all get ready"
            ready = ready + 1 if httpx.get(f"{base}/readyz").status_code == 200 else 0
        ids, mask = call_inputs(7, 2, 12)
        for _ in range(4):  # the connections land on either worker
            assert predict(base, ids, mask).json() == predict(torch_server, ids, mask).json()
        maps = [mapped_libraries(p) for p in descendants(pid)]
    assert sum("libtorch_cpu.so" in m for m in maps) >= 2  # each worker runs the compiled code
    assert not [name for m in maps for name in m if name.startswith("_C.") or name == "libtorch_python.so"]


def test_the_native_server_follows_deploys(classifier_versions, tmp_path):
    current = tmp_path / "current"
    current.symlink_to(classifier_versions[0])
    with serving(current, "--runtime", "native", "--watch", "--watch-interval", "0.05") as (base, _, _):
        ids, mask = call_inputs(8, 1, 6)
        before = predict(base, ids, mask).json()
        replace_link(current, classifier_versions[2])
        deadline = time.monotonic() + DEADLINE
        while httpx.get(f"{base}/readyz").json()["version"] != 3:
            assert time.monotonic() < deadline, "the deploy was not picked up"
            time.sleep(0.05)
        after = predict(base, ids, mask).json()
        replace_link(current, classifier_versions[1])  # an older version: refused, version 3 serves on
        deadline = time.monotonic() + DEADLINE
        while (attempt := httpx.get(f"{base}/v1/artifact").json()["last_attempt"])["version"] != 2:
            assert time.monotonic() < deadline, "the rollback was not tried"
            time.sleep(0.05)
        assert not attempt["ok"] and "older than the serving version 3" in attempt["error"]
        assert httpx.get(f"{base}/readyz").json()["version"] == 3
    assert before["artifact"]["version"] == 1 and after["artifact"]["version"] == 3
    assert after["outputs"] == before["outputs"]  # the versions are copies of one artifact


def test_openmp_starts_with_the_servers_settings(native_server):
    """OpenMP reads its settings once, when libgomp loads: the native server puts them in its own
    environment first (no re-exec: nothing loaded it before), and libgomp starts with them."""
    settings = native_server[2].read_text()
    assert "OMP_WAIT_POLICY = 'ACTIVE'" in settings
    assert "GOMP_SPINCOUNT = '10000'" in settings  # a short spin before sleeping (loader.threads.wait_env)
    assert f"OMP_NUM_THREADS = '{cpu_allowance().cpus}'" in settings


# --- the same answers as the torch runtime ---------------------------------------------------------


@pytest.mark.parametrize("seed, batch, seq", CALLS)
def test_predict_answers_equal_the_torch_runtimes(torch_server, native_server, seed, batch, seq):
    ids, mask = call_inputs(seed, batch, seq)
    want, got = predict(torch_server, ids, mask), predict(native_server[0], ids, mask)
    assert want.status_code == got.status_code == 200
    assert got.json() == want.json()  # outputs (bit for bit, through JSON), artifact and variant


@pytest.mark.parametrize("binary", [False, True], ids=["json", "binary"])
@pytest.mark.parametrize("seed, batch, seq", CALLS)
def test_v2_infer_answers_equal_the_torch_runtimes(torch_server, native_server, seed, batch, seq, binary):
    ids, mask = call_inputs(seed, batch, seq)
    want = infer(torch_server, ids, mask, binary=binary)
    got = infer(native_server[0], ids, mask, binary=binary)
    assert got.dtype == want.dtype == np.float32
    assert np.array_equal(got, want)


def test_metadata_and_refusals_equal_the_torch_runtimes(torch_server, native_server):
    native = native_server[0]
    for path in (f"/v2/models/{MODEL}", "/v2/models/nope"):
        want, got = httpx.get(torch_server + path), httpx.get(native + path)
        assert (got.status_code, got.json()) == (want.status_code, want.json())
    ids, mask = call_inputs(5, 2, 8)
    ids[1, 3] = 99  # outside the ids range [0, 49]
    bad = [
        {"inputs": {"ids": ids.tolist(), "mask": mask.tolist()}},
        {"inputs": {"ids": [[1.5] * 8], "mask": [[True] * 8]}},
        {"inputs": {"ids": [[2**70] * 8], "mask": [[True] * 8]}},
        {"inputs": {"ids": [[1] * 8], "mask": [[1] * 8]}},
    ]
    for payload in bad:
        want = httpx.post(f"{torch_server}/predict", json=payload)
        got = httpx.post(f"{native}/predict", json=payload)
        assert want.status_code == 422 and (got.status_code, got.json()) == (want.status_code, want.json())


def test_batched_answers_are_each_callers_own(torch_server, native_batch_server):
    calls = [call_inputs(seed, 1, 9) for seed in range(6)]
    start = threading.Barrier(len(calls))

    def one(args):
        start.wait(timeout=DEADLINE)
        return infer(native_batch_server, *args, binary=True), predict(native_batch_server, *args).json()

    with ThreadPoolExecutor(len(calls)) as pool:
        results = list(pool.map(one, calls))
    for (ids, mask), (binary, predicted) in zip(calls, results):
        want = infer(torch_server, ids, mask, binary=True)
        np.testing.assert_allclose(binary, want, rtol=1e-4, atol=1e-5)  # the build's batching tolerance
        np.testing.assert_allclose(np.array(predicted["outputs"], dtype=np.float32), want, rtol=1e-4, atol=1e-5)
    text = httpx.get(f"{native_batch_server}/metrics", timeout=DEADLINE).text
    samples = {line.split()[0]: float(line.split()[1]) for line in text.splitlines() if line and line[0] != "#"}
    batches, rows = samples["precompile_batch_size_count"], samples["precompile_batch_size_sum"]
    assert rows >= 2 * len(calls) and batches < rows  # some calls ran together


# --- choosing the runtime --------------------------------------------------------------------------


@pytest.fixture
def served_config(monkeypatch):
    seen = {}
    monkeypatch.setattr("precompile.serve.server.run", lambda config, **kw: seen.update(config=config, **kw))
    return seen


NEEDS_TORCH = "op aten.nonzero has no C shim (the proxy executor runs it)"


def needing_torch(src: Path, dst: Path) -> tuple[Path, str]:
    """A copy of ``src`` whose manifest records its first variant as needing torch's proxy executor;
    and that variant's id."""
    shutil.copytree(src, dst)
    manifest = json.loads((dst / "manifest.json").read_text())
    manifest["variants"][0]["needs_torch"] = NEEDS_TORCH
    (dst / "manifest.json").write_text(json.dumps(manifest, indent=2))
    return dst, manifest["variants"][0]["id"]


def test_auto_serves_a_cpu_artifact_without_torch(classifier_artifact, served_config):
    assert invoke("serve", str(classifier_artifact)).exit_code == 0
    assert served_config["config"].runtime == "native"
    assert invoke("serve", str(classifier_artifact), "--runtime", "torch").exit_code == 0
    assert served_config["config"].runtime == "torch"


def test_auto_serves_an_artifact_that_needs_torch_with_torch(classifier_artifact, tmp_path, served_config):
    artifact, _ = needing_torch(classifier_artifact, tmp_path / "a")
    assert invoke("serve", str(artifact)).exit_code == 0
    assert served_config["config"].runtime == "torch"


def test_native_refuses_an_artifact_that_needs_torch_in_one_line(classifier_artifact, tmp_path, served_config):
    artifact, variant = needing_torch(classifier_artifact, tmp_path / "a")
    result = invoke("serve", str(artifact), "--runtime", "native")
    assert result.exit_code == 1 and "Traceback" not in result.output
    assert result.output.strip() == (
        f"Error: --runtime native: {artifact}: variant {variant!r} cannot run without torch: {NEEDS_TORCH}; "
        "serve it with --runtime torch"
    )
    assert "config" not in served_config


# --- in process: the codec, hot swap, batching ---------------------------------------------------------


def native_app(artifact: Path, **options) -> AppClient:
    live = loader.Live(artifact, load=loader.load_native)
    return AppClient(create_app(ServeConfig(str(artifact), runtime="native", **options), live=live))


def torch_app(artifact: Path, **options) -> AppClient:
    return AppClient(create_app(ServeConfig(str(artifact), **options), live=loader.Live(artifact)))


NON_FINITE = {
    "nan": (np.nan, b"NaN"),
    "inf": (np.inf, b"Infinity"),
    "-inf": (-np.inf, b"-Infinity"),
    "1e39": (1e39, b"1e39"),
}


@pytest.mark.parametrize("case", NON_FINITE)
def test_non_finite_floats_are_refused_alike_as_json_and_binary(structured_artifact, case):
    value, token = NON_FINITE[case]
    with np.errstate(over="ignore"):
        x = np.array([[0, 0, 0, value, 0, 0, 0, 0]], dtype=np.float64).astype(np.float32)  # 1e39: infinity
    header = json.dumps(
        {"inputs": [{"name": "x", "shape": [1, 8], "datatype": "FP32", "parameters": {"binary_data_size": 32}}]}
    ).encode()
    answers = []
    for app in (torch_app(structured_artifact), native_app(structured_artifact)):
        with app as c:
            as_json = c.post(
                "/predict",
                content=b'{"inputs": {"x": [[0, 0, 0, ' + token + b", 0, 0, 0, 0]]}}",
                headers={"content-type": "application/json"},
            )
            as_binary = c.post(
                "/v2/models/tiny-structured/infer",
                content=header + x.tobytes(),
                headers={"Inference-Header-Content-Length": str(len(header))},
            )
            answers.append(((as_json.status_code, as_json.json()), (as_binary.status_code, as_binary.json())))
    assert answers[0] == answers[1]
    (json_status, json_body), (binary_status, binary_body) = answers[1]
    assert json_status == 422 and json_body["reason"] == "invalid_body" and "finite" in json_body["detail"]
    assert binary_status == 400 and "finite" in binary_body["error"]


def test_wrong_datatypes_and_sizes_are_refused_alike(classifier_artifact):
    bodies = [
        {"inputs": [{"name": "ids", "shape": [1, 4], "datatype": "INT32", "data": [1, 2, 3, 4]}]},
        {"inputs": [{"name": "ids", "shape": [1, 4], "datatype": "INT64", "data": [1, 2, 3]}]},
        {"inputs": [{"name": "ids", "shape": [1, 4], "datatype": "INT64", "parameters": {"binary_data_size": 30}}]},
    ]
    answers = []
    for app in (torch_app(classifier_artifact), native_app(classifier_artifact)):
        with app as c:
            answers.append([c.post(f"/v2/models/{MODEL}/infer", json=b).json() for b in bodies])
    assert answers[0] == answers[1]
    assert [a["error"].split(":")[0] for a in answers[1]] == ["input 'ids'"] * 3


def test_binary_inputs_are_views_of_the_body_where_aligned():
    from precompile.serve.codec import codec_for

    codec = codec_for("native")
    data = np.arange(6, dtype=np.int64)
    for offset in (0, 8, 3):  # aligned views, then an unaligned offset that must be copied
        body = b"\0" * offset + data.tobytes()
        array, end = codec.binary("ids", body, offset, 48, [2, 3], 6, "int64")
        assert end == offset + 48 and np.array_equal(array, data.reshape(2, 3)) and array.flags.aligned
        assert np.shares_memory(array, np.frombuffer(body, np.uint8)) == (offset % 8 == 0)


def test_hot_swap_rollback_refusal_and_stats_on_the_native_loader(classifier_versions):
    live = loader.Live(classifier_versions[1], load=loader.load_native)
    assert isinstance(live.model, loader.NativeModel) and live.serving.version == 2
    ids, mask = call_inputs(0, 2, 10)
    live(ids, mask)
    live.swap(classifier_versions[2])
    assert live.serving.version == 3 and isinstance(live.model, loader.NativeModel)
    live(ids, mask)
    with pytest.raises(SwapError, match="older than the serving version 3"):
        live.swap(classifier_versions[0])
    assert live.serving.version == 3 and not live.last_attempt.ok
    stats = live.stats()
    assert stats["calls"] == 1  # the current version's
    assert stats["shapes"] == [{"dims": {"batch": 2, "seq": 10}, "count": 2}]  # every version's


def test_the_batcher_batches_numpy_calls(classifier_artifact):
    model = loader.load_native(classifier_artifact)
    calls = [call_inputs(seed, 1, 10) for seed in range(6)]
    expected = [model(*args) for args in calls]
    model.reset_stats()
    start = threading.Barrier(len(calls))
    with loader.Batcher(model, max_batch=8, max_delay_ms=200, wait_alone=True) as batcher:

        def one(args):
            start.wait(timeout=DEADLINE)
            return batcher.submit(*args).result(timeout=DEADLINE)[0]

        with ThreadPoolExecutor(len(calls)) as pool:
            got = list(pool.map(one, calls))
        stats = batcher.stats()
    for out, want in zip(got, expected):
        assert isinstance(out, np.ndarray) and out.shape == want.shape
        np.testing.assert_allclose(out, want, rtol=1e-4, atol=1e-5)
    assert stats["batching"]["batches"] < len(calls) and stats["calls"] == stats["batching"]["batches"]


def test_the_batcher_pads_numpy_calls_to_the_longest(encoder_artifact):
    encoder = loader.load_native(encoder_artifact)
    calls = [
        tuple(t.numpy() for t in encoder_call(*c, **k))
        for c, k in [((1, 12), {}), ((2, 16), {"batch": 2}), ((3, 5), {})]
    ]
    expected = [encoder(*args) for args in calls]
    encoder.reset_stats()
    with loader.Batcher(encoder, max_batch=8, max_delay_ms=300, wait_alone=True) as batcher:
        got = [f.result(timeout=DEADLINE)[0] for f in [batcher.submit(*args) for args in calls]]
        stats = batcher.stats()
    for out, want in zip(got, expected):
        for piece, whole in zip(out, want):
            assert isinstance(piece, np.ndarray) and piece.shape == whole.shape
            np.testing.assert_allclose(piece, whole, rtol=1e-4, atol=1e-5)
    # One batch of 4 rows ran, the shorter calls grown to 16 with their pad values and cut back.
    assert stats["shapes"] == [{"dims": {"batch": 4, "seq": 16}, "count": 1}]
    assert stats["batching"]["padded_calls"] == 2


@pytest.mark.integration
def test_loader_live_and_batch_import_without_torch():
    code = (
        "import sys, loader.serving.live, loader.serving.batch, precompile.serve.app, precompile.serve.server; "
        "print(sorted(m for m in sys.modules if m.split('.')[0] == 'torch'))"
    )
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT, env=env, check=True)
    assert out.stdout.strip() == "[]"
