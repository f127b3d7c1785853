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

import numpy as np
import pytest

from precompile.serve.app import WORKER_HEADER
from tests.test_serve_load import DEADLINE


def worker_of(connection: http.client.HTTPConnection) -> int:
    connection.request("GET", "/healthz")
    response = connection.getresponse()
    response.read()
    assert response.status == 200
    return int(response.getheader(WORKER_HEADER))


def test_two_workers_share_sixteen_keep_alive_connections(classifier_workers):
    tritonclient_grpc = pytest.importorskip("tritonclient.grpc")
    port, grpc_port = classifier_workers  # `precompile serve --workers 2 --grpc-port G` (tests/conftest.py)
    # Both workers serving: fresh connections until each has answered one (a worker that has not
    # bound its socket yet gets none).
    started, deadline = set(), time.monotonic() + DEADLINE
    while len(started) < 2 and time.monotonic() < deadline:
        c = http.client.HTTPConnection("127.0.0.1", port, timeout=DEADLINE)
        started.add(worker_of(c))
        c.close()
    assert len(started) == 2, f"only worker {started} answered in {DEADLINE} s"

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
