"""The whole benchmark for one model: build, ONNX export, cold start, loader overhead, steady state.

``run_case`` works in a scratch folder: a copy of ``profiles/bench`` (so the profile's factory and
traffic resolve) beside a derived profile with a dynamic-only plan, the two artifacts, the ONNX file
the peers serve, the inputs and eager references the child processes compare with, and the Inductor
caches of the cold starts.
"""

from __future__ import annotations

import importlib.metadata
import json
import os
import platform
import shutil
import statistics
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import yaml
from safetensors.torch import save_file

from precompile.pipeline import build
from precompile.profile import load_profile
from precompile.progress import Progress
from precompile.stages.resolve import resolve_model

from . import coldstart, steady
from .cases import Case, Sizes
from .onnx_export import export_onnx
from .overhead import per_call_us
from .workload import distribution, draw, inputs_for, read_profile, work

CHECKED_REQUESTS = 5  # the first requests of the stream are compared with eager, in every method

Log = Callable[[str], None]


class StageTimes(Progress):
    """Keeps each build stage's seconds and logs one line per stage."""

    def __init__(self, log: Log) -> None:
        self.log = log
        self.stages: list[dict[str, Any]] = []

    def done(self, name: str, detail: str, seconds: float) -> None:
        self.stages.append({"stage": name, "detail": detail, "seconds": seconds})
        self.log(f"    {name:<8} {seconds:6.1f} s  {detail}")


def prepare(case: Case, work_dir: Path) -> tuple[Path, Path]:
    """Copy the bench profiles folder; write the dynamic-only profile beside the planned one."""
    folder = work_dir / "profiles"
    shutil.copytree(case.profile.parent, folder, ignore=shutil.ignore_patterns("__pycache__"), dirs_exist_ok=True)
    planned = folder / case.profile.name
    raw = yaml.safe_load(planned.read_text(encoding="utf-8"))
    raw["name"] = f"{raw['name']}-dynamic"
    raw["plan"] = {"max_specialized": 0}
    dynamic = folder / f"{case.profile.stem}.dynamic.yaml"
    dynamic.write_text(yaml.safe_dump(raw, sort_keys=False), encoding="utf-8")
    return planned, dynamic


def build_artifact(profile: Path, out: Path, log: Log) -> dict[str, Any]:
    """Build one artifact; its compile seconds per variant, stage times, and sizes unpacked and packed."""
    times = StageTimes(log)
    start = time.perf_counter()
    result = build(profile, out, progress=times, jobs=os.cpu_count())
    wall = time.perf_counter() - start
    unpacked = sum(f.stat().st_size for f in out.rglob("*") if f.is_file())
    return {
        "artifact": str(out),
        "wall_s": wall,
        "variants": [
            {
                "id": v.id,
                "kind": v.kind,
                "dims": {d: [r.min, r.max] for d, r in v.dims.items()},
                "compile_s": result.seconds.get(v.id),
            }
            for v in result.manifest.variants
        ],
        "stages": times.stages,
        "unpacked_bytes": unpacked,
        "weights_bytes": (out / "weights.safetensors").stat().st_size,
        **packed_size(out),
    }


def packed_size(folder: Path) -> dict[str, Any]:
    """The artifact as one file (``loader.stores.pack``: tar + zstandard, what ``precompile pack`` writes)."""
    try:
        from loader.stores.pack import write_pack
    except ImportError:
        return {"packed_bytes": None}
    target = folder.with_suffix(".tar.zst")
    start = time.perf_counter()
    try:
        with open(target, "wb") as f:
            write_pack(folder, f)
    except ImportError:  # zstandard not installed
        return {"packed_bytes": None}
    seconds = time.perf_counter() - start
    size = target.stat().st_size
    target.unlink()
    return {"packed_bytes": size, "pack_s": seconds}


