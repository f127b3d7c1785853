"""The Ray Serve deployment (precompile/integrations/rayserve.py) on a real local Ray cluster started
here: a head on 127.0.0.2 and workers on 127.0.0.3 and .4 (tests/ray_cluster.py), Serve's HTTP proxy
on the head's loopback address; called over HTTP as any client would."""

from __future__ import annotations

import json
import threading
import time
import urllib.error
import urllib.request
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import pytest
import torch

import loader

from .ray_cluster import LocalRayCluster, free_port

ray = pytest.importorskip("ray")
serve = pytest.importorskip("ray.serve")

from precompile.integrations.rayserve import app, decode  # noqa: E402

HEAD_IP = "127.0.0.2"
ROUTE = "/tiny"
REQUEST_TIMEOUT_S = 20


@pytest.fixture(scope="module")
def served(classifier_artifact, tmp_path_factory):
    """Serve on a three-node cluster of 1 CPU each, the classifier autoscaled between 2 and 3
    replicas of half a CPU; yields the URL of its route."""
    with LocalRayCluster(tmp_path_factory.mktemp("rayserve"), nodes=3, cpus=1) as address:
        ray.init(address=address, log_to_driver=False)
        try:
            port = free_port()
            # The proxy's own deadline for a request: a request routed to a replica that dies under
            # it can otherwise wait on that replica for minutes (seen on a loaded 2-core host); with
            # it the client gets a 408 it can retry, as a production proxy should give.
            serve.start(
                http_options={"host": HEAD_IP, "port": port, "request_timeout_s": REQUEST_TIMEOUT_S},
                proxy_location="HeadOnly",
            )
            application = app(
                str(classifier_artifact),
                name="tiny",
                autoscaling={"min_replicas": 2, "max_replicas": 3, "target_ongoing_requests": 4},
                num_cpus=0.5,
                max_ongoing_requests=8,
                threads=1,
            )
            serve.run(application, name="tiny", route_prefix=ROUTE)
            yield f"http://{HEAD_IP}:{port}{ROUTE}"
        finally:
            try:
                serve.shutdown()
            finally:
                ray.shutdown()


@pytest.fixture(scope="module")
def reference(classifier_artifact):
    return loader.load(classifier_artifact)


def body(ids: np.ndarray, mask: np.ndarray) -> bytes:
    return json.dumps(
        {
            "inputs": [
                {"name": "ids", "shape": list(ids.shape), "datatype": "INT64", "data": ids.ravel().tolist()},
                {"name": "mask", "shape": list(mask.shape), "datatype": "BOOL", "data": mask.ravel().tolist()},
            ]
        }
    ).encode()


def post(url: str, data: bytes, timeout: float = 30) -> tuple[int, dict]:
    request = urllib.request.Request(url, data=data, method="POST", headers={"content-type": "application/json"})
    try:
        with urllib.request.urlopen(request, timeout=timeout) as r:
            return r.status, json.loads(r.read())
    except urllib.error.HTTPError as e:
        text = e.read()
        try:
            return e.code, json.loads(text)
        except ValueError:
            return e.code, {"error": text.decode(errors="replace")}


def call(seed: int, batch: int = 2, seq: int = 12) -> tuple[np.ndarray, np.ndarray]:
    rng = np.random.default_rng(seed)
    return rng.integers(0, 50, (batch, seq), dtype=np.int64), np.ones((batch, seq), dtype=bool)


def expected(model, ids, mask) -> np.ndarray:
    return model(torch.from_numpy(ids), torch.from_numpy(mask)).numpy()


def answer(result: dict) -> np.ndarray:
    out = result["outputs"][0]
    return np.array(out["data"], dtype=np.float32).reshape(out["shape"])


def test_answers_through_the_http_proxy_equal_the_loaders(served, reference):
    for seed, (batch, seq) in enumerate([(1, 2), (2, 12), (8, 48)]):
        ids, mask = call(seed, batch, seq)
        status, result = post(served, body(ids, mask))
        assert status == 200, result
        assert result["model_name"] == "tiny-classifier"
        np.testing.assert_allclose(answer(result), expected(reference, ids, mask), rtol=1e-5, atol=1e-6)


