"""The server's own cost per request: p50 of a request at one client minus the in-process call on the
same input, over HTTP (``POST /v2/models/{name}/infer`` with binary tensors) and gRPC (ModelInfer
with raw input contents), for ``--runtime torch`` and ``--runtime native``.

    python -m bench.server_cost                              # the tiny classifier of tests/conftest.py
    python -m bench.server_cost --runtime native --requests 3000
    python -m bench.server_cost --artifact DIR --shape batch=1,seq=16 --profile-server out.prof

For each runtime, ``precompile serve ARTIFACT --grpc-port`` is started on loopback (the environment
``precompile serve`` sets), and one client sends ``--requests`` sequential requests per protocol over one
keep-alive connection (HTTP: a raw socket, the request pre-encoded as bench/serve_load.py sends it;
gRPC: one channel, bytes in and out), after a warm-up. The in-process figure is the same call on the
same arrays in this process (``loader.load`` or ``loader.load_native``, with the same OpenMP
settings), so ``cost = p50(request) - p50(call)`` is what HTTP or gRPC, decoding, validation, the
hops between threads and the metrics add. ``--profile-server FILE`` runs the server under cProfile
(its stats written to FILE when it stops): where that cost goes.

Client and server share the machine: on a busy one the figures are noisy; compare runs taken
side by side (interleave A and B), and take the final figure on a quiet machine.
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
import tempfile
import time
import urllib.request
from pathlib import Path

from bench.serve_load import MODEL_INFER, free_port, grpc_infer_request, infer_request, request_tensors

ROOT = Path(__file__).resolve().parent.parent


def build_tiny(work: Path) -> Path:
    """The tests' tiny classifier (tests/conftest.py), built once into ``work``."""
    from precompile.pipeline import build
    from tests.conftest import CLASSIFIER_PROFILE, write_profile

    out = work / "tiny-classifier"
    if not (out / "manifest.json").is_file():
        print(f"building the tiny classifier -> {out}", flush=True)
        build(write_profile(work, CLASSIFIER_PROFILE), out)
    return out


def percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


# --- the client --------------------------------------------------------------------------------


def http_latencies(port: int, request: bytes, n: int, warmup: int) -> list[float]:
    """Seconds per request, ``n`` sequential requests on one keep-alive connection."""
    with socket.create_connection(("127.0.0.1", port)) as sock:
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        stream = sock.makefile("rb")
        latencies = []
        for i in range(warmup + n):
            start = time.perf_counter()
            sock.sendall(request)
            status = int(stream.readline().split(b" ", 2)[1])
            length = 0
            while (line := stream.readline()) not in (b"\r\n", b""):
                if line.lower().startswith(b"content-length:"):
                    length = int(line.split(b":", 1)[1])
            stream.read(length)
            if status != 200:
                raise SystemExit(f"HTTP infer answered {status}")
            if i >= warmup:
                latencies.append(time.perf_counter() - start)
        return latencies


def grpc_latencies(port: int, request: bytes, n: int, warmup: int) -> list[float]:
    import grpc

    with grpc.insecure_channel(f"127.0.0.1:{port}") as channel:
        infer = channel.unary_unary(MODEL_INFER)
        latencies = []
        for i in range(warmup + n):
            start = time.perf_counter()
            infer(request)
            if i >= warmup:
                latencies.append(time.perf_counter() - start)
        return latencies


def call_latencies(artifact: Path, runtime: str, manifest: dict, sizes: dict, n: int, warmup: int) -> list[float]:
    """The in-process call on the same input: ``model(**inputs)`` of the runtime's loader."""
    import numpy as np

    import loader

    arrays = {
        name: np.frombuffer(data, dtype=_NUMPY[datatype]).reshape(shape)
        for name, shape, datatype, data in request_tensors(manifest, sizes)
    }
    if runtime == "native":
        model = loader.load_native(artifact)
        inputs = arrays
    else:
        import torch

        model = loader.load(artifact)
        inputs = {k: torch.from_numpy(v.copy()) for k, v in arrays.items()}
    latencies = []
    for i in range(warmup + n):
        start = time.perf_counter()
        model(**inputs)
        if i >= warmup:
            latencies.append(time.perf_counter() - start)
    return latencies


_NUMPY = {
    "BOOL": "bool",
    "INT64": "int64",
    "INT32": "int32",
    "INT16": "int16",
    "INT8": "int8",
    "UINT8": "uint8",
    "FP32": "float32",
}


# --- the server --------------------------------------------------------------------------------


