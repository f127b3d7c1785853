"""The first call at a shape no call met before, against the steady call at that shape, per dynamic variant.

    .venv/bin/python -m bench.firstcall ARTIFACT [ARTIFACT ...] [--shapes 3] [--repeat 20] [--out firstcall.json]

Prints one row per shape, then one line per artifact (``summary``): the median and worst ratio.

Each artifact is loaded in a fresh process, as a server loads it (``loader.load``: every variant warmed
up on its hint shape). Then, for each dynamic variant, ``--shapes`` shapes drawn inside its ranges
(none of them the hint): the first call's time, then the median of ``--repeat`` calls of the same
shape. What the first call pays over the steady one is oneDNN compiling its kernels for the shape
and ideep planning it (``loader.threads.onednn_cache_env``). Target (issue 22): first ≤ 1.5× steady.

Run it on a quiet machine; on a busy one the ratios say little.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
TARGET = 1.5  # first call / steady call


def measure(artifacts: list[Path], *, shapes: int = 3, repeat: int = 20) -> list[dict[str, Any]]:
    """One row per (artifact, dynamic variant, shape), each artifact measured in its own process."""
    rows: list[dict[str, Any]] = []
    env = {**os.environ, "OMP_WAIT_POLICY": os.environ.get("OMP_WAIT_POLICY", "PASSIVE")}
    for path in artifacts:
        run = subprocess.run(
            [sys.executable, "-m", "bench.firstcall", "--child", str(path), "--shapes", str(shapes), "--repeat", str(repeat)],
            cwd=ROOT, env=env, capture_output=True, text=True,
        )  # fmt: skip
        if run.returncode != 0:
            rows.append({"artifact": str(path), "failed": run.stderr.strip().splitlines()[-1:] or ["exit"]})
            continue
        rows += json.loads(run.stdout.strip().splitlines()[-1])
    return rows


def _child(path: Path, shapes: int, repeat: int) -> list[dict[str, Any]]:
    import torch

    import loader

    model = loader.load(path)
    rng = random.Random(22)
    rows = []
    for v in model.manifest.variants:
        if v.kind != "dynamic" or v.id not in model.variant_precision:
            continue
        for _ in range(shapes):
            sizes = {d: _unseen(rng, r.min, r.max, v.hint.get(d)) for d, r in v.dims.items()}
            args = [_input(torch, spec, sizes, rng) for spec in model.manifest.inputs]
            start = time.perf_counter()
            model.run_variant(v.id, *args)
            first = (time.perf_counter() - start) * 1000
            times = []
            for _ in range(repeat):
                start = time.perf_counter()
                model.run_variant(v.id, *args)
                times.append((time.perf_counter() - start) * 1000)
            steady = statistics.median(times)
            rows.append({
                "artifact": str(path), "variant": v.id, "precision": v.precision, "dims": sizes,
                "first_ms": first, "steady_ms": steady, "ratio": first / steady,
            })  # fmt: skip
    return rows


def _unseen(rng: random.Random, lo: int, hi: int, hint: int | None) -> int:
    choices = [n for n in range(lo, hi + 1) if n != hint] or [lo]
    return rng.choice(choices)


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


def report(rows: list[dict[str, Any]]) -> str:
    lines = [f"{'artifact':<28} {'variant':<16} {'dims':<34} {'first ms':>9} {'steady ms':>9} {'ratio':>6}"]
    for r in rows:
        if "failed" in r:
            lines.append(f"{Path(r['artifact']).name:<28} failed: {r['failed'][0]}")
            continue
        dims = " ".join(f"{d}={n}" for d, n in r["dims"].items())
        flag = "" if r["ratio"] <= TARGET else f"  > {TARGET}×"
        lines.append(
            f"{Path(r['artifact']).name:<28} {r['variant']:<16} {dims:<34} {r['first_ms']:9.2f} "
            f"{r['steady_ms']:9.2f} {r['ratio']:6.2f}{flag}"
        )
    return "\n".join(lines)


def per_artifact(rows: list[dict[str, Any]]) -> dict[str, dict[str, Any]]:
    """Per artifact (by its folder's name): its shapes' median and worst first/steady ratio, and
    whether the worst meets ``TARGET``; an artifact that failed says so."""
    out: dict[str, dict[str, Any]] = {}
    for name in dict.fromkeys(Path(r["artifact"]).name for r in rows):
        mine = [r for r in rows if Path(r["artifact"]).name == name]
        ratios = [r["ratio"] for r in mine if "failed" not in r]
        if not ratios:
            out[name] = {"failed": mine[0].get("failed", ["no dynamic variant"])[0]}
            continue
        worst = max(ratios)
        out[name] = {"shapes": len(ratios), "median": statistics.median(ratios), "worst": worst, "met": worst <= TARGET}
    return out


def summary(rows: list[dict[str, Any]]) -> str:
    """One line per artifact: the first call against the steady one over its unseen shapes."""
    lines = []
    for name, s in per_artifact(rows).items():
        if "failed" in s:
            lines.append(f"{name}: first call not measured: {s['failed']}")
            continue
        verdict = "met" if s["met"] else "not met"
        lines.append(
            f"{name}: first call {s['median']:.2f}× the steady one (median of {s['shapes']} unseen shapes), "
            f"worst {s['worst']:.2f}×: target ≤ {TARGET}× {verdict}"
        )
    return "\n".join(lines)


def main() -> None:
    import loader  # noqa: F401  before torch: OpenMP's wait policy, oneDNN's cache sizes

    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("artifacts", nargs="+", type=Path)
    parser.add_argument("--shapes", type=int, default=3, help="unseen shapes per dynamic variant")
    parser.add_argument("--repeat", type=int, default=20, help="calls timed for the steady median")
    parser.add_argument("--out", type=Path, help="write the rows as JSON here")
    parser.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        print(json.dumps(_child(args.artifacts[0], args.shapes, args.repeat)))
        return
    rows = measure(args.artifacts, shapes=args.shapes, repeat=args.repeat)
    print(report(rows))
    print(summary(rows))
    if args.out:
        args.out.write_text(json.dumps({"rows": rows}, indent=2) + "\n")


if __name__ == "__main__":
    main()
