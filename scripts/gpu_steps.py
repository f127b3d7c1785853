"""The steps of scripts/gpu-check that touch the GPU, each run in a child process of its own:

    python scripts/gpu_steps.py STEP --params JSON --result FILE

gpu-check bounds each child by the deadline that remains and kills its process group on time-out, so
a step that hangs (a wedged kernel, a deadlock among callers) costs its own record only. A step writes
its result as JSON to FILE and exits 0; a failure prints its traceback and exits 1.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
EXAMPLES = ROOT / "profiles" / "examples"
sys.path.insert(0, str(ROOT))

import torch  # noqa: E402

import loader  # noqa: E402
import loader.cuda as cuda_host  # noqa: E402
from loader.aoti import describe as binding_signatures  # noqa: E402
from loader.cuda import CudaFacts, kernel_targets, runs_on  # noqa: E402
from loader.manifest import parse_manifest  # noqa: E402
from loader.threads import cpu_allowance  # noqa: E402
from precompile.cuda_targets import package_kernels  # noqa: E402
from precompile.profile import load_profile  # noqa: E402
from precompile.samples import make_inputs  # noqa: E402
from precompile.stages.resolve import resolve_model  # noqa: E402

# gpu-check's own judgement of agreement with float32 eager on the GPU: max abs error, relative to
# the output's magnitude (the build's check is set loose for bf16; see gpu-check's BF16_BUILD_CHECK).
TOLERANCE = {"float32": 1e-3, "bfloat16": 5e-2}
GRAPH_TARGET = 1.5  # graph replay at least this much faster than the plain runner, at batch ≤ 8
# Recorded facts of GPUs this machine is not: (capability, name).
OTHER_GPUS = [
    ((8, 0), "NVIDIA A100"),
    ((8, 9), "NVIDIA L4"),
    ((9, 0), "NVIDIA H100"),
    ((10, 0), "NVIDIA B200"),
    ((12, 0), "NVIDIA RTX PRO 6000"),
]


def facts(_: dict) -> dict:
    """What this machine is: GPU, torch, Triton, the package loader's signatures, CPUs and memory."""
    try:
        import triton

        triton_version = triton.__version__
    except ImportError:
        triton_version = None
    allowance = cpu_allowance()
    out = {
        "torch": torch.__version__,
        "cuda": torch.version.cuda,
        "triton": triton_version,
        "python": sys.version.split()[0],
        "cpus": {
            "host": allowance.host,
            "affinity": allowance.affinity,
            "quota": allowance.quota,
            "usable": allowance.cpus,
        },
        "memory_mib": _meminfo(),
        "bindings": binding_signatures(),
        "gpu_visible": torch.cuda.is_available(),
    }
    if torch.cuda.is_available():
        out["gpu"] = torch.cuda.get_device_name(0)
        out["capability"] = "{}.{}".format(*torch.cuda.get_device_capability(0))
        out["gpus"] = torch.cuda.device_count()
        out["gpu_memory_mib"] = torch.cuda.get_device_properties(0).total_memory >> 20
    return out


def _meminfo() -> dict:
    info = {}
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            key, _, rest = line.partition(":")
            if key in ("MemTotal", "MemAvailable"):
                info[key] = int(rest.split()[0]) // 1024
    except OSError:
        pass
    return info


def _inputs(profile, sizes: dict, seed: int) -> list[torch.Tensor]:
    return [t.to("cuda") for t in make_inputs(profile, sizes, seed=seed)]


def accuracy(p: dict) -> dict:
    """Every variant, plain and graphed, against float32 eager on the GPU."""
    dtype, artifact = p["dtype"], p["artifact"]
    loaded = load_profile(p["profile"])
    eager = resolve_model(loaded).to("cuda").eval()
    plain = loader.load(artifact, device="cuda:0")  # no warm-up: no graphs captured
    graphed = loader.load(artifact, device="cuda:0")
    graphed.warmup()  # captures one CUDA graph per static variant
    rows, ok = [], True
    for v in plain.variants:
        sizes = dict(v.hint)
        args = _inputs(loaded.profile, sizes, seed=1)
        with torch.no_grad():
            want = eager(*args).float()
        got_plain = plain.run_variant(v.id, *args).float()
        got_graph = graphed.run_variant(v.id, *args).float()
        err = max((got_plain - want).abs().max().item(), (got_graph - want).abs().max().item())
        passed = err <= TOLERANCE[dtype] * max(1.0, want.abs().max().item())
        rows.append({"variant": v.id, "kind": v.kind, "dims": sizes, "max_abs_error": err, "passed": passed})
        ok &= passed
    return {"dtype": dtype, "variants": rows, "ok": ok}


