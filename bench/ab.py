"""Two builds of one model, each served by the checkout of precompile that built it, timed in turn.

    git worktree add --detach ../old 35ef64c                  # the version to compare against
    (cd ../old && PYTHONPATH=. python -m precompile build PROFILE -o /tmp/old)
    python -m precompile build PROFILE -o /tmp/new
    python -m bench.ab --side ../old /tmp/old --side . /tmp/new \\
        --shape batch=1,seq=16 --shape batch=8,seq=128 [--rounds 5] [--seconds 1] [--out ab.json]

    python -m bench.ab --side . /tmp/new --onnx model.onnx --shape batch=1,height=32,width=32   # and ONNX Runtime

Answers "is this version slower than that one on this model?" where the two cannot share a process:
each side's artifact is loaded by its own checkout's loader (``PYTHONPATH`` set to it, so the old
loader reads the old artifact), in a fresh process per round, the sides alternating, so that a drift
of the host's speed falls on both. Per shape: the median call over ``--seconds`` of calls in each
round, then the median over the rounds, and its ratio to the first side's. The inputs are drawn from
the manifest's specs (random floats; integers inside the input's range; an ``attention_mask`` all
ones, unpadded). Two threads, OpenMP's idle
threads asleep after a short spin (``precompile serve``'s settings); ``--env NAME=VALUE`` adds to
the processes' environment (``--env LD_PRELOAD=...`` for an allocator). ``--onnx MODEL.onnx`` adds ONNX
Runtime as one more side, run as it would be in production: a fresh process per round like the others
(so its spinning threads meet no other engine's), its CPU provider with as many intra-op threads and
its default settings otherwise, on inputs of the first artifact's shapes (``bench.onnx_export`` writes
such a file). Asserts nothing; run it on a quiet machine (``python -m bench.monitor -- ...``).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
from pathlib import Path
from typing import Any

from loader.threads import wait_env

# Run by each side's interpreter with that side's checkout first on the path: it may use only what
# every version of the loader has (load, the manifest's inputs, calls by input name).
CHILD = r"""
import json, sys, time
import torch
import loader

