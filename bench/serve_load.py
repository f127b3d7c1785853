"""Serving under concurrency: requests/s, p50/p99 latency and the batches formed through the HTTP
server, with and without ``--batch``, for the artifact and for eager behind the same server.

    python -m bench.serve_load                                   # MiniLM (real weights) and ResNet-50
    python -m bench.serve_load --case minilm --concurrency 1 16 --seconds 20
    python -m bench.serve_load --artifact DIR --profile FILE --shape batch=1,seq=16 --smoke

Per case, the artifact is built from ``profiles/bench/<case>.yaml`` (or ``--artifact`` is used), then
four servers run one after the other on a loopback port, each serving every concurrency level:

- ``precompile``: ``precompile serve ARTIFACT``, and ``precompile --batch`` with ``--batch --max-delay-ms``;
- ``eager``, ``eager --batch``: the same server (``create_app``: guards, dispatch, batcher, codec,
  metrics) in which every variant's compiled code is replaced by the profile's eager module
  (``loader.model.open_package`` patched in the server process only; ``--eager-server``). ResNet-50's
  factory makes random weights, so its eager outputs differ from the artifact's; its cost does not.

Both get the environment ``precompile serve`` sets (``OMP_WAIT_POLICY=PASSIVE``, ``OMP_NUM_THREADS``).

The load generator is this script: closed-loop clients (each sends its next request when the last
answer arrived), ``--concurrency`` of them, as asyncio tasks with one keep-alive connection each,
spread over ``--client-procs`` processes, speaking plain HTTP/1.1 with pre-encoded bodies (the Open
Inference Protocol's binary tensors: no JSON encoding of tensors on either side). Each level is
bounded by ``--requests`` and ``--seconds``, after a short warm-up. Batch sizes come from the
server's ``/metrics`` (``precompile_batch_size``) before and after each level; the load generator's
own CPU use is ``getrusage`` of its processes over the level's wall time, the server's from /proc.
Clients and server share the machine: read the client CPU column before the others.

Writes ``--out`` (default bench/results/serve_load.json) and prints one table per case.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import multiprocessing as mp
import os
import re
import resource
import signal
import socket
import statistics
import subprocess
import sys
import time
import urllib.request
from array import array
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PROFILES = ROOT / "profiles" / "bench"
CASES = {  # the request every client sends: MiniLM's short sentence, ResNet-50's larger camera size
    "minilm": {"batch": 1, "seq": 16},
    "resnet50": {"batch": 1, "height": 128, "width": 128},
}
ARRAY_CODES = {"int64": "q", "int32": "i", "int16": "h", "int8": "b", "uint8": "B", "float32": "f", "float64": "d"}
DATATYPES = {
    "bool": "BOOL",
    "uint8": "UINT8",
    "int8": "INT8",
    "int16": "INT16",
    "int32": "INT32",
    "int64": "INT64",
    "float32": "FP32",
    "float64": "FP64",
}
HEADER_LENGTH = "Inference-Header-Content-Length"


# --- the request -------------------------------------------------------------------------------


def infer_request(manifest: dict, sizes: dict[str, int], port: int) -> bytes:
    """One complete HTTP/1.1 POST of /v2/models/<name>/infer with binary tensors: integer inputs
    within their value range, masks all true, floats small and varied; binary outputs asked for."""
    header: dict = {"inputs": [], "parameters": {"binary_data_output": True}}
    raw = []
    for spec in manifest["inputs"]:
        shape = [sizes[s] if isinstance(s, str) else s for s in spec["shape"]]
        n = 1
        for s in shape:
            n *= s
        dtype = spec["dtype"]
        if dtype == "bool":
            data = bytes([1]) * n
        elif dtype.startswith("float"):
            data = array(ARRAY_CODES[dtype], ((i * 7) % 13 / 13.0 - 0.5 for i in range(n))).tobytes()
        else:
            lo, hi = spec.get("range", [0, 0])
            data = array(ARRAY_CODES[dtype], (lo + (i * 7) % (hi - lo + 1) for i in range(n))).tobytes()
        header["inputs"].append(
            {
                "name": spec["name"],
                "shape": shape,
                "datatype": DATATYPES[dtype],
                "parameters": {"binary_data_size": len(data)},
            }
        )
        raw.append(data)
    head = json.dumps(header).encode()
    body = head + b"".join(raw)
    return (
        f"POST /v2/models/{manifest['name']}/infer HTTP/1.1\r\nHost: 127.0.0.1:{port}\r\n"
        f"Content-Type: application/octet-stream\r\n{HEADER_LENGTH}: {len(head)}\r\nContent-Length: {len(body)}\r\n\r\n"
    ).encode() + body


# --- the load generator ------------------------------------------------------------------------


async def _read_response(reader: asyncio.StreamReader) -> int:
    head = await reader.readuntil(b"\r\n\r\n")
    status = int(head.split(b" ", 2)[1])
    length = re.search(rb"(?i)\r\ncontent-length: *(\d+)", head)
    await reader.readexactly(int(length.group(1)) if length else 0)
    return status


async def _clients(
    port: int, request: bytes, tasks: int, budget: int, start_at: float, stop_at: float, warmup: int
) -> dict:
    latencies: list[float] = []
    errors = [0]
    left = [budget]

    async def one() -> None:
        reader, writer = await asyncio.open_connection("127.0.0.1", port)
        try:
            for _ in range(warmup):
                writer.write(request)
                await _read_response(reader)
            await asyncio.sleep(max(0.0, start_at - time.time()))
            while left[0] > 0 and time.time() < stop_at:
                left[0] -= 1
                t0 = time.perf_counter()
                writer.write(request)
                status = await _read_response(reader)
                latencies.append(time.perf_counter() - t0)
                if status != 200:
                    errors[0] += 1
        finally:
            writer.close()

    running = asyncio.gather(*(one() for _ in range(tasks)))  # connect and warm up, then wait for start_at
    await asyncio.sleep(max(0.0, start_at - time.time()))
    cpu0 = _own_cpu()
    await running
    return {"latencies": latencies, "errors": errors[0], "cpu_s": _own_cpu() - cpu0, "end": time.time()}


def _own_cpu() -> float:
    r = resource.getrusage(resource.RUSAGE_SELF)
    return r.ru_utime + r.ru_stime


def client_process(
    port: int, request: bytes, tasks: int, budget: int, start_at: float, stop_at: float, warmup: int, out
) -> None:
    out.put(asyncio.run(_clients(port, request, tasks, budget, start_at, stop_at, warmup)))


def run_level(
    port: int, server_pid: int, request: bytes, concurrency: int, procs: int, requests: int, seconds: float, warmup: int
) -> dict:
    """``concurrency`` closed-loop clients for at most ``requests`` requests and ``seconds`` seconds."""
    procs = max(1, min(procs, concurrency))
    ctx = mp.get_context("spawn")
    out = ctx.Queue()
    start_at = time.time() + 2.0  # spawned interpreters start, connect and warm up before it
    stop_at = start_at + seconds
    shares = [concurrency // procs + (1 if k < concurrency % procs else 0) for k in range(procs)]
    workers = [
        ctx.Process(
            target=client_process,
            args=(port, request, n, max(1, requests * n // concurrency), start_at, stop_at, warmup, out),
        )
        for n in shares
    ]
    for w in workers:
        w.start()
    time.sleep(max(0.0, start_at - time.time()))
    server0 = process_cpu(server_pid)
    results = [out.get(timeout=seconds + 120) for _ in workers]
    server1 = process_cpu(server_pid)
    for w in workers:
        w.join()
    latencies = sorted(x for r in results for x in r["latencies"])
    wall = max(r["end"] for r in results) - start_at
    done = len(latencies)
    return {
        "concurrency": concurrency,
        "requests": done,
        "errors": sum(r["errors"] for r in results),
        "wall_s": wall,
        "rps": done / wall if wall > 0 else 0.0,
        "p50_ms": statistics.median(latencies) * 1000 if latencies else None,
        "p99_ms": latencies[min(done - 1, int(done * 0.99))] * 1000 if latencies else None,
        "mean_ms": statistics.fmean(latencies) * 1000 if latencies else None,
        "client_procs": procs,
        "client_cpu_s": sum(r["cpu_s"] for r in results),
        "client_cores": sum(r["cpu_s"] for r in results) / wall if wall > 0 else None,
        "server_cores": (server1 - server0) / wall
        if server0 is not None and server1 is not None and wall > 0
        else None,
    }


# --- the servers -------------------------------------------------------------------------------


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start_server(
    kind: str, artifact: Path, profile: Path, port: int, batch_args: list[str], workers: int = 1
) -> subprocess.Popen:
    from precompile.serve.server import serving_env

    workers = workers if kind == "precompile" else 1  # the eager server is one process
    env = {**{k: v for k, v in os.environ.items() if k != "PYTHONPATH"}, **serving_env(workers)}
    if kind == "precompile":
        command = [
            sys.executable,
            "-m",
            "precompile",
            "serve",
            str(artifact),
            "--port",
            str(port),
            "--log-level",
            "warning",
            "--workers",
            str(workers),
            *batch_args,
        ]
    else:
        command = [
            sys.executable,
            "-m",
            "bench.serve_load",
            "--eager-server",
            str(artifact),
            "--profile",
            str(profile),
            "--port",
            str(port),
            "--serve-args",
            " ".join(batch_args),
        ]
    return subprocess.Popen(command, cwd=ROOT, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)


def wait_ready(base: str, server: subprocess.Popen, timeout: float = 600) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if server.poll() is not None:
            raise SystemExit(f"the server exited ({server.returncode}): {server.stderr.read()[-2000:]}")
        try:
            with urllib.request.urlopen(f"{base}/readyz", timeout=5) as r:
                if r.status == 200:
                    return
        except OSError:
            pass
        time.sleep(0.2)
    raise SystemExit(f"{base} not ready after {timeout:.0f} s")


def stop_server(server: subprocess.Popen) -> None:
    server.send_signal(signal.SIGTERM)
    try:
        server.wait(timeout=60)
    except subprocess.TimeoutExpired:
        server.kill()
        server.wait()


def scrape(base: str) -> dict[str, float]:
    """The batch-size histogram and the 200 count from /metrics (unlabelled samples by name, buckets by le)."""
    with urllib.request.urlopen(f"{base}/metrics", timeout=10) as r:
        text = r.read().decode()
    out: dict[str, float] = {}
    for line in text.splitlines():
        m = re.match(
            r'^(precompile_batch_size_(?:count|sum)|precompile_batch_size_bucket\{le="([^"]+)"\}|precompile_requests_total\{code="200"\}) (\S+)$',
            line,
        )
        if m:
            key = f"le={m.group(2)}" if m.group(2) else m.group(1).split("{")[0]
            out[key] = float(m.group(3))
    return out


def process_cpu(pid: int) -> float | None:
    """User + system CPU seconds of a process and its live children (``--workers``: uvicorn's worker
    processes), from /proc (Linux)."""

    def stat(p: int | str) -> list[str]:
        return Path(f"/proc/{p}/stat").read_text().rsplit(")", 1)[1].split()

    try:
        fields = stat(pid)
    except (OSError, ValueError, IndexError):
        return None
    total = int(fields[11]) + int(fields[12])
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                child = stat(entry.name)
                if int(child[1]) == pid:  # field 4 of stat, the parent's pid
                    total += int(child[11]) + int(child[12])
            except (OSError, ValueError, IndexError):
                continue
    return total / os.sysconf("SC_CLK_TCK")


def batches_between(before: dict, after: dict, batching: bool) -> dict:
    if not batching:
        return {"batches": None, "mean_batch": 1.0, "batch_sizes": {}}
    count = after.get("precompile_batch_size_count", 0) - before.get("precompile_batch_size_count", 0)
    rows = after.get("precompile_batch_size_sum", 0) - before.get("precompile_batch_size_sum", 0)
    cumulative = {k[3:]: after[k] - before.get(k, 0) for k in after if k.startswith("le=")}
    sizes, below = {}, 0.0
    for le, n in sorted(cumulative.items(), key=lambda kv: float(kv[0])):
        if n - below:
            sizes[f"≤{float(le):g}"] = int(n - below)
        below = n
    return {"batches": int(count), "mean_batch": rows / count if count else None, "batch_sizes": sizes}


def run_server(
    kind: str, batching: bool, artifact: Path, profile: Path, manifest: dict, sizes: dict, args
) -> list[dict]:
    port = free_port()
    base = f"http://127.0.0.1:{port}"
    batch_args = ["--batch", "--max-delay-ms", str(args.max_delay_ms)] if batching else []
    if batching and args.max_batch:
        batch_args += ["--max-batch", str(args.max_batch)]
    server = start_server(kind, artifact, profile, port, batch_args, args.workers)
    rows = []
    try:
        wait_ready(base, server)
        request = infer_request(manifest, sizes, port)
        for c in args.concurrency:
            before = scrape(base)
            level = run_level(port, server.pid, request, c, args.client_procs, args.requests, args.seconds, args.warmup)
            level.update(batches_between(before, scrape(base), batching))
            row = {
                "server": kind + (" --batch" if batching else ""),
                "workers": args.workers if kind == "precompile" else 1,
                **level,
            }
            rows.append(row)
            print(format_row(row), flush=True)
    finally:
        stop_server(server)
    return rows


# --- the eager server (runs in its own process) ----------------------------------------------------


def eager_server(artifact: str, profile: str, port: int, serve_args: str) -> None:
    """The service of ``precompile serve`` with each variant's compiled code replaced by ``profile``'s
    eager module: everything but the compiled code is what the artifact's server runs."""
    import torch
    import uvicorn

    import loader.model
    from loader.artifact import read_manifest
    from loader.outputs import flatten
    from precompile.profile import load_profile
    from precompile.serve.app import create_app
    from precompile.serve.config import ServeConfig
    from precompile.stages.resolve import resolve_model

    module = resolve_model(load_profile(profile)).eval().requires_grad_(False)
    manifest = read_manifest(Path(artifact))

    class EagerRunner:
        """What the loader needs of a package runner, running the eager module."""

        def __init__(self, path: str):
            variant = next(v for v in manifest.variants if path.endswith(v.file))
            self.constants = list(variant.constants)

        def get_constant_fqns(self) -> list[str]:
            return self.constants

        def load_constants(self, *args) -> None:
            pass

        def run(self, tensors: list) -> list:
            with torch.inference_mode():
                return flatten(module(*tensors))

    loader.model.open_package = lambda path, **kwargs: EagerRunner(path)  # in this process only, for measuring
    options = serve_args.split()
    config = ServeConfig(
        artifact=artifact,
        batch="--batch" in options,
        max_delay_ms=float(options[options.index("--max-delay-ms") + 1]) if "--max-delay-ms" in options else 2.0,
        max_batch=int(options[options.index("--max-batch") + 1]) if "--max-batch" in options else None,
    )
    uvicorn.run(create_app(config), host="127.0.0.1", port=port, log_level="warning")