def time_ms(fn, repeats: int, warmup: int = 10) -> float:
    """Median wall time of one call as the GPU sees it (CUDA events around it, host launch included)."""
    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(repeats):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end))
    return statistics.median(times)


def timing(p: dict) -> dict:
    """Every variant with and without its CUDA graph, and eager in the same dtype."""
    dtype, artifact, repeats = p["dtype"], p["artifact"], p["repeats"]
    loaded = load_profile(p["profile"])
    eager_same = resolve_model(loaded).to("cuda", dtype=getattr(torch, dtype)).eval()
    plain = loader.load(artifact, device="cuda:0")
    graphed = loader.load(artifact, device="cuda:0")
    graphed.warmup()
    rows = []
    for v in plain.variants:
        sizes = dict(v.hint)
        args = _inputs(loaded.profile, sizes, seed=1)
        ms = time_ms(lambda: plain.run_variant(v.id, *args), repeats)
        ms_graph = time_ms(lambda: graphed.run_variant(v.id, *args), repeats)
        with torch.no_grad():
            ms_eager = time_ms(lambda: eager_same(*args), repeats)
        row = {"variant": v.id, "kind": v.kind, "dims": sizes, "ms": ms, "ms_graph": ms_graph, "ms_eager": ms_eager}
        if v.kind == "static":
            row["graph_speedup"] = ms / ms_graph
            row["graph_target_met"] = sizes["batch"] > 8 or row["graph_speedup"] >= GRAPH_TARGET
        rows.append(row)
    statics = [r for r in rows if "graph_speedup" in r]
    return {"dtype": dtype, "variants": rows, "ok": all(r["graph_target_met"] for r in statics)}


def concurrency(p: dict, calls: int = 400, threads: int = 8) -> dict:
    """Many threads calling one graphed static variant, and one plain static variant opened without
    warm-up (its runner is single-threaded): each caller must get its own result."""
    artifact = p["artifact"]
    profile = load_profile(p["profile"]).profile
    out = {"calls": calls, "threads": threads}
    for label, warm in (("graphed", True), ("no_warmup", False)):
        model = loader.load(artifact, device="cuda:0")
        if warm:
            model.warmup()
        static = next(v for v in model.variants if v.kind == "static")
        sizes = dict(static.hint)
        inputs = [_inputs(profile, sizes, seed=100 + i) for i in range(16)]
        want = [model.run_variant(static.id, *a).float() for a in inputs]

        def call(i, model=model, inputs=inputs, want=want):
            got, variant = model.call_detailed(*inputs[i % 16])
            return variant, bool(torch.allclose(got.float(), want[i % 16], atol=1e-3, rtol=1e-3))

        with ThreadPoolExecutor(threads) as pool:
            results = list(pool.map(call, range(calls)))
        wrong = sum(1 for _, good in results if not good)
        out[label] = {"variant": static.id, "served_by": sorted({v for v, _ in results}), "wrong_results": wrong}
    out["wrong_results"] = out["graphed"]["wrong_results"] + out["no_warmup"]["wrong_results"]
    out["ok"] = out["wrong_results"] == 0
    return out


