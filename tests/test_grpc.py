"""The Open Inference Protocol over gRPC (`precompile serve --grpc-port`) through the published client,
tritonclient.grpc, against the server run as a process on loopback: answers compared with the HTTP
/v2 answers and with the eager model; refusals get gRPC status codes and the server serves on."""

from __future__ import annotations

import contextlib
import socket
import threading
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor

import grpc
import httpx
import numpy as np
import pytest
import torch
from click.testing import CliRunner
from google.protobuf import descriptor as _descriptor
from prometheus_client.parser import text_string_to_metric_families

import loader
from precompile.cli import main
from precompile.serve import predict_v2_pb2 as ours
from tests.conftest import builds
from tests.models import tiny
from tests.test_serve_load import DEADLINE, free_port, serve_command

tritonclient_grpc = pytest.importorskip("tritonclient.grpc")
from tritonclient.grpc import service_pb2 as triton_pb2  # noqa: E402
from tritonclient.grpc import service_pb2_grpc as triton_pb2_grpc  # noqa: E402
from tritonclient.utils import InferenceServerException  # noqa: E402

MODEL = "tiny-classifier"


@pytest.fixture(scope="module")
def served(classifier_batched):
    """`precompile serve ARTIFACT --batch --grpc-port G` (tests/conftest.py): (HTTP base URL, gRPC host:port)."""
    port, grpc_port = classifier_batched
    return f"http://127.0.0.1:{port}", f"127.0.0.1:{grpc_port}"


@pytest.fixture(scope="module")
def client(served):
    c = tritonclient_grpc.InferenceServerClient(url=served[1])
    yield c
    c.close()


@pytest.fixture(scope="module")
@builds
def structured_served(structured_artifact):
    """The structured model (a float input, three outputs) without --batch: its calls run on instances."""
    grpc_port = free_port()
    with serve_command(structured_artifact, "--grpc-port", str(grpc_port)) as port:
        yield f"http://127.0.0.1:{port}", f"127.0.0.1:{grpc_port}"


@pytest.fixture(scope="module")
def eager():
    return tiny.classifier(vocab=50, width=16).eval()


def inputs(seed: int, batch: int = 1, seq: int = 9) -> tuple[np.ndarray, np.ndarray]:
    rng = np.random.default_rng(seed)
    return rng.integers(0, 50, (batch, seq), dtype=np.int64), rng.random((batch, seq)) < 0.8


def infer(client, ids: np.ndarray, mask: np.ndarray, *, model: str = MODEL, ids_type: str = "INT64") -> np.ndarray:
    request = [
        tritonclient_grpc.InferInput("ids", list(ids.shape), ids_type),
        tritonclient_grpc.InferInput("mask", list(mask.shape), "BOOL"),
    ]
    request[0].set_data_from_numpy(ids)
    request[1].set_data_from_numpy(mask)
    return client.infer(model, request).as_numpy("output")


def http_infer(base: str, ids: np.ndarray, mask: np.ndarray) -> np.ndarray:
    body = {
        "inputs": [
            {"name": "ids", "shape": list(ids.shape), "datatype": "INT64", "data": ids.reshape(-1).tolist()},
            {"name": "mask", "shape": list(mask.shape), "datatype": "BOOL", "data": mask.reshape(-1).tolist()},
        ]
    }
    response = httpx.post(f"{base}/v2/models/{MODEL}/infer", json=body, timeout=DEADLINE)
    assert response.status_code == 200, response.text
    out = response.json()["outputs"][0]
    return np.asarray(out["data"], dtype=np.float32).reshape(out["shape"])


def refused(call) -> InferenceServerException:
    with pytest.raises(InferenceServerException) as raised:
        call()
    return raised.value


def samples(base: str, name: str) -> dict[tuple, float]:
    metrics = httpx.get(f"{base}/metrics", timeout=DEADLINE).text
    return {
        tuple(sorted(s.labels.items())): s.value
        for f in text_string_to_metric_families(metrics)
        for s in f.samples
        if s.name == name
    }


# --- the wire --------------------------------------------------------------------------------


def fields(message: _descriptor.Descriptor) -> dict:
    """A message's wire shape: each field's number, type and label, nested messages followed."""
    return {
        f.name: (f.number, f.type, f.is_repeated, fields(f.message_type) if f.message_type is not None else None)
        for f in message.fields
    }


