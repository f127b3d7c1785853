"""What a client can send, and what each runtime answers: a client's mistake is the client's 4xx (or
gRPC INVALID_ARGUMENT / NOT_FOUND), never a 5xx or a silent wrong answer, on every route, protocol
and runtime. Real repository servers (`precompile serve REPO`, torch and --runtime native, HTTP and
gRPC) on loopback ports; the loaders in process.

    versions     ASCII digits only: "²", "１" and "١" are malformed (400), never a 500 nor version 1
    shapes       an empty input of a huge shape is refused before numpy or torch makes it
    bool bytes   a bool array viewed from other bytes is refused by both loaders' guards
    fuzz         a fixed-seed slice of bench/fuzz.py per route and protocol: no 5xx, no death
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import grpc
import httpx
import numpy as np
import pytest
import torch
from click.testing import CliRunner
from hypothesis import HealthCheck, assume, given, settings
from hypothesis import strategies as st

import loader
from bench import fuzz as fuzzing
from precompile.cli import main
from precompile.serve import predict_v2_pb2 as pb
from precompile.serve.repository import RepositoryError, VersionPolicy
from tests.models import tiny

from .test_serve_load import free_port, serve_command

MODEL = "tiny-classifier"
# What str.isdigit() takes and a version number is not (superscripts, circled, full-width and
# Arabic-Indic digits: int() refuses the first three kinds and reads the others as numbers), signs,
# spaces, decimals, a number past int64.
MALFORMED = ["²", "¹", "①", "２", "١", "+2", "-1", " 2", "2.0", "9" * 30, "x"]
HUGE_EMPTY = fuzzing.HUGE_EMPTY


@pytest.fixture(scope="module")
def repo(classifier_versions, structured_artifact, tmp_path_factory) -> Path:
    """The classifier as versions 1-3 (2 and 3 served, --versions latest:2) and the structured model."""
    root = tmp_path_factory.mktemp("hardening") / "models"
    for n in (1, 2, 3):
        shutil.copytree(classifier_versions[n - 1], root / MODEL / str(n))
    shutil.copytree(structured_artifact, root / "structured")
    return root


@pytest.fixture(scope="module", params=["torch", "native"])
def server(request, repo, tmp_path_factory):
    """A repository server of each runtime: (runtime, HTTP base URL, gRPC target)."""
    grpc_port = free_port()
    options = ("--runtime", request.param, "--versions", "latest:2", "--grpc-port", str(grpc_port))
    log = tmp_path_factory.mktemp(f"hardening-{request.param}") / "server.log"
    with serve_command(repo, *options, "--allow-repository-control", log=log) as port:
        yield request.param, f"http://127.0.0.1:{port}", f"127.0.0.1:{grpc_port}"
    text = log.read_text()
    assert "Traceback" not in text, text[-3000:]


def rpc(target: str, method: str, request, response_type):
    """One call of the inference service's ``method``; (status code name, details)."""
    with grpc.insecure_channel(target) as channel:
        call = channel.unary_unary(
            f"/inference.GRPCInferenceService/{method}",
            request_serializer=type(request).SerializeToString,
            response_deserializer=response_type.FromString,
        )
        try:
            call(request, timeout=30)
        except grpc.RpcError as e:
            return e.code().name, e.details()
        return "OK", ""


def classifier_request(version: str = "", shape=(2, 5)) -> pb.ModelInferRequest:
    ids, mask = np.arange(10, dtype=np.int64).reshape(shape), np.ones(shape, dtype=bool)
    request = pb.ModelInferRequest(model_name=MODEL, model_version=version)
    request.inputs.add(name="ids", datatype="INT64", shape=list(shape))
    request.inputs.add(name="mask", datatype="BOOL", shape=list(shape))
    request.raw_input_contents.extend([ids.tobytes(), mask.tobytes()])
    return request


def v2_body() -> dict:
    return {
        "inputs": [
            {"name": "ids", "shape": [1, 3], "datatype": "INT64", "data": [1, 2, 3]},
            {"name": "mask", "shape": [1, 3], "datatype": "BOOL", "data": [True, True, False]},
        ]
    }


# --- 1. versions ---------------------------------------------------------------------------------


