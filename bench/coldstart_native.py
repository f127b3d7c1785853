"""Cold start of the torch-free loader beside today's loader (and ONNX Runtime, given the ONNX file of
the same model and the bench extra): fresh process to first correct result, and peak RSS.

    python -m bench.coldstart_native ARTIFACT [--rounds 5] [--dims batch=4,seq=77] [--onnx FILE] [-o OUT.json]

Methods, alternated round by round so a neighbour's load slows them alike:

    native        python, numpy, ``loader.load_native`` (torch's libraries, never ``import torch``)
    loader        python, ``import torch``, ``loader.load`` (what serving does today)
    onnxruntime   python, numpy, ``onnxruntime`` on --onnx (skipped without it or without the package)

Each child (``--child METHOD``) imports only what its method needs, loads, runs one call on inputs
made from the manifest (a fixed seed; each dim at ``--dims`` or the first variant's hint), and prints
the wall-clock time of its result and its peak RSS (``ru_maxrss``) before it saves the outputs; the
time counted is from just before the parent starts the process, interpreter start-up and imports
included. The parent checks each result against the torch loader's: bit-identical for the
torch-free path, within 1e-3 relative for ONNX Runtime. Figures mean something only on a quiet
machine; the script prints them, it never asserts on them.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

METHODS = ("native", "loader", "onnxruntime")
ROOT = Path(__file__).resolve().parent.parent


def make_case(artifact: Path, dims: dict[str, int], out: Path) -> dict[str, int]:
    """Write the inputs of one call (numpy, seeded) to ``out`` (.npz); return the dim sizes used."""
    import numpy as np

    from loader.artifact import read_manifest

    manifest = read_manifest(artifact)
    sizes = {**manifest.variants[0].hint, **dims}
    rng = np.random.default_rng(0)
    arrays = {}
    for spec in manifest.inputs:
        shape = [sizes[s] if isinstance(s, str) else s for s in spec.shape]
        if spec.dtype == "bool":
            arrays[spec.name] = np.ones(shape, dtype=bool)
        elif spec.dtype.startswith(("int", "uint")):
            lo, hi = (spec.range.min, spec.range.max) if spec.range is not None else (0, 9)
            arrays[spec.name] = rng.integers(lo, hi + 1, shape, dtype=spec.dtype)
        else:
            arrays[spec.name] = rng.standard_normal(shape).astype(spec.dtype)
    np.savez(out, **arrays)
    return sizes


def child(method: str, artifact: str, case: str, out: str, onnx: str | None) -> None:
    """One cold start; everything imported here is part of what is timed."""
    import numpy as np

    feeds = dict(np.load(case))
    if method == "native":
        import loader

        model = loader.load_native(artifact)
        names = model.input_names
        result = model(*[feeds[n] for n in names])
    elif method == "loader":
        import torch

        import loader

        model = loader.load(artifact)
        result = model(*[torch.from_numpy(feeds[n]) for n in model.input_names])
    else:
        from bench.peers import open_engine

        run, _ = open_engine("onnxruntime", onnx, len(os.sched_getaffinity(0)))
        result = run(feeds)[0]
    done = time.time()
    rss_mb = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    print(json.dumps({"done": done, "rss_mb": rss_mb}), flush=True)
    first = _first(result)
    np.save(out, first.numpy() if hasattr(first, "numpy") and not isinstance(first, np.ndarray) else np.asarray(first))


def _first(result):
    """The first array of forward()'s structure."""
    while isinstance(result, (tuple, list, dict)):
        result = next(iter(result.values())) if isinstance(result, dict) else result[0]
    return result


def start(method: str, artifact: Path, case: Path, out: Path, onnx: str | None) -> dict:
    env = {k: v for k, v in os.environ.items() if not k.startswith("OMP_")}
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))
    env["OMP_WAIT_POLICY"] = "PASSIVE"  # what precompile serve runs with, for every method alike
    command = [
        sys.executable,
        "-m",
        "bench.coldstart_native",
        "--child",
        method,
        str(artifact),
        str(case),
        str(out),
        onnx or "",
    ]
    began = time.time()
    proc = subprocess.run(command, capture_output=True, text=True, env=env, cwd=ROOT)
    if proc.returncode != 0:
        raise RuntimeError(f"{method} failed (exit {proc.returncode}):\n{proc.stderr[-3000:]}")
    report = json.loads(proc.stdout.strip().splitlines()[-1])
    return {"seconds": report["done"] - began, "rss_mb": report["rss_mb"]}


def onnxruntime_available() -> bool:
    import importlib.util

    return importlib.util.find_spec("onnxruntime") is not None


def main(argv: list[str] | None = None) -> None:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["--child"]:  # METHOD ARTIFACT CASE OUT ONNX-or-empty: one cold start
        child(*argv[1:5], argv[5] or None)
        return
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("artifact", type=Path)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--dims", default="", help="dim sizes of the call, e.g. batch=4,seq=77")
    parser.add_argument("--onnx", help="the same model as ONNX (bench.onnx_export), for ONNX Runtime")
    parser.add_argument("-o", "--output", type=Path, help="write the figures as JSON here too")
    opts = parser.parse_args(argv)
    import numpy as np

    dims = {k: int(v) for k, v in (item.split("=", 1) for item in opts.dims.split(",") if item)}
    methods = ["native", "loader"]
    skipped = {}
    if not opts.onnx:
        skipped["onnxruntime"] = "no --onnx file given"
    elif not onnxruntime_available():
        skipped["onnxruntime"] = "onnxruntime is not installed (the bench extra: make venv-bench)"
    else:
        methods.append("onnxruntime")
    with tempfile.TemporaryDirectory() as tmp:
        folder = Path(tmp)
        case = folder / "case.npz"
        sizes = make_case(opts.artifact, dims, case)
        runs: dict[str, list[dict]] = {m: [] for m in methods}
        results = {}
        for _ in range(opts.rounds):
            for method in methods:
                out = folder / f"{method}.npy"
                runs[method].append(start(method, opts.artifact, case, out, opts.onnx))
                results[method] = np.load(out)
    reference = results["loader"]
    checks = {
        "native": bool(np.array_equal(results["native"], reference) and results["native"].dtype == reference.dtype)
    }
    if "onnxruntime" in results:
        scale = float(np.abs(reference).max()) or 1.0
        checks["onnxruntime"] = bool(np.abs(results["onnxruntime"] - reference).max() / scale <= 1e-3)
    report = {
        "artifact": str(opts.artifact),
        "dims": sizes,
        "rounds": opts.rounds,
        "methods": {
            m: {
                "cold_start_s": {
                    "median": statistics.median(r["seconds"] for r in rs),
                    "min": min(r["seconds"] for r in rs),
                },
                "peak_rss_mb": {
                    "median": statistics.median(r["rss_mb"] for r in rs),
                    "max": max(r["rss_mb"] for r in rs),
                },
                "correct": checks.get(m, True),
            }
            for m, rs in runs.items()
        },
        "skipped": skipped,
    }
    text = json.dumps(report, indent=2)
    print(text)
    if opts.output:
        opts.output.write_text(text + "\n")
    if not all(checks.values()):
        raise SystemExit(f"wrong results: {', '.join(m for m, ok in checks.items() if not ok)}")


if __name__ == "__main__":
    main()