@pytest.mark.parametrize(
    "name",
    [
        "ServerLiveRequest",
        "ServerLiveResponse",
        "ServerReadyResponse",
        "ModelReadyRequest",
        "ModelReadyResponse",
        "ServerMetadataResponse",
        "ModelMetadataRequest",
        "ModelMetadataResponse",
        "ModelInferRequest",
        "ModelInferResponse",
    ],
)
def test_our_messages_are_the_ones_tritonclient_sends(name):
    """predict_v2.proto has the wire names and field numbers of the clients' own generated code."""
    mine = ours.DESCRIPTOR.message_types_by_name[name]
    theirs = triton_pb2.DESCRIPTOR.message_types_by_name[name]
    assert mine.full_name == theirs.full_name == f"inference.{name}"
    assert fields(mine) == fields(theirs)


def test_the_service_and_its_methods_are_named_as_the_clients_call_them():
    mine = ours.DESCRIPTOR.services_by_name["GRPCInferenceService"]
    theirs = triton_pb2.DESCRIPTOR.services_by_name["GRPCInferenceService"]
    assert mine.full_name == theirs.full_name == "inference.GRPCInferenceService"
    assert {m.name for m in mine.methods} <= {m.name for m in theirs.methods}


# --- health and metadata ---------------------------------------------------------------------


def test_health_and_readiness(client):
    assert client.is_server_live()
    assert client.is_server_ready()
    assert client.is_model_ready(MODEL)
    assert not client.is_model_ready("no-such-model")  # as Triton answers, and HTTP (404)
    assert client.get_server_metadata().name == "precompile"


def test_metadata_is_the_http_metadata(client, served):
    meta = client.get_model_metadata(MODEL)
    want = httpx.get(f"{served[0]}/v2/models/{MODEL}", timeout=DEADLINE).json()
    assert meta.name == want["name"] == MODEL
    assert list(meta.versions) == want["versions"] and meta.platform == want["platform"]
    for got, expected in ((meta.inputs, want["inputs"]), (meta.outputs, want["outputs"])):
        assert [{"name": t.name, "datatype": t.datatype, "shape": list(t.shape)} for t in got] == expected
    assert [(t.name, t.datatype, list(t.shape)) for t in meta.inputs] == [
        ("ids", "INT64", [-1, -1]),
        ("mask", "BOOL", [-1, -1]),
    ]


# --- infer -----------------------------------------------------------------------------------


@pytest.mark.parametrize(("batch", "seq"), [(1, 2), (3, 11), (8, 48)])
def test_infer_matches_http_and_eager(client, served, eager, batch, seq):
    ids, mask = inputs(seed=batch * 100 + seq, batch=batch, seq=seq)
    got = infer(client, ids, mask)
    with torch.no_grad():
        want = eager(torch.from_numpy(ids), torch.from_numpy(mask)).numpy()
    assert got.dtype == np.float32 and got.shape == want.shape
    np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-5)
    np.testing.assert_array_equal(got, http_infer(served[0], ids, mask))


def test_typed_contents_are_read_as_raw_ones_are(served):
    """Values in the typed fields (int64_contents, bool_contents) instead of raw_input_contents."""
    ids, mask = inputs(seed=5, batch=2, seq=7)
    request = triton_pb2.ModelInferRequest(model_name=MODEL, id="typed-1")
    request.inputs.add(name="ids", datatype="INT64", shape=ids.shape).contents.int64_contents.extend(ids.reshape(-1))
    request.inputs.add(name="mask", datatype="BOOL", shape=mask.shape).contents.bool_contents.extend(
        mask.reshape(-1).tolist()
    )
    with grpc.insecure_channel(served[1]) as channel:
        response = triton_pb2_grpc.GRPCInferenceServiceStub(channel).ModelInfer(request, timeout=DEADLINE)
    assert response.id == "typed-1" and response.model_name == MODEL
    [output] = response.outputs
    got = np.frombuffer(response.raw_output_contents[0], dtype="<f4").reshape(list(output.shape))
    np.testing.assert_array_equal(got, http_infer(served[0], ids, mask))


