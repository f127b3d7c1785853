"""One artifact behind three engines: requests/s of `precompile serve --batch`, the KServe runtime
(kserve's ModelServer, precompile/integrations/kserve.py) and the Ray Serve deployment
(precompile/integrations/rayserve.py, on a local cluster: tests/ray_cluster.py), 16 clients each.

    python -m bench.engines ARTIFACT [--seconds 10] [--clients 16] [--out bench/results/engines.json]

Each server is started on loopback, warmed up, then driven by ``--clients`` closed-loop clients (each
sends its next request when the last answer arrived: asyncio tasks in this process, one keep-alive
HTTP/1.1 connection each) for ``--seconds`` seconds, then stopped. Every engine gets the same JSON
Open Inference Protocol request (one call of ``--shape``, JSON tensors: the one encoding all three
accept) on its own route; answers other than 200 are counted as errors. The load average and CPU model
are recorded beside each row: clients and servers share the machine.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import os
import platform
import re
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))  # the tests' Ray cluster and process helpers


def request_body(manifest: dict, sizes: dict[str, int]) -> bytes:
    from loader.constants import OIP_DATATYPES

    inputs = []
    for spec in manifest["inputs"]:
        shape = [sizes[s] if isinstance(s, str) else s for s in spec["shape"]]
        n = math.prod(shape)
        if spec["dtype"] == "bool":
            data: list = [True] * n
        else:
            lo, hi = spec.get("range", [0, 9])
            data = [lo + (i * 7) % (hi - lo + 1) for i in range(n)]
        inputs.append({"name": spec["name"], "shape": shape, "datatype": OIP_DATATYPES[spec["dtype"]], "data": data})
    return json.dumps({"inputs": inputs}).encode()


async def _client(host: str, port: int, request: bytes, stop_at: float, latencies: list, errors: list) -> None:
    reader, writer = await asyncio.open_connection(host, port)
    try:
        while time.monotonic() < stop_at:
            t0 = time.perf_counter()
            writer.write(request)
            head = await reader.readuntil(b"\r\n\r\n")
            length = re.search(rb"(?i)\r\ncontent-length: *(\d+)", head)
            await reader.readexactly(int(length.group(1)) if length else 0)
            latencies.append(time.perf_counter() - t0)
            if int(head.split(b" ", 2)[1]) != 200:
                errors.append(head[:200])
    finally:
        writer.close()


def drive(host: str, port: int, path: str, body: bytes, clients: int, seconds: float) -> dict[str, Any]:
    request = (
        f"POST {path} HTTP/1.1\r\nHost: {host}:{port}\r\nContent-Type: application/json\r\n"
        f"Content-Length: {len(body)}\r\n\r\n"
    ).encode() + body

    async def run() -> tuple[list, list, float]:
        latencies: list[float] = []
        errors: list[bytes] = []
        await asyncio.gather(*(_client(host, port, request, time.monotonic() + 2, [], errors) for _ in range(clients)))
        errors.clear()  # the warm-up's
        begin = time.monotonic()
        await asyncio.gather(
            *(_client(host, port, request, begin + seconds, latencies, errors) for _ in range(clients))
        )
        return latencies, errors, time.monotonic() - begin

    load_before = os.getloadavg()[0]
    latencies, errors, wall = asyncio.run(run())
    latencies.sort()
    n = len(latencies)
    return {
        "requests": n,
        "errors": len(errors),
        "wall_s": round(wall, 2),
        "rps": round(n / wall, 1),
        "p50_ms": round(statistics.median(latencies) * 1000, 2) if n else None,
        "p99_ms": round(latencies[min(n - 1, int(n * 0.99))] * 1000, 2) if n else None,
        "load_1m_before": load_before,
        "load_1m_after": os.getloadavg()[0],
    }


def _server(args: list[str], log: Path, env: dict | None = None) -> subprocess.Popen:
    out = open(log, "wb")
    return subprocess.Popen(args, stdout=out, stderr=subprocess.STDOUT, start_new_session=True, env=env, cwd=ROOT)


def bench_precompile(artifact: Path, body: bytes, opts, work: Path) -> dict:
    from tests.ray_cluster import free_port, stop_group, wait_http_ready

    port = free_port()
    cli = Path(sys.executable).with_name("precompile")
    process = _server([str(cli), "serve", str(artifact), "--port", str(port), "--batch"], work / "precompile.log")
    try:
        wait_http_ready(
            f"http://127.0.0.1:{port}/readyz", process, work / "precompile.log", "precompile serve", timeout=300
        )
        name = json.loads((artifact / "manifest.json").read_text())["name"]
        return drive("127.0.0.1", port, f"/v2/models/{name}/infer", body, opts.clients, opts.seconds)
    finally:
        stop_group(process, grace=10)


def bench_kserve(artifact: Path, body: bytes, opts, work: Path) -> dict:
    from tests.ray_cluster import free_port, stop_group, wait_http_ready

    port, grpc = free_port(), free_port()
    args = [sys.executable, "-m", "precompile.integrations.kserve", "--model_name=model", f"--model_dir={artifact}"]
    process = _server([*args, f"--http_port={port}", f"--grpc_port={grpc}"], work / "kserve.log")
    try:
        wait_http_ready(
            f"http://127.0.0.1:{port}/v2/models/model/ready", process, work / "kserve.log", "kserve", timeout=300
        )
        return drive("127.0.0.1", port, "/v2/models/model/infer", body, opts.clients, opts.seconds)
    finally:
        stop_group(process, grace=10)


def bench_rayserve(artifact: Path, body: bytes, opts, work: Path) -> dict:
    import ray
    from ray import serve

    from precompile.integrations.rayserve import app
    from tests.ray_cluster import LocalRayCluster, free_port

    with LocalRayCluster(work / "ray", nodes=opts.ray_nodes, cpus=opts.ray_node_cpus) as address:
        ray.init(address=address, log_to_driver=False)
        try:
            port = free_port()
            serve.start(http_options={"host": "127.0.0.2", "port": port}, proxy_location="HeadOnly")
            application = app(str(artifact), name="model", num_replicas=opts.ray_replicas, num_cpus=1, threads=1)
            serve.run(application, name="model", route_prefix="/model")
            return drive("127.0.0.2", port, "/model", body, opts.clients, opts.seconds)
        finally:
            try:
                serve.shutdown()
            finally:
                ray.shutdown()


ENGINES = {"precompile serve --batch": bench_precompile, "kserve": bench_kserve, "ray serve": bench_rayserve}


def machine() -> dict[str, Any]:
    model = next((line.split(":", 1)[1].strip() for line in open("/proc/cpuinfo") if line.startswith("model name")), "")
    return {"cpu": model, "cores": os.cpu_count(), "python": platform.python_version(), "uptime": _uptime()}


def _uptime() -> str:
    return subprocess.run(["uptime"], capture_output=True, text=True).stdout.strip()


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("artifact", type=Path)
    p.add_argument("--seconds", type=float, default=10)
    p.add_argument("--clients", type=int, default=16)
    p.add_argument("--shape", default="batch=1,seq=16")
    p.add_argument("--engines", nargs="+", default=list(ENGINES), choices=list(ENGINES))
    p.add_argument("--ray-nodes", type=int, default=3)
    p.add_argument("--ray-node-cpus", type=int, default=1)
    p.add_argument("--ray-replicas", type=int, default=2)
    p.add_argument("--out", type=Path, default=ROOT / "bench" / "results" / "engines.json")
    p.add_argument("--work", type=Path, default=Path("/tmp/precompile-bench-engines"))
    opts = p.parse_args()
    opts.work.mkdir(parents=True, exist_ok=True)
    manifest = json.loads((opts.artifact / "manifest.json").read_text())
    sizes = {k: int(v) for k, v in (kv.split("=") for kv in opts.shape.split(","))}
    body = request_body(manifest, sizes)
    rows = []
    for engine in opts.engines:
        row = {"engine": engine, "uptime_before": _uptime(), **ENGINES[engine](opts.artifact, body, opts, opts.work)}
        row["uptime_after"] = _uptime()
        print(json.dumps(row), flush=True)
        rows.append(row)
    result = {
        "machine": machine(),
        "artifact": manifest["name"],
        "shape": sizes,
        "clients": opts.clients,
        "seconds": opts.seconds,
        "rows": rows,
    }
    opts.out.write_text(json.dumps(result, indent=2) + "\n")


if __name__ == "__main__":
    main()
