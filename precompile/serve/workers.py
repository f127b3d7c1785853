"""``precompile serve --workers N``: N server processes, each with a listening socket of its own.

When every worker accepts from one shared socket, the kernel hands a new connection to whichever
worker is waiting in accept first, and keep-alive clients stay where they landed: one run of 16
clients gave 178 req/s (one worker held all 16 connections), others 438 (see issue 24). Here each
worker binds its own socket to the port with SO_REUSEPORT, and the kernel spreads connections over
the listening sockets by a hash of their addresses, so every worker gets its share. The gRPC service
(--grpc-port) joins its port the same way (grpc_service.py).

A worker binds its socket at once (a port it cannot join stops the server at start) but listens only
once its models are loaded (app.py's lifespan waits for the first load before uvicorn starts
serving): a bound socket that is not listening gets no connections, so while a worker loads, at
start or when it replaces one that died, the others take them all, and ``/readyz`` through the port
is the answer of a worker that can serve.

The supervisor (this process) holds a socket bound to the port with SO_REUSEPORT but never listening
(so no connection reaches it): it finds the port for --port 0 and says at once when the port is
taken. A worker that dies after it started is replaced; one that dies early (a start-up failure,
which would only repeat) stops the server.
"""

from __future__ import annotations

import logging
import multiprocessing
import socket
import time
from multiprocessing.connection import wait
from multiprocessing.process import BaseProcess

import uvicorn

log = logging.getLogger("precompile.serve")

RESTART_AFTER_S = 10.0  # a worker that ran this long before it died is replaced
STOP_GRACE_S = 30.0  # how long workers may drain on stop before they are killed


class PortTaken(Exception):
    """The port cannot be bound (another program holds it without SO_REUSEPORT, or the address is not this host's)."""


def bound_socket(host: str, port: int, *, reuse_port: bool = True) -> socket.socket:
    """A TCP socket bound to ``host:port`` (with SO_REUSEPORT: beside the other workers'), not yet
    listening; PortTaken when it cannot be."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        if reuse_port:
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
        sock.bind((host, port))
    except OSError as e:
        sock.close()
        raise PortTaken(f"cannot listen on {host}:{port}: {e.strerror or e}") from None
    return sock


def run_workers(count: int, *, host: str, port: int, log_level: str, http: str) -> None:
    """Start ``count`` workers serving ``precompile.serve.app:app_from_env`` on ``host:port`` (their
    configuration is in the environment), replace those that die, and stop them all on return (a
    signal's SystemExit or KeyboardInterrupt)."""
    reserved = bound_socket(host, port)
    port = reserved.getsockname()[1]
    context = multiprocessing.get_context("spawn")  # fresh interpreters: OpenMP reads its settings at start

    def start(i: int) -> tuple[BaseProcess, float]:
        process = context.Process(
            target=serve_worker, args=(host, port, log_level, http), name=f"precompile-worker-{i}", daemon=False
        )
        process.start()
        return process, time.monotonic()

    workers = [start(i) for i in range(count)]
    log.info("%d workers on %s:%d, each with its own socket (SO_REUSEPORT)", count, host, port)
    try:
        while True:
            wait([p.sentinel for p, _ in workers])
            for i, (process, started) in enumerate(workers):
                if process.is_alive():
                    continue
                ran = time.monotonic() - started
                if ran < RESTART_AFTER_S:
                    raise SystemExit(
                        f"worker {process.pid} exited with status {process.exitcode} {ran:.1f} s after it started; "
                        "stopping (its log says why)"
                    )
                log.error("worker %s exited with status %s; starting another", process.pid, process.exitcode)
                workers[i] = start(i)
    finally:
        for process, _ in workers:
            if process.is_alive():
                process.terminate()  # SIGTERM: uvicorn finishes the requests in flight
        deadline = time.monotonic() + STOP_GRACE_S
        for process, _ in workers:
            process.join(max(0.0, deadline - time.monotonic()))
            if process.is_alive():
                process.kill()
                process.join()
        reserved.close()


def serve_worker(host: str, port: int, log_level: str, http: str) -> None:
    """One worker process: its own socket on the port, uvicorn serving the app on it."""
    sock = bound_socket(host, port)
    config = uvicorn.Config(
        "precompile.serve.app:app_from_env", factory=True, host=host, port=port, log_level=log_level, http=http
    )
    uvicorn.Server(config).run(sockets=[sock])
