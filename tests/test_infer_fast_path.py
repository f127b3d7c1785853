"""The /v2 infer fast path (oip.InferFastPath) answers byte for byte as the FastAPI route it bypasses:
the same requests (good, refused, an unknown model or version, too large, a client that hangs up)
sent to the app with it and to the same app without it give the same ASGI messages (status, headers,
body) and count the same metrics."""

from __future__ import annotations

import asyncio
import contextlib
import json
import threading

import numpy as np
import pytest
from prometheus_client.parser import text_string_to_metric_families

from loader import Live
from precompile.serve.app import create_app
from precompile.serve.config import ServeConfig
from precompile.serve.oip import HEADER_LENGTH, InferFastPath, infer_path
from tests.test_serve_load import DEADLINE

MODEL = "tiny-classifier"
INFER = f"/v2/models/{MODEL}/infer"


def binary_request(ids: np.ndarray, mask: np.ndarray, **parameters) -> tuple[dict[str, str], bytes]:
    header = {
        "inputs": [
            {"name": "ids", "shape": list(ids.shape), "datatype": "INT64", "parameters": {"binary_data_size": ids.nbytes}},
            {"name": "mask", "shape": list(mask.shape), "datatype": "BOOL", "parameters": {"binary_data_size": mask.nbytes}},
        ],
        **parameters,
    }  # fmt: skip
    head = json.dumps(header).encode()
    return {HEADER_LENGTH: str(len(head))}, head + ids.tobytes() + mask.tobytes()


def json_request(ids: np.ndarray, mask: np.ndarray, indent: int | None = None, **parameters) -> tuple[dict, bytes]:
    header = {
        "id": "r1",
        "inputs": [
            {"name": "ids", "shape": list(ids.shape), "datatype": "INT64", "data": ids.reshape(-1).tolist()},
            {"name": "mask", "shape": list(mask.shape), "datatype": "BOOL", "data": mask.reshape(-1).tolist()},
        ],
        **parameters,
    }
    return {"content-type": "application/json"}, json.dumps(header, indent=indent).encode()


IDS = np.arange(12, dtype=np.int64).reshape(1, 12) % 50
MASK = np.ones((1, 12), dtype=np.bool_)
OUT_OF_RANGE = IDS.copy()
OUT_OF_RANGE[0, 3] = 99

CASES = {
    "binary in and out": ("POST", INFER, *binary_request(IDS, MASK, parameters={"binary_data_output": True})),
    "binary in, JSON out": ("POST", INFER, *binary_request(IDS, MASK)),
    "JSON in and out": ("POST", INFER, *json_request(IDS, MASK)),
    "a JSON request longer than the loop decodes": (
        "POST",
        INFER,
        *json_request(np.arange(8 * 48).reshape(8, 48) % 50, np.ones((8, 48), dtype=np.bool_), indent=2),
    ),
    "one output asked in binary": (
        "POST",
        INFER,
        *json_request(IDS, MASK, outputs=[{"name": "output", "parameters": {"binary_data": True}}]),
    ),
    "an unknown output": ("POST", INFER, *json_request(IDS, MASK, outputs=[{"name": "nope"}])),
    "the version served": ("POST", f"/v2/models/{MODEL}/versions/1/infer", *binary_request(IDS, MASK)),
    "a version not served": ("POST", f"/v2/models/{MODEL}/versions/99/infer", *binary_request(IDS, MASK)),
    "an unknown model": ("POST", "/v2/models/nope/infer", *binary_request(IDS, MASK)),
    "a guard's refusal": ("POST", INFER, *binary_request(OUT_OF_RANGE, MASK)),
    "not JSON": ("POST", INFER, {}, b"{not json"),
    "a header length past the body": ("POST", INFER, {HEADER_LENGTH: "99999"}, b"{}"),
    "a header length that is no number": ("POST", INFER, {HEADER_LENGTH: "x"}, b"{}"),
    "binary bytes no input claims": ("POST", INFER, *binary_request(IDS, MASK)[:1], binary_request(IDS, MASK)[1] + b"x"),
    "too large": ("POST", INFER, {}, b"{" + b" " * (70 * 1024) + b"}"),
    "GET on the infer path": ("GET", INFER, {}, b""),
    "a trailing slash": ("POST", INFER + "/", *binary_request(IDS, MASK)),
}  # fmt: skip