@pytest.mark.parametrize("version", MALFORMED)
def test_a_version_not_in_ascii_digits_is_malformed_on_every_route_and_protocol(server, version):
    """Before: "²" was a 500 (str.isdigit() took it, int() refused it) and "２" served version 2."""
    _, base, target = server
    quoted = httpx.URL(f"/v2/models/{MODEL}/versions/").path + version.replace("/", "%2F")
    with httpx.Client(base_url=base, timeout=30) as c:
        for method, path, body, status in [
            ("POST", f"{quoted}/infer", v2_body(), 400),
            ("GET", quoted, None, 400),
            ("GET", f"{quoted}/ready", None, 400),
            ("POST", f"/predict/{MODEL}/versions/{version}", {"inputs": {"ids": [[1]], "mask": [[True]]}}, 422),
        ]:
            response = c.request(method, path, json=body)
            assert response.status_code == status, (path, response.text)
            message = response.json().get("error") or response.json().get("detail")
            assert "is not a version number: write it in ASCII digits" in message, message
    for method, request, response_type in [
        ("ModelInfer", classifier_request(version), pb.ModelInferResponse),
        ("ModelReady", pb.ModelReadyRequest(name=MODEL, version=version), pb.ModelReadyResponse),
        ("ModelMetadata", pb.ModelMetadataRequest(name=MODEL, version=version), pb.ModelMetadataResponse),
    ]:
        code, details = rpc(target, method, request, response_type)
        assert code == "INVALID_ARGUMENT", (method, code, details)
        assert "is not a version number" in details


def test_a_version_in_ascii_digits_is_looked_up_by_its_number(server):
    _, base, target = server
    with httpx.Client(base_url=base, timeout=30) as c:
        response = c.post(f"/v2/models/{MODEL}/versions/02/infer", json=v2_body())  # as Triton reads it
        assert response.status_code == 200 and response.json()["model_version"] == "2", response.text
        for unserved in ("1", "7", "0"):
            response = c.post(f"/v2/models/{MODEL}/versions/{unserved}/infer", json=v2_body())
            assert response.status_code == 404, response.text
    assert rpc(target, "ModelInfer", classifier_request("3"), pb.ModelInferResponse) == ("OK", "")
    assert rpc(target, "ModelInfer", classifier_request("1"), pb.ModelInferResponse)[0] == "NOT_FOUND"


def test_model_metadata_lists_the_same_versions_over_http_and_grpc(server):
    """Both protocols describe a model through one front door (serve/calls.py): without a version,
    every version served (gRPC listed the newest only before they shared it); with one, that one."""
    _, base, target = server
    with grpc.insecure_channel(target) as channel:
        call = channel.unary_unary(
            "/inference.GRPCInferenceService/ModelMetadata",
            request_serializer=pb.ModelMetadataRequest.SerializeToString,
            response_deserializer=pb.ModelMetadataResponse.FromString,
        )
        for version, path in (("", f"/v2/models/{MODEL}"), ("3", f"/v2/models/{MODEL}/versions/3")):
            described = httpx.get(base + path, timeout=30).json()
            answer = call(pb.ModelMetadataRequest(name=MODEL, version=version), timeout=30)
            assert list(answer.versions) == described["versions"] == (["2", "3"] if not version else ["3"])


def test_a_server_of_one_artifact_refuses_a_malformed_version_too(classifier_artifact):
    from precompile.serve.app import create_app
    from precompile.serve.config import ServeConfig
    from tests.test_serve import AppClient

    app = create_app(ServeConfig(str(classifier_artifact)), live=loader.Live(classifier_artifact))
    with AppClient(app) as c:
        assert c.post(f"/v2/models/{MODEL}/versions/1/infer", json=v2_body()).status_code == 200
        response = c.post(f"/v2/models/{MODEL}/versions/１/infer", json=v2_body())
        assert response.status_code == 400 and "ASCII digits" in response.json()["error"]


@pytest.mark.parametrize("text", ["latest:²", "latest:１", "２,３", "1,²", "latest:+1"])
def test_the_versions_option_takes_ascii_digits_only(repo, text):
    with pytest.raises(RepositoryError, match="--versions"):
        VersionPolicy.parse(text)
    result = CliRunner().invoke(main, ["serve", str(repo), "--versions", text], catch_exceptions=False)
    assert result.exit_code != 0 and "Traceback" not in result.output
    assert f"--versions {text}" in result.output


@pytest.mark.parametrize("length", ["²", "１２", "+12", "0x12", "1_2", "-1"])
def test_a_header_length_not_in_ascii_digits_is_400(server, length):
    """Before: "²" passed str.isdigit() into int() on the route's fast path: a 500."""
    _, base, _ = server
    header = json.dumps(v2_body()).encode()
    with httpx.Client(base_url=base, timeout=30) as c:
        response = c.post(
            f"/v2/models/{MODEL}/infer",
            content=header,
            headers={"Inference-Header-Content-Length": length.encode(), "Content-Type": "application/octet-stream"},
        )
    assert response.status_code == 400, response.text
    assert "is not a byte count" in response.json()["error"]


# --- 2. shapes -----------------------------------------------------------------------------------


