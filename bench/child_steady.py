"""One steady-state server: one serving method in its own process, driven by ``bench.steady``.

    python -m bench.child_steady METHOD SPEC.json OUT.json

Methods:
    eager               the module as it is, every request at its own shape
    compile             torch.compile(dynamic=True), warmed up first
    buckets-eager       hand bucketing: pad each request up to a fixed bucket, eager module
    buckets-compile     hand bucketing with one compiled graph per bucket (torch.compile, static
                        shapes), every bucket compiled before traffic
    precompile-dynamic  loader.load() of the artifact built with a dynamic-only plan
    precompile-planned  loader.load() of the artifact built with the profile's plan
    onnxruntime         ONNX Runtime on the ONNX file written at prepare time (``bench.peers``)
    openvino            OpenVINO on the same file, its default precision
    openvino-f32        OpenVINO with the f32 precision hint

The process sets up, runs the warm-up requests and says ``{"ready": ...}`` on stdout; then, for each
``{"run": [i, j]}`` line on stdin, it serves requests i..j-1 of the stream and answers ``{"done": j}``;
``{"finish": true}`` writes OUT.json (latencies, setup time, RSS, errors against eager's references)
and exits. The parent interleaves the methods chunk by chunk, so a noisy neighbour hits them alike.
Inputs are made outside the timed region. Anything else written to stdout goes to stderr.
"""

from __future__ import annotations

import json
import os
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from bench.peers import METHODS as PEERS

METHODS = ("eager", "compile", "buckets-eager", "buckets-compile", "precompile-dynamic", "precompile-planned", *PEERS)

Serve = Callable[[tuple, dict], Any]


def memory_mb() -> dict[str, float]:
    """Resident memory now and its high-water mark, from /proc (Linux). Not ru_maxrss: Linux keeps
    that across exec, so a child would report its parent's peak."""
    out = {"rss_mb": 0.0, "peak_rss_mb": 0.0}
    try:
        with open("/proc/self/status", encoding="ascii") as f:
            for line in f:
                if line.startswith("VmRSS:"):
                    out["rss_mb"] = int(line.split()[1]) / 1024
                elif line.startswith("VmHWM:"):
                    out["peak_rss_mb"] = int(line.split()[1]) / 1024
    except OSError:
        pass
    return out


def setup(method: str, spec: dict, profile) -> tuple[Serve, dict]:
    """The callable serving one request for ``method``, ready for traffic; and facts about it."""
    import torch

    from bench.child_cold import build_module
    from bench.peers import serve_torch
    from bench.workload import all_buckets, bucket_for, cut, inputs_for, pad

    if method in PEERS:
        return serve_torch(method, spec)
    if method.startswith("precompile-"):
        import loader

        model = loader.load(spec["artifacts"][method], open="eager")  # warmed whole before it returns
        model.warmup()
        return (lambda args, sizes: model(*args)), {"variants": [v.id for v in model.variants], "model": model}
    module = build_module(spec)
    if method == "eager":
        return (lambda args, sizes: module(*args)), {}
    if method == "compile":
        compiled = torch.compile(module, dynamic=True)
        return (lambda args, sizes: compiled(*args)), {}
    buckets = {d: tuple(b) for d, b in spec["buckets"].items()}
    dims = list(profile.dims)
    shapes = all_buckets(buckets, dims, {d: profile.dims[d].max for d in dims})
    run = module
    if method == "buckets-compile":
        # One graph per bucket: static shapes, so the recompile limit must allow one per bucket.
        torch._dynamo.config.recompile_limit = max(torch._dynamo.config.recompile_limit, len(shapes) + 1)
        run = torch.compile(module, dynamic=False)
        for i, sizes in enumerate(shapes):
            run(*inputs_for(profile, sizes, seed=i))

    def serve(args: tuple, sizes: dict) -> Any:
        return cut(profile, run(*pad(profile, args, bucket_for(sizes, buckets))), sizes)

    return serve, {"buckets": len(shapes)}


def main(argv: list[str]) -> None:
    method, spec_path, out_path = argv
    if method not in METHODS:
        raise SystemExit(f"unknown method {method!r} (methods: {', '.join(METHODS)})")
    # The protocol keeps the real stdout; prints from libraries (Python or C) go to stderr.
    protocol = os.fdopen(os.dup(1), "w", buffering=1)
    os.dup2(2, 1)
    sys.stdout = sys.stderr

    spec = json.loads(Path(spec_path).read_text(encoding="utf-8"))
    import torch
    from safetensors.torch import load_file

    from bench.workload import abs_error, inputs_for, read_profile, relative_error

    profile = read_profile(Path(spec["profile"]))
    references = load_file(spec["references"])
    requests = spec["requests"]
    base = memory_mb()["rss_mb"]
    latencies: list[float] = []
    errors: list[float] = []
    abs_errors: list[float] = []
    with torch.inference_mode():
        start = time.perf_counter()
        serve, facts = setup(method, spec, profile)
        setup_s = time.perf_counter() - start
        for i, sizes in enumerate(spec["warmup"]):
            serve(inputs_for(profile, sizes, seed=10_000 + i), sizes)
        ready_s = time.perf_counter() - start
        model = facts.pop("model", None)
        if model is not None:
            model.reset_stats()
        protocol.write(json.dumps({"ready": ready_s}) + "\n")
        for line in sys.stdin:
            command = json.loads(line)
            if "finish" in command:
                break
            first, last = command["run"]
            for i in range(first, last):
                sizes = requests[i]
                args = inputs_for(profile, sizes, seed=i)
                t = time.perf_counter()
                out = serve(args, sizes)
                latencies.append(round((time.perf_counter() - t) * 1000, 4))
                if f"ref/{i}" in references:
                    errors.append(relative_error(out, references[f"ref/{i}"]))
                    abs_errors.append(abs_error(out, references[f"ref/{i}"]))
            protocol.write(json.dumps({"done": last}) + "\n")
    result = {
        "method": method,
        "latency_ms": latencies,
        "setup_s": setup_s,
        "ready_s": ready_s,
        "rss_base_mb": base,
        **memory_mb(),
        "max_error": max(errors) if errors else None,
        "max_abs_error": max(abs_errors) if abs_errors else None,
        "threads": torch.get_num_threads(),
        **facts,  # a peer's own thread count replaces torch's
    }
    if model is not None:
        result["calls_per_variant"] = {v: s["calls"] for v, s in model.stats()["variants"].items()}
    Path(out_path).write_text(json.dumps(result), encoding="utf-8")


if __name__ == "__main__":
    main(sys.argv[1:])