def cc_guard(p: dict) -> dict:
    """Load the artifact as if on GPUs of other compute capabilities (recorded facts): exactly those the
    coverage rule (loader.cuda.runs_on, the loader's own) says its kernels miss must be refused with
    IncompatibleArtifactError, before any compiled code is opened."""
    artifact = p["artifact"]
    manifest = parse_manifest((Path(artifact) / "manifest.json").read_bytes()).cuda
    real = cuda_host.host_facts
    rows = []
    try:
        for capability, name in OTHER_GPUS:
            cuda_host.host_facts = lambda c=capability, n=name: CudaFacts(torch.version.cuda, (c,), (n,))
            try:
                loader.load(artifact, device="cuda:0")
                outcome, message = "loaded", None
            except loader.IncompatibleArtifactError as e:
                outcome, message = "refused", str(e)
            covered = runs_on(manifest, capability)
            rows.append(
                {
                    "gpu": name,
                    "capability": "{}.{}".format(*capability),
                    "outcome": outcome,
                    "covered": covered,
                    "ok": (outcome == "loaded") == covered,
                    **({"message": message} if message else {}),
                }
            )
    finally:
        cuda_host.host_facts = real
    return {
        "kernels": [str(k) for k in kernel_targets(manifest)],
        "recorded": bool(manifest.kernels),
        "gpus": rows,
        "ok": all(r["ok"] for r in rows),
    }


def kernels(p: dict) -> dict:
    """What each CUDA package's kernels hold, read again here (cuobjdump of every cubin and fatbin),
    against what the build recorded in the manifest: they must agree, or the coverage rule decides
    from a false claim."""
    import shutil

    artifact = Path(p["artifact"])
    manifest = parse_manifest((artifact / "manifest.json").read_bytes())
    tool = shutil.which("cuobjdump")
    packages = {}
    for v in manifest.variants:
        if v.device != "cuda":
            continue
        read = package_kernels(artifact / v.file, tool)
        packages[v.id] = {"kernels": sorted(read.kernels), "files": read.files, "unread": list(read.unread)}
    listing = ""
    first = next((artifact / v.file for v in manifest.variants if v.device == "cuda"), None)
    if tool and first is not None:
        import zipfile

        with zipfile.ZipFile(first) as z, tempfile.TemporaryDirectory() as tmp:
            names = [n for n in z.namelist() if n.endswith((".cubin", ".fatbin"))][:1]
            for name in names:
                target = Path(tmp) / Path(name).name
                target.write_bytes(z.read(name))
                out = subprocess.run(
                    [tool, "--list-elf", "--list-ptx", str(target)], capture_output=True, text=True, timeout=60
                )
                listing = f"{name}:\n{out.stdout}{out.stderr}"[-1500:]
    recorded = sorted(manifest.cuda.kernels)
    seen = [set(r["kernels"]) for r in packages.values() if r["files"]]
    common = sorted(set.intersection(*seen)) if seen else []
    return {
        "cuobjdump": tool,
        "recorded": recorded,
        "derived": [str(k) for k in kernel_targets(manifest.cuda)],
        "packages": packages,
        "listing": listing,
        "ok": bool(recorded) and recorded == common,
    }


BAD_CALLS = ("cpu_input", "seq_too_long", "float_ids", "id_past_table", "negative_id")

BAD_CALL = """
import sys, json, torch, loader
m = loader.load({path!r}, device="cuda:0")
for case in sys.argv[1:]:
    ids = torch.randint(0, 1000, (2, 64), device="cuda"); mask = torch.ones(2, 64, dtype=torch.bool, device="cuda")
    if case == "cpu_input": args = (ids.cpu(), mask.cpu())
    elif case == "seq_too_long": args = (torch.zeros(1, 600, dtype=torch.long, device="cuda"), torch.ones(1, 600, dtype=torch.bool, device="cuda"))
    elif case == "float_ids": args = (ids.float(), mask)
    elif case == "id_past_table": ids[0, 0] = 1000; args = (ids, mask)
    elif case == "negative_id": ids[1, 3] = -1; args = (ids, mask)
    print(json.dumps({{"case": case, "outcome": "started"}}), flush=True)
    try:
        out = m(*args); torch.cuda.synchronize()
        result = {{"outcome": "ran", "finite": bool(torch.isfinite(out.float()).all())}}
    except loader.GuardError as e:
        result = {{"outcome": "GuardError", "reason": getattr(e, "reason", None), "message": str(e)[:300]}}
    except Exception as e:
        result = {{"outcome": type(e).__name__, "message": str(e)[:300]}}
    print(json.dumps({{"case": case, **result}}), flush=True)
"""


