"""The first call at a shape no call met before, against the steady call at that shape, per dynamic variant.

    .venv/bin/python -m bench.firstcall ARTIFACT [ARTIFACT ...] [--shapes 3] [--repeat 20]
        [--warmup-shapes hint auto] [--onnx MODEL.onnx ...] [--malloc auto] [--out firstcall.json]

Prints one row per shape, then one line per artifact and warm-up (``summary``): the median and worst ratio.

Each artifact is loaded in a fresh process per ``--warmup-shapes`` mode, as a server loads it
(``loader.load``: every variant warmed up on its hint shape; with ``auto`` or ``range``, a dynamic
variant on the largest shape of its ranges too, ``loader.warmup``). Then, for each dynamic variant,
``--shapes`` shapes drawn inside its ranges (none of them the hint or a traffic shape, the same in
every mode), then up to ``--shapes`` of its traffic's shapes (the manifest's ``warm``, which the
``auto`` and ``range`` warm-ups run; rows marked ``traffic``): the first call's time, then the
median of ``--repeat`` calls of the same shape; beside the wall times, the
process's CPU time and minor page faults of the first call and of a steady one, which depend far
less on the machine's load. What the first call pays over the steady one is oneDNN creating its
primitives for the shape (descriptor and JIT), and fresh pages for buffers larger than any met before
(what the largest shape's warm-up takes away). Target (issue 22): first ≤ 1.5× steady.

``--onnx`` (one ONNX export per artifact, in the same order: ``bench.onnx_export``, or the
``model.onnx`` that ``bench.vision --work`` leaves): ONNX Runtime's own first call against its steady
one, at the same unseen shapes, in a fresh process of its own with as many intra-op threads as the
artifact's process ran, after the same warm-up shapes (rows ``ONNX Runtime``).

Each engine runs as it is served: the artifact's processes with what ``precompile serve`` adds for
one worker (``serving_process_env``: its OpenMP wait policy and thread count, ``--malloc``'s
allocator preloaded, default ``auto``: tcmalloc where installed), ONNX Runtime's on glibc's malloc.
Before 2026-12-08 the artifact ran on glibc's malloc, whose buffers over 32 MB are mapped afresh on
every call, first and steady alike (UNet at 3×175×203: 13,290 page faults a steady call).

Run it on a quiet machine; on a busy one the wall-time ratios say little.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import resource
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from loader.malloc import PRELOAD_ENV, MallocError, in_use, resolve
from loader.threads import wait_env

ROOT = Path(__file__).resolve().parent.parent
TARGET = 1.5  # first call / steady call
# The load's warm-up modes compared (loader.warmup): the hint alone, as before, and the default.
WARMUPS = ("hint", "auto")


def serving_process_env(malloc: str) -> dict[str, str]:
    """The environment a process serving an artifact starts with: this one's, with no allocator
    preloaded, plus what ``precompile serve`` adds for one worker (``serving_env``: OpenMP's wait
    policy and threads, ``malloc``'s allocator preloaded)."""
    from precompile.serve.server import serving_env

    base = {k: v for k, v in os.environ.items() if k != PRELOAD_ENV}  # the user's allocator is malloc's to choose
    return {**base, **serving_env(1, base, malloc=malloc)}


def measure(
    artifacts: list[Path],
    *,
    shapes: int = 3,
    repeat: int = 20,
    warmups: tuple[str, ...] = WARMUPS,
    env: dict[str, str] | None = None,
    onnx: list[Path] | None = None,
) -> list[dict[str, Any]]:
    """One row per (artifact, warm-up mode, dynamic variant, shape), each artifact and mode measured
    in its own process, on the same shapes in every mode. ``env``: those processes' environment
    (default: this one's, OpenMP's idle threads asleep after the short spin ``precompile serve``
    sets, ``loader.threads.wait_env``; before 2026-12-07 they slept at once, which slowed every call
    of a convnet, oneDNN's and generated code alike), e.g. with an allocator preloaded. ``onnx``:
    each artifact's ONNX export, whose first calls ONNX Runtime makes at the same shapes, in a process
    on glibc's malloc, as its users run it."""
    rows: list[dict[str, Any]] = []
    if env is None:
        env = {**os.environ, **wait_env()}
    onnx_env = {k: v for k, v in env.items() if k != PRELOAD_ENV}
    for k, path in enumerate(artifacts):
        mine: list[dict[str, Any]] = []
        for mode in warmups:
            mine += _run_child(
                ["--child", str(path), "--shapes", str(shapes), "--repeat", str(repeat), "--warmup-shapes", mode],
                env, {"artifact": str(path), "warmup": mode},
            )  # fmt: skip
        rows += mine
        done = [r for r in mine if "failed" not in r]
        if onnx and done:
            from loader.artifact import read_manifest

            inputs = [
                {"name": i.name, "shape": list(i.shape), "dtype": i.dtype, "range": [i.range.min, i.range.max] if i.range else None}
                for i in read_manifest(path).inputs
            ]  # fmt: skip
            plan = {
                "warmed": done[-1]["warmed"], "threads": done[-1].get("threads", 1), "model": done[-1]["model"],
                "dims": [r["dims"] for r in done if r["warmup"] == done[-1]["warmup"]], "inputs": inputs,
            }  # fmt: skip
            rows += _run_child(
                ["--onnx-child", str(onnx[k]), "--repeat", str(repeat), "--plan", json.dumps(plan)],
                onnx_env, {"artifact": str(onnx[k]), "warmup": "onnxruntime"},
            )  # fmt: skip
    return rows


def _run_child(argv: list[str], env: dict[str, str], where: dict[str, Any]) -> list[dict[str, Any]]:
    """A fresh process's rows (``python -m bench.firstcall`` with ``argv``); one failed row if it fails."""
    run = subprocess.run(
        [sys.executable, "-m", "bench.firstcall", *argv], cwd=ROOT, env=env, capture_output=True, text=True
    )
    if run.returncode != 0:
        return [{**where, "failed": run.stderr.strip().splitlines()[-1:] or ["exit"]}]
    return json.loads(run.stdout.strip().splitlines()[-1])


def _onnx_child(path: Path, repeat: int, plan: dict[str, Any]) -> list[dict[str, Any]]:
    """ONNX Runtime's first and steady calls at ``plan``'s shapes, after its warm-up shapes, with its
    thread count (``bench.peers.open_engine``: the bench's ONNX Runtime session)."""
    import numpy as np

    from .peers import open_engine

    start = time.perf_counter()
    run, facts = open_engine("onnxruntime", str(path), plan["threads"])
    load_s = time.perf_counter() - start
    rng = np.random.default_rng(22)

    def feeds(sizes: dict[str, int]) -> dict[str, Any]:
        """The artifact's inputs at ``sizes`` (its manifest's names, shapes, dtypes and ranges)."""
        out = {}
        for spec in plan["inputs"]:
            shape = [sizes[d] if isinstance(d, str) else d for d in spec["shape"]]
            if spec["dtype"] == "bool":
                out[spec["name"]] = np.ones(shape, dtype=bool)
            elif spec["dtype"].startswith(("int", "uint")):
                lo, hi = spec["range"] or (0, 1)
                out[spec["name"]] = rng.integers(int(lo), int(hi) + 1, shape).astype(spec["dtype"])
            else:
                out[spec["name"]] = rng.standard_normal(shape).astype(spec["dtype"])
        return out

    for sizes in plan["warmed"]:
        run(feeds(sizes))
    rows = []
    for sizes in plan["dims"]:
        x = feeds(sizes)
        times = []
        for _ in range(repeat + 1):
            cpu, t = time.process_time(), time.perf_counter()
            run(x)
            times.append(((time.perf_counter() - t) * 1000, (time.process_time() - cpu) * 1000))
        first, steady = times[0], statistics.median(w for w, _ in times[1:])
        rows.append({
            "artifact": str(path), "model": plan["model"], "warmup": "onnxruntime", "load_s": load_s,
            "warmed": plan["warmed"], "threads": facts["threads"], "variant": "onnxruntime", "dims": sizes,
            "shape": "unseen", "first_ms": first[0], "steady_ms": steady, "ratio": first[0] / steady,
            "first_cpu_ms": first[1], "steady_cpu_ms": statistics.median(c for _, c in times[1:]),
            "first_faults": 0, "steady_faults": 0, "malloc": in_use(),
        })  # fmt: skip
    return rows


def _child(path: Path, shapes: int, repeat: int, warmup_shapes: str) -> list[dict[str, Any]]:
    import torch

    import loader.warmup

    start = time.perf_counter()
    model = loader.load(path, warmup_shapes=warmup_shapes, open="eager")
    load_s = time.perf_counter() - start
    rng = random.Random(22)
    rows = []
    # A variant another serves the first calls of (Variant.first_calls_of) is timed as calls reach
    # it, through dispatch: the first call at a shape runs the other; once the loader has run it
    # there in the background (wait_first_calls), the next is its own first in this thread ("then").
    served = {v.first_calls_of for v in model.manifest.variants if v.first_calls_of}
    for v in model.manifest.variants:
        if v.kind != "dynamic" or v.id not in model.variant_precision or v.first_calls_of:
            continue
        dispatched = v.id in served
        warmed = model.warmed.get(v.id, [])
        unseen = [_unseen(rng, v, [dict(v.hint), loader.warmup.largest(v), *v.warm]) for _ in range(shapes)]
        for kind, sizes in [*(("unseen", s) for s in unseen), *(("traffic", dict(s)) for s in v.warm[:shapes])]:
            args = [_input(torch, spec, sizes, rng) for spec in model.manifest.inputs]
            first, first_cpu, first_faults, first_variant = _timed(model, v.id, args, dispatched)
            then = {}
            if dispatched:
                model.wait_first_calls(300)
                then_ms, _, _, then_variant = _timed(model, v.id, args, dispatched)
                then = {"first_variant": first_variant, "then_ms": then_ms, "then_variant": then_variant}
            times = [_timed(model, v.id, args, dispatched) for _ in range(repeat)]
            steady = statistics.median(t[0] for t in times)
            if dispatched:
                then["then_ratio"] = then["then_ms"] / steady
            rows.append({
                "artifact": str(path), "model": model.name, "warmup": warmup_shapes, "load_s": load_s, "warmed": warmed,
                "malloc": in_use(), "threads": torch.get_num_threads(),
                "variant": v.id, "precision": v.precision, "dims": sizes, "shape": kind,
                "first_ms": first, "steady_ms": steady, "ratio": first / steady,
                "first_cpu_ms": first_cpu, "steady_cpu_ms": statistics.median(t[1] for t in times),
                "first_faults": first_faults, "steady_faults": statistics.median(t[2] for t in times), **then,
            })  # fmt: skip
    return rows


def _timed(model: Any, variant_id: str, args: list, dispatched: bool = False) -> tuple[float, float, int, str]:
    """One call of the variant (``dispatched``: a call of the model, which dispatch sends to it or to
    the variant serving its first calls): wall ms, this process's CPU ms (every thread), minor page
    faults, the variant that ran."""
    faults = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    cpu, start = time.process_time(), time.perf_counter()
    if dispatched:
        _, variant_id = model.call_detailed(*args)
    else:
        model.run_variant(variant_id, *args)
    wall, cpu = (time.perf_counter() - start) * 1000, (time.process_time() - cpu) * 1000
    return wall, cpu, resource.getrusage(resource.RUSAGE_SELF).ru_minflt - faults, variant_id


def _unseen(rng: random.Random, v: Any, warmable: list[Any], tries: int = 100) -> dict[str, int]:
    """Sizes inside ``v``'s ranges that no warm-up mode runs (so that every mode meets the same
    shapes); where the ranges hold no other, the last drawn."""
    for _ in range(tries):
        sizes = {d: rng.randint(r.min, r.max) for d, r in v.dims.items()}
        if sizes not in warmable:
            break
    return sizes


def _input(torch: Any, spec: Any, sizes: dict[str, int], rng: random.Random) -> Any:
    shape = [sizes[s] if isinstance(s, str) else s for s in spec.shape]
    gen = torch.Generator().manual_seed(rng.randrange(1 << 30))
    dtype = getattr(torch, spec.dtype)
    if dtype.is_floating_point:
        return torch.randn(shape, generator=gen, dtype=dtype)
    if dtype == torch.bool:
        return torch.ones(shape, dtype=torch.bool)
    lo, hi = (spec.range.min, spec.range.max) if spec.range is not None else (0, 1)
    return torch.randint(int(lo), int(hi) + 1, shape, generator=gen, dtype=dtype)


def _name(r: dict[str, Any]) -> str:
    """A row's model (its manifest's name; the artifact's folder where it failed), the load's warm-up
    mode, and for a shape of the build's traffic (``plan.warm_shapes``) rather than an unseen one, so."""
    traffic = " traffic" if r.get("shape") == "traffic" else ""
    return f"{r.get('model') or Path(r['artifact']).name} [warm-up: {r.get('warmup', 'hint')}]{traffic}"


def report(rows: list[dict[str, Any]]) -> str:
    lines = [
        f"{'artifact [warm-up]':<36} {'variant':<12} {'dims':<30} {'first ms':>9} {'steady ms':>9} {'ratio':>6}"
        f" {'cpu ms first/steady':>20} {'faults first/steady':>20}"
    ]
    for r in rows:
        if "failed" in r:
            lines.append(f"{_name(r):<36} failed: {r['failed'][0]}")
            continue
        dims = " ".join(f"{d}={n}" for d, n in r["dims"].items())
        flag = "" if _worst(r) <= TARGET else f"  > {TARGET}×"
        cpu = f"{r['first_cpu_ms']:.1f}/{r['steady_cpu_ms']:.1f}"
        faults = f"{r['first_faults']}/{r['steady_faults']:g}"
        lines.append(
            f"{_name(r):<36} {r['variant']:<12} {dims:<30} {r['first_ms']:9.2f} "
            f"{r['steady_ms']:9.2f} {r['ratio']:6.2f} {cpu:>20} {faults:>20}{flag}"
        )
        if "then_ms" in r:
            lines.append(
                f"{'':<36} {'':<12} first call on {r['first_variant']}; the next, on {r['then_variant']} "
                f"once warmed in the background: {r['then_ms']:.2f} ms, {r['then_ratio']:.2f}×"
            )
    return "\n".join(lines)


def _worst(r: dict[str, Any]) -> float:
    """A row's worst call at its shape over the steady one: the first, or where another variant served
    it, the first or the next (the variant's own first in this thread)."""
    return max(r["ratio"], r.get("then_ratio", 0.0))


def per_artifact(rows: list[dict[str, Any]]) -> dict[str, dict[str, Any]]:
    """Per artifact and warm-up mode (``name [warm-up: mode]``): its shapes' median and worst
    first/steady ratio, whether the worst meets ``TARGET``, the first calls' page faults in all and
    the load's seconds; an artifact that failed says so."""
    out: dict[str, dict[str, Any]] = {}
    for name in dict.fromkeys(_name(r) for r in rows):
        mine = [r for r in rows if _name(r) == name]
        done = [r for r in mine if "failed" not in r]
        if not done:
            out[name] = {"failed": mine[0].get("failed", ["no dynamic variant"])[0]}
            continue
        ratios = [_worst(r) for r in done]
        worst = max(ratios)
        out[name] = {
            "shapes": len(ratios), "median": statistics.median(ratios), "worst": worst, "met": worst <= TARGET,
            "first_faults": sum(r["first_faults"] for r in done), "load_s": done[0]["load_s"],
            "kind": done[0].get("shape", "unseen"),
        }  # fmt: skip
    return out


def summary(rows: list[dict[str, Any]]) -> str:
    """One line per artifact and warm-up mode (and its traffic's shapes apart): the first call against
    the steady one over those shapes."""
    lines = []
    for name, s in per_artifact(rows).items():
        if "failed" in s:
            lines.append(f"{name}: first call not measured: {s['failed']}")
            continue
        verdict = "met" if s["met"] else "not met"
        lines.append(
            f"{name}: first call {s['median']:.2f}× the steady one (median of {s['shapes']} {s['kind']} shapes), "
            f"worst {s['worst']:.2f}×: target ≤ {TARGET}× {verdict}; {s['first_faults']} page faults in "
            f"the first calls, load {s['load_s']:.2f} s"
        )
    return "\n".join(lines)


def main() -> None:
    import loader.warmup  # loader before torch: OpenMP's wait policy, oneDNN's cache sizes

    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("artifacts", nargs="+", type=Path)
    parser.add_argument("--shapes", type=int, default=3, help="unseen shapes per dynamic variant")
    parser.add_argument("--repeat", type=int, default=20, help="calls timed for the steady median")
    parser.add_argument(
        "--warmup-shapes", nargs="+", default=list(WARMUPS), choices=loader.warmup.WARMUP_SHAPES,
        help="the load's warm-up modes to compare, each in its own process (loader.warmup)",
    )  # fmt: skip
    parser.add_argument(
        "--onnx", nargs="+", type=Path, help="each artifact's ONNX export: ONNX Runtime's first calls too"
    )
    parser.add_argument(
        "--malloc", default="auto", metavar="auto|tcmalloc|jemalloc|system|PATH",
        help="the allocator the artifact's processes run on, as `precompile serve --malloc` (default auto: "
        "tcmalloc where installed)",
    )  # fmt: skip
    parser.add_argument("--out", type=Path, help="write the rows as JSON here")
    parser.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--onnx-child", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--plan", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        print(json.dumps(_child(args.artifacts[0], args.shapes, args.repeat, args.warmup_shapes[0])))
        return
    if args.onnx_child:
        print(json.dumps(_onnx_child(args.artifacts[0], args.repeat, json.loads(args.plan))))
        return
    if args.onnx and len(args.onnx) != len(args.artifacts):
        parser.error("--onnx: one ONNX export per artifact, in the same order")
    try:
        resolve(args.malloc)
    except MallocError as e:
        parser.error(str(e))
    rows = measure(
        args.artifacts, shapes=args.shapes, repeat=args.repeat, warmups=tuple(args.warmup_shapes),
        env=serving_process_env(args.malloc), onnx=args.onnx,
    )  # fmt: skip
    print(report(rows))
    print(summary(rows))
    if args.out:
        args.out.write_text(json.dumps({"rows": rows}, indent=2) + "\n")


if __name__ == "__main__":
    main()
