"""The vision suite: seven convnets at any image size, against eager and the CPU peers.

    .venv/bin/python -m bench.vision [--models resnet50 mobilenet_v2 ...] [--seconds 1.0] [--out bench/results/vision.json]
    .venv/bin/python -m bench.vision --work /work/benchart/vision --build-only    # build (and export ONNX) only
    .venv/bin/python -m bench.vision --work /work/benchart/vision                # time what is built there
    .venv/bin/python -m bench.vision --work DIR --malloc system                  # our artifact on glibc's malloc only
    .venv/bin/python -m bench.vision --work /work/benchart/vision --reorders     # oneDNN reorders per call

    resnet50         dense 3×3 and 1×1 convolutions (bottlenecks)
    resnet18         dense 3×3 convolutions (basic blocks)
    mobilenet_v2     depthwise convolutions
    efficientnet_b0  depthwise convolutions and squeeze-and-excite
    regnet_y         grouped convolutions (RegNetY-4GF) and squeeze-and-excite
    segformer        an encoder-decoder for segmentation (MiT-b0: attention over strided convolutions)
    unet             a hand-written UNet: dense 3×3 convolutions, transposed ones up, skips concatenated

Each from its transformers config (the UNet: written in the file) with random weights (``profiles/bench/models.py``), built from
``profiles/bench/vision_<model>.yaml``: one dynamic fp32 variant over batch 1-4 and 96-256 pixels a
side (a convnet frozen by the per-kind default), the same unfrozen (``freezing: false``: what the
default is measured against), and its ONNX export for the peers. ``--work`` keeps them in
``DIR/<model>/`` and reuses any already there (an artifact with its manifest, a ``model.onnx``), so the builds can run on a busy
machine (``--build-only``) and the timing alone on a quiet one.

Each method runs in a process of its own (``bench.vision_worker``), started on the allocator it is
compared on: fp32 eager, ONNX Runtime, OpenVINO with its defaults (bf16 on CPUs with AMX) and
OpenVINO f32 on glibc's malloc, as their users run them; the artifact and its unfrozen build as
``precompile serve`` runs them (``--malloc``, default ``auto``: tcmalloc where it is installed, in
the environment serve gives its worker: ``serving_env``), and the artifact once more on glibc's
malloc (``precompile fp32 (glibc)``). One process for all cannot do it: the allocator is fixed when
a process starts, and OpenVINO aborts beside tcmalloc. Timed per shape, interleaved: in each of
``--rounds`` rounds every method's process runs its share of calls in turn (the others wait, their
threads asleep), so that a change in the machine's load falls on every method alike; on the range's
two ends, the variant's hint and two random shapes, each method checked against eager on the same
inputs (a peer that refuses a shape is left out, with its reason). Then, per model, the first call
at shapes the artifact never met against the steady call, after the hint-only warm-up and after the
default one (``bench.firstcall``, fresh processes on the artifact's allocator). Prints and writes
the median ms per shape, their sum, each method's ratio to ONNX Runtime and the allocator its
process ran on (``loader.malloc.in_use``).

``--reorders``: what does not depend on the machine's load: per model and shape, the reorders oneDNN
runs in one steady call of the artifact (``ONEDNN_VERBOSE``, a fresh process per artifact, the
second call of each shape): to a blocked layout (plain weights, and images some kernels want
blocked), back to a plain one, and from one blocking to another (a weight packed for other sizes,
re-laid by oneDNN's slow ``simple:any``: ``precompile.passes.prepack`` must leave none).

Needs the bench extra (make venv-bench). Time it on a quiet machine.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import math
import os
import random
import shutil
import statistics
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import numpy as np
import torch

from loader.malloc import MallocError, resolve
from loader.threads import wait_env
from precompile.errors import PrecompileError

from . import firstcall
from .firstcall import serving_process_env as process_env
from .precision import PEER_LABELS, PROFILES, ROOT, peer_label
from .vision_worker import Worker, WorkerFailed

MODELS = ("resnet50", "resnet18", "mobilenet_v2", "efficientnet_b0", "regnet_y", "segformer", "unet")
PEER = "ONNX Runtime (f32)"  # the ratios' reference
EAGER = "eager fp32"  # the reference outputs


def suite_shapes(hint: dict[str, int], seed: int = 22) -> list[dict[str, int]]:
    """The range's two ends, the hint, and two shapes drawn inside the range."""
    rng = random.Random(seed)
    drawn = [
        {"batch": rng.randint(1, 4), "height": rng.randint(96, 256), "width": rng.randint(96, 256)} for _ in range(2)
    ]
    return [{"batch": 1, "height": 96, "width": 96}, {"batch": 4, "height": 256, "width": 256}, dict(hint), *drawn]


