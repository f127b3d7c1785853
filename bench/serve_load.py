"""Serving under concurrency: requests/s, p50/p99 latency and the batches formed, over HTTP and
gRPC, with and without ``--batch``, for the artifact and for eager behind the same server, and for
the same artifact behind Triton Inference Server.

    python -m bench.serve_load                                   # MiniLM (real weights) and ResNet-50
    python -m bench.serve_load --case minilm --concurrency 1 16 --seconds 20
    python -m bench.serve_load --case minilm --servers "precompile --batch" triton --protocol grpc
    python -m bench.serve_load --artifact DIR --profile FILE --shape batch=1,seq=16 --smoke
    python -m bench.serve_load --case minilm --servers "precompile --batch" --workers 2 --concurrency 16 --repeat 3

Per case, the artifact is built from ``profiles/bench/<case>.yaml`` (or ``--artifact`` is used), then
the servers run one after the other on loopback ports, each serving every protocol and concurrency level:

- ``precompile``: ``precompile serve ARTIFACT``, and ``precompile --batch`` with ``--batch --max-delay-ms``;
  for gRPC with ``--grpc-port`` (rows skipped, with a line saying so, where the server lacks it);
- ``eager``, ``eager --batch``: the same server (``create_app``: guards, dispatch, batcher, codec,
  metrics) in which every variant's compiled code is replaced by the profile's eager module
  (``loader.model.open_package`` patched in the server process only; ``--eager-server``). ResNet-50's
  factory makes random weights, so its eager outputs differ from the artifact's; its cost does not.
  HTTP only;
- ``triton``: the artifact exported with ``precompile export triton`` (``export_triton``: its
  config.pbtxt's dynamic batcher, queue delay ``--max-delay-ms``, ``--triton-instances`` instances,
  the Python-backend model.py calling ``loader.load()``), served by the real ``tritonserver`` that
  ``make triton`` unpacks into ``.triton/`` (skipped, with a line saying so, without it).

The precompile and eager servers get the environment ``precompile serve`` sets (``loader.threads.wait_env``,
``OMP_NUM_THREADS``); Triton's model.py sets the same for each instance.

The load generator is this script: closed-loop clients (each sends its next request when the last
answer arrived), ``--concurrency`` of them, as asyncio tasks with one connection each, spread over
``--client-procs`` processes, sending pre-encoded requests: over HTTP/1.1 keep-alive, the Open
Inference Protocol's binary tensors (no JSON encoding of tensors on either side); over gRPC, a
KServe v2 ``ModelInferRequest`` with raw input contents (built with tritonclient's generated
``service_pb2``, serialized once) on a ``grpc.aio`` channel of its own per client, answers kept as
bytes. Both servers speak both the same way. Each level is bounded by ``--requests`` and
``--seconds``, after a short warm-up. Batch sizes come from our server's ``/metrics``
(``precompile_batch_size``) or Triton's statistics extension (``/v2/models/NAME/stats``) before and
after each level; the load generator's own CPU use is ``getrusage`` of its processes over the level's
wall time, the server's from /proc (its child processes, Triton's backend stubs, included).
Clients and server share the machine: read the client CPU column before the others.

Writes ``--out`` (default bench/results/serve_load.json) and prints one table per case.
"""

from __future__ import annotations

import argparse
import asyncio
import functools
import json
import multiprocessing as mp
import os
import re
import resource
import shutil
import signal
import socket
import statistics
import subprocess
import sys
import time
import urllib.request
from array import array
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from loader.constants import OIP_DATATYPES
from loader.threads import wait_env

ROOT = Path(__file__).resolve().parent.parent
PROFILES = ROOT / "profiles" / "bench"
CASES = {  # the request every client sends: MiniLM's short sentence, ResNet-50's larger camera size
    "minilm": {"batch": 1, "seq": 16},
    "resnet50": {"batch": 1, "height": 128, "width": 128},
}
ARRAY_CODES = {"int64": "q", "int32": "i", "int16": "h", "int8": "b", "uint8": "B", "float32": "f", "float64": "d"}
DATATYPES = OIP_DATATYPES
HEADER_LENGTH = "Inference-Header-Content-Length"
MODEL_INFER = "/inference.GRPCInferenceService/ModelInfer"  # KServe v2, as Triton and precompile serve it
SERVERS = ("precompile", "precompile --batch", "eager", "eager --batch", "triton")
TRITON = ROOT / ".triton"  # scripts/fetch-triton (make triton)
TRITON_SERVER = TRITON / "pytriton" / "tritonserver"


