"""ResNet-50's int8 under the precision gate: is the verdict stable, and what does the fallback keep?

    python -m bench.int8_gate --work /tmp/int8            # about 25 minutes on 2 busy cores

1. The gate's verdict, before and after. The int8 variant is quantized as the build does
   (``stages.quantize.static_int8``) with the default options and with ResNet-50's last bottleneck
   block kept in fp32 on 64 calibration samples, and compiled as the build compiles it
   (``stages.compile.compile_package``). Each is then scored as the old gate did (the worst row on
   the calibration inputs themselves) and as the gate does now (``calibration.gate_inputs``: held-out
   inputs of the traffic's shapes; ``compare.summarize``: p5, with worst and mean beside it) at 3
   seeds × 3 sample counts.
2. A build (``precompile.build``, fp32 and int8) under a gate the default int8 fails (``--threshold``,
   cosine p5 ≥ 0.995 by default): what the fallback measured, kept and scored (the manifest's gate
   record), and then the CPU seconds per call of fp32 and int8, single-threaded, ``time.process_time``
   (deterministic enough on a busy machine; wall times are not taken).

Accuracy figures do not depend on the machine's load; the CPU times do a little (caches): run it on a
quiet machine for figures.
"""

from __future__ import annotations

import argparse
import importlib
import json
import sys
import time
from pathlib import Path
from typing import Any

import torch

from .precision import LAST_BLOCK, PROFILES, ROOT

COUNTS = (32, 64, 128)
SEEDS = (0, 1, 2)
OPTIONS = [("default", {}, 16), ("keep: the last block, 64 samples", {"keep": [LAST_BLOCK]}, 64)]
SHAPES = [
    {"batch": 1, "height": 64, "width": 64},
    {"batch": 1, "height": 128, "width": 128},
    {"batch": 2, "height": 96, "width": 96},
]


def study(work: Path, log: Any) -> list[dict[str, Any]]:
    """Part 1 of the module docstring: per option, the old gate's value and the new gate's per seed and count."""
    from precompile.calibration import calibration_inputs, gate_inputs
    from precompile.compare import accuracy_entries, row_values, summarize
    from precompile.options import unit_options
    from precompile.profile import load_profile
    from precompile.stages import quantize
    from precompile.stages.compile import compile_package
    from precompile.tracing import export_model
    from precompile.traffic import read_distribution

    loaded = load_profile(PROFILES / "resnet50_precision.yaml")
    profile, traffic = loaded.profile, read_distribution(loaded)
    model = _model(profile)
    ranges = {d: (s.min, s.max) for d, s in profile.dims.items()}
    hint = {d: s.max for d, s in profile.dims.items()}
    ep = export_model(model, profile, ranges, hint)
    out = []
    for label, changes, count in OPTIONS:
        changed = profile.model_copy(
            update={
                "calibration": profile.calibration.model_copy(update={"samples": count}),
                "quantization": profile.quantization.model_copy(update=changes),
            }
        )
        cal_loaded = loaded.model_copy(update={"profile": changed})
        calibration = calibration_inputs(cal_loaded, traffic)
        converted = quantize.static_int8(ep.module(), changed.quantization, [a for _, a in calibration])
        package = compile_package(
            export_model(converted, profile, ranges, hint), work / f"study-{len(out)}.pt2", unit_options({}, "int8")
        )
        compiled = torch._inductor.aoti_load_package(str(package.path))
        rule = profile.accuracy.rule(0)

        def pairs(samples):
            with torch.no_grad():
                return [([model(*a)], [compiled(*a)]) for _, a in samples]

        old = min(float(row_values(rule, w[0], g[0]).min()) for w, g in pairs(calibration))
        log(f"{label}: old gate (worst row, on the {count} calibration inputs): {old:.4f}")
        runs = []
        for seed in SEEDS:
            for n in COUNTS:
                p = profile.model_copy(
                    update={
                        "check": profile.check.model_copy(update={"seed": profile.check.seed + seed}),
                        "accuracy": profile.accuracy.model_copy(update={"samples": n}),
                    }
                )
                held = gate_inputs(loaded.model_copy(update={"profile": p}), traffic, ranges)
                calibrated = {tuple(t.flatten()[:8].tolist()) for _, a in calibration for t in a}
                overlap = sum(tuple(a[0].flatten()[:8].tolist()) in calibrated for _, a in held)
                scored = pairs(held)
                (entry,) = accuracy_entries(changed, scored)
                values = torch.cat([row_values(rule, w[0], g[0]) for w, g in scored])
                runs.append(
                    {
                        "seed": seed,
                        "samples": n,
                        "rows": entry["rows"],
                        "p5": entry["value"],
                        "worst": summarize(rule, values, "worst"),
                        "mean": summarize(rule, values, "mean"),
                        "passed": entry["passed"],
                        "overlap_with_calibration": overlap,
                    }
                )
                r = runs[-1]
                log(
                    f"  seed +{seed}, {n:>3} inputs ({r['rows']:>3} rows): p5 {r['p5']:.4f} "
                    f"{'pass' if r['passed'] else 'FAIL'}  worst {r['worst']:.4f}  mean {r['mean']:.4f}  "
                    f"shared with calibration: {overlap}"
                )
        out.append({"option": label, "calibration_samples": count, "old_gate_worst_in_sample": old, "runs": runs})
    return out