@dataclass(frozen=True)
class Built:
    """One model's builds in the work folder: as its profile says (for a convnet: frozen, by the
    per-kind default), and the same profile with ``freezing: false``, each with its path and manifest."""

    result: Any
    unfrozen: Any
    profile: Path
    build_seconds: dict[str, float]  # the builds this run made (none: both reused)


def build_model(name: str, work: Path, log: Callable[[str], None]) -> Built:
    """``name``'s artifacts (``Built``) and ONNX export in ``work/<name>``, each built unless already there."""
    import yaml

    from loader.artifact import read_manifest
    from precompile.pipeline import build
    from precompile.profile import load_profile
    from precompile.stages.resolve import resolve_model

    from .onnx_export import export_onnx

    folder = work / name
    profile_path = folder / f"vision_{name}.yaml"
    if not profile_path.is_file():
        shutil.copytree(PROFILES, folder, ignore=shutil.ignore_patterns("__pycache__"), dirs_exist_ok=True)
    unfrozen_path = folder / f"vision_{name}_unfrozen.yaml"
    if not unfrozen_path.is_file():
        raw = yaml.safe_load(profile_path.read_text())
        raw["compile"] = {"inductor": {**raw.get("compile", {}).get("inductor", {}), "freezing": False}}
        unfrozen_path.write_text(yaml.safe_dump(raw, sort_keys=False))
    seconds, results = {}, []
    for path, artifact in ((profile_path, folder / "artifact"), (unfrozen_path, folder / "artifact-unfrozen")):
        if (artifact / "manifest.json").is_file():
            log(f"{name}: reusing the artifact built earlier in {artifact}")
            results.append(SimpleNamespace(path=artifact, manifest=read_manifest(artifact)))
            continue
        start = time.perf_counter()
        results.append(build(path, artifact))
        seconds[artifact.name] = time.perf_counter() - start
        log(f"{name}: {artifact.name} built in {seconds[artifact.name]:.0f} s")
    onnx = folder / "model.onnx"
    if not onnx.is_file():
        loaded = load_profile(profile_path)
        said = export_onnx(resolve_model(loaded), loaded.profile, onnx)
        log(
            f"{name}: ONNX export "
            + (f"failed: {said['failed']}" if "failed" in said else f"in {said['seconds']:.0f} s")
        )
    return Built(results[0], results[1], profile_path, seconds)


def dynamic_fp32(result: Any) -> Any:
    """The artifact's one dynamic fp32 variant."""
    (variant,) = [v for v in result.manifest.variants if v.kind == "dynamic" and v.precision == "fp32"]
    return variant


def interleaved_ms(
    methods: dict[str, Callable[[int], list[float]]], seconds: float, rounds: int = 5
) -> dict[str, float]:
    """Each method's median ms per call, timed in ``rounds`` rounds of about ``seconds / rounds`` per
    method each, one method after another within a round. A method is given a number of calls and
    returns the ms each took."""
    per_call = {label: fn(2)[-1] / 1000 for label, fn in methods.items()}  # warm, and learn how many calls fill a round
    times: dict[str, list[float]] = {label: [] for label in methods}
    for _ in range(rounds):
        for label, fn in methods.items():
            times[label] += fn(max(1, min(200, int(seconds / rounds / max(per_call[label], 1e-6)))))
    return {label: statistics.median(t) for label, t in times.items()}


@dataclass(frozen=True)
class Method:
    """One compared method: its label, what its process runs (a ``bench.vision_worker`` method and
    the artifact or ONNX file it opens) and the allocator that process starts on (a ``--malloc`` choice)."""

    label: str
    kind: str
    path: Path | None
    malloc: str


