"""`precompile serve` on a shared CPU: p50 latency quiet, then beside a co-located torch process (default
settings, its OpenMP threads spinning) and one busy loop, with the server's OpenMP threads sleeping
(`OMP_WAIT_POLICY=PASSIVE`, what `precompile serve` sets) and spinning (`ACTIVE`, torch's behaviour
before). Sequential requests on loopback, bounded in count and time.

    python -m bench.contention ARTIFACT [--requests 200] [--out bench/results/contention.json]

ARTIFACT is any artifact whose inputs are integer token ids and a mask ``[batch, seq]`` (the MiniLM
bench profile's); each request is one 1×64 call. A fair share of 2 cores beside two busy neighbours is
about 3× the quiet latency; the target is at most 3.5×.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import socket
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent

NEIGHBOUR_TORCH = """
import time, torch
a = torch.randn(512, 512); deadline = time.time() + float(__import__("sys").argv[1])
while time.time() < deadline:
    a @ a
    time.sleep(0.002)  # a service between requests: its threads spin in the gaps
"""
NEIGHBOUR_BUSY = "import time, sys\nd = time.time() + float(sys.argv[1])\nwhile time.time() < d: pass\n"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def request_body(manifest: dict, seq: int = 64, batch: int = 1) -> dict:
    """A /predict body for a token model: ids within the first input's value range, the other inputs
    (masks) all ones (True for bool)."""
    specs = manifest["inputs"]
    lo = specs[0].get("range", [0, 0])[0]
    ids = [[lo + (j * 7 + r) % 97 for j in range(seq)] for r in range(batch)]
    rest = {s["name"]: [[True if s["dtype"] == "bool" else 1] * seq for _ in range(batch)] for s in specs[1:]}
    return {"inputs": {specs[0]["name"]: ids, **rest}}


def p50(client, body: dict, requests: int, seconds: float) -> float:
    times, deadline = [], time.monotonic() + seconds
    for _ in range(requests):
        start = time.perf_counter()
        response = client.post("/predict", json=body)
        times.append((time.perf_counter() - start) * 1000)
        response.raise_for_status()
        if time.monotonic() > deadline:
            break
    return statistics.median(times)


SCENARIOS = {
    "passive": {"OMP_WAIT_POLICY": "PASSIVE"},  # what precompile serve sets (and its spin, loader.threads.wait_env)
    "sleep": {"OMP_WAIT_POLICY": "PASSIVE", "GOMP_SPINCOUNT": "0"},  # sleep at once (serve's default before)
    "spin-1000": {"OMP_WAIT_POLICY": "PASSIVE", "GOMP_SPINCOUNT": "1000"},  # about 10 µs, then sleep
    "spin-3000": {"OMP_WAIT_POLICY": "PASSIVE", "GOMP_SPINCOUNT": "3000"},
    "short-spin": {"OMP_WAIT_POLICY": "", "GOMP_SPINCOUNT": "10000"},  # about 0.1 ms, then sleep
    "spin": {"OMP_WAIT_POLICY": "ACTIVE"},  # OpenMP threads spin between parallel regions
}


def scenario(artifact: Path, name: str, requests: int) -> dict:
    import httpx

    env = {k: v for k, v in os.environ.items() if k not in ("OMP_WAIT_POLICY", "OMP_NUM_THREADS", "GOMP_SPINCOUNT")}
    env.update({k: v for k, v in SCENARIOS[name].items() if v})
    if "OMP_WAIT_POLICY" not in env:
        env["OMP_WAIT_POLICY"] = ""  # present, so serve leaves the runtime's default alone
    port = free_port()
    server = subprocess.Popen(
        [sys.executable, "-m", "precompile", "serve", str(artifact), "--port", str(port), "--log-level", "warning"],
        cwd=ROOT,
        env=env,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    neighbours = []
    try:
        base = f"http://127.0.0.1:{port}"
        with httpx.Client(base_url=base, timeout=30) as client:
            deadline = time.monotonic() + 120
            while True:
                try:
                    if client.get("/readyz").status_code == 200:
                        break
                except httpx.TransportError:
                    pass
                if time.monotonic() > deadline or server.poll() is not None:
                    raise RuntimeError("the server did not become ready")
                time.sleep(0.1)
            manifest = json.loads((artifact / "manifest.json").read_text())
            body = request_body(manifest)
            p50(client, body, 20, 10)  # warm
            quiet = p50(client, body, requests, 60)
            clean = {k: v for k, v in os.environ.items() if k not in ("OMP_WAIT_POLICY", "OMP_NUM_THREADS")}
            for code in (NEIGHBOUR_TORCH, NEIGHBOUR_BUSY):
                neighbours.append(subprocess.Popen([sys.executable, "-c", code, "120"], env=clean))
            time.sleep(2)
            busy = p50(client, body, requests, 90)
    finally:
        for n in neighbours:
            n.kill()
            n.wait()
        server.send_signal(signal.SIGTERM)
        try:
            server.wait(timeout=30)
        except subprocess.TimeoutExpired:
            server.kill()
    return {
        "scenario": name,
        "env": SCENARIOS[name],
        "quiet_p50_ms": quiet,
        "contended_p50_ms": busy,
        "ratio": busy / quiet,
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.contention", description=__doc__.split("\n\n")[0])
    parser.add_argument("artifact", type=Path)
    parser.add_argument("--requests", type=int, default=200)
    parser.add_argument("--out", type=Path, default=ROOT / "bench" / "results" / "contention.json")
    parser.add_argument("--scenarios", nargs="+", choices=sorted(SCENARIOS), default=["passive", "spin"])
    opts = parser.parse_args(argv)
    rows = [scenario(opts.artifact, name, opts.requests) for name in opts.scenarios]
    for r in rows:
        print(
            f"{r['scenario']:<11} quiet p50 {r['quiet_p50_ms']:7.2f} ms   beside a torch process and a busy loop "
            f"{r['contended_p50_ms']:7.2f} ms   ({r['ratio']:.1f}×)"
        )
    opts.out.parent.mkdir(parents=True, exist_ok=True)
    opts.out.write_text(
        json.dumps({"cpus": os.cpu_count(), "requests": opts.requests, "scenarios": rows}, indent=2) + "\n"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