def run_case(case: Case, sizes: Sizes, work_dir: Path, log: Log) -> dict[str, Any]:
    """Build, cold start, overhead and steady state for one model; everything the report needs."""
    started = mark = time.perf_counter()
    phases: dict[str, float] = {}

    def phase(name: str) -> None:
        nonlocal mark
        now = time.perf_counter()
        phases[name] = now - mark
        mark = now

    work_dir.mkdir(parents=True, exist_ok=True)
    planned_profile, dynamic_profile = prepare(case, work_dir)
    profile = read_profile(planned_profile)
    folder = planned_profile.parent

    log(f"[{case.name}] build, planned ({planned_profile.name})")
    builds = {"planned": build_artifact(planned_profile, work_dir / "planned", log)}
    log(f"[{case.name}] build, dynamic-only plan")
    builds["dynamic"] = build_artifact(dynamic_profile, work_dir / "dynamic", log)

    phase("build")

    model = resolve_model(load_profile(planned_profile)).requires_grad_(False)
    log(f"[{case.name}] ONNX export for the peers (torch.onnx.export, dynamo=True)")
    onnx = export_onnx(model, profile, work_dir / "model.onnx")
    log(
        f"    {onnx['seconds']:.1f} s  "
        + (f"FAILED: {onnx['failed']}" if "failed" in onnx else f"{onnx['bytes'] / 2**20:.1f} MB")
    )
    phase("onnx export")

    requests = draw(profile, planned_profile, sizes.requests, seed=1)
    warmup = corners(profile) + draw(profile, planned_profile, sizes.warmup, seed=2)
    spec = write_spec(case, profile, model, folder, work_dir, builds, onnx, requests, warmup)
    phase("references")

    log(f"[{case.name}] cold start, {sizes.runs} run(s) per method")
    cold, warm_cache = coldstart.run(spec, work_dir, sizes.runs, log)
    phase("cold start")

    log(f"[{case.name}] loader overhead")
    overhead = loader_overhead(builds["planned"]["artifact"], profile, sizes)
    log(
        f"    {overhead['select_us']:.1f} µs guards + dispatch; loader {overhead['loader_us']:.1f} µs vs raw runner {overhead['raw_us']:.1f} µs"
    )
    phase("overhead")

    log(f"[{case.name}] steady state, {len(requests)} requests, methods interleaved")
    steady_results = steady.run(spec, work_dir, warm_cache, len(requests), log)
    phase("steady state")
    log(
        f"[{case.name}] done in {time.perf_counter() - started:.0f} s: "
        + ", ".join(f"{k} {v:.0f} s" for k, v in phases.items())
    )
    return {
        "description": case.description,
        "profile": str(case.profile.relative_to(case.profile.parents[2])),
        "exact_padding": case.exact_padding,
        "buckets": {d: list(b) for d, b in case.buckets.items()},
        "cold_shape": json.loads(spec.read_text())["cold_shape"],
        "builds": builds,
        "onnx": onnx,
        "cold_start": cold,
        "overhead": overhead,
        "requests": requests,
        "work": [work(r) for r in requests],
        "work_unit": " × ".join(profile.dims),
        "steady": steady_results,
        "seconds": time.perf_counter() - started,
        "phase_seconds": phases,
    }


def corners(profile) -> list[dict[str, int]]:
    """Every dim at its minimum, then at its maximum: the shapes a dynamic compile meets first and last."""
    return [{d: s.min for d, s in profile.dims.items()}, {d: s.max for d, s in profile.dims.items()}]


def hottest(profile, path: Path) -> dict[str, int]:
    """The most frequent shape of the profile's traffic (ties: the smaller): what a cold start serves first."""
    key = min(distribution(path).items(), key=lambda kv: (-kv[1], kv[0]))[0]
    return dict(zip(profile.dims, key))