path, shapes, seconds = sys.argv[1], json.loads(sys.argv[2]), float(sys.argv[3])
model = loader.load(path, threads=2)
out = {}
for k, sizes in enumerate(shapes):
    gen = torch.Generator().manual_seed(k)
    inputs = {}
    for spec in model.manifest.inputs:
        shape = [sizes[s] if isinstance(s, str) else s for s in spec.shape]
        dtype = getattr(torch, spec.dtype)
        if dtype.is_floating_point:
            inputs[spec.name] = torch.randn(shape, generator=gen, dtype=dtype)
        else:
            lo, hi = (spec.range.min, spec.range.max) if spec.range is not None else (0, 1)
            if spec.name == "attention_mask":
                lo = hi = 1
            inputs[spec.name] = torch.randint(int(lo), int(hi) + 1, shape, generator=gen, dtype=dtype)
    for _ in range(5):
        model(**inputs)
    times, end = [], time.perf_counter() + seconds
    while time.perf_counter() < end or len(times) < 10:
        start = time.perf_counter()
        model(**inputs)
        times.append((time.perf_counter() - start) * 1000)
    times.sort()
    out[k] = times[len(times) // 2]
print("AB " + json.dumps({"loader": loader.__file__, "ms": out}))
"""

# ONNX Runtime's side: {input name: (shape, dtype, (low, high) for integers)} per shape, as the first
# artifact's manifest gives them.
ONNX_CHILD = r"""
import json, sys, time
import numpy as np
from bench.peers import open_engine

path, feeds_spec, seconds = sys.argv[1], json.loads(sys.argv[2]), float(sys.argv[3])
run, _ = open_engine("onnxruntime", path, 2)
out = {}
for k, specs in enumerate(feeds_spec):
    rng = np.random.default_rng(k)
    feeds = {}
    for name, (shape, dtype, bounds) in specs.items():
        if bounds is None:
            feeds[name] = rng.standard_normal(shape).astype(dtype)
        else:
            feeds[name] = rng.integers(bounds[0], bounds[1] + 1, size=shape).astype(dtype)
    for _ in range(5):
        run(feeds)
    times, end = [], time.perf_counter() + seconds
    while time.perf_counter() < end or len(times) < 10:
        start = time.perf_counter()
        run(feeds)
        times.append((time.perf_counter() - start) * 1000)
    times.sort()
    out[k] = times[len(times) // 2]
print("AB " + json.dumps({"loader": "onnxruntime", "ms": out}))
"""
ROOT = Path(__file__).resolve().parent.parent


def onnx_feeds(artifact: Path, shapes: list[dict[str, int]]) -> list[dict[str, Any]]:
    """ONNX Runtime's inputs at each of ``shapes``: per input its shape, numpy dtype and, for an
    integer input, the range its values are drawn from (as the loader's side draws them)."""
    manifest = json.loads((artifact / "manifest.json").read_text())
    feeds = []
    for sizes in shapes:
        specs = {}
        for spec in manifest["inputs"]:
            shape = [sizes[s] if isinstance(s, str) else s for s in spec["shape"]]
            bounds = None
            if not spec["dtype"].startswith(("float", "bfloat")):
                lo, hi = spec["range"] if spec.get("range") else (0, 1)
                bounds = (1, 1) if spec["name"] == "attention_mask" else (int(lo), int(hi))
            specs[spec["name"]] = (shape, spec["dtype"], bounds)
        feeds.append(specs)
    return feeds


def measure(
    sides: list[tuple[Path, Path]],
    shapes: list[dict[str, int]],
    *,
    rounds: int = 5,
    seconds: float = 1.0,
    env: dict[str, str] | None = None,
    onnx: Path | None = None,
) -> dict[str, Any]:
    """``sides``: (checkout, artifact) pairs; ``onnx``: an ONNX file for ONNX Runtime, a last side.
    Per side and shape, every round's median ms."""
    base = {**os.environ, **wait_env({}), **(env or {})}  # what precompile serve sets
    for tree, _ in sides:
        if not (tree / "loader" / "__init__.py").is_file():
            raise SystemExit(f"bench.ab: {tree} is no checkout of precompile (no loader/ in it)")
    if onnx is not None:
        if not onnx.is_file():
            raise SystemExit(f"bench.ab: --onnx {onnx}: no such file")
        feeds = json.dumps(onnx_feeds(sides[0][1], shapes))
        sides = [*sides, (ROOT, onnx)]
    runs: list[list[list[float]]] = [[[] for _ in shapes] for _ in sides]
    for _ in range(rounds):
        for i, (tree, artifact) in enumerate(sides):
            is_onnx = onnx is not None and i == len(sides) - 1
            child = subprocess.run(
                [sys.executable, "-c", ONNX_CHILD if is_onnx else CHILD, str(artifact.resolve()),
                 feeds if is_onnx else json.dumps(shapes), str(seconds)],
                # ONNX Runtime's threads as its own defaults have them (it never reads OpenMP's settings)
                env={**(os.environ if is_onnx else base), "PYTHONPATH": str(tree.resolve())},
                cwd=tree,
                capture_output=True,
                text=True,
            )  # fmt: skip
            line = next((x for x in child.stdout.splitlines() if x.startswith("AB ")), None)
            if child.returncode != 0 or line is None:
                raise SystemExit(f"bench.ab: {artifact} under {tree} failed:\n{child.stderr[-2000:]}")
            said = json.loads(line[3:])
            if not is_onnx and not Path(said["loader"]).resolve().is_relative_to(tree.resolve()):
                raise SystemExit(f"bench.ab: {artifact} was loaded by {said['loader']}, not by {tree}'s loader")
            for k, ms in said["ms"].items():
                runs[i][int(k)].append(ms)
    result: dict[str, Any] = {"rounds": rounds, "seconds": seconds, "shapes": shapes, "sides": []}
    for (tree, artifact), per_shape in zip(sides, runs):
        medians = [statistics.median(r) for r in per_shape]
        result["sides"].append({
            "checkout": str(tree), "artifact": str(artifact), "median_ms": medians, "sum_ms": sum(medians),
            "rounds_ms": per_shape,
        })  # fmt: skip
    first = result["sides"][0]
    for side in result["sides"]:
        side["ratio_to_first"] = side["sum_ms"] / first["sum_ms"]
    return result


def report(result: dict[str, Any]) -> str:
    names = [",".join(f"{d}={n}" for d, n in s.items()) for s in result["shapes"]]
    labels = [
        f"onnxruntime: {Path(s['artifact']).name}"
        if s["artifact"].endswith(".onnx")
        else f"{Path(s['checkout']).name or s['checkout']}: {Path(s['artifact']).name}"
        for s in result["sides"]
    ]
    width = max(len(label) for label in labels)
    lines = [f"{'checkout: artifact':{width}} " + " ".join(f"{n:>{len(n)}}" for n in names) + "       sum  ratio"]
    for label, side in zip(labels, result["sides"]):
        cells = " ".join(f"{ms:{len(n)}.3f}" for n, ms in zip(names, side["median_ms"]))
        lines.append(f"{label:{width}} {cells} {side['sum_ms']:9.2f} {side['ratio_to_first']:5.3f}×")
    return "\n".join(lines)


def _shape(text: str) -> dict[str, int]:
    try:
        return {k.strip(): int(v) for k, v in (part.split("=") for part in text.split(","))}
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r}: expected DIM=SIZE,DIM=SIZE (batch=1,seq=16)") from None


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m bench.ab", description=__doc__.split("\n\n")[0])
    parser.add_argument("--side", nargs=2, action="append", type=Path, metavar=("CHECKOUT", "ARTIFACT"), required=True)
    parser.add_argument("--shape", action="append", type=_shape, required=True, help="DIM=SIZE,...")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--seconds", type=float, default=1.0)
    parser.add_argument("--env", action="append", default=[], metavar="NAME=VALUE")
    parser.add_argument("--onnx", type=Path, help="an ONNX export of the model: ONNX Runtime as a last side")
    parser.add_argument("--out", type=Path)
    opts = parser.parse_args(argv)
    if len(opts.side) + (opts.onnx is not None) < 2:
        parser.error("give two --side CHECKOUT ARTIFACT pairs at least, or one and --onnx")
    env = dict(e.split("=", 1) for e in opts.env)
    result = measure(
        [tuple(s) for s in opts.side], opts.shape, rounds=opts.rounds, seconds=opts.seconds, env=env, onnx=opts.onnx
    )
    print(report(result))
    if opts.out:
        opts.out.write_text(json.dumps(result, indent=1) + "\n")
        print(f"wrote {opts.out}")


if __name__ == "__main__":
    main()