def test_concurrent_calls_are_batched_and_each_gets_its_own_result(served, eager):
    """Rounds of 12 calls sent together, each on a connection of its own, until one round ran in fewer
    batches than calls (on a busy machine the first calls of a round can reach the batcher one by one,
    and a lone call runs at once). Every call of every round gets its own result."""
    clients = [tritonclient_grpc.InferenceServerClient(url=served[1]) for _ in range(12)]
    for c in clients:
        assert c.is_server_ready()  # connected before the calls start together

    def one(c, args, start):
        start.wait(timeout=DEADLINE)
        return infer(c, *args)

    rounds = []
    try:
        for round_ in range(5):
            calls = [inputs(seed=round_ * 100 + i) for i in range(len(clients))]
            before = samples(served[0], "precompile_batch_size_count")[()]
            rows_before = samples(served[0], "precompile_batch_size_sum")[()]
            start = threading.Barrier(len(calls))
            with ThreadPoolExecutor(len(calls)) as pool:
                results = list(pool.map(one, clients, calls, [start] * len(calls)))
            for (ids, mask), got in zip(calls, results):
                with torch.no_grad():
                    want = eager(torch.from_numpy(ids), torch.from_numpy(mask)).numpy()
                np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-5)
            batches = samples(served[0], "precompile_batch_size_count")[()] - before
            rows = samples(served[0], "precompile_batch_size_sum")[()] - rows_before
            assert rows == len(calls)  # every call went through the batcher
            rounds.append(batches)
            if batches < rows:
                break
    finally:
        for c in clients:
            c.close()
    assert rounds[-1] < len(clients), f"batches per round of {len(clients)} calls: {rounds}"  # some ran together


# --- refusals --------------------------------------------------------------------------------


def test_refusals_get_grpc_status_codes_and_the_server_serves_on(client, served, classifier_artifact):
    ids, mask = inputs(seed=3)
    counts = samples(served[0], "precompile_grpc_requests_total")
    rejected = samples(served[0], "precompile_rejections_total")
    wrong_type = refused(lambda: infer(client, ids.astype(np.int32), mask, ids_type="INT32"))
    assert wrong_type.status() == "StatusCode.INVALID_ARGUMENT"
    assert "input 'ids': datatype must be INT64, got 'INT32'" in wrong_type.message()

    long_ids, long_mask = inputs(seed=4, seq=60)  # seq's range is [2, 48]
    with pytest.raises(loader.GuardError) as guard:
        loader.load(classifier_artifact)(torch.from_numpy(long_ids), torch.from_numpy(long_mask))
    out_of_range = refused(lambda: infer(client, long_ids, long_mask))
    assert out_of_range.status() == "StatusCode.INVALID_ARGUMENT" and str(guard.value) in out_of_range.message()

    unknown = refused(lambda: infer(client, ids, mask, model="no-such-model"))
    assert unknown.status() == "StatusCode.NOT_FOUND" and MODEL in unknown.message()
    assert refused(lambda: client.get_model_metadata("no-such-model")).status() == "StatusCode.NOT_FOUND"
    assert refused(lambda: client.get_model_metadata(MODEL, model_version="7")).status() == "StatusCode.NOT_FOUND"

    huge = np.zeros((1, 300_000), dtype=np.int64)  # 2.4 MB, over the 1 MiB body limit
    too_large = refused(lambda: infer(client, huge, huge.astype(bool)))
    assert too_large.status() == "StatusCode.RESOURCE_EXHAUSTED"

    np.testing.assert_array_equal(infer(client, ids, mask), http_infer(served[0], ids, mask))  # serves on
    after = samples(served[0], "precompile_grpc_requests_total")
    grew = {dict(k)["code"]: v - counts.get(k, 0.0) for k, v in after.items()}
    assert grew["INVALID_ARGUMENT"] == 2 and grew["NOT_FOUND"] == 1 and grew["OK"] >= 1
    reasons = {
        dict(k)["reason"]
        for k, v in samples(served[0], "precompile_rejections_total").items()
        if v > rejected.get(k, 0.0)
    }
    assert {"invalid_body", "unknown_model", "out_of_range"} <= reasons