def fallback_build(work: Path, threshold: float, log: Any) -> dict[str, Any]:
    """Part 2 of the module docstring."""
    import yaml

    from precompile import build

    raw = yaml.safe_load((PROFILES / "resnet50_precision.yaml").read_text())
    raw.pop("compile", None)
    raw.update(precision=["fp32", "int8"], accuracy={"metric": "cosine", "threshold": threshold})
    start = time.perf_counter()
    result = build(raw, work / "artifact", folder=PROFILES)
    seconds = time.perf_counter() - start
    records = result.manifest.check.precision
    for r in records:
        log(json.dumps(r, indent=1)[:4000])
    timing = cpu_times(work, log)
    return {
        "threshold": threshold,
        "build_seconds": seconds,
        "gate": records,
        "cpu_ms_per_call": timing,
        "shapes": SHAPES,
    }


def cpu_times(work: Path, log: Any) -> dict[str, list[float]]:
    """CPU ms per call, one thread (``time.process_time``, 10 calls after 3), at ``SHAPES``: each
    precision the artifact in ``work`` kept (through the loader), and the int8 packages part 1 compiled
    (``study-*.pt2``, called directly: what the build would have kept under a gate they pass)."""
    import loader

    torch.set_num_threads(1)
    runs: dict[str, Any] = {}
    artifact = work / "artifact"
    if artifact.exists():
        for precision in sorted({v.precision for v in loader.load(artifact).manifest.variants}):
            runs[f"artifact {precision}"] = loader.load(artifact, precision=precision)
    for k, (label, _, _) in enumerate(OPTIONS):
        if (work / f"study-{k}.pt2").exists():
            runs[f"int8 {label}"] = torch._inductor.aoti_load_package(str(work / f"study-{k}.pt2"))
    timing = {}
    for label, run in runs.items():
        per_shape = []
        for sizes in SHAPES:
            x = torch.rand(
                sizes["batch"], 3, sizes["height"], sizes["width"], generator=torch.Generator().manual_seed(1)
            )
            with torch.no_grad():
                for _ in range(3):
                    run(x)
                t = time.process_time()
                for _ in range(10):
                    run(x)
            per_shape.append((time.process_time() - t) / 10 * 1000)
        timing[label] = per_shape
        log(f"{label}: CPU ms per call, 1 thread, at {SHAPES}: {[round(v, 2) for v in per_shape]}")
    return timing


def _model(profile: Any) -> torch.nn.Module:
    sys.path.insert(0, str(PROFILES))
    module, factory = profile.model.factory.split(":")
    return getattr(importlib.import_module(module), factory)()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--work", type=Path, required=True, help="build and compile into this folder")
    parser.add_argument("--threshold", type=float, default=0.995, help="part 2's gate: cosine p5 at least this")
    parser.add_argument("--skip-study", action="store_true")
    parser.add_argument("--skip-build", action="store_true")
    parser.add_argument("--times-only", action="store_true", help="only the CPU times of what --work holds")
    parser.add_argument("--out", type=Path, default=ROOT / "bench" / "results" / "int8_gate.json")
    args = parser.parse_args()
    args.work.mkdir(parents=True, exist_ok=True)

    def log(s: str) -> None:
        print(s, flush=True)

    result: dict[str, Any] = {}
    if args.times_only:
        result["cpu_ms_per_call"] = cpu_times(args.work, log)
        args.out.write_text(json.dumps(result, indent=2) + "\n")
        return
    if not args.skip_study:
        result["study"] = study(args.work, log)
    if not args.skip_build:
        result["fallback"] = fallback_build(args.work, args.threshold, log)
    args.out.write_text(json.dumps(result, indent=2) + "\n")
    log(f"wrote {args.out}")


if __name__ == "__main__":
    main()
