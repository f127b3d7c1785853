"""The service under load, on a real uvicorn server on a loopback port: concurrent clients get exactly
the serial results, and swapping versions under load fails no request. Every loop is bounded in
requests and time; every server stops by itself."""

from __future__ import annotations

import json
import os
import random
import signal
import socket
import subprocess
import sys
import threading
import time
from contextlib import contextmanager
from pathlib import Path

import httpx
import uvicorn
from prometheus_client.parser import text_string_to_metric_families

from precompile.serve.app import create_app
from precompile.serve.config import ServeConfig

ROOT = Path(__file__).resolve().parent.parent
DEADLINE = 30.0  # seconds any one test may spend sending requests


def bodies(n: int, seed: int = 0) -> list[dict]:
    """Requests of many shapes (batch 1-8, seq 2-48)."""
    rng = random.Random(seed)
    out = []
    for _ in range(n):
        batch, seq = rng.randint(1, 8), rng.randint(2, 48)
        ids = [[rng.randrange(50) for _ in range(seq)] for _ in range(batch)]
        mask = [[rng.random() < 0.8 for _ in range(seq)] for _ in range(batch)]
        out.append({"inputs": {"ids": ids, "mask": mask}})
    return out


@contextmanager
def server(app):
    """uvicorn in a thread on a free loopback port; yields the base URL, stops on exit."""
    config = uvicorn.Config(app, host="127.0.0.1", port=0, log_level="warning", lifespan="on")
    srv = uvicorn.Server(config)
    thread = threading.Thread(target=srv.run, daemon=True)
    thread.start()
    deadline = time.monotonic() + DEADLINE
    while not srv.started:
        if not thread.is_alive() or time.monotonic() > deadline:
            raise RuntimeError("uvicorn did not start")
        time.sleep(0.01)
    port = srv.servers[0].sockets[0].getsockname()[1]
    try:
        yield f"http://127.0.0.1:{port}"
    finally:
        srv.should_exit = True
        thread.join(timeout=DEADLINE)


def wait_ready(base: str, timeout: float = DEADLINE) -> dict:
    deadline = time.monotonic() + timeout
    with httpx.Client(base_url=base, timeout=5) as c:
        while time.monotonic() < deadline:
            try:
                response = c.get("/readyz")
                if response.status_code == 200:
                    return response.json()
            except httpx.TransportError:
                pass
            time.sleep(0.05)
    raise TimeoutError(f"{base} not ready after {timeout} s")


def test_concurrent_clients_get_exactly_the_serial_results(classifier_artifact):
    requests = bodies(24)
    with server(create_app(ServeConfig(str(classifier_artifact)))) as base:
        wait_ready(base)
        with httpx.Client(base_url=base, timeout=10) as c:
            serial = [c.post("/predict", json=b).json()["outputs"] for b in requests]

        order = [i for i in range(len(requests)) for _ in range(5)]
        random.Random(1).shuffle(order)
        results: list[tuple[int, int, object]] = []
        lock = threading.Lock()

        def client(share: list[int]) -> None:
            with httpx.Client(base_url=base, timeout=10) as c:
                for i in share:
                    response = c.post("/predict", json=requests[i])
                    with lock:
                        results.append((i, response.status_code, response.json().get("outputs")))

        clients = [threading.Thread(target=client, args=(order[k::8],)) for k in range(8)]
        for t in clients:
            t.start()
        for t in clients:
            t.join(timeout=DEADLINE)
    assert len(results) == len(order)
    assert all(code == 200 for _, code, _ in results)
    assert all(outputs == serial[i] for i, _, outputs in results)