def refused_both(served, *, model=MODEL, version="", ids_type="INT64", seq=9, outputs=()):
    """The same infer call over HTTP /v2 (JSON) and gRPC (raw contents), both refused: (HTTP response, RpcError)."""
    ids, mask = inputs(seed=5, seq=seq)
    ids = ids.astype(np.int32) if ids_type == "INT32" else ids
    path = f"/v2/models/{model}" + (f"/versions/{version}" if version else "") + "/infer"
    body = {
        "inputs": [
            {"name": "ids", "shape": list(ids.shape), "datatype": ids_type, "data": ids.reshape(-1).tolist()},
            {"name": "mask", "shape": list(mask.shape), "datatype": "BOOL", "data": mask.reshape(-1).tolist()},
        ],
        "outputs": [{"name": n} for n in outputs],
    }
    http = httpx.post(served[0] + path, json=body if outputs else {"inputs": body["inputs"]}, timeout=DEADLINE)
    message = triton_pb2.ModelInferRequest(model_name=model, model_version=version)
    message.inputs.add(name="ids", datatype=ids_type, shape=list(ids.shape))
    message.inputs.add(name="mask", datatype="BOOL", shape=list(mask.shape))
    message.raw_input_contents.extend([ids.tobytes(), mask.tobytes()])
    for n in outputs:
        message.outputs.add(name=n)
    with grpc.insecure_channel(served[1]) as channel:
        with pytest.raises(grpc.RpcError) as rpc:
            triton_pb2_grpc.GRPCInferenceServiceStub(channel).ModelInfer(message, timeout=DEADLINE)
    return http, rpc.value


@pytest.mark.parametrize(
    "call",
    [
        {"model": "no-such-model"},
        {"version": "7"},
        {"version": "x1"},
        {"ids_type": "INT32"},
        {"seq": 60},  # beyond seq's range: the guard's refusal
        {"outputs": ("logits",)},
    ],
    ids=["unknown-model", "unknown-version", "malformed-version", "datatype", "guard", "unknown-output"],
)
def test_a_refused_call_reads_the_same_over_http_and_grpc(served, call):
    """Both protocols reach the model through one front door (serve/calls.py): a call it refuses gets
    the same words over /v2 and gRPC, and the gRPC status is the HTTP status's code."""
    http, rpc = refused_both(served, **call)
    assert http.status_code in (400, 404), http.text
    assert rpc.details() == http.json()["error"]
    assert rpc.code() is {400: grpc.StatusCode.INVALID_ARGUMENT, 404: grpc.StatusCode.NOT_FOUND}[http.status_code]


def test_non_finite_values_are_refused_raw_and_typed(structured_served, structured_artifact):
    base, address = structured_served
    c = tritonclient_grpc.InferenceServerClient(url=address)
    try:
        x = np.ones((2, 8), dtype=np.float32)
        x[1, 3] = np.nan
        request = [tritonclient_grpc.InferInput("x", [2, 8], "FP32")]
        request[0].set_data_from_numpy(x)
        raw = refused(lambda: c.infer("tiny-structured", request))
        assert raw.status() == "StatusCode.INVALID_ARGUMENT" and "NaN" in raw.message()

        typed = triton_pb2.ModelInferRequest(model_name="tiny-structured")
        typed.inputs.add(name="x", datatype="FP32", shape=[2, 8]).contents.fp32_contents.extend(
            [float("inf")] + [1.0] * 15
        )
        with grpc.insecure_channel(address) as channel:
            stub = triton_pb2_grpc.GRPCInferenceServiceStub(channel)
            with pytest.raises(grpc.RpcError) as rpc:
                stub.ModelInfer(typed, timeout=DEADLINE)
        assert rpc.value.code() is grpc.StatusCode.INVALID_ARGUMENT

        # Serves on, every output of the structured result by name, as the in-process model gives them.
        x[1, 3] = 0.5
        request[0].set_data_from_numpy(x)
        result = c.infer("tiny-structured", request)
        want = loader.load(structured_artifact)(torch.from_numpy(x))
        np.testing.assert_allclose(result.as_numpy("hidden"), want["hidden"].numpy(), rtol=1e-5, atol=1e-6)
        np.testing.assert_allclose(result.as_numpy("pair.1"), want["pair"][1].numpy(), rtol=1e-5, atol=1e-6)
        only = c.infer("tiny-structured", request, outputs=[tritonclient_grpc.InferRequestedOutput("pair.0")])
        assert [o.name for o in only.get_response().outputs] == ["pair.0"]
    finally:
        c.close()


def test_a_grpc_port_in_use_is_one_line_before_starting(classifier_artifact):
    with socket_held() as port:
        result = CliRunner().invoke(main, ["serve", str(classifier_artifact), "--grpc-port", str(port)])
    assert result.exit_code == 1 and f"--grpc-port {port}: cannot listen on 127.0.0.1:{port}" in result.output
    assert "Traceback" not in result.output


@contextlib.contextmanager
def socket_held() -> Iterator[int]:
    """A loopback port held by a listening socket (no SO_REUSEPORT) while the block runs."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        sock.listen()
        yield sock.getsockname()[1]