# --- the run -----------------------------------------------------------------------------------


def format_row(r: dict) -> str:
    batch = f"{r['mean_batch']:.2f}" if r.get("mean_batch") is not None else "-"
    client = f"{r['client_cores']:.2f}" if r.get("client_cores") is not None else "-"
    server = f"{r['server_cores']:.2f}" if r.get("server_cores") is not None else "-"
    p50 = f"{r['p50_ms']:.1f}" if r["p50_ms"] is not None else "-"
    p99 = f"{r['p99_ms']:.1f}" if r["p99_ms"] is not None else "-"
    return (
        f"  {r['server']:<20} {r['concurrency']:>4} {r['rps']:>8.1f} {p50:>8} {p99:>8} {batch:>6} "
        f"{client:>7} {server:>7} {r['requests']:>7} {r['errors']:>4}"
    )


HEADER = f"  {'server':<20} {'conc':>4} {'req/s':>8} {'p50 ms':>8} {'p99 ms':>8} {'batch':>6} {'client':>7} {'server':>7} {'reqs':>7} {'err':>4}"


def build_case(case: str, work: Path) -> tuple[Path, Path]:
    from precompile.pipeline import build

    profile = PROFILES / f"{case}.yaml"
    out = work / case / "artifact"
    if not (out / "manifest.json").is_file():
        print(f"[{case}] building {profile.relative_to(ROOT)} -> {out}", flush=True)
        build(profile, out)
    return out, profile


