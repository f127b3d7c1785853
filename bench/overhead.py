"""Loader overhead: the Python path (guards + dispatch + stats + output structure) per call, against
the raw AOTInductor runner on the same inputs.

    python -m bench.overhead [ARTIFACT]      (default: builds profiles/examples/text_classifier.yaml)

Prints microseconds per call for both and their difference. Rounds alternate between the two so
that a noisy neighbour slows both alike; the median of the per-round medians is reported.
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time
from pathlib import Path

import torch

import loader

ROOT = Path(__file__).resolve().parent.parent


def per_call_us(fn, calls: int) -> float:
    start = time.perf_counter()
    for _ in range(calls):
        fn()
    return (time.perf_counter() - start) / calls * 1e6


def measure(model: loader.CompiledModel, args: tuple, rounds: int = 15, calls: int = 2000) -> dict[str, float]:
    variant = model.select(*args)
    runner = model._runners[variant.id]  # the raw runner: what the loader wraps
    tensors = list(args)
    for _ in range(200):
        model(*args)
        runner.run(tensors)
    raw, full = [], []
    for _ in range(rounds):
        raw.append(per_call_us(lambda: runner.run(tensors), calls))
        full.append(per_call_us(lambda: model(*args), calls))
    raw_us, full_us = statistics.median(raw), statistics.median(full)
    return {"variant": variant.id, "raw_us": raw_us, "loader_us": full_us, "overhead_us": full_us - raw_us}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("artifact", nargs="?", help="a built 2-input artifact (ids, mask)")
    opts = parser.parse_args()
    torch.set_num_threads(1)
    path = opts.artifact
    if path is None:
        from precompile.build import build

        path = build(ROOT / "profiles/examples/text_classifier.yaml", Path(tempfile.mkdtemp()) / "tc").path
    model = loader.load(path)
    ids = torch.randint(0, 10, (1, 8))
    mask = torch.ones(1, 8, dtype=torch.bool)
    r = measure(model, (ids, mask))
    print(f"artifact {path}, variant {r['variant']}, input [1, 8]")
    print(f"raw runner      {r['raw_us']:8.1f} µs/call")
    print(f"loader.load()() {r['loader_us']:8.1f} µs/call")
    print(f"overhead        {r['overhead_us']:8.1f} µs/call (guards + dispatch + stats + outputs)")


if __name__ == "__main__":
    main()
