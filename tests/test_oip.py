"""The Open Inference Protocol (KServe v2) through the published client, tritonclient[http], against
`precompile serve --batch` run as a process on a loopback port; results compared with loader.load."""

from __future__ import annotations

import threading
from concurrent.futures import ThreadPoolExecutor

import httpx
import numpy as np
import pytest
import torch
from prometheus_client.parser import text_string_to_metric_families

import loader
from tests.test_serve_load import DEADLINE

tritonclient_http = pytest.importorskip("tritonclient.http")
from tritonclient.utils import InferenceServerException  # noqa: E402

MODEL = "tiny-classifier"


@pytest.fixture(scope="module")
def served(classifier_batched):
    """`precompile serve ARTIFACT --batch` (tests/conftest.py); the host:port the client connects to."""
    return f"127.0.0.1:{classifier_batched[0]}"


@pytest.fixture(scope="module")
def client(served):
    c = tritonclient_http.InferenceServerClient(
        url=served, concurrency=4, connection_timeout=DEADLINE, network_timeout=DEADLINE
    )
    yield c
    c.close()


@pytest.fixture(scope="module")
def classifier(classifier_artifact):
    return loader.load(classifier_artifact)


def inputs(seed: int, batch: int = 1, seq: int = 9) -> tuple[np.ndarray, np.ndarray]:
    rng = np.random.default_rng(seed)
    return rng.integers(0, 50, (batch, seq), dtype=np.int64), rng.random((batch, seq)) < 0.8


def infer(client, ids: np.ndarray, mask: np.ndarray, *, binary: bool):
    request = [
        tritonclient_http.InferInput("ids", list(ids.shape), "INT64"),
        tritonclient_http.InferInput("mask", list(mask.shape), "BOOL"),
    ]
    request[0].set_data_from_numpy(ids, binary_data=binary)
    request[1].set_data_from_numpy(mask, binary_data=binary)
    outputs = [tritonclient_http.InferRequestedOutput("output", binary_data=binary)]
    return client.infer(MODEL, request, outputs=outputs).as_numpy("output")


def test_health_and_readiness(client):
    assert client.is_server_live()
    assert client.is_server_ready()
    assert client.is_model_ready(MODEL)
    assert not client.is_model_ready("no-such-model")


def test_metadata_names_datatypes_and_dynamic_dims(client):
    meta = client.get_model_metadata(MODEL)
    assert meta["name"] == MODEL
    assert meta["inputs"] == [
        {"name": "ids", "datatype": "INT64", "shape": [-1, -1]},
        {"name": "mask", "datatype": "BOOL", "shape": [-1, -1]},
    ]
    assert [(o["name"], o["datatype"]) for o in meta["outputs"]] == [("output", "FP32")]
    assert meta["outputs"][0]["shape"][0] == -1


@pytest.mark.parametrize("binary", [False, True], ids=["json", "binary"])
def test_infer_matches_a_direct_call(client, classifier, binary):
    ids, mask = inputs(seed=1, batch=3, seq=11)
    got = infer(client, ids, mask, binary=binary)
    want = classifier(torch.from_numpy(ids), torch.from_numpy(mask)).numpy()
    assert got.dtype == np.float32 and got.shape == want.shape
    np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-5)


def batch_counts(served: str) -> tuple[float, float]:
    """(batches run, rows in them) so far, from the server's /metrics."""
    metrics = httpx.get(f"http://{served}/metrics", timeout=DEADLINE).text
    found = {s.name: s.value for f in text_string_to_metric_families(metrics) for s in f.samples}
    return found["precompile_batch_size_count"], found["precompile_batch_size_sum"]


def test_concurrent_clients_are_batched_and_each_gets_its_own_result(served, classifier):
    calls = [inputs(seed) for seed in range(6)]
    # The batcher has an instance per CPU (as on the native runtime): an idle one may take a call
    # before its batch-mates arrive, so a round of six may run as six; a few rounds must batch some.
    for _ in range(3):
        batches, rows = _concurrent_round(served, classifier, calls)
        assert rows == len(calls)
        if batches < rows:
            break
    assert batches < rows  # some calls ran together


def _concurrent_round(served, classifier, calls) -> tuple[float, float]:
    """Send ``calls`` at once; check each answer; (batches run, rows run) meanwhile."""
    batches_before, rows_before = batch_counts(served)
    start = threading.Barrier(len(calls))

    def one(args):
        c = tritonclient_http.InferenceServerClient(url=served, connection_timeout=DEADLINE, network_timeout=DEADLINE)
        try:
            start.wait(timeout=DEADLINE)
            return infer(c, *args, binary=True)
        finally:
            c.close()

    with ThreadPoolExecutor(len(calls)) as pool:
        results = list(pool.map(one, calls))
    for (ids, mask), got in zip(calls, results):
        want = classifier(torch.from_numpy(ids), torch.from_numpy(mask)).numpy()
        np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-5)
    batches, rows = (after - before for after, before in zip(batch_counts(served), (batches_before, rows_before)))
    return batches, rows


def test_a_call_the_guards_refuse_raises_with_the_guards_message(client, classifier):
    ids, mask = inputs(seed=2)
    ids[0, 0] = 99  # outside the ids range [0, 49]
    with pytest.raises(loader.GuardError) as refused:
        classifier(torch.from_numpy(ids), torch.from_numpy(mask))
    with pytest.raises(InferenceServerException) as raised:
        infer(client, ids, mask, binary=True)
    assert raised.value.status() == "400"
    assert str(refused.value) in raised.value.message()


def test_an_unknown_model_is_404(client):
    with pytest.raises(InferenceServerException) as raised:
        client.get_model_metadata("no-such-model")
    assert raised.value.status() == "404" and "tiny-classifier" in raised.value.message()