def target_line(rows: list[dict]) -> str | None:
    """The issue's target for short MiniLM requests: at 16 clients, batching ≥ 3× the unbatched
    requests/s, with p99 no worse than 2× the unbatched p99 at concurrency 1."""
    by = {(r["server"], r["concurrency"]): r for r in rows}
    plain16, batched16 = by.get(("precompile", 16)), by.get(("precompile --batch", 16))
    plain1, batched1 = by.get(("precompile", 1)), by.get(("precompile --batch", 1))
    if (
        not (plain16 and batched16 and plain1 and batched1)
        or not plain16["rps"]
        or not plain1["p99_ms"]
        or batched1["p99_ms"] is None
    ):
        return None
    speedup = batched16["rps"] / plain16["rps"]
    p99 = batched1["p99_ms"] / plain1["p99_ms"]  # what batching costs a lone client
    met = speedup >= 3 and p99 <= 2
    return (
        f"target: with 16 clients --batch serves {speedup:.2f}× the unbatched req/s (want ≥ 3×); at concurrency 1 "
        f"its p99 is {p99:.2f}× the unbatched p99 (want ≤ 2×): {'met' if met else 'NOT met'}"
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--case", nargs="+", choices=sorted(CASES), default=["minilm", "resnet50"])
    parser.add_argument(
        "--artifact", type=Path, help="serve this artifact instead of building a case (needs --profile, --shape)"
    )
    parser.add_argument("--profile", type=Path, help="the profile the artifact was built from (its eager module)")
    parser.add_argument("--shape", help="the request's dims, e.g. batch=1,seq=16 (default: the case's)")
    parser.add_argument("--concurrency", type=int, nargs="+", default=[1, 4, 16, 64])
    parser.add_argument("--requests", type=int, default=4000, help="at most this many timed requests per level")
    parser.add_argument("--seconds", type=float, default=20.0, help="at most this long per level")
    parser.add_argument("--warmup", type=int, default=3, help="untimed requests per client before each level")
    parser.add_argument(
        "--client-procs", type=int, default=2, help="load generator processes (clients spread over them)"
    )
    parser.add_argument("--max-delay-ms", type=float, default=2.0)
    parser.add_argument("--max-batch", type=int)
    parser.add_argument(
        "--workers", type=int, default=1, help="precompile serve --workers (the eager server is one process)"
    )
    parser.add_argument("--servers", nargs="+", default=["precompile", "precompile --batch", "eager", "eager --batch"])
    parser.add_argument(
        "--work", type=Path, default=ROOT / "bench" / "work" / "serve_load", help="where cases are built"
    )
    parser.add_argument("--out", type=Path, default=ROOT / "bench" / "results" / "serve_load.json")
    parser.add_argument(
        "--smoke", action="store_true", help="a check of the harness: concurrency 1 and 4, 2 s per level"
    )
    parser.add_argument("--eager-server", help=argparse.SUPPRESS)  # internal: run the eager server for this artifact
    parser.add_argument("--port", type=int, help=argparse.SUPPRESS)
    parser.add_argument("--serve-args", default="", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.eager_server:
        eager_server(args.eager_server, str(args.profile), args.port, args.serve_args)
        return
    if args.smoke:
        args.concurrency, args.seconds, args.requests, args.warmup = [1, 4], 2.0, 400, 1
    if args.artifact is not None and (args.profile is None or args.shape is None):
        parser.error("--artifact needs --profile and --shape")

    cases = (
        [("custom", args.artifact, args.profile)]
        if args.artifact
        else [(c, *build_case(c, args.work)) for c in args.case]
    )
    report = {
        "machine": {"cores": os.cpu_count(), "platform": sys.platform, "python": sys.version.split()[0]},
        "load_generator": "bench/serve_load.py: closed-loop asyncio clients, plain HTTP/1.1 keep-alive, OIP binary tensors",
        "settings": {
            k: v
            for k, v in vars(args).items()
            if k
            in ("concurrency", "requests", "seconds", "warmup", "client_procs", "max_delay_ms", "max_batch", "workers")
        },
        "cases": {},
    }
    for name, artifact, profile in cases:
        manifest = json.loads((artifact / "manifest.json").read_text())
        sizes = dict(kv.split("=") for kv in args.shape.split(",")) if args.shape else CASES[name]
        sizes = {d: int(n) for d, n in sizes.items()}
        print(f"[{name}] {artifact}: request {sizes}, {os.cpu_count()} cores; client/server: cores used")
        print(HEADER)
        rows = []
        for server in args.servers:
            kind, batching = server.split()[0], server.endswith("--batch")
            rows += run_server(kind, batching, artifact, profile, manifest, sizes, args)
        line = target_line(rows)
        if line:
            print(f"  {line}")
        report["cases"][name] = {"artifact": str(artifact), "request": sizes, "rows": rows, "target": line}
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(report, indent=2) + "\n")
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
