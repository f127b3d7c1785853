"""Steady state: every serving method in its own process, all alive at once, the request stream
served chunk by chunk in turn (``bench.child_steady``).

The processes are set up one after the other (so no setup competes with another), then each chunk of
the stream goes to every method, the order rotating per chunk. A neighbour's burst of load lands on
one chunk of one method, not on a whole method; the ratios between methods hold. A peer (ONNX
Runtime, OpenVINO) that has no ONNX file or cannot start is reported as failed, with the reason.
"""

from __future__ import annotations

import json
import statistics
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path
from typing import IO, Any

from .cases import ROOT
from .child_steady import METHODS
from .coldstart import ChildFailed, child_env, peer_failure, unrunnable_peers

CHUNK = 25


class Server:
    """One ``bench.child_steady`` process and its line protocol."""

    def __init__(self, method: str, spec: Path, work: Path, cache_dir: Path):
        self.method = method
        self.out = work / f"steady-{method}.json"
        self.stderr_path = work / f"steady-{method}.log"
        self._stderr: IO[str] = open(self.stderr_path, "w", encoding="utf-8")
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "bench.child_steady", method, str(spec), str(self.out)],
            env=child_env(cache_dir),
            cwd=ROOT,
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=self._stderr,
            text=True,
            bufsize=1,
        )

    def _reply(self) -> dict[str, Any]:
        line = self.proc.stdout.readline()
        if not line:
            self.proc.wait()
            self._stderr.close()
            raise ChildFailed(
                f"steady state {self.method}",
                self.proc.returncode,
                self.stderr_path.read_text(encoding="utf-8", errors="replace"),
            )
        return json.loads(line)

    def _send(self, command: dict[str, Any]) -> None:
        self.proc.stdin.write(json.dumps(command) + "\n")
        self.proc.stdin.flush()

    def ready(self) -> float:
        return self._reply()["ready"]

    def run(self, first: int, last: int) -> None:
        self._send({"run": [first, last]})
        self._reply()

    def finish(self) -> dict[str, Any]:
        self._send({"finish": True})
        self.proc.wait()
        self._stderr.close()
        if self.proc.returncode != 0:
            raise RuntimeError(f"steady state {self.method} exited {self.proc.returncode}: see {self.stderr_path}")
        return json.loads(self.out.read_text(encoding="utf-8"))

    def kill(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait()
        self._stderr.close()


def run(spec: Path, work: Path, cache_dir: Path, requests: int, log: Callable[[str], None]) -> dict[str, Any]:
    """Every method over the same ``requests``-long stream; per method its latencies and summary, or
    for a peer that could not run, why."""
    failed = unrunnable_peers(spec)
    servers: list[Server] = []
    try:
        for method in (m for m in METHODS if m not in failed):
            server = Server(method, spec, work, cache_dir)
            ready = peer_failure(method, server.ready)
            if isinstance(ready, ChildFailed):
                failed[method] = ready.reason
                log(f"    {method:<20} FAILED: {ready.reason}")
                continue
            log(f"    {method:<20} ready in {ready:6.1f} s")
            servers.append(server)
        chunks = [(i, min(i + CHUNK, requests)) for i in range(0, requests, CHUNK)]
        for k, (first, last) in enumerate(chunks):
            for server in servers[k % len(servers) :] + servers[: k % len(servers)]:
                server.run(first, last)
        ran = {s.method: summarize(s.finish()) for s in servers}
    finally:
        for s in servers:
            s.kill()
    results = {m: {"failed": failed[m]} if m in failed else ran[m] for m in METHODS}
    for method, r in ran.items():
        log(
            f"    {method:<20} p50 {r['p50_ms']:8.2f} ms  p99 {r['p99_ms']:8.2f} ms  {r['requests_per_s']:7.1f} req/s  "
            f"peak RSS {r['peak_rss_mb']:6.0f} MB"
        )
    return results


def summarize(raw: dict[str, Any]) -> dict[str, Any]:
    lat = raw["latency_ms"]
    mean = statistics.fmean(lat)
    return {
        **raw,
        "p50_ms": percentile(lat, 50),
        "p99_ms": percentile(lat, 99),
        "mean_ms": mean,
        "requests_per_s": 1000.0 / mean if mean > 0 else float("inf"),
    }


def percentile(values: list[float], q: float) -> float:
    """Linear interpolation between closest ranks (numpy's default)."""
    ordered = sorted(values)
    pos = (len(ordered) - 1) * q / 100
    lo = int(pos)
    hi = min(lo + 1, len(ordered) - 1)
    return ordered[lo] + (ordered[hi] - ordered[lo]) * (pos - lo)