# --- the request -------------------------------------------------------------------------------


def request_tensors(manifest: dict, sizes: dict[str, int]) -> list[tuple[str, list[int], str, bytes]]:
    """Each input's name, shape, Open Inference Protocol datatype and raw bytes: integer inputs
    within their value range, masks all true, floats small and varied."""
    tensors = []
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
        tensors.append((spec["name"], shape, DATATYPES[dtype], data))
    return tensors


def infer_request(manifest: dict, sizes: dict[str, int], port: int) -> bytes:
    """One complete HTTP/1.1 POST of /v2/models/<name>/infer with binary tensors, binary outputs asked for."""
    tensors = request_tensors(manifest, sizes)
    header: dict = {
        "inputs": [
            {"name": name, "shape": shape, "datatype": datatype, "parameters": {"binary_data_size": len(data)}}
            for name, shape, datatype, data in tensors
        ],
        "parameters": {"binary_data_output": True},
    }
    head = json.dumps(header).encode()
    body = head + b"".join(data for *_, data in tensors)
    return (
        f"POST /v2/models/{manifest['name']}/infer HTTP/1.1\r\nHost: 127.0.0.1:{port}\r\n"
        f"Content-Type: application/octet-stream\r\n{HEADER_LENGTH}: {len(head)}\r\nContent-Length: {len(body)}\r\n\r\n"
    ).encode() + body


def grpc_infer_request(manifest: dict, sizes: dict[str, int]) -> bytes:
    """The same call as a serialized KServe v2 ``ModelInferRequest``, the tensors as raw input contents."""
    from tritonclient.grpc import service_pb2

    tensors = request_tensors(manifest, sizes)
    request = service_pb2.ModelInferRequest(model_name=manifest["name"])
    for name, shape, datatype, data in tensors:
        request.inputs.add(name=name, datatype=datatype, shape=shape)
        request.raw_input_contents.append(data)
    return request.SerializeToString()


# --- the load generator ------------------------------------------------------------------------


async def _read_response(reader: asyncio.StreamReader) -> int:
    head = await reader.readuntil(b"\r\n\r\n")
    status = int(head.split(b" ", 2)[1])
    length = re.search(rb"(?i)\r\ncontent-length: *(\d+)", head)
    await reader.readexactly(int(length.group(1)) if length else 0)
    return status


async def _http_caller(port: int, request: bytes):
    """A call over one keep-alive HTTP/1.1 connection: True when answered 200."""
    reader, writer = await asyncio.open_connection("127.0.0.1", port)

    async def call() -> bool:
        writer.write(request)
        return await _read_response(reader) == 200

    async def close() -> None:
        writer.close()

    return call, close


async def _grpc_caller(port: int, request: bytes):
    """A ModelInfer call on a gRPC channel of its own (its own HTTP/2 connection: a local subchannel
    pool), the request sent and the answer kept as bytes: True when answered OK."""
    import grpc

    channel = grpc.aio.insecure_channel(
        f"127.0.0.1:{port}",
        options=[
            ("grpc.use_local_subchannel_pool", 1),
            ("grpc.max_send_message_length", 256 << 20),
            ("grpc.max_receive_message_length", 256 << 20),
        ],
    )
    infer = channel.unary_unary(MODEL_INFER)  # no (de)serializers: bytes in, bytes out

    async def call() -> bool:
        try:
            await infer(request)
        except grpc.aio.AioRpcError:
            return False
        return True

    return call, channel.close


CALLERS = {"http": _http_caller, "grpc": _grpc_caller}


