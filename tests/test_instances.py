"""Execution instances (precompile/serve/instances.py): a bounded number of calls at once, each on a
thread with its own OpenMP team, a bounded queue in front, and 503 / UNAVAILABLE at once beyond it."""

from __future__ import annotations

import asyncio
import ctypes
import threading
import time

import httpx
import numpy as np
import pytest
import torch
from click.testing import CliRunner
from prometheus_client.parser import text_string_to_metric_families

from loader import Live
from loader.native.libs import openmp_library
from loader.threads import cpu_allowance
from precompile.cli import main
from precompile.serve.app import create_app
from precompile.serve.config import ServeConfig
from precompile.serve.grpc_service import GrpcServer
from precompile.serve.instances import Instances, InstancesFull, default_batch_count, default_count
from tests.test_serve import AppClient, served_config  # noqa: F401 (a fixture)
from tests.test_serve_load import DEADLINE, free_port

MODEL = "tiny-classifier"
BODY = {"inputs": {"ids": [[1, 2, 3, 4]], "mask": [[True, True, True, False]]}}


# --- the pool itself -------------------------------------------------------------------------


def team_size() -> int:
    """The calling thread's OpenMP team size (a per-thread setting; torch.get_num_threads() is the
    process's last torch.set_num_threads)."""
    return ctypes.CDLL(openmp_library()).omp_get_max_threads()


def test_each_instance_sets_its_own_team():
    before = team_size()
    instances = Instances(count=2, queue_size=0, threads=4)
    both = threading.Barrier(2)

    def held():  # two calls at once: each instance runs one, on its share of the threads
        both.wait(timeout=DEADLINE)
        return threading.current_thread().name, team_size()

    try:
        lone = instances.submit(lambda: (threading.current_thread().name, team_size())).result(timeout=DEADLINE)
        together = {f.result(timeout=DEADLINE) for f in [instances.submit(held), instances.submit(held)]}
        again = instances.submit(lambda: (threading.current_thread().name, team_size())).result(timeout=DEADLINE)
    finally:
        instances.close()
    assert lone[1] == 4 and again[1] == 4  # a call that runs alone: the whole team
    assert {name for name, _ in together} == {f"precompile-instance-{i}" for i in range(2)}
    assert {threads for _, threads in together} == {2}  # side by side: a share each, set per thread
    assert team_size() == before  # the caller's team is its own


def test_a_lone_caller_s_calls_go_to_the_instance_that_ran_the_last_one():
    """Last in, first out: the instance idle the shortest time takes the next call, so one client's
    calls keep one OpenMP team awake instead of waking each instance's in turn (which doubled a lone
    MiniLM request's time on 2 CPUs)."""
    instances = Instances(count=3, queue_size=4, threads=3)
    both = threading.Barrier(3)
    try:
        names = [instances.submit(lambda: threading.current_thread().name).result(timeout=DEADLINE) for _ in range(6)]
        held = [
            instances.submit(lambda: (both.wait(timeout=DEADLINE), threading.current_thread().name)[1])
            for _ in range(3)
        ]
        assert len({f.result(timeout=DEADLINE) for f in held}) == 3  # all three can still run at once
        time.sleep(0.05)  # every instance idle again, in some order
        after = [instances.submit(lambda: threading.current_thread().name).result(timeout=DEADLINE) for _ in range(6)]
    finally:
        instances.close()
    assert len(set(names)) == 1 and len(set(after)) == 1


def test_on_each_runs_once_on_every_instance_before_its_next_call():
    instances = Instances(count=3, queue_size=8, threads=3)
    ran: list[str] = []
    try:
        instances.on_each(lambda: ran.append(threading.current_thread().name))
        instances.on_each(lambda: ran.append("second " + threading.current_thread().name))  # replaces the first
        names = [instances.submit(lambda: threading.current_thread().name).result(timeout=DEADLINE) for _ in range(6)]
        deadline = time.monotonic() + DEADLINE
        while len([r for r in ran if r.startswith("second")]) < 3 and time.monotonic() < deadline:
            time.sleep(0.01)  # idle instances wake for it too
    finally:
        instances.close()
    seconds = sorted(r for r in ran if r.startswith("second"))
    assert seconds == sorted(f"second precompile-instance-{i}" for i in range(3))  # once on each, not twice
    assert len(ran) - len(seconds) <= 3 and set(names) <= {f"precompile-instance-{i}" for i in range(3)}


