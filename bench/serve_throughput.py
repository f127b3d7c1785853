"""Requests per second through `precompile serve`, for one worker process and for several.

    .venv/bin/python bench/serve_throughput.py ARTIFACT [--workers 1 2] [--clients 8] [--seconds 5] [--batch 4] [--seq 128]
        [--serve-args "--batch --max-batch 8 --max-delay-ms 2"]

Starts the server on a free loopback port for each worker count, waits for /readyz, then runs
``--clients`` client processes posting the same request for ``--seconds`` and prints requests per
second and median latency. Clients share the machine with the server: on a small host, read the
figures as a comparison between rows, not as the server's capacity.
"""

from __future__ import annotations

import argparse
import multiprocessing as mp
import os
import signal
import socket
import statistics
import subprocess
import sys
import time


def client(base: str, body: dict, seconds: float, out: mp.Queue) -> None:
    import httpx

    latencies = []
    with httpx.Client(base_url=base, timeout=30) as c:
        stop = time.perf_counter() + seconds
        while time.perf_counter() < stop:
            start = time.perf_counter()
            response = c.post("/predict", json=body)
            response.raise_for_status()
            latencies.append(time.perf_counter() - start)
    out.put(latencies)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("artifact")
    parser.add_argument("--workers", type=int, nargs="+", default=[1, 2])
    parser.add_argument("--clients", type=int, default=8)
    parser.add_argument("--seconds", type=float, default=5.0)
    parser.add_argument("--batch", type=int, default=4)
    parser.add_argument("--seq", type=int, default=128)
    parser.add_argument(
        "--serve-args", default="", help="more options for precompile serve, e.g. '--batch --max-batch 8'"
    )
    args = parser.parse_args()
    import json
    from pathlib import Path

    import httpx

    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
    from bench.contention import request_body

    body = request_body(json.loads((Path(args.artifact) / "manifest.json").read_text()), args.seq, args.batch)
    print(f"{args.artifact}: batch {args.batch}, seq {args.seq}, {args.clients} clients, {os.cpu_count()} cores")
    print(f"{'workers':>7} {'req/s':>8} {'p50 ms':>7}")
    for workers in args.workers:
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        base = f"http://127.0.0.1:{port}"
        server = subprocess.Popen(
            [
                sys.executable,
                "-m",
                "precompile",
                "serve",
                args.artifact,
                "--port",
                str(port),
                "--workers",
                str(workers),
                "--log-level",
                "warning",
                *args.serve_args.split(),
            ],
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )
        try:
            deadline = time.monotonic() + 120
            while True:
                try:
                    if httpx.get(f"{base}/readyz").status_code == 200:
                        break
                except httpx.TransportError:
                    pass
                if time.monotonic() > deadline:
                    raise SystemExit("server not ready")
                time.sleep(0.1)
            time.sleep(1.0 if workers > 1 else 0.0)  # the other workers finish loading
            out: mp.Queue = mp.Queue()
            procs = [mp.Process(target=client, args=(base, body, args.seconds, out)) for _ in range(args.clients)]
            for p in procs:
                p.start()
            latencies = [x for _ in procs for x in out.get()]
            for p in procs:
                p.join()
            print(f"{workers:>7} {len(latencies) / args.seconds:>8.1f} {statistics.median(latencies) * 1000:>7.1f}")
        finally:
            server.send_signal(signal.SIGTERM)
            server.wait(timeout=60)


if __name__ == "__main__":
    main()