def test_sixteen_concurrent_clients_each_get_their_own_answer(served, reference):
    calls = [call(50 + i, 1 + i % 2, 10) for i in range(16)]
    with ThreadPoolExecutor(16) as pool:
        results = list(pool.map(lambda c: post(served, body(*c)), calls))
    for c, (status, result) in zip(calls, results):
        assert status == 200, result
        np.testing.assert_allclose(answer(result), expected(reference, *c), rtol=1e-5, atol=1e-6)


def test_a_bad_shape_is_a_400_with_the_guards_words(served):
    ids, _ = call(1, 2, 12)
    _, mask = call(1, 2, 10)
    status, result = post(served, body(ids, mask))
    assert status == 400
    assert "inputs sharing a dim must agree" in result["error"]
    status, result = post(served, b"{not json")
    assert status == 400 and "not JSON" in result["error"]


def test_the_deployment_runs_the_replicas_and_autoscaling_it_was_given(served):
    application = serve.status().applications["tiny"]
    deployment = application.deployments["tiny"]
    assert deployment.status == "HEALTHY"
    assert deployment.replica_states.get("RUNNING", 0) >= 2


def test_a_replica_killed_mid_load_loses_no_acknowledged_request(served, reference):
    """16 clients send 20 requests each; a replica is killed while they run. A request is
    acknowledged when it got a 200: every one of them carries the right answer, and a client whose
    request was cut by the kill (a 5xx, or the proxy's 408 for one that waited on the dead replica
    past its deadline) retries it, so all 320 complete, with a bounded number of retries and in
    bounded time, and Serve brings the replica count back."""
    replicas = [
        a["name"]
        for a in ray.util.list_named_actors(all_namespaces=True)
        if a["namespace"] == "serve" and a["name"].startswith("SERVE_REPLICA::tiny#")
    ]
    assert len(replicas) >= 2, replicas
    victim = ray.get_actor(replicas[0], namespace="serve")
    retries, done = [], []
    lock = threading.Lock()
    started = threading.Event()

    def client(k: int) -> None:
        for j in range(20):
            ids, mask = call(1000 + 20 * k + j, 1, 8)
            for _ in range(10):
                status, result = post(served, body(ids, mask), timeout=3 * REQUEST_TIMEOUT_S)
                started.set()
                if status == 200:
                    np.testing.assert_allclose(answer(result), expected(reference, ids, mask), rtol=1e-5, atol=1e-6)
                    with lock:
                        done.append((k, j))
                    break
                assert status >= 500 or status == 408, result  # never another client error for a good request
                with lock:
                    retries.append(status)
                time.sleep(0.2)

    begin = time.monotonic()
    with ThreadPoolExecutor(16) as pool:
        futures = [pool.submit(client, k) for k in range(16)]
        started.wait(60)
        time.sleep(0.5)
        ray.kill(victim, no_restart=True)
        for f in futures:
            f.result()
    elapsed = time.monotonic() - begin
    assert len(done) == 16 * 20
    assert len(retries) <= 2 * 8  # at most what the killed replica held (max_ongoing_requests), twice over
    assert elapsed < 180
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline:
        state = serve.status().applications["tiny"].deployments["tiny"]
        if state.replica_states.get("RUNNING", 0) >= 2 and state.status == "HEALTHY":
            break
        time.sleep(1)
    assert state.replica_states.get("RUNNING", 0) >= 2
    names = {a["name"] for a in ray.util.list_named_actors(all_namespaces=True) if a["namespace"] == "serve"}
    assert replicas[0] not in names  # the victim is gone: a new replica took its place


@pytest.mark.parametrize(
    ("request_body", "says"),
    [
        (b'{"inputs": []}', "expected"),
        (b'{"inputs": [{"name": "ids", "shape": [1, 2], "datatype": "INT64", "data": [1]}]}', "1 values for shape"),
        (b'{"inputs": [{"name": "ids", "shape": [1], "datatype": "INT64", "data": [1.5]}]}', "another kind"),
        (b'{"inputs": [{"name": "ids", "shape": [1], "datatype": "STR", "data": [1]}]}', "datatype"),
        (b'{"inputs": [{"name": "ids", "shape": [-1], "datatype": "INT64", "data": [1]}]}', "shape must be"),
    ],
)
def test_a_malformed_request_is_refused_by_the_decoder(request_body, says):
    from precompile.integrations.rayserve import BadRequest

    with pytest.raises(BadRequest, match=says):
        decode(request_body)