def test_each_instance_warms_a_loaded_version_in_its_own_thread(classifier_artifact):
    app = create_app(ServeConfig(str(classifier_artifact), instances=2, queue_size=4))
    service = app.state.service
    with AppClient(app):
        assert wait_loaded(service)
        model, both = service.live.model, threading.Barrier(2)

        def probe():  # holds its instance until the other one runs a probe too
            both.wait(timeout=DEADLINE)
            return threading.current_thread().name, getattr(model._warm, "done", False)

        seen = {f.result(timeout=DEADLINE) for f in [service.instances.submit(probe) for _ in range(2)]}
    assert seen == {("precompile-instance-0", True), ("precompile-instance-1", True)}  # warm before any call


def test_the_default_count_is_what_the_workers_share_of_the_cpus_can_feed():
    cpus = cpu_allowance().cpus
    assert default_count(threads=1) == cpus  # one single-threaded instance per CPU
    assert default_count(threads=cpus) == 1  # one team as wide as the CPUs
    assert default_count(workers=cpus, threads=1) == 1  # each worker's share is one CPU
    assert default_count(threads=4 * cpus) == 1  # at least one
    # Torch-free calls run side by side (they let go of the GIL): one per CPU, sharing the team.
    assert default_count(runtime="native", threads=cpus) == cpus
    assert default_count(runtime="native", workers=cpus, threads=cpus) == 1


def test_batches_at_once_default_to_one_per_cpu_where_calls_let_go_of_the_gil():
    cpus = cpu_allowance().cpus
    assert default_batch_count(runtime="native", threads=cpus) == cpus  # the threads split while busy
    assert default_batch_count(runtime="native", threads=1) == 1  # never more batches than threads
    assert default_batch_count(runtime="native", workers=cpus, threads=cpus) == 1  # each worker's share
    assert default_batch_count(runtime="torch", threads=cpus) == 1  # the binding holds the GIL


def test_a_lone_call_gets_the_whole_team_and_calls_at_once_share_it():
    gate, started = threading.Event(), threading.Event()
    instances = Instances(count=2, queue_size=4, threads=2)

    def held():
        started.set()
        gate.wait(DEADLINE)
        return team_size()

    try:
        assert instances.submit(team_size).result(timeout=DEADLINE) == 2  # alone: both threads
        first = instances.submit(held)
        assert started.wait(DEADLINE)
        assert instances.submit(team_size).result(timeout=DEADLINE) == 1  # beside it: its share
        gate.set()
        assert first.result(timeout=DEADLINE) == 2  # it started alone
    finally:
        gate.set()
        instances.close()


def test_a_call_beyond_the_queue_is_refused_at_once_and_the_others_run():
    gate = threading.Event()
    instances = Instances(count=1, queue_size=2, threads=1)
    try:
        running = instances.submit(gate.wait, timeout=DEADLINE)
        while instances.queued:  # the instance has taken it
            time.sleep(0.01)
        queued = [instances.submit(lambda i=i: i) for i in range(2)]
        start = time.monotonic()
        with pytest.raises(InstancesFull, match="--queue-size"):
            instances.submit(lambda: None)
        assert time.monotonic() - start < 0.5 and not running.done()
        cancelled = instances.submit(lambda: "dropped") if queued[1].cancel() else None
        assert cancelled is not None  # the cancelled call's place in the queue was freed
        gate.set()
        assert running.result(timeout=DEADLINE) and queued[0].result(timeout=DEADLINE) == 0
        assert cancelled.result(timeout=DEADLINE) == "dropped"
    finally:
        gate.set()
        instances.close()


# --- in the server ---------------------------------------------------------------------------


class HeldLive(Live):
    """The real Live whose calls each wait for ``release`` before they run (the test decides when
    the one instance frees up); ``entered`` counts the calls an instance has taken."""

    def __init__(self, path):
        super().__init__(path)
        self.release = threading.Event()
        self.entered = threading.Semaphore(0)

    def call_detailed(self, **inputs):
        self.entered.release()
        self.release.wait(DEADLINE)
        return super().call_detailed(**inputs)


def metric(text: str, name: str, **labels: str) -> float:
    return sum(
        s.value
        for f in text_string_to_metric_families(text)
        for s in f.samples
        if s.name == name and all(s.labels.get(k) == v for k, v in labels.items())
    )


