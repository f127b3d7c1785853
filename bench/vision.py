"""The vision suite: five kinds of convnet at any image size, against eager and the CPU peers.

    .venv/bin/python -m bench.vision [--models resnet50 mobilenet_v2 ...] [--seconds 1.0] [--out bench/results/vision.json]

    resnet50         dense 3×3 and 1×1 convolutions (bottlenecks)
    mobilenet_v2     depthwise convolutions
    efficientnet_b0  depthwise convolutions and squeeze-and-excite
    regnet_y         grouped convolutions (RegNetY-4GF) and squeeze-and-excite
    segformer        an encoder-decoder for segmentation (MiT-b0: attention over strided convolutions)

Each from its transformers config with random weights (``profiles/bench/models.py``), built from
``profiles/bench/vision_<model>.yaml``: one dynamic fp32 variant over batch 1-4 and 96-256 pixels a
side. Timed, one method after another per shape, on the range's two ends, the variant's hint and two
random shapes: fp32 eager, the artifact, ONNX Runtime, OpenVINO with its defaults (bf16 on CPUs with
AMX) and OpenVINO f32, each checked against eager on the same inputs. Then, per model, the first call
at shapes the artifact never met against the steady call (``bench.firstcall``). Prints and writes the
median ms per shape, their sum and each method's ratio to ONNX Runtime.

Needs the bench extra (make venv-bench). Run it on a quiet machine: the builds take most of the time.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import shutil
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from precompile.errors import PrecompileError

from . import firstcall
from .precision import PROFILES, ROOT, compared_methods, time_shapes

MODELS = ("resnet50", "mobilenet_v2", "efficientnet_b0", "regnet_y", "segformer")
PEER = "ONNX Runtime (f32)"  # the ratios' reference


def suite_shapes(hint: dict[str, int], seed: int = 22) -> list[dict[str, int]]:
    """The range's two ends, the hint, and two shapes drawn inside the range."""
    rng = random.Random(seed)
    drawn = [
        {"batch": rng.randint(1, 4), "height": rng.randint(96, 256), "width": rng.randint(96, 256)} for _ in range(2)
    ]
    return [{"batch": 1, "height": 96, "width": 96}, {"batch": 4, "height": 256, "width": 256}, dict(hint), *drawn]


def run_model(name: str, work: Path, seconds: float, log: Callable[[str], None]) -> dict[str, Any]:
    """Build ``name``'s vision profile in ``work``, check and time its methods (the module docstring)."""
    from precompile.pipeline import build
    from precompile.samples import make_inputs

    folder = work / name
    shutil.copytree(PROFILES, folder, ignore=shutil.ignore_patterns("__pycache__"), dirs_exist_ok=True)
    profile_path = folder / f"vision_{name}.yaml"
    start = time.perf_counter()
    result = build(profile_path, folder / f"artifact-{name}")
    build_s = time.perf_counter() - start
    (variant,) = [v for v in result.manifest.variants if v.kind == "dynamic" and v.precision == "fp32"]
    log(f"{name}: built in {build_s:.0f} s, hint {variant.hint}")
    loaded, methods, engines, threads = compared_methods(name, result, profile_path, log)
    profile, eager = loaded.profile, methods["eager fp32"]

    shapes = suite_shapes(variant.hint)
    error: dict[str, float] = {}
    failed: dict[str, str] = {}
    for i, sizes in enumerate(shapes):  # each method against eager, on the timed inputs
        args = make_inputs(profile, sizes, seed=100 + i)
        want = eager(args)
        scale = float(want.abs().max())
        for label, fn in list(methods.items()):
            try:
                got = fn(args)
            except Exception as e:  # a peer refusing a shape (OpenVINO: EfficientNet's 1280² pool) is its result
                failed[label] = f"{sizes}: {type(e).__name__}: {str(e).strip().splitlines()[-1][:300]}"
                log(f"{name}: {label} failed, left out: {failed[label]}")
                del methods[label]
                continue
            error[label] = max(error.get(label, 0.0), float((got - want).abs().max()) / scale)
    rows = time_shapes(profile, shapes, methods, seconds, log)
    totals = {label: sum(r[label] for r in rows) for label in methods}
    first = firstcall.measure([result.path], shapes=2, repeat=max(3, int(10 * seconds)))
    log(firstcall.report(first))
    return {
        "model": name,
        "build_seconds": build_s,
        "hint": variant.hint,
        "shapes": rows,
        "total_ms": totals,
        "max_relative_error_vs_eager": error,
        "failed_methods": failed,
        "first_call": first,
        "engines": engines,
        "threads": threads,
    }


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
            lines.append(f"  {label:<28} {total:9.1f} ms  {ratio}   max rel. error {err:.1e}")
        for label, why in r["failed_methods"].items():
            lines.append(f"  {label:<28} failed: {why}")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--models", nargs="+", default=list(MODELS), choices=MODELS)
    parser.add_argument("--seconds", type=float, default=1.0, help="timing per method per shape")
    parser.add_argument("--out", type=Path, default=ROOT / "bench" / "results" / "vision.json")
    args = parser.parse_args()
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    results = []
    with tempfile.TemporaryDirectory(prefix="vision-bench-") as tmp:
        for name in args.models:
            try:
                results.append(run_model(name, Path(tmp), args.seconds, lambda s: print(s, flush=True)))
            except PrecompileError as e:  # one model that does not build leaves the others to run
                print(f"{name}: failed: {e}", flush=True)
                results.append({"model": name, "failed": str(e)})
    print(summary(results))
    args.out.write_text(
        json.dumps({"results": results, "cpu": torch.cpu.get_capabilities().get("cpu_name")}, indent=2) + "\n"
    )
    print(f"\nwrote {args.out}")


if __name__ == "__main__":
    main()