async def _clients(
    protocol: str, port: int, request: bytes, tasks: int, budget: int, seconds: float, warmup: int, sync
) -> dict:
    """``tasks`` closed-loop clients: each connects and sends its ``warmup`` requests; once all of
    them have been answered, the process says so (``sync.ready``) and every client starts at the
    time the parent gives once every process has (``sync.go``, ``sync.start``), for ``seconds``."""
    latencies: list[float] = []
    errors = [0]
    left = [budget]
    warmed, all_warm, started = [0], asyncio.Event(), asyncio.Event()
    window = [0.0, 0.0]  # start, stop

    async def one() -> None:
        call, close = await CALLERS[protocol](port, request)
        try:
            for _ in range(warmup):
                await call()
            warmed[0] += 1
            if warmed[0] == tasks:
                all_warm.set()
            await started.wait()
            while left[0] > 0 and time.time() < window[1]:
                left[0] -= 1
                t0 = time.perf_counter()
                ok = await call()
                latencies.append(time.perf_counter() - t0)
                if not ok:
                    errors[0] += 1
        finally:
            await close()

    running = asyncio.ensure_future(asyncio.gather(*(one() for _ in range(tasks))))
    warm = asyncio.ensure_future(all_warm.wait())
    await asyncio.wait([running, warm], return_when=asyncio.FIRST_COMPLETED)
    if running.done():  # a client failed before every one was warm
        warm.cancel()
        running.result()
    sync.ready.put(1)
    await asyncio.get_running_loop().run_in_executor(None, sync.go.wait)
    window[:] = [sync.start.value, sync.start.value + seconds]
    await asyncio.sleep(max(0.0, window[0] - time.time()))
    cpu0 = _own_cpu()
    started.set()
    await running
    return {"latencies": latencies, "errors": errors[0], "cpu_s": _own_cpu() - cpu0, "end": time.time()}


def _own_cpu() -> float:
    r = resource.getrusage(resource.RUSAGE_SELF)
    return r.ru_utime + r.ru_stime


@dataclass
class LevelSync:
    """How one level's client processes start together: each says it is warm (``ready``), then
    waits for ``go``, then starts at ``start`` (epoch seconds)."""

    ready: Any
    go: Any
    start: Any


def client_process(
    protocol: str, port: int, request: bytes, tasks: int, budget: int, seconds: float, warmup: int, sync, out
) -> None:
    try:
        out.put(asyncio.run(_clients(protocol, port, request, tasks, budget, seconds, warmup, sync)))
    except Exception as e:  # noqa: BLE001 -- said to the parent, which stops the level
        sync.ready.put(0)
        out.put({"failed": f"{type(e).__name__}: {e}"})