def test_requests_beyond_the_queue_get_503_at_once_and_the_others_succeed(classifier_artifact):
    live = HeldLive(classifier_artifact)
    app = create_app(ServeConfig(str(classifier_artifact), instances=1, queue_size=2), live=live)
    service = app.state.service
    want = live.model(torch.tensor(BODY["inputs"]["ids"]), torch.tensor(BODY["inputs"]["mask"])).tolist()

    async def scenario():
        transport = httpx.ASGITransport(app=app)
        async with httpx.AsyncClient(transport=transport, base_url="http://test", timeout=DEADLINE) as client:
            first = asyncio.create_task(client.post("/predict", json=BODY))
            assert await asyncio.to_thread(live.entered.acquire, timeout=DEADLINE)  # the instance is busy
            waiting = [asyncio.create_task(client.post("/predict", json=BODY)) for _ in range(2)]
            while service.instances.queued < 2:
                await asyncio.sleep(0.01)
            start = time.monotonic()
            beyond = await asyncio.gather(*(client.post("/predict", json=BODY) for _ in range(5)))
            answered_in = time.monotonic() - start
            assert not first.done()  # refused while the first call still held the instance
            live.release.set()
            served = await asyncio.gather(first, *waiting)
            return beyond, answered_in, served, (await client.get("/metrics")).text

    with AppClient(app):
        assert wait_loaded(service)
        beyond, answered_in, served, metrics = asyncio.run(scenario())
    assert [r.status_code for r in beyond] == [503] * 5
    assert "--queue-size" in beyond[0].json()["detail"] and beyond[0].json()["reason"] == "queue_full"
    assert answered_in < 5.0  # at once: none waited for the instance
    assert [r.status_code for r in served] == [200] * 3
    for r in served:
        np.testing.assert_allclose(r.json()["outputs"], want, rtol=1e-5, atol=1e-6)
    assert metric(metrics, "precompile_rejections_total", reason="queue_full") == 5
    assert metric(metrics, "precompile_requests_total", code="503") == 5
    assert metric(metrics, "precompile_requests_total", code="200") == 3


def wait_loaded(service) -> bool:
    deadline = time.monotonic() + DEADLINE
    while not service.live.ready and time.monotonic() < deadline:
        time.sleep(0.05)
    return service.live.ready


def test_grpc_calls_beyond_the_queue_get_unavailable(classifier_artifact):
    tritonclient_grpc = pytest.importorskip("tritonclient.grpc")
    from tritonclient.utils import InferenceServerException

    live = HeldLive(classifier_artifact)
    app = create_app(ServeConfig(str(classifier_artifact), instances=1, queue_size=0), live=live)
    service = app.state.service
    with AppClient(app):
        assert wait_loaded(service)
        server = GrpcServer(
            app.state.models,
            host="127.0.0.1",
            port=free_port(),
            max_message_bytes=1 << 20,
            reuse_port=False,
        )
        port = server.start()
        client = tritonclient_grpc.InferenceServerClient(url=f"127.0.0.1:{port}")
        try:
            ids, mask = np.array([[1, 2, 3]], dtype=np.int64), np.array([[True, True, False]])
            request = [
                tritonclient_grpc.InferInput("ids", [1, 3], "INT64"),
                tritonclient_grpc.InferInput("mask", [1, 3], "BOOL"),
            ]
            request[0].set_data_from_numpy(ids)
            request[1].set_data_from_numpy(mask)
            holding = threading.Thread(target=lambda: results.append(client.infer(MODEL, request)))
            results: list = []
            holding.start()
            assert live.entered.acquire(timeout=DEADLINE)
            with pytest.raises(InferenceServerException) as raised:
                client.infer(MODEL, request)
            assert raised.value.status() == "StatusCode.UNAVAILABLE" and "--queue-size" in raised.value.message()
            live.release.set()
            holding.join(DEADLINE)
            want = live.model(torch.from_numpy(ids), torch.from_numpy(mask)).numpy()
            np.testing.assert_allclose(results[0].as_numpy("output"), want, rtol=1e-5, atol=1e-6)
        finally:
            live.release.set()
            client.close()
            server.stop()
        counted = service.metrics.exposition().decode()
    assert metric(counted, "precompile_grpc_requests_total", code="UNAVAILABLE") == 1
    assert metric(counted, "precompile_rejections_total", reason="queue_full") == 1


# --- the command -----------------------------------------------------------------------------


def test_the_command_passes_instances_and_queue_size_on(classifier_artifact, served_config):
    result = CliRunner().invoke(
        main, ["serve", str(classifier_artifact), "--instances", "2", "--queue-size", "8"], catch_exceptions=False
    )
    assert result.exit_code == 0, result.output
    config = served_config["config"]
    assert config.instances == 2 and config.queue_size == 8 and config.grpc_port is None


def test_instances_with_batch_are_batches_at_once(classifier_artifact, served_config):
    result = CliRunner().invoke(
        main, ["serve", str(classifier_artifact), "--batch", "--instances", "2"], catch_exceptions=False
    )
    assert result.exit_code == 0, result.output
    assert served_config["config"].instances == 2 and served_config["config"].batch


def test_queue_size_with_batch_is_a_usage_error(classifier_artifact, served_config):
    result = CliRunner().invoke(main, ["serve", str(classifier_artifact), "--batch", "--queue-size", "8"])
    assert result.exit_code == 2 and "--queue-size applies without --batch" in result.output