def exchange(app, method: str, path: str, headers: dict[str, str], body: bytes, *, hang_up: bool = False) -> list:
    """The ASGI messages ``app`` sends for one request; ``hang_up``: the client disconnects once the
    body is sent (else the connection stays open until the answer)."""

    async def run() -> list:
        sent: list = []
        incoming = [{"type": "http.request", "body": body, "more_body": False}]

        async def receive() -> dict:
            if incoming:
                return incoming.pop(0)
            if hang_up:
                return {"type": "http.disconnect"}
            await asyncio.Event().wait()  # open until the answer is sent (then this is cancelled)

        async def send(message: dict) -> None:
            sent.append(message)

        raw = [(k.lower().encode(), v.encode()) for k, v in headers.items()]
        raw.append((b"content-length", str(len(body)).encode()))
        scope = {
            "type": "http", "asgi": {"version": "3.0"}, "http_version": "1.1", "method": method,
            "scheme": "http", "path": path, "raw_path": path.encode(), "query_string": b"", "root_path": "",
            "headers": raw, "client": ("127.0.0.1", 50000), "server": ("127.0.0.1", 8000),
        }  # fmt: skip
        await app(scope, receive, send)
        return sent

    return asyncio.run(run())


def counted(app) -> dict[tuple, float]:
    """The route's counters in ``app``'s metrics (latency counts included, not its timings)."""
    text = app.state.models.metrics.exposition().decode()
    return {
        (s.name, tuple(sorted(s.labels.items()))): s.value
        for family in text_string_to_metric_families(text)
        for s in family.samples
        if family.type in ("counter", "histogram")
        and not s.name.endswith(("_created", "_bucket", "_sum"))
        and not s.name.startswith(("precompile_reloads", "precompile_batch"))  # the loader's, not the route's
    }


def without_fast_path(app):
    """``app`` with the /v2 infer requests going through FastAPI's route, as before the fast path."""
    app.user_middleware = [m for m in app.user_middleware if m.cls is not InferFastPath]
    return app


@pytest.fixture(scope="module")
def apps(classifier_artifact):
    """The same server twice, with the fast path and without it; one execution instance each."""
    config = ServeConfig(str(classifier_artifact), max_body_bytes=64 * 1024, instances=1)
    fast = create_app(config, live=Live(classifier_artifact))
    slow = without_fast_path(create_app(config, live=Live(classifier_artifact)))
    for app in (fast, slow):
        app.state.service.start()
        app.state.service.join_load()
    yield fast, slow
    for app in (fast, slow):
        app.state.service.stop()


@contextlib.contextmanager
def busy(app):
    """``app``'s one execution instance held by another call, so a request's call waits in the queue."""
    release = threading.Event()
    app.state.service.instances.submit(release.wait, timeout=DEADLINE)
    try:
        yield
    finally:
        release.set()


@pytest.mark.parametrize("case", CASES)
def test_the_fast_path_answers_byte_for_byte_as_the_route(apps, case):
    fast, slow = apps
    method, path, headers, body = CASES[case]
    answered = exchange(fast, method, path, headers, body)
    assert answered == exchange(slow, method, path, headers, body)
    assert answered[0]["type"] == "http.response.start"


def test_a_client_that_hangs_up_is_answered_and_counted_alike(apps):
    fast, slow = apps
    before = [counted(app) for app in apps]
    request = ("POST", INFER, *binary_request(IDS, MASK))
    with busy(fast):
        answered = exchange(fast, *request, hang_up=True)
    with busy(slow):
        assert answered == exchange(slow, *request, hang_up=True)
    assert answered[0]["status"] == 499
    after = [counted(app) for app in apps]
    gone = ("precompile_rejections_total", (("reason", "disconnected"),))
    assert after[0][gone] - before[0].get(gone, 0) == 1 == after[1][gone] - before[1].get(gone, 0)


def test_both_count_the_same_metrics(apps):
    fast, slow = apps
    for case in ("binary in and out", "a guard's refusal", "an unknown model", "too large"):
        method, path, headers, body = CASES[case]
        exchange(fast, method, path, headers, body)
        exchange(slow, method, path, headers, body)
    assert counted(fast) == counted(slow)


@pytest.mark.parametrize(
    "path",
    [
        f"/v2/models/{MODEL}/versions/3/infer", "/v2/models/versions/infer", "/v2/models/a/versions/infer",
        "/v2/models//infer", "/v2/models/a/versions//infer", "/v2/models/a/infer/", "/v2/models/a/b/infer",
        "/v2/models/a/ready", "/v2/models/infer", "/v2//models/a/infer", "/v1/models/a/infer", "//v2/models/a/infer",
        "/v2/models/a/versions/1/x/infer", "/v2/models/a b/infer", f"/v2/models/{MODEL}/versions/1/infer/",
    ],
)  # fmt: skip
def test_the_fast_path_takes_the_paths_the_routes_take(apps, path):
    """A path the routes do not match gets FastAPI's own 404, 405 or redirect, which names no model;
    one they match, the infer work's answer: the same from both only if infer_path reads paths as
    the routes do."""
    fast, slow = apps
    request = ("POST", path, *binary_request(IDS, MASK))
    assert exchange(fast, *request) == exchange(slow, *request)


def test_infer_path_reads_the_model_and_version():
    assert infer_path(INFER) == (MODEL, None)
    assert infer_path(f"/v2/models/{MODEL}/versions/3/infer") == (MODEL, "3")
    assert infer_path(f"/v2/models/{MODEL}/ready") is None
