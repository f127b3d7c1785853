"""A local Ray cluster for tests and bench/fleet.py: a head and more worker nodes, each a
`ray start --block` process of ours, on loopback addresses only.

Ray turns 127.0.0.1 into the host's outward address (its nodes must be reachable from other hosts), so
the nodes take 127.0.0.2, 127.0.0.3, ..., loopback addresses it leaves alone. Ray's head also asks
cloud metadata servers which cloud it runs on unless it finds an autoscaler config in $HOME, and
reports "usage stats disabled" to Ray's server: the nodes get a $HOME holding an empty config and a
report URL on loopback, so nothing leaves the machine.
"""

from __future__ import annotations

import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def stop_group(process: subprocess.Popen, *, grace: float) -> None:
    """End a process started with ``start_new_session=True`` and its group: SIGTERM, ``grace`` seconds
    to exit, then SIGKILL for whatever it started and left behind in its group."""
    if process.poll() is None:
        os.killpg(process.pid, signal.SIGTERM)
        try:
            process.wait(timeout=grace)
        except subprocess.TimeoutExpired:
            pass
    try:
        os.killpg(process.pid, signal.SIGKILL)
    except ProcessLookupError:
        pass
    process.wait(timeout=10)


def wait_http_ready(url: str, process: subprocess.Popen, log: Path, what: str, *, timeout: float) -> None:
    """Poll ``url`` until it answers 200; RuntimeError with the tail of ``log`` if ``process`` exits
    first or ``timeout`` seconds pass (a server a test started: tritonserver, the KServe runtime)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if process.poll() is not None:
            break
        try:
            with urllib.request.urlopen(url, timeout=2) as r:
                if r.status == 200:
                    return
        except OSError:
            pass
        time.sleep(0.25)
    raise RuntimeError(f"{what} did not get ready: {log.read_text(errors='replace')[-4000:]}")


class Node:
    """One `ray start --block` in a process group of its own: ending the group ends this node and only it."""

    def __init__(self, args: list[str], env: dict[str, str], log: Path):
        self.log_path = log
        self.log = open(log, "wb")
        ray_cli = Path(sys.executable).with_name("ray")
        self.process = subprocess.Popen(
            [str(ray_cli), "start", "--block", "--disable-usage-stats", *args],
            stdout=self.log,
            stderr=subprocess.STDOUT,
            env=env,
            start_new_session=True,
        )

    def wait_started(self, timeout: float = 60) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if b"Ray runtime started" in self.log_path.read_bytes():
                return
            if self.process.poll() is not None:
                break
            time.sleep(0.1)
        raise RuntimeError(f"ray start did not come up: {self.log_path.read_text(errors='replace')[-3000:]}")

    def stop(self) -> None:
        stop_group(self.process, grace=5)
        self.log.close()


class LocalRayCluster:
    """``with LocalRayCluster(folder, nodes=2, cpus=1) as address:`` a head and ``nodes - 1`` worker
    nodes of ``cpus`` CPUs each; ``address`` is the head's, for ``--address``."""

    def __init__(self, folder: Path, *, nodes: int = 2, cpus: int = 1):
        self.folder, self.nodes, self.cpus = Path(folder), nodes, cpus
        self.running: list[Node] = []
        self.address = ""
        self.temp: str | None = None

    def __enter__(self) -> str:
        home = self.folder / "home"
        home.mkdir(parents=True, exist_ok=True)
        (home / "ray_bootstrap_config.yaml").write_text("{}\n")
        temp = self.temp = tempfile.mkdtemp(prefix="ray-")  # short: Ray's unix socket paths are limited to 107 bytes
        env = {**os.environ, "HOME": str(home), "RAY_USAGE_STATS_REPORT_URL": "http://127.0.0.1:9/"}
        port = free_port()
        self.address = f"127.0.0.2:{port}"
        cpus = ["--num-cpus", str(self.cpus)]
        try:
            head = Node(
                [
                    "--head",
                    "--node-ip-address",
                    "127.0.0.2",
                    "--port",
                    str(port),
                    "--temp-dir",
                    temp,
                    "--include-dashboard",
                    "false",
                    *cpus,
                ],
                env,
                self.folder / "head.log",
            )
            self.running.append(head)
            head.wait_started()
            for i in range(1, self.nodes):
                node = Node(
                    ["--address", self.address, "--node-ip-address", f"127.0.0.{2 + i}", *cpus],
                    env,
                    self.folder / f"node{i}.log",
                )
                self.running.append(node)
                node.wait_started()
        except BaseException:
            self.__exit__()
            raise
        return self.address

    def __exit__(self, *exc: object) -> None:
        for node in reversed(self.running):
            node.stop()
        self.running = []
        if self.temp is not None:
            shutil.rmtree(self.temp, ignore_errors=True)
