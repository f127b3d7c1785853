"""Hostile and careless clients against `precompile serve --batch` run as a process on a loopback port:
each refusal is the client's 4xx under the server's exception policy (precompile/serve/errors.py),
never a 5xx; a client that hangs up is counted apart, and its queued call never runs."""

from __future__ import annotations

import json
import math
import socket
import struct
import time
from contextlib import closing

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from .test_serve_load import DEADLINE, serve_command

MODEL = "tiny-structured"
INFER = f"/v2/models/{MODEL}/infer"
LIMIT = 65536
DELAY_MS = 1500  # how long a queued call waits for batch-mates: long enough to hang up meanwhile
FINITE_RULE = (
    "input 'x': values must be finite numbers within float32's range (±3.403e+38); NaN, Infinity and larger numbers are refused"
)


@pytest.fixture(scope="module")
def served(structured_artifact, tmp_path_factory):
    """`precompile serve` of the structured model (one FP32 input x: [batch, 8]) with --batch; yields
    (base URL, server log path)."""
    log = tmp_path_factory.mktemp("served") / "server.log"
    options = ("--batch", "--max-delay-ms", str(DELAY_MS), "--max-body-bytes", str(LIMIT))
    with serve_command(structured_artifact, *options, log=log) as port:
        yield f"http://127.0.0.1:{port}", log


@pytest.fixture(scope="module")
def client(served):
    with httpx.Client(base_url=served[0], timeout=DEADLINE) as c:
        yield c


def counts(c: httpx.Client) -> dict[tuple[str, tuple], float]:
    """Every sample of /metrics by (name, labels)."""
    out = {}
    for family in text_string_to_metric_families(c.get("/metrics").text):
        for s in family.samples:
            out[(s.name, tuple(sorted(s.labels.items())))] = s.value
    return out


def requests(c: httpx.Client, code: str) -> float:
    return counts(c).get(("precompile_requests_total", (("code", code),)), 0.0)