def write_spec(case, profile, model, folder: Path, work_dir: Path, builds, onnx, requests, warmup) -> Path:
    """What the child processes need: how to build the module, inputs and eager references."""
    cold_shape = hottest(profile, folder / case.profile.name)
    args = inputs_for(profile, cold_shape, seed=0)
    names = list(profile.inputs)
    with torch.inference_mode():
        case_tensors = {f"in/{n}": t for n, t in zip(names, args)}
        case_tensors["expected"] = model(*args).contiguous()
        save_file(case_tensors, str(work_dir / "cold_case.safetensors"))
        refs = {
            f"ref/{i}": model(*inputs_for(profile, s, seed=i)).contiguous()
            for i, s in enumerate(requests[:CHECKED_REQUESTS])
        }
        save_file(refs, str(work_dir / "references.safetensors"))
    weights = None
    if not case.weights_in_factory:
        weights = str(work_dir / "eager_weights.safetensors")
        save_file({k: v.contiguous() for k, v in model.state_dict().items()}, weights)
    raw = yaml.safe_load(case.profile.read_text(encoding="utf-8"))
    spec = {
        "folder": str(folder),
        "factory": raw["model"]["factory"],
        "kwargs": raw["model"].get("kwargs") or {},
        "weights": weights,
        "inputs": names,
        "case_file": str(work_dir / "cold_case.safetensors"),
        "cold_shape": cold_shape,
        "artifact": builds["planned"]["artifact"],
        "artifacts": {
            "precompile-planned": builds["planned"]["artifact"],
            "precompile-dynamic": builds["dynamic"]["artifact"],
        },
        "onnx": onnx,  # its path, or why the export failed
        "threads": torch.get_num_threads(),  # ONNX Runtime's intra-op threads: as many as torch's
        "profile": str(folder / case.profile.name),
        "references": str(work_dir / "references.safetensors"),
        "buckets": {d: list(b) for d, b in case.buckets.items()},
        "requests": requests,
        "warmup": warmup,
    }
    path = work_dir / "spec.json"
    path.write_text(json.dumps(spec, indent=1), encoding="utf-8")
    return path


def loader_overhead(artifact: str, profile, sizes: Sizes) -> dict[str, Any]:
    """Guards + dispatch alone (``select``), and a whole call against the raw runner, at the smallest
    shape. Rounds alternate the two, as ``bench.overhead`` does; calls per round are sized so a round
    takes about half a second whatever the model costs."""
    import loader

    model = loader.load(artifact)
    args = inputs_for(profile, {d: s.min for d, s in profile.dims.items()}, seed=0)
    variant = model.select(*args)
    runner = model._runners[variant.id]  # the raw runner: what the loader wraps
    tensors = list(args)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # one thread: a neighbour's load stalls OpenMP teams, and this is about Python time
    try:
        with torch.inference_mode():
            for _ in range(5):
                model(*args)
            one = per_call_us(lambda: runner.run(tensors), 5)
            calls = max(5, min(sizes.overhead_calls, int(0.5e6 / max(one, 1.0))))
            raw, full = [], []
            for _ in range(sizes.overhead_rounds):
                raw.append(per_call_us(lambda: runner.run(tensors), calls))
                full.append(per_call_us(lambda: model(*args), calls))
            select = [per_call_us(lambda: model.select(*args), 20_000) for _ in range(5)]
    finally:
        torch.set_num_threads(threads)
    raw_us, full_us = statistics.median(raw), statistics.median(full)
    return {
        "variant": variant.id,
        "shape": {d: s.min for d, s in profile.dims.items()},
        "calls_per_round": calls,
        "raw_us": raw_us,
        "loader_us": full_us,
        "overhead_us": full_us - raw_us,
        "select_us": statistics.median(select),
    }


def describe_machine() -> dict[str, Any]:
    """CPU model, cores, memory, platform and the versions that matter, for the results' header."""
    cpu = platform.processor() or platform.machine()
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    memory = None
    try:
        memory = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError):
        pass
    versions = {"python": platform.python_version(), "torch": torch.__version__}
    for name in ("transformers", "loader", "precompile"):
        try:
            versions[name] = __import__(name).__version__
        except (ImportError, AttributeError):
            pass
    for name in ("onnxruntime", "openvino", "onnx", "onnxscript"):  # not imported: this process times torch
        try:
            versions[name] = importlib.metadata.version(name)
        except importlib.metadata.PackageNotFoundError:
            pass
    return {
        "cpu": cpu,
        "cores": os.cpu_count(),
        "torch_threads": torch.get_num_threads(),
        "memory_gb": round(memory / 2**30, 1) if memory else None,
        "platform": platform.platform(),
        "cpu_capability": torch.backends.cpu.get_cpu_capability(),
        "versions": versions,
        "date": time.strftime("%Y-%m-%d %H:%M %Z"),
    }