class Load:
    """Client threads that keep sending requests until stopped (or out of time or requests), noting
    every response's status, version and whether its outputs are the expected ones."""

    def __init__(self, base: str, requests: list[dict], expected: list, clients: int = 6, max_requests: int = 3000):
        self.base, self.requests, self.expected = base, requests, expected
        self.max_requests = max_requests
        self.stop = threading.Event()
        self.seen: list[list[tuple[int, int | None, bool]]] = [[] for _ in range(clients)]
        self.errors: list[str] = []
        self.threads = [threading.Thread(target=self._run, args=(k,), daemon=True) for k in range(clients)]

    def __enter__(self) -> Load:
        self.deadline = time.monotonic() + DEADLINE
        for t in self.threads:
            t.start()
        return self

    def __exit__(self, *exc) -> None:
        self.stop.set()
        for t in self.threads:
            t.join(timeout=DEADLINE)

    def _run(self, k: int) -> None:
        rng = random.Random(k)
        with httpx.Client(base_url=self.base, timeout=10) as c:
            for _ in range(self.max_requests // len(self.threads)):
                if self.stop.is_set() or time.monotonic() > self.deadline:
                    return
                i = rng.randrange(len(self.requests))
                try:
                    response = c.post("/predict", json=self.requests[i])
                except httpx.HTTPError as e:
                    self.errors.append(f"{type(e).__name__}: {e}")
                    continue
                if response.status_code != 200:
                    self.errors.append(f"{response.status_code}: {response.text}")
                    continue
                data = response.json()
                self.seen[k].append((200, data["artifact"]["version"], data["outputs"] == self.expected[i]))

    def versions(self) -> set[int]:
        return {v for seen in self.seen for _, v, _ in seen}

    def wait_for_version(self, version: int, timeout: float = DEADLINE) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if sum(1 for seen in self.seen for _, v, _ in list(seen) if v == version) >= 20:
                return
            time.sleep(0.01)
        raise TimeoutError(f"no responses from version {version}")

    def check(self, versions: list[int]) -> int:
        """Zero failures, every response from one of ``versions`` with the right outputs, and no
        client ever sent back to an older version after seeing a newer one."""
        assert self.errors == []
        assert self.versions() == set(versions)
        for seen in self.seen:
            assert all(ok for _, _, ok in seen)
            order = [v for _, v, _ in seen]
            assert order == sorted(order), "a client saw an older version after a newer one"
        return sum(len(seen) for seen in self.seen)


def test_reloads_under_load_fail_no_request(classifier_versions):
    requests = bodies(12, seed=2)
    root = classifier_versions[1].parent  # v2..v4
    config = ServeConfig(str(classifier_versions[0]), allow_reload=True, reload_root=str(root))
    with server(create_app(config)) as base:
        wait_ready(base)
        with httpx.Client(base_url=base, timeout=10) as c:
            expected = [c.post("/predict", json=b).json()["outputs"] for b in requests]
            with Load(base, requests, expected) as load:
                load.wait_for_version(1)
                for n, path in enumerate(classifier_versions[1:], start=2):
                    response = c.post("/v1/reload", json={"path": str(path)}, timeout=DEADLINE)
                    assert response.status_code == 200, response.text
                    load.wait_for_version(n)
    assert load.check([1, 2, 3, 4]) >= 80


def replace_link(link: Path, target: Path) -> None:
    """The deploy step: a new link beside the old one, renamed over it."""
    tmp = link.with_name(link.name + ".new")
    tmp.symlink_to(target)
    os.replace(tmp, link)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def stop_server(process: subprocess.Popen, timeout: float = 60) -> None:
    """SIGTERM (the server drains, then exits 0); killed if it has not stopped within ``timeout`` s."""
    process.send_signal(signal.SIGTERM)
    try:
        process.wait(timeout=timeout)
    except subprocess.TimeoutExpired:
        process.kill()
        process.wait()


def test_the_command_follows_deploys_under_load_and_records_the_traffic(classifier_versions, tmp_path):
    """`precompile serve --watch --record` as a process: links replaced under load, then SIGTERM;
    the recorded histogram counts every request served, across all versions."""
    current = tmp_path / "current"
    current.symlink_to(classifier_versions[0])
    traffic = tmp_path / "traffic.jsonl"
    port = free_port()
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    command = [
        sys.executable,
        "-m",
        "precompile",
        "serve",
        str(current),
        "--runtime",
        "torch",  # the re-exec checked below is the torch runtime's (the native one never imports torch)
        "--port",
        str(port),
        "--watch",
        "--watch-interval",
        "0.05",
        "--record",
        str(traffic),
        "--record-interval",
        "0.5",
        "--log-level",
        "warning",
    ]
    process = subprocess.Popen(command, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        base = f"http://127.0.0.1:{port}"
        wait_ready(base)
        # The server re-executed itself with OpenMP settings that only take effect at torch's import.
        served_env = dict(
            item.split("=", 1) for item in Path(f"/proc/{process.pid}/environ").read_text().split("\0") if "=" in item
        )
        assert served_env["OMP_WAIT_POLICY"] == "ACTIVE" and served_env["GOMP_SPINCOUNT"] == "10000"
        assert int(served_env["OMP_NUM_THREADS"]) >= 1
        requests = bodies(12, seed=3)
        with httpx.Client(base_url=base, timeout=10) as c:
            expected = [c.post("/predict", json=b).json()["outputs"] for b in requests]
            with Load(base, requests, expected, clients=4) as load:
                load.wait_for_version(1)
                for n, path in enumerate(classifier_versions[1:], start=2):
                    replace_link(current, path)
                    load.wait_for_version(n)
            metrics = c.get("/metrics").text
        served = load.check([1, 2, 3, 4]) + len(requests)
    finally:
        process.send_signal(signal.SIGTERM)
        try:
            output, _ = process.communicate(timeout=DEADLINE)
        except subprocess.TimeoutExpired:
            process.kill()
            output, _ = process.communicate()
    # uvicorn shuts down cleanly on SIGTERM, then re-raises it so the exit status tells what stopped it.
    assert process.returncode in (0, -signal.SIGTERM), output
    recorded = [json.loads(line) for line in traffic.read_text().splitlines()]
    assert sum(entry["count"] for entry in recorded) == served
    assert _reloads(metrics) == 4  # the first load and three swaps


def _reloads(text: str) -> float:
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if sample.name == "precompile_reloads_total" and sample.labels == {"result": "ok"}:
                return sample.value
    return 0.0


@contextmanager
def serve_command(artifact: Path, *options: str, log: Path | None = None):
    """`precompile serve ARTIFACT OPTIONS` as a process on a free loopback port, ready; yields the port
    and stops it with SIGTERM (killed if it does not stop in time). ``log``: its output goes there
    (read it while it runs), with ``--log-level info`` unless OPTIONS give one."""
    port = free_port()
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    level = [] if "--log-level" in options else ["--log-level", "info" if log is not None else "warning"]
    command = [sys.executable, "-m", "precompile", "serve", str(artifact), "--port", str(port), *level, *options]
    out = open(log, "w") if log is not None else subprocess.PIPE
    process = subprocess.Popen(command, cwd=ROOT, env=env, stdout=out, stderr=subprocess.STDOUT, text=True)
    if log is not None:
        out.close()  # the process holds its own copy
    try:
        wait_ready(f"http://127.0.0.1:{port}")
        yield port
    finally:
        process.send_signal(signal.SIGTERM)
        try:
            process.communicate(timeout=DEADLINE)
        except subprocess.TimeoutExpired:
            process.kill()
            process.communicate()


def test_workers_answer_without_the_delayed_ack_wait(classifier_workers):
    """`precompile serve --workers 2`: every worker turns Nagle's algorithm off on its connections.
    Without it, each response waited for the client's delayed ACK: 44 ms per GET /healthz on
    loopback, against well under 1 ms (precompile.serve.nodelay)."""
    import http.client

    port, _ = classifier_workers  # `precompile serve --workers 2` (tests/conftest.py)
    connection = http.client.HTTPConnection("127.0.0.1", port, timeout=10)  # no TCP_NODELAY on this side
    times = []
    for _ in range(15):
        start = time.perf_counter()
        connection.request("GET", "/healthz")
        response = connection.getresponse()
        response.read()
        assert response.status == 200
        times.append(time.perf_counter() - start)
    connection.close()
    times.sort()
    assert times[len(times) // 2] < 0.025, (
        f"median {times[len(times) // 2] * 1000:.1f} ms: the responses waited for delayed ACKs"
    )


def test_the_bench_reports_the_spread_of_repeated_levels():
    """bench.serve_load --repeat: the req/s of each repeat of a level and their spread, (max - min) / median."""
    from bench.serve_load import spread_lines

    row = {"server": "precompile --batch", "workers": 2, "protocol": "http", "concurrency": 16}
    rows = [{**row, "rps": rps} for rps in (400.0, 440.0, 420.0)] + [{**row, "concurrency": 1, "rps": 150.0}]
    assert spread_lines(rows) == [
        "spread: precompile --batch --workers 2 http at 16 clients, 3 repeats: 400.0, 440.0, 420.0 req/s, "
        "median 420.0, spread 9.5%"
    ]