def test_an_empty_input_of_a_huge_shape_is_400_on_every_route(server):
    """Before: on --runtime native, numpy's "array is too big" was a 500 (JSON and binary) and gRPC
    INTERNAL (typed and raw); the torch runtime answered 400. Now the codec refuses it for both."""
    _, base, target = server
    expected = f"input 'ids': shape {HUGE_EMPTY} is too large"
    good_mask = {"name": "mask", "shape": [1, 3], "datatype": "BOOL", "data": [True, True, True]}
    json_body = {"inputs": [{"name": "ids", "shape": HUGE_EMPTY, "datatype": "INT64", "data": []}, good_mask]}
    header = json.dumps(
        {
            "inputs": [
                {"name": "ids", "shape": HUGE_EMPTY, "datatype": "INT64", "parameters": {"binary_data_size": 0}},
                good_mask,
            ]
        }
    ).encode()
    with httpx.Client(base_url=base, timeout=30) as c:
        for response in (
            c.post(f"/v2/models/{MODEL}/infer", json=json_body),
            c.post(
                f"/v2/models/{MODEL}/infer",
                content=header,
                headers={"Inference-Header-Content-Length": str(len(header))},
            ),
        ):
            assert response.status_code == 400, response.text
            assert expected in response.json()["error"]
    for raw in (True, False):
        request = pb.ModelInferRequest(model_name=MODEL)
        request.inputs.add(name="ids", datatype="INT64", shape=HUGE_EMPTY)
        request.inputs.add(name="mask", datatype="BOOL", shape=[1, 3])
        if raw:
            request.raw_input_contents.extend([b"", b"\x01\x01\x01"])
        else:
            request.inputs[1].contents.bool_contents.extend([True, True, True])
        code, details = rpc(target, "ModelInfer", request, pb.ModelInferResponse)
        assert (code, expected in details) == ("INVALID_ARGUMENT", True), details


def test_an_empty_input_of_a_modest_shape_reaches_the_guards(server):
    """Below the limit the guards answer, naming the dim and its range, as for any other size."""
    _, base, _ = server
    body = {
        "inputs": [
            {"name": "ids", "shape": [0, 5], "datatype": "INT64", "data": []},
            {"name": "mask", "shape": [0, 5], "datatype": "BOOL", "data": []},
        ]
    }
    with httpx.Client(base_url=base, timeout=30) as c:
        response = c.post(f"/v2/models/{MODEL}/infer", json=body)
    assert response.status_code == 400
    assert "dim 'batch' (axis 0) is 0, outside the built range" in response.json()["error"]


# --- 3. bool bytes -------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def loaders(classifier_artifact):
    return {
        "load": loader.load(classifier_artifact, warmup=False),
        "load_native": loader.load_native(classifier_artifact, warmup=False),
    }


def bool_from_bytes(shape: tuple[int, ...], byte: int, where: int) -> np.ndarray:
    raw = np.ones(int(np.prod(shape)), dtype=np.uint8)
    raw[where] = byte
    return np.frombuffer(raw.tobytes(), dtype=bool).reshape(shape)


@pytest.mark.parametrize("which", ["load", "load_native"])
@pytest.mark.parametrize("byte", [2, 255])
def test_bool_bytes_other_than_0_or_1_are_refused_by_both_loaders(loaders, which, byte):
    """Before: accepted, and the answer was wrong (max error 57.1 for byte 255 against real booleans)."""
    model = loaders[which]
    ids = np.arange(12, dtype=np.int64).reshape(2, 6)
    mask = bool_from_bytes((2, 6), byte, where=7)
    args = (ids, mask) if which == "load_native" else (torch.from_numpy(ids), torch.from_numpy(mask.copy()))
    with pytest.raises(loader.GuardError, match=rf"input 'mask': a bool holds byte {byte} at \[1, 1\]") as e:
        model(*args)
    assert e.value.reason == "bool_bytes"
    with pytest.raises(loader.GuardError):
        model.check(*args)


def test_a_bool_tensor_viewed_from_uint8_is_refused(loaders):
    ids = torch.randint(0, 50, (1, 4))
    mask = torch.tensor([[1, 1, 2, 1]], dtype=torch.uint8).view(torch.bool)
    with pytest.raises(loader.GuardError, match="bool holds byte 2 at \\[0, 2\\]"):
        loaders["load"](ids, mask)
    assert torch.equal(loaders["load"](ids, mask != 0), loaders["load"](ids, torch.ones(1, 4, dtype=torch.bool)))


# Property: any array a caller can build is served exactly as eager would answer it, or refused with
# a GuardError: never another exception, never a crash, never a silent wrong answer.

DTYPES = [np.int64, np.int32, np.bool_, np.uint8, np.float32]