def run_level(
    protocol: str,
    port: int,
    server_pid: int,
    request: bytes,
    concurrency: int,
    procs: int,
    requests: int,
    seconds: float,
    warmup: int,
) -> dict:
    """``concurrency`` closed-loop clients over ``protocol`` for at most ``requests`` requests and
    ``seconds`` seconds."""
    procs = max(1, min(procs, concurrency))
    ctx = mp.get_context("spawn")
    out = ctx.Queue()
    # The timed window starts once every client's warm-up requests have been answered: a fixed start
    # (2 s after spawning, until 2026-12-07) fell inside the warm-up at 64 clients of ResNet-50 (192
    # requests, 3.4 s of the server's time), and the window counted that work as no requests.
    sync = LevelSync(ctx.Queue(), ctx.Event(), ctx.Value("d", 0.0))
    shares = [concurrency // procs + (1 if k < concurrency % procs else 0) for k in range(procs)]
    workers = [
        ctx.Process(
            target=client_process,
            args=(protocol, port, request, n, max(1, requests * n // concurrency), seconds, warmup, sync, out),
        )
        for n in shares
    ]
    for w in workers:
        w.start()
    warm = [sync.ready.get(timeout=300) for _ in workers]
    sync.start.value = start_at = time.time() + 0.2  # the processes read it and sleep until then
    sync.go.set()
    time.sleep(max(0.0, start_at - time.time()))
    server0 = process_cpu(server_pid)
    results = [out.get(timeout=seconds + 120) for _ in workers]
    server1 = process_cpu(server_pid)
    for w in workers:
        w.join()
    failed = [r["failed"] for r in results if "failed" in r]
    if failed or not all(warm):
        raise RuntimeError(f"{protocol} at {concurrency} clients: a load generator failed: {'; '.join(failed)}")
    latencies = sorted(x for r in results for x in r["latencies"])
    wall = max(r["end"] for r in results) - start_at
    done = len(latencies)
    return {
        "protocol": protocol,
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


@dataclass
class Server:
    """A server under test: its process, its ports (``grpc`` None: not over gRPC) and what it serves."""

    kind: str  # precompile, eager, triton
    batching: bool
    process: subprocess.Popen
    http: int
    grpc: int | None
    workers: int  # precompile's --workers, Triton's instances
    log: Path

    @property
    def base(self) -> str:
        return f"http://127.0.0.1:{self.http}"

    @property
    def label(self) -> str:
        return self.kind + (" --batch" if self.batching and self.kind != "triton" else "")

    def port(self, protocol: str) -> int | None:
        return self.http if protocol == "http" else self.grpc


def start_server(
    kind: str, batching: bool, artifact: Path, profile: Path | None, protocols: list[str], work: Path, args
) -> Server | None:
    """Start one server on free loopback ports; None (with a line saying why) when it cannot run here."""
    from precompile.serve.server import serving_env

    http, grpc = free_port(), None
    log = work / f"{kind}{'-batch' if batching else ''}.log"
    workers = args.workers if kind == "precompile" else 1  # the eager server is one process
    env = {**{k: v for k, v in os.environ.items() if k != "PYTHONPATH"}, **serving_env(workers)}
    batch_args = ["--batch", "--max-delay-ms", str(args.max_delay_ms)] if batching else []
    if batching and args.max_batch:
        batch_args += ["--max-batch", str(args.max_batch)]
    instance_args = ["--instances", str(args.instances)] if args.instances else []
    instance_args += ["--runtime", args.runtime] if args.runtime else []
    if kind == "precompile":
        if "grpc" in protocols:
            if serves_grpc():
                grpc = free_port()
            else:
                print("  precompile: gRPC rows skipped: `precompile serve` has no --grpc-port here", flush=True)
        command = [
            sys.executable, "-m", "precompile", "serve", str(artifact),
            "--port", str(http), "--log-level", "warning", "--workers", str(workers),
            *(["--grpc-port", str(grpc)] if grpc is not None else []),
            *batch_args, *instance_args,
        ]  # fmt: skip
    elif kind == "eager":
        if profile is None:
            raise SystemExit("eager: needs --profile (the profile the artifact was built from)")
        if "grpc" in protocols:
            print("  eager: gRPC rows skipped: the eager server is create_app under uvicorn, HTTP only", flush=True)
        command = [
            sys.executable, "-m", "bench.serve_load", "--eager-server", str(artifact),
            "--profile", str(profile), "--port", str(http), "--serve-args", " ".join(batch_args),
        ]  # fmt: skip
    else:
        if not (TRITON_SERVER / "bin" / "tritonserver").is_file():
            print(f"  triton: skipped: no tritonserver in {TRITON} (run `make triton`)", flush=True)
            return None
        grpc, workers = free_port(), args.triton_instances
        command, env = triton_command(artifact, work / "triton-repo", http, grpc, args)
    if "http" not in protocols and grpc is None:
        return None  # nothing to measure it over
    with open(log, "wb") as out:
        process = subprocess.Popen(
            command, cwd=ROOT, env=env, stdout=out, stderr=subprocess.STDOUT, start_new_session=True
        )
    return Server(kind, batching, process, http, grpc, workers, log)


def triton_command(artifact: Path, repo: Path, http: int, grpc: int, args) -> tuple[list[str], dict[str, str]]:
    """Export ``artifact`` as Triton would get it (``precompile export triton --link``, the queue
    delay ``--max-delay-ms``) into ``repo`` (replaced), and the tritonserver command serving it."""
    from precompile.ship.triton import export_triton, tritonserver_command

    shutil.rmtree(repo, ignore_errors=True)
    (model,) = export_triton(
        [artifact],
        repo,
        link=True,
        instances=args.triton_instances,
        max_queue_delay_us=round(args.max_delay_ms * 1000),
    )
    if not model.config.max_batch_size:
        print(f"  triton: not batched by Triton ({model.config.unbatched})", flush=True)
    return tritonserver_command(
        repo,
        server=TRITON_SERVER,
        stub_site=TRITON / "stub-site",
        http_port=http,
        grpc_port=grpc,
        options=["--allow-metrics", "false", "--exit-timeout-secs", "10"],
    )


@functools.cache
def serves_grpc() -> bool:
    """Whether this checkout's `precompile serve` takes --grpc-port (the KServe v2 gRPC service)."""
    result = subprocess.run(
        [sys.executable, "-m", "precompile", "serve", "--help"], cwd=ROOT, capture_output=True, text=True, timeout=120
    )
    return "--grpc-port" in result.stdout


def wait_ready(server: Server, timeout: float = 600) -> None:
    path = "/v2/health/ready" if server.kind == "triton" else "/readyz"
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if server.process.poll() is not None:
            tail = server.log.read_text(errors="replace")[-2000:]
            raise SystemExit(f"{server.label}: the server exited ({server.process.returncode}): {tail}")
        try:
            with urllib.request.urlopen(f"{server.base}{path}", timeout=5) as r:
                if r.status == 200:
                    return
        except OSError:
            pass
        time.sleep(0.2)
    raise SystemExit(f"{server.label}: {server.base} not ready after {timeout:.0f} s (log: {server.log})")


def stop_server(server: Server | subprocess.Popen) -> None:
    """SIGTERM, then the whole process group (workers, Triton's backend stubs) if it does not stop
    (a bench Server, or a server process other benches started: coldstart_native, repository_rss)."""
    process = server.process if isinstance(server, Server) else server
    process.send_signal(signal.SIGTERM)
    try:
        process.wait(timeout=60)
    except subprocess.TimeoutExpired:
        os.killpg(process.pid, signal.SIGKILL)
        process.wait()


def batch_counts(server: Server, model: str) -> dict[str, float]:
    return triton_stats(server.base, model) if server.kind == "triton" else scrape(server.base)


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
    """CPU seconds spent so far by the threads of a process and of its live children (``--workers``:
    uvicorn's worker processes; Triton: its Python backend's stub), from /proc (Linux). Summed from
    each thread's ``schedstat`` (nanoseconds), not from ``stat``'s clock ticks: a short level runs
    for tens of milliseconds, a few ticks of 10 ms. A thread that exits takes its time with it, so the
    difference of two readings undercounts a server that starts and stops threads per request (ours
    and Triton's keep theirs)."""

    def parent(p: str) -> int:
        return int(Path(f"/proc/{p}/stat").read_text().rsplit(")", 1)[1].split()[1])

    def threads_ns(p: int | str) -> int:
        total = 0
        for task in Path(f"/proc/{p}/task").iterdir():
            try:
                total += int((task / "schedstat").read_text().split()[0])
            except (OSError, ValueError, IndexError):
                continue  # the thread exited meanwhile
        return total

    try:
        total = threads_ns(pid)
    except OSError:
        return None
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                if parent(entry.name) == pid:
                    total += threads_ns(entry.name)
            except (OSError, ValueError, IndexError):
                continue
    return total / 1e9


def triton_stats(base: str, model: str) -> dict[str, float]:
    """Triton's statistics extension for ``model``: inferences and executions (batches), and the
    executions per batch size (``size=N``), its versions added up."""
    with urllib.request.urlopen(f"{base}/v2/models/{model}/stats", timeout=10) as r:
        versions = json.loads(r.read())["model_stats"]
    out: dict[str, float] = {
        "triton_inference_count": sum(v["inference_count"] for v in versions),
        "triton_execution_count": sum(v["execution_count"] for v in versions),
    }
    for v in versions:
        for b in v["batch_stats"]:
            key = f"size={b['batch_size']}"
            out[key] = out.get(key, 0) + b["compute_infer"]["count"]
    return out


def triton_batches_between(before: dict, after: dict) -> dict:
    count = after["triton_execution_count"] - before["triton_execution_count"]
    rows = after["triton_inference_count"] - before["triton_inference_count"]
    sizes = {
        f"={k[5:]}": int(after[k] - before.get(k, 0))
        for k in sorted(after, key=lambda k: int(k[5:]) if k.startswith("size=") else 0)
        if k.startswith("size=") and after[k] - before.get(k, 0)
    }
    return {"batches": int(count), "mean_batch": rows / count if count else None, "batch_sizes": sizes}


def batches_between(before: dict, after: dict, batching: bool) -> dict:
    if "triton_execution_count" in after:
        return triton_batches_between(before, after)
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
    kind: str,
    batching: bool,
    artifact: Path,
    profile: Path | None,
    manifest: dict,
    sizes: dict,
    protocols: list[str],
    work: Path,
    args,
) -> list[dict]:
    """One server, every protocol it speaks here and every concurrency level: a row each."""
    server = start_server(kind, batching, artifact, profile, protocols, work, args)
    if server is None:
        return []
    rows = []
    try:
        wait_ready(server)
        for protocol in protocols:
            port = server.port(protocol)
            if port is None:
                continue
            request = (
                infer_request(manifest, sizes, port) if protocol == "http" else grpc_infer_request(manifest, sizes)
            )
            for c in args.concurrency:
                for repeat in range(args.repeat):
                    before = batch_counts(server, manifest["name"])
                    level = run_level(
                        protocol,
                        port,
                        server.process.pid,
                        request,
                        c,
                        args.client_procs,
                        args.requests,
                        args.seconds,
                        args.warmup,
                    )
                    level.update(batches_between(before, batch_counts(server, manifest["name"]), batching))
                    row = {"server": server.label, "workers": server.workers, "repeat": repeat, **level}
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
        f"  {r['server']:<20} {r['protocol']:<5} {r['concurrency']:>4} {r['rps']:>8.1f} {p50:>8} {p99:>8} {batch:>6} "
        f"{client:>7} {server:>7} {r['requests']:>7} {r['errors']:>4}"
    )


HEADER = (
    f"  {'server':<20} {'proto':<5} {'conc':>4} {'req/s':>8} {'p50 ms':>8} {'p99 ms':>8} {'batch':>6} "
    f"{'client':>7} {'server':>7} {'reqs':>7} {'err':>4}"
)


def build_case(case: str, work: Path) -> tuple[Path, Path]:
    from precompile.pipeline import build

    profile = PROFILES / f"{case}.yaml"
    out = work / case / "artifact"
    if not (out / "manifest.json").is_file():
        print(f"[{case}] building {profile.relative_to(ROOT)} -> {out}", flush=True)
        build(profile, out)
    return out, profile


def target_line(rows: list[dict]) -> str | None:
    """Issue 14's target for short MiniLM requests (over HTTP): at 16 clients, batching ≥ 3× the
    unbatched requests/s, with p99 no worse than 2× the unbatched p99 at concurrency 1."""
    by = {(r["server"], r["concurrency"]): r for r in rows if r["protocol"] == "http"}
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


def peer_lines(rows: list[dict]) -> list[str]:
    """Issue 24's target, per protocol: at 16 clients ``precompile --batch`` serves at least 3× the
    unbatched single-client rate, and at least what Triton's dynamic batcher serves in the same run."""
    by = {(r["server"], r["protocol"], r["concurrency"]): r for r in rows}
    lines = []
    for protocol in dict.fromkeys(r["protocol"] for r in rows):
        batched16, plain1 = by.get(("precompile --batch", protocol, 16)), by.get(("precompile", protocol, 1))
        triton16 = by.get(("triton", protocol, 16))
        if not batched16 or not (plain1 or triton16):
            continue
        parts, met = [], True
        if plain1 and plain1["rps"]:
            parts.append(f"{batched16['rps'] / plain1['rps']:.2f}× the unbatched single-client req/s (want ≥ 3×)")
            met &= batched16["rps"] >= 3 * plain1["rps"]
        if triton16 and triton16["rps"]:
            parts.append(f"{batched16['rps'] / triton16['rps']:.2f}× Triton's dynamic batcher (want ≥ 1×)")
            met &= batched16["rps"] >= triton16["rps"]
        if parts:
            lines.append(
                f"target ({protocol}): with 16 clients --batch serves {' and '.join(parts)}: {'met' if met else 'NOT met'}"
            )
    return lines


def spread_lines(rows: list[dict]) -> list[str]:
    """Per server, protocol and concurrency measured more than once (``--repeat``): the req/s of
    each repeat, and their spread, (max - min) / median: whether a figure holds run after run (issue
    24: two workers at 16 clients)."""
    groups: dict[tuple, list[float]] = {}
    for r in rows:
        groups.setdefault((r["server"], r["workers"], r["protocol"], r["concurrency"]), []).append(r["rps"])
    lines = []
    for (server, workers, protocol, concurrency), rates in groups.items():
        if len(rates) < 2:
            continue
        median = statistics.median(rates)
        spread = (max(rates) - min(rates)) / median if median else float("inf")
        lines.append(
            f"spread: {server} --workers {workers} {protocol} at {concurrency} clients, {len(rates)} repeats: "
            f"{', '.join(f'{x:.1f}' for x in rates)} req/s, median {median:.1f}, spread {spread:.1%}"
        )
    return lines


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
    parser.add_argument("--instances", type=int, help="precompile serve --instances (default: the server's)")
    parser.add_argument(
        "--runtime",
        choices=["auto", "native", "torch"],
        help="precompile serve --runtime (default: the server's, auto); the eager server and Triton's backend run torch",
    )
    parser.add_argument(
        "--repeat", type=int, default=1, help="measure each level this many times in a row (the spread is printed)"
    )
    parser.add_argument(
        "--servers",
        nargs="+",
        choices=SERVERS,
        default=list(SERVERS),
        help="the servers to measure, one after the other",
    )
    parser.add_argument(
        "--protocol",
        nargs="+",
        choices=["http", "grpc"],
        default=["http", "grpc"],
        help="what the clients speak (each server is measured over each it serves)",
    )
    parser.add_argument(
        "--triton-instances", type=int, default=1, help="Triton model instances (precompile export triton --instances)"
    )
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
    os.environ.update(wait_env())  # serve's OpenMP settings, unless set (the Triton export loads the artifact here)
    if args.eager_server:
        eager_server(args.eager_server, str(args.profile), args.port, args.serve_args)
        return
    if args.smoke:
        args.concurrency, args.seconds, args.requests, args.warmup = [1, 4], 2.0, 400, 1
    if args.artifact is not None and args.shape is None:
        parser.error("--artifact needs --shape")
    if args.artifact is not None and args.profile is None and any(s.startswith("eager") for s in args.servers):
        parser.error("--artifact with an eager server needs --profile (the profile the artifact was built from)")

    cases = (
        [(json.loads((args.artifact / "manifest.json").read_text())["name"], args.artifact, args.profile)]
        if args.artifact
        else [(c, *build_case(c, args.work)) for c in args.case]
    )
    report = {
        "machine": {"cores": os.cpu_count(), "platform": sys.platform, "python": sys.version.split()[0]},
        "load_generator": "bench/serve_load.py: closed-loop asyncio clients, one connection each: HTTP/1.1 keep-alive "
        "with OIP binary tensors, or a grpc.aio channel with a pre-serialized ModelInferRequest (raw contents)",
        "settings": {
            k: v
            for k, v in vars(args).items()
            if k
            in (
                "concurrency",
                "requests",
                "seconds",
                "warmup",
                "client_procs",
                "max_delay_ms",
                "max_batch",
                "workers",
                "instances",
                "runtime",
                "repeat",
                "protocol",
                "triton_instances",
            )
        },
        "cases": {},
    }
    for name, artifact, profile in cases:
        manifest = json.loads((artifact / "manifest.json").read_text())
        sizes = dict(kv.split("=") for kv in args.shape.split(",")) if args.shape else CASES[name]
        sizes = {d: int(n) for d, n in sizes.items()}
        print(f"[{name}] {artifact}: request {sizes}, {os.cpu_count()} cores; client/server: cores used")
        print(HEADER)
        work = args.work / name
        work.mkdir(parents=True, exist_ok=True)
        rows = []
        for server in args.servers:
            kind, batching = server.split()[0], server.endswith("--batch") or server == "triton"
            rows += run_server(kind, batching, artifact, profile, manifest, sizes, args.protocol, work, args)
        line = target_line(rows)
        peers = peer_lines(rows)
        spreads = spread_lines(rows)
        for text in filter(None, [line, *peers, *spreads]):
            print(f"  {text}")
        report["cases"][name] = {
            "artifact": str(artifact),
            "request": sizes,
            "rows": rows,
            "target": line,
            "peer_targets": peers,
            "spreads": spreads,
        }
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(report, indent=2) + "\n")
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