def start(artifact: Path, runtime: str, http: int, grpc: int, log: Path, profile: str | None) -> subprocess.Popen:
    from precompile.serve.server import serving_env

    env = {**{k: v for k, v in os.environ.items() if k != "PYTHONPATH"}, **serving_env(1)}
    prefix = [sys.executable, "-m", "cProfile", "-o", profile, "-m"] if profile else [sys.executable, "-m"]
    command = [
        *prefix, "precompile", "serve", str(artifact), "--runtime", runtime, "--port", str(http),
        "--grpc-port", str(grpc), "--log-level", "warning",
    ]  # fmt: skip
    with open(log, "wb") as out:
        process = subprocess.Popen(command, cwd=ROOT, env=env, stdout=out, stderr=subprocess.STDOUT)
    deadline = time.monotonic() + 300
    while time.monotonic() < deadline:
        if process.poll() is not None:
            raise SystemExit(f"the server exited ({process.returncode}): {log.read_text(errors='replace')[-2000:]}")
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{http}/readyz", timeout=5) as r:
                if r.status == 200:
                    return process
        except OSError:
            pass
        time.sleep(0.2)
    raise SystemExit(f"the server is not ready after 300 s (log: {log})")


def stop(process: subprocess.Popen) -> None:
    process.send_signal(signal.SIGINT)  # uvicorn stops on SIGINT; cProfile writes its stats on the way out
    try:
        process.wait(timeout=60)
    except subprocess.TimeoutExpired:
        process.kill()
        process.wait()


def measure(artifact: Path, runtime: str, sizes: dict, args, work: Path) -> list[dict]:
    manifest = json.loads((artifact / "manifest.json").read_text())
    http, grpc = free_port(), free_port()
    requests = {"http": infer_request(manifest, sizes, http), "grpc": grpc_infer_request(manifest, sizes)}
    process = start(artifact, runtime, http, grpc, work / f"server-{runtime}.log", args.profile_server)
    try:
        served = {
            "http": http_latencies(http, requests["http"], args.requests, args.warmup),
            "grpc": grpc_latencies(grpc, requests["grpc"], args.requests, args.warmup),
        }
    finally:
        stop(process)
    # The call is measured after the server stopped, so neither takes the other's cores.
    call = statistics.median(call_latencies(artifact, runtime, manifest, sizes, args.requests, args.warmup))
    rows = []
    for protocol, latencies in served.items():
        p50 = statistics.median(latencies)
        rows.append(
            {
                "runtime": runtime,
                "protocol": protocol,
                "requests": len(latencies),
                "p50_ms": p50 * 1e3,
                "p99_ms": percentile(latencies, 0.99) * 1e3,
                "call_p50_ms": call * 1e3,
                "cost_ms": (p50 - call) * 1e3,
            }
        )
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--artifact", type=Path, help="the artifact to serve (default: the tests' tiny classifier)")
    parser.add_argument("--shape", default="batch=1,seq=16", help="the request's dims, e.g. batch=1,seq=16")
    parser.add_argument("--runtime", choices=("torch", "native"), action="append", help="default: both")
    parser.add_argument("--requests", type=int, default=2000)
    parser.add_argument("--warmup", type=int, default=200)
    parser.add_argument("--work", type=Path, default=Path(tempfile.gettempdir()) / "precompile-server-cost")
    parser.add_argument("--profile-server", metavar="FILE", help="run the server under cProfile, stats to FILE")
    parser.add_argument("--out", type=Path, help="write the rows as JSON here too")
    args = parser.parse_args()
    from precompile.serve.server import serving_env

    os.environ.update(serving_env(1))  # the in-process call gets the OpenMP settings the server gets
    sizes = {k: int(v) for k, v in (part.split("=") for part in args.shape.split(","))}
    args.work.mkdir(parents=True, exist_ok=True)
    artifact = args.artifact or build_tiny(args.work)
    rows = [
        row
        for runtime in args.runtime or ["torch", "native"]
        for row in measure(artifact, runtime, sizes, args, args.work)
    ]
    print(f"  {'runtime':<7} {'proto':<5} {'reqs':>6} {'p50 ms':>8} {'p99 ms':>8} {'call ms':>8} {'cost ms':>8}")
    for r in rows:
        print(
            f"  {r['runtime']:<7} {r['protocol']:<5} {r['requests']:>6} {r['p50_ms']:>8.3f} {r['p99_ms']:>8.3f} "
            f"{r['call_p50_ms']:>8.3f} {r['cost_ms']:>8.3f}"
        )
    if args.out:
        args.out.write_text(json.dumps(rows, indent=2) + "\n")


if __name__ == "__main__":
    main()