def compared(built: Built, onnx: Path | None, malloc: str) -> list[Method]:
    """Eager, our artifact on ``malloc`` (as ``precompile serve --malloc`` runs it) and on glibc's
    malloc where that differs, its unfrozen build on ``malloc``, and the peers on the ONNX export
    (where there is one): eager and the peers on glibc's malloc, as their users run them."""
    ours = [Method("precompile fp32", "precompile", built.result.path, malloc)]
    if resolve(malloc) is not None:
        ours.append(Method("precompile fp32 (glibc)", "precompile", built.result.path, "system"))
    ours.append(Method("precompile fp32 unfrozen", "precompile", built.unfrozen.path, malloc))
    peers = [Method(label, kind, onnx, "system") for kind, label in PEER_LABELS.items()] if onnx else []
    return [Method(EAGER, "eager", None, "system"), *ours, *peers]


def start_workers(
    methods: list[Method], built: Built, shapes: list[dict[str, int]], folder: Path,
    failed: dict[str, str], log: Callable[[str], None],
) -> dict[str, Worker]:  # fmt: skip
    """Each method's process, started one after another and loaded; one that fails to is in ``failed``."""
    workers: dict[str, Worker] = {}
    for n, m in enumerate(methods):
        try:
            worker = Worker(
                m.kind, profile=built.profile, shapes=shapes, folder=folder, env=process_env(m.malloc),
                artifact=m.path if m.kind == "precompile" else None, onnx=m.path if m.kind in PEER_LABELS else None,
                name=f"{n}-{m.kind}",
            )  # fmt: skip
        except WorkerFailed as e:
            failed[m.label] = str(e)
            log(f"{built.profile.parent.name}: {m.label} did not load, left out: {e}")
            continue
        label = peer_label(m.kind, worker.ready["facts"]) if m.kind in PEER_LABELS else m.label
        workers[label] = worker
    return workers


def run_model(
    name: str, work: Path, seconds: float, log: Callable[[str], None], *, rounds: int = 5, malloc: str = "auto"
) -> dict[str, Any]:
    """Build (or reuse) ``name``'s vision profile in ``work``, check and time its methods, each in its
    own process (the module docstring); our artifact's on ``malloc``'s allocator."""
    built = build_model(name, work, log)
    result, variant = built.result, dynamic_fp32(built.result)
    onnx = built.profile.parent / "model.onnx"
    if not onnx.is_file():
        log(f"{name}: no ONNX export (see {onnx.with_suffix('.log')}): peers skipped")
    shapes = suite_shapes(variant.hint)
    error: dict[str, float] = {}
    failed: dict[str, str] = {}
    rows = []
    with tempfile.TemporaryDirectory(prefix=f"vision-{name}-") as tmp, contextlib.ExitStack() as running:
        methods = compared(built, onnx if onnx.is_file() else None, malloc)
        workers = start_workers(methods, built, shapes, Path(tmp), failed, log)
        for worker in workers.values():
            running.callback(worker.close)
        if EAGER not in workers:
            raise WorkerFailed(f"{EAGER}: {failed[EAGER]}")
        ready = {label: w.ready for label, w in workers.items()}
        log(f"{name}: " + ", ".join(f"{label} on {r['malloc']}" for label, r in ready.items()))
        for i, sizes in enumerate(shapes):
            want = workers[EAGER].output(i)
            scale = float(np.abs(want).max())
            for label, worker in list(workers.items()):  # each method against eager, on the same inputs
                try:
                    got = want if label == EAGER else worker.output(i)
                except WorkerFailed as e:  # a peer refusing a shape (OpenVINO: EfficientNet's 1280² pool) is its result
                    failed[label] = f"{sizes}: {e}"
                    log(f"{name}: {label} failed, left out: {failed[label]}")
                    worker.close()
                    del workers[label]
                    continue
                diff = float(np.abs(got.astype(np.float64) - want).max())
                error[label] = max(error.get(label, 0.0), diff / scale)
            row: dict[str, Any] = {"dims": sizes}
            row.update(interleaved_ms({k: (lambda n, w=w: w.time(i, n)) for k, w in workers.items()}, seconds, rounds))
            rows.append(row)
            log(f"  {sizes}: " + "  ".join(f"{k} {v:.2f}" for k, v in row.items() if k != "dims"))
    totals = {label: sum(r[label] for r in rows if label in r) for label in workers}
    # In fresh processes of its own, on the allocator the artifact was timed on.
    first = firstcall.measure([result.path], shapes=2, repeat=max(3, int(10 * seconds)), env=process_env(malloc))
    log(firstcall.report(first) + "\n" + firstcall.summary(first))
    return {
        "model": name,
        "build_seconds": built.build_seconds,
        "frozen": bool(result.manifest.variants[0].embedded_constants),
        "hint": variant.hint,
        "shapes": rows,
        "total_ms": totals,
        "max_relative_error_vs_eager": error,
        "failed_methods": failed,
        "malloc": {label: r["malloc"] for label, r in ready.items()},
        "first_call": first,
        "engines": {PEER_LABELS[r["method"]]: r["facts"] for r in ready.values() if r["method"] in PEER_LABELS},
        "threads": ready[EAGER]["threads"],
    }