def tensor(values: list[float], *, binary: bool = False, **extra) -> dict:
    entry = {"name": "x", "shape": [len(values) // 8, 8], "datatype": "FP32", **extra}
    if binary:
        entry.setdefault("parameters", {})["binary_data_size"] = 4 * len(values)
    else:
        entry["data"] = values
    return entry


def binary_body(request: dict, raw: bytes) -> tuple[bytes, dict[str, str]]:
    header = json.dumps(request).encode()
    return header + raw, {"Inference-Header-Content-Length": str(len(header)), "Content-Type": "application/octet-stream"}


def send_raw(base: str, request: bytes) -> socket.socket:
    host, port = base.removeprefix("http://").split(":")
    s = socket.create_connection((host, int(port)), timeout=DEADLINE)
    s.sendall(request)
    return s


def http_post(path: str, body: bytes, *, length: int | None = None) -> bytes:
    head = f"POST {path} HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\nContent-Length: {length or len(body)}\r\n\r\n"
    return head.encode() + body


def wait_for(check, timeout: float = 10.0) -> None:
    deadline = time.monotonic() + timeout
    while not check():
        if time.monotonic() > deadline:
            raise AssertionError("not reached in time")
        time.sleep(0.05)


# --- 1. the body limit ----------------------------------------------------------------------------


@pytest.mark.parametrize("path, key", [(INFER, "error"), ("/predict", "detail")])
def test_a_chunked_body_over_the_limit_is_413_on_every_route(client, path, key):
    big = json.dumps({"inputs": [tensor([0.0] * 8)], "id": "x" * (2 * LIMIT)}).encode()
    before = counts(client).get(("precompile_rejections_total", (("reason", "too_large"),)), 0.0)

    def chunks():  # no Content-Length: the limit is met while the route reads
        for i in range(0, len(big), 4096):
            yield big[i : i + 4096]

    response = client.post(path, content=chunks())
    assert response.status_code == 413, response.text
    assert f"larger than the {LIMIT} bytes this server accepts (--max-body-bytes)" in response.json()[key]
    assert counts(client)[("precompile_rejections_total", (("reason", "too_large"),))] == before + 1


# --- 2. parameters that are not objects -----------------------------------------------------------


@pytest.mark.parametrize(
    "request_, where",
    [
        ({"inputs": [tensor([0.0] * 8)], "parameters": "yes"}, "parameters: expected an object, got a string"),
        ({"inputs": [tensor([0.0] * 8, parameters=[1])]}, "inputs[0].parameters: expected an object, got list"),
        ({"inputs": [tensor([0.0] * 8, parameters=7)]}, "inputs[0].parameters: expected an object, got int"),
        ({"inputs": [tensor([0.0] * 8)], "outputs": [{"name": "hidden", "parameters": "b"}]}, "outputs[0].parameters: expected an object"),
        ({"inputs": [tensor([0.0] * 8)], "parameters": {"binary_data_output": "yes"}}, "parameters.binary_data_output: expected true or false"),
        ({"inputs": [tensor([0.0] * 8)], "outputs": [{"name": "hidden", "parameters": {"binary_data": 1}}]}, "binary_data: expected true or false"),
        ({"inputs": [tensor([0.0] * 8)], "id": 7}, "id: expected a string, got int"),
    ],
    ids=["request-string", "input-list", "input-int", "output-string", "binary-output-string", "binary-data-int", "id-int"],
)
def test_parameters_of_the_wrong_json_type_are_400(client, request_, where):
    response = client.post(INFER, json=request_)
    assert response.status_code == 400, response.text
    assert where in response.json()["error"]


# --- 3. NaN and infinity, JSON or binary ----------------------------------------------------------


@pytest.mark.parametrize("value", [math.nan, math.inf, -math.inf])
def test_non_finite_binary_inputs_are_refused_as_predict_refuses_them(client, value):
    values = [0.5] * 7 + [value]
    before = counts(client)
    body, headers = binary_body({"inputs": [tensor(values, binary=True)]}, struct.pack("<8f", *values))
    response = client.post(INFER, content=body, headers=headers)
    assert response.status_code == 400, response.text
    assert response.json() == {"error": FINITE_RULE}
    raw = json.dumps({"inputs": {"x": [values]}}).encode()  # Python writes NaN, Infinity: what a careless client sends
    predicted = client.post("/predict", content=raw, headers={"content-type": "application/json"})
    assert predicted.status_code == 422 and predicted.json() == {"detail": FINITE_RULE, "reason": "invalid_body"}
    after = counts(client)
    ran = [k for k in after if k[0] == "precompile_predict_seconds_count" and after[k] != before.get(k, 0.0)]
    assert not ran, "a refused call ran"
    assert after[("precompile_rejections_total", (("reason", "invalid_body"),))] == before.get(
        ("precompile_rejections_total", (("reason", "invalid_body"),)), 0.0
    ) + 2


# --- 4. a client that hangs up while its call waits for a batch -----------------------------------


def test_a_client_that_hangs_up_while_queued_drops_its_call(served, client):
    base, _ = served
    before = counts(client)
    request = http_post(INFER, json.dumps({"inputs": [tensor([0.25] * 8)]}).encode())
    sockets = [send_raw(base, request[:-1]) for _ in range(6)]
    time.sleep(0.2)
    for s in sockets:  # the last bytes together, so the calls reach the batcher together
        s.sendall(request[-1:])
    time.sleep(0.3)
    for s in sockets:
        s.close()
    gone = lambda: requests(client, "499") - before.get(("precompile_requests_total", (("code", "499"),)), 0.0)  # noqa: E731
    wait_for(lambda: gone() >= 4)
    time.sleep(DELAY_MS / 1000 + 0.5)  # past the batch's deadline: a call still queued would have run by now
    after = counts(client)
    served_ok = after.get(("precompile_requests_total", (("code", "200"),)), 0.0) - before.get(("precompile_requests_total", (("code", "200"),)), 0.0)
    rows = after.get(("precompile_batch_size_sum", ()), 0.0) - before.get(("precompile_batch_size_sum", ()), 0.0)
    assert served_ok + gone() == 6
    assert gone() >= 4  # a lone first call may run at once (and be answered) before the others arrive
    assert rows == served_ok, f"{rows} rows ran for {served_ok} answered calls: abandoned calls ran"
    assert after[("precompile_rejections_total", (("reason", "disconnected"),))] >= gone()


# --- 5. a client that hangs up halfway through its body -------------------------------------------


def test_a_client_that_hangs_up_mid_body_is_counted_apart_without_a_traceback(served, client):
    base, log = served
    before_499, before_500 = requests(client, "499"), requests(client, "500")
    mark = log.stat().st_size
    half = json.dumps({"inputs": [tensor([0.25] * 8)]}).encode()[:40]
    for path in (INFER, "/predict"):
        with closing(send_raw(base, http_post(path, half, length=1000))):
            time.sleep(0.1)
    wait_for(lambda: requests(client, "499") == before_499 + 2)
    assert requests(client, "500") == before_500
    text = log.read_text()[mark:]
    assert "Traceback" not in text and "Exception in ASGI application" not in text, text
    lines = [line for line in text.splitlines() if "disconnected while sending the body" in line]
    assert len(lines) == 2, text
    assert client.post(INFER, json={"inputs": [tensor([0.25] * 8)]}).status_code == 200  # and serves on