def bad_calls(p: dict) -> dict:
    """Bad calls in a grandchild: each must be refused with a GuardError, never kill the process. One
    process takes the cases in turn; one that dies is recorded and a new process takes the rest."""
    out: dict[str, dict] = {}
    todo = list(BAD_CALLS)
    while todo:
        proc = subprocess.run(
            [sys.executable, "-c", BAD_CALL.format(path=p["artifact"]), *todo],
            capture_output=True,
            text=True,
            timeout=120,
        )
        for line in proc.stdout.splitlines():
            if line.startswith("{"):
                row = json.loads(line)
                out[row.pop("case")] = row
        for case in list(todo):
            row = out.get(case)
            if row is None or row["outcome"] == "started":  # the process died on this case (or before it)
                out[case] = {
                    "outcome": "process died" if row else "not reached",
                    "exit": proc.returncode,
                    "stderr": proc.stderr[-600:],
                }
                todo = todo[todo.index(case) + 1 :]
                break
            row["exit"] = 0
        else:
            todo = []
    for row in out.values():
        row["ok"] = row.get("outcome") == "GuardError"
    return {"cases": out, "ok": all(r["ok"] for r in out.values())}


COLD_LOADER = """
import time, torch, loader
t0 = time.perf_counter()
m = loader.load({path!r}, device="cuda:0")
ids = torch.randint(0, 1000, (4, 100), device="cuda"); mask = torch.ones(4, 100, dtype=torch.bool, device="cuda")
m(ids, mask); torch.cuda.synchronize()
print(time.perf_counter() - t0)
"""

COLD_COMPILE = """
import sys, time, torch
t0 = time.perf_counter()
sys.path.insert(0, {examples!r})
import models
m = models.text_classifier(vocab=1000, width=64, layers=2).eval().cuda()
c = torch.compile(m, dynamic=True)
ids = torch.randint(0, 1000, (4, 100), device="cuda"); mask = torch.ones(4, 100, dtype=torch.bool, device="cuda")
with torch.no_grad():
    c(ids, mask)
torch.cuda.synchronize()
print(time.perf_counter() - t0)
"""


def cold_start(p: dict) -> dict:
    """Fresh process to first result, wall clock (python and torch start-up included for both)."""

    def run(code: str, env: dict) -> float:
        start = time.perf_counter()
        out = subprocess.run(
            [sys.executable, "-c", code], capture_output=True, text=True, env=env, cwd=ROOT, timeout=240
        )
        if out.returncode != 0:
            raise RuntimeError(out.stderr[-2000:])
        return time.perf_counter() - start

    loader_s = [run(COLD_LOADER.format(path=p["artifact"]), dict(os.environ)) for _ in range(p["runs"])]
    compile_s = []
    for _ in range(p["runs"]):
        cache = tempfile.mkdtemp(prefix="inductor-empty-")
        env = {**os.environ, "TORCHINDUCTOR_CACHE_DIR": cache, "TRITON_CACHE_DIR": os.path.join(cache, "triton")}
        compile_s.append(run(COLD_COMPILE.format(examples=str(EXAMPLES)), env))
    speedup = statistics.median(compile_s) / statistics.median(loader_s)
    return {"loader_s": loader_s, "torch_compile_cold_s": compile_s, "speedup": speedup, "ok": speedup > 1.0}


STEPS = {f.__name__: f for f in (facts, accuracy, timing, concurrency, cc_guard, kernels, bad_calls, cold_start)}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("step", choices=sorted(STEPS))
    parser.add_argument("--params", default="{}")
    parser.add_argument("--result", type=Path, required=True)
    opts = parser.parse_args()
    value = STEPS[opts.step](json.loads(opts.params))
    partial = opts.result.with_suffix(".partial")
    partial.write_text(json.dumps(value, indent=2, default=str))
    partial.replace(opts.result)
    return 0


if __name__ == "__main__":
    sys.exit(main())
