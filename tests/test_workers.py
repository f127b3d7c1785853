"""`precompile serve --workers N` (precompile/serve/workers.py): each worker listens on the port with a
socket of its own (SO_REUSEPORT), so keep-alive connections spread over the workers instead of all
landing on whichever accepted first; the gRPC port is shared the same way."""

from __future__ import annotations

import http.client
import socket
import subprocess
import sys
import time
from collections import Counter
from contextlib import contextmanager

import numpy as np
import pytest

from precompile.serve.app import WORKER_HEADER
from tests.conftest import artifact_version
from tests.test_serve_load import DEADLINE, free_port, stop_server


def worker_of(connection: http.client.HTTPConnection) -> int:
    connection.request("GET", "/healthz")
    response = connection.getresponse()
    response.read()
    assert response.status == 200
    return int(response.getheader(WORKER_HEADER))


def get(port: int, path: str) -> http.client.HTTPResponse:
    c = http.client.HTTPConnection("127.0.0.1", port, timeout=DEADLINE)
    try:
        c.request("GET", path)
        response = c.getresponse()
        response.read()
        return response
    finally:
        c.close()


@contextmanager
def launched(artifact, *options: str):
    """`precompile serve ARTIFACT OPTIONS` on a free port, not waited for; yields the port."""
    port = free_port()
    command = [sys.executable, "-m", "precompile", "serve", str(artifact), "--port", str(port), *options]
    process = subprocess.Popen(command, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        yield port
    finally:
        stop_server(process)


VERSIONS = 8  # of the classifier, loaded one after the other by each worker: a start-up of seconds


def test_two_workers_share_sixteen_keep_alive_connections(classifier_artifact, tmp_path):
    tritonclient_grpc = pytest.importorskip("tritonclient.grpc")
    repo = tmp_path / "repo"
    for n in range(1, VERSIONS + 1):
        artifact_version(classifier_artifact, repo / "tiny-classifier" / str(n), n)
    grpc_port = free_port()
    options = ("--workers", "2", "--versions", f"latest:{VERSIONS}", "--grpc-port", str(grpc_port))
    with launched(repo, *options, "--log-level", "warning") as port:
        # From the start, fresh connections until each worker has answered one: a worker listens only
        # once its models are loaded, so every /readyz through the port, from its first answer, is 200.
        started, ready, deadline = set(), [], time.monotonic() + 4 * DEADLINE
        while len(started) < 2 and time.monotonic() < deadline:
            try:
                ready.append(get(port, "/readyz").status)
                started.add(int(get(port, "/healthz").getheader(WORKER_HEADER)))
            except ConnectionRefusedError:  # no worker listening yet
                time.sleep(0.02)
        assert len(started) == 2, f"only worker {started} answered in {4 * DEADLINE} s"
        assert ready and set(ready) == {200}, f"/readyz answered {Counter(ready)} while the workers started"

        connections = [http.client.HTTPConnection("127.0.0.1", port, timeout=DEADLINE) for _ in range(16)]
        try:
            owners = []
            for c in connections:
                answered = {worker_of(c) for _ in range(3)}
                assert len(answered) == 1  # a keep-alive connection stays with its worker
                owners.append(answered.pop())
        finally:
            for c in connections:
                c.close()
        shares = Counter(owners)
        assert set(shares) == started, f"connections per worker: {dict(shares)}"  # both serve; not exact balance

        # gRPC on the shared port too: every worker bound it (a worker that could not would have stopped the server).
        client = tritonclient_grpc.InferenceServerClient(url=f"127.0.0.1:{grpc_port}")
        try:
            ids = tritonclient_grpc.InferInput("ids", [1, 3], "INT64")
            ids.set_data_from_numpy(np.array([[1, 2, 3]], dtype=np.int64))
            mask = tritonclient_grpc.InferInput("mask", [1, 3], "BOOL")
            mask.set_data_from_numpy(np.array([[True, True, True]]))
            assert client.infer("tiny-classifier", [ids, mask]).as_numpy("output").shape[0] == 1
        finally:
            client.close()


def test_a_port_in_use_is_one_line(classifier_artifact):
    with socket.socket() as held:  # listening without SO_REUSEPORT: the workers cannot join it
        held.bind(("127.0.0.1", 0))
        held.listen()
        port = held.getsockname()[1]
        result = subprocess.run(
            [
                sys.executable,
                "-m",
                "precompile",
                "serve",
                str(classifier_artifact),
                "--port",
                str(port),
                "--workers",
                "2",
            ],
            capture_output=True,
            text=True,
            timeout=DEADLINE * 2,
        )
    assert result.returncode == 1
    assert f"--port {port}: cannot listen on 127.0.0.1:{port}: Address already in use" in result.stderr
    assert "Traceback" not in result.stderr