# Loads an artifact under ONEDNN_VERBOSE and calls it twice per shape between markers.
CALLS = """
import json, sys, torch, loader
model = loader.load(sys.argv[1], precision="fp32")
for i, sizes in enumerate(json.loads(sys.argv[2])):
    x = torch.randn(sizes["batch"], 3, sizes["height"], sizes["width"])
    for call in range(2):
        print(f"=== {i} {call}", flush=True)
        model(x)
print("=== end", flush=True)
"""
PLAIN_TAGS = {
    "a",
    "ab",
    "abc",
    "abcd",
    "abcde",
    "acb",
    "acdb",
    "acdeb",
    "abdec",
}  # torch's own layouts (abdec: a channels-last grouped weight)


def onednn_reorders(artifact: Path, shapes: list[dict[str, int]]) -> list[dict[str, Any]]:
    """Per shape, the reorders oneDNN ran in the steady (second) call, by the layouts they go from and
    to (each one's dims): ``to_blocked`` from torch's own layouts (a plain weight, or an image, laid
    out for a kernel), ``to_plain`` (an image handed back), ``blocked_to_blocked`` (a weight packed
    in one blocking re-laid in another: what ``precompile.passes.prepack`` must never leave)."""
    import subprocess
    import sys

    env = {**os.environ, "ONEDNN_VERBOSE": "1", **wait_env({})}
    run = subprocess.run(
        [sys.executable, "-c", CALLS, str(artifact), json.dumps(shapes)],
        env=env, capture_output=True, text=True, check=True, cwd=ROOT,
    )  # fmt: skip
    rows: list[dict[str, Any]] = []
    current = None
    for line in run.stdout.splitlines():
        if line.startswith("=== "):
            i, call = (line[4:].split() + [""])[:2]
            current = None
            if call == "1":
                current = {"dims": shapes[int(i)], "to_blocked": [], "to_plain": [], "blocked_to_blocked": []}
                rows.append(current)
        elif current is not None and ",exec,cpu,reorder," in line:
            fields = line.split(",")
            layouts = next(f for f in fields if f.startswith("src:")).split()  # "src:f32::blocked:abcd::f0 dst:..."
            src, dst = (part.split(":")[4] in PLAIN_TAGS for part in layouts[:2])
            kind = "to_blocked" if src and not dst else "to_plain" if dst else "blocked_to_blocked"
            current[kind].append(fields[-2])
    return rows


def reorders_report(name: str, rows: list[dict[str, Any]]) -> str:
    lines = [
        f"{name}: oneDNN reorders in one steady call: to a blocked layout (MB of f32 they move) / "
        "back to a plain one / blocked to blocked"
    ]
    for r in rows:
        dims = " ".join(f"{d}={n}" for d, n in r["dims"].items())
        mb = sum(math.prod(int(n) for n in d.split("x")) for d in r["to_blocked"]) * 4 / 1e6
        lines.append(
            f"  {dims:<32} {len(r['to_blocked']):4d} ({mb:5.1f} MB) / {len(r['to_plain']):d} / "
            f"{len(r['blocked_to_blocked']):d}"
        )
    return "\n".join(lines)