@st.composite
def arrays(draw, dtype_default):
    dtype = draw(st.sampled_from([dtype_default] * 3 + DTYPES))
    shape = tuple(draw(st.lists(st.integers(0, 10), min_size=0, max_size=3)))
    if draw(st.booleans()):
        shape = (draw(st.integers(0, 9)), draw(st.integers(0, 50)))
    size = int(np.prod(shape))
    if dtype is np.bool_:
        raw = draw(st.lists(st.sampled_from([0, 1, 1, 1, 2, 255]), min_size=size, max_size=size))
        a = np.array(raw, dtype=np.uint8).view(np.bool_).reshape(shape)
    elif dtype is np.float32:
        a = np.array(draw(st.lists(st.floats(-100, 100, width=32), min_size=size, max_size=size)), np.float32)
        a = a.reshape(shape)
    else:
        info = np.iinfo(dtype)  # below zero only where the dtype holds it: numpy 2 refuses -1 as a uint8
        values = st.integers(max(-3, int(info.min)), 52) | st.sampled_from([info.min, info.max])
        a = np.array(draw(st.lists(values, min_size=size, max_size=size)), dtype=dtype).reshape(shape)
    layout = draw(st.sampled_from(["plain", "plain", "transposed", "strided", "offset"]))
    if layout == "transposed" and a.ndim == 2:
        a = np.ascontiguousarray(a.T).T
    elif layout == "strided" and a.ndim >= 1 and a.shape[-1] >= 2:
        a = np.repeat(a, 2, axis=-1)[..., ::2]
    elif layout == "offset":
        a = np.frombuffer(b"\x00" + np.ascontiguousarray(a).tobytes(), dtype=a.dtype, offset=1).reshape(a.shape)
    return a


@pytest.fixture(scope="module")
def eager():
    return tiny.classifier(vocab=50, width=16).eval()


@settings(max_examples=120, deadline=None, derandomize=True, suppress_health_check=list(HealthCheck))
@given(ids=arrays(np.int64), mask=arrays(np.bool_), which=st.sampled_from(["load", "load_native"]))
def test_any_array_is_served_as_eager_or_refused_with_a_guard_error(loaders, eager, ids, mask, which):
    model = loaders[which]
    if which == "load_native":
        args = (ids, mask)
    else:
        try:  # what a caller can build from the same memory (strides, offset and all)
            args = tuple(torch.from_numpy(a) for a in (ids, mask))
        except (TypeError, ValueError, RuntimeError):
            assume(False)
    try:
        got = model(*args)
    except loader.GuardError:
        return
    assert mask.view(np.uint8).max(initial=0) <= 1, "a bool byte other than 0/1 was accepted"
    with torch.no_grad():
        want = eager(torch.from_numpy(np.ascontiguousarray(ids)), torch.from_numpy(np.ascontiguousarray(mask)))
    got = torch.from_numpy(got) if isinstance(got, np.ndarray) else got
    torch.testing.assert_close(got, want, atol=1e-4, rtol=1e-4)


# --- 4. the fuzz, a fixed-seed slice -------------------------------------------------------------

SLICE = 60  # requests per route and runtime here; bench/fuzz.py sends 2,000


def test_a_fuzz_slice_gets_no_server_error_on_any_route(server):
    runtime, base, target = server
    tally = fuzzing.Tally()
    models = fuzzing.describe(base)
    fuzzing.fuzz_http(base, models, SLICE, 11, tally)
    fuzzing.fuzz_grpc(target, models, SLICE, 12, tally)
    fuzzing.fuzz_control(base, "tiny-structured", SLICE // 2, 13, tally)
    print(f"fuzz ({runtime}): {json.dumps({r: dict(c) for r, c in tally.codes.items()})}")
    assert not tally.errors, "\n".join(tally.errors[:10])
    assert set(tally.codes) == {"predict", "v2-infer", "v2-metadata", "grpc-typed", "grpc-raw", "control"}
    for route, codes in tally.codes.items():
        assert sum(codes.values()) >= (SLICE // 2 if route == "control" else SLICE), route
    assert tally.codes["v2-infer"]["200"] and tally.codes["grpc-raw"]["OK"]  # the model was reached too
    with httpx.Client(base_url=base, timeout=60) as c:
        assert c.get("/v2/models/tiny-structured/ready").status_code == 200  # loaded again after the control fuzz
        assert c.get(f"/v2/models/{MODEL}/ready").status_code == 200


def test_the_raw_generator_sends_bool_bytes_other_than_0_or_1():
    """The fuzz's raw contents carry, at times, BOOL bytes the codec must refuse (so the slice tries them)."""
    import random

    rng = random.Random(5)
    model = {
        "name": MODEL,
        "inputs": [
            {"name": "ids", "datatype": "INT64", "shape": [-1, -1], "max": 49},
            {"name": "mask", "datatype": "BOOL", "shape": [-1, -1], "max": 0},
        ],
        "outputs": [{"name": "output"}],
    }
    seen = set()
    for _ in range(300):
        request = fuzzing.grpc_request(rng, model, raw=True)
        if len(request.raw_input_contents) >= 2:
            seen |= set(request.raw_input_contents[1])
    assert {0, 1} <= seen and seen & {2, 255}