def summary(results: list[dict[str, Any]]) -> str:
    lines = []
    for r in results:
        if "failed" in r:
            lines.append(f"\n{r['model']}: failed: {r['failed'].splitlines()[0]}")
            continue
        peer = next((v for k, v in r["total_ms"].items() if k == PEER), None)
        lines.append(f"\n{r['model']}: sum of median ms over {len(r['shapes'])} shapes (hint {r['hint']})")
        for label, total in sorted(r["total_ms"].items(), key=lambda kv: kv[1]):
            ratio = f"{total / peer:5.2f}× ONNX Runtime" if peer else ""
            err = r["max_relative_error_vs_eager"][label]
            malloc = r.get("malloc", {}).get(label, "system")  # results from before each method had its process
            lines.append(f"  {label:<28} {total:9.1f} ms  {ratio}   max rel. error {err:.1e}   on {malloc}")
        for label, why in r["failed_methods"].items():
            lines.append(f"  {label:<28} failed: {why}")
        lines += ["  " + line for line in firstcall.summary(r["first_call"]).splitlines()]
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--models", nargs="+", default=list(MODELS), choices=MODELS)
    parser.add_argument("--seconds", type=float, default=1.0, help="timing per method per shape")
    parser.add_argument("--rounds", type=int, default=5, help="rounds the timing per shape is interleaved in")
    parser.add_argument("--out", type=Path, default=ROOT / "bench" / "results" / "vision.json")
    parser.add_argument("--work", type=Path, help="build into (and reuse builds from) this folder, not a temporary one")
    parser.add_argument("--build-only", action="store_true", help="with --work: build and export, time nothing")
    parser.add_argument("--reorders", action="store_true", help="with --work: oneDNN's reorders per call, no timing")
    parser.add_argument(
        "--malloc", default="auto", metavar="auto|tcmalloc|jemalloc|system|PATH",
        help="the allocator our artifact's processes run on, as `precompile serve --malloc` (default auto: "
        "tcmalloc where installed); it is timed on glibc's malloc too",
    )  # fmt: skip
    args = parser.parse_args()
    if (args.build_only or args.reorders) and not args.work:
        parser.error("--build-only and --reorders need --work (the folder the builds are kept in)")
    try:
        library = resolve(args.malloc)
    except MallocError as e:
        parser.error(str(e))
    if library is None and args.malloc == "auto" and not (args.build_only or args.reorders):
        print(
            "tcmalloc is not installed here (Debian/Ubuntu: libtcmalloc-minimal4): our artifact runs on glibc's malloc"
        )
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    log = lambda s: print(s, flush=True)  # noqa: E731
    results = []
    with tempfile.TemporaryDirectory(prefix="vision-bench-") as tmp:
        work = args.work or Path(tmp)
        for name in args.models:
            try:
                if args.build_only:
                    build_model(name, work, log)
                elif args.reorders:
                    built = build_model(name, work, log)
                    shapes = suite_shapes(dynamic_fp32(built.result).hint)
                    rows = onednn_reorders(built.result.path, shapes)
                    cold = onednn_reorders(built.unfrozen.path, shapes)
                    log(reorders_report(name, rows) + "\n" + reorders_report(f"{name} unfrozen", cold))
                    results.append({"model": name, "reorders": rows, "reorders_unfrozen": cold})
                else:
                    results.append(run_model(name, work, args.seconds, log, rounds=args.rounds, malloc=args.malloc))
            except (PrecompileError, WorkerFailed) as e:  # one model that does not build or run leaves the others to
                print(f"{name}: failed: {e}", flush=True)
                results.append({"model": name, "failed": str(e)})
    if args.build_only:
        return
    if args.reorders:
        out = args.out.with_name("vision-reorders.json") if args.out.name == "vision.json" else args.out
        out.write_text(json.dumps({"results": results}, indent=2) + "\n")
        print(f"\nwrote {out}")
        return
    print(summary(results))
    args.out.write_text(
        json.dumps({"results": results, "cpu": torch.cpu.get_capabilities().get("cpu_name")}, indent=2) + "\n"
    )
    print(f"\nwrote {args.out}")


if __name__ == "__main__":
    main()
