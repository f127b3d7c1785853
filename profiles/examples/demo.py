"""`make demo`: load the built text classifier, run it on several shapes, compare with eager.

    python profiles/examples/demo.py artifacts/text-classifier [profiles/examples/text_classifier_planned.yaml]

Each line says which compiled variant served the shape (static, dynamic, or several for a split).
"""

from __future__ import annotations

import sys
import time
from pathlib import Path

import torch

import loader
from precompile.profile import load_profile
from precompile.samples import make_inputs
from precompile.stages.resolve import resolve_model


def median_ms(fn, repeats: int = 20) -> float:
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append((time.perf_counter() - start) * 1000)
    return sorted(times)[len(times) // 2]


def main() -> None:
    artifact = sys.argv[1] if len(sys.argv) > 1 else "artifacts/text-classifier"
    profile_path = sys.argv[2] if len(sys.argv) > 2 else str(Path(__file__).with_name("text_classifier_planned.yaml"))
    start = time.perf_counter()
    model = loader.load(artifact)
    print(f"loaded {model!r} in {(time.perf_counter() - start) * 1000:.1f} ms")
    loaded = load_profile(profile_path)
    eager = resolve_model(loaded)
    print(f"{'batch':>5} {'seq':>5} {'variant':>20} {'compiled ms':>12} {'eager ms':>9} {'max |err|':>10}")
    for batch, seq in [(1, 128), (2, 128), (1, 8), (4, 77), (8, 256), (16, 512), (96, 64)]:
        ids, mask = make_inputs(loaded.profile, {"batch": batch, "seq": seq}, seed=batch * 1000 + seq)
        with torch.no_grad():
            want = eager(ids, mask)
            got = model(ids, mask)
            err = (want - got).abs().max().item()
            compiled_ms = median_ms(lambda: model(ids, mask))
            eager_ms = median_ms(lambda: eager(ids, mask))
        variant = model.call_detailed(ids, mask)[1]
        print(f"{batch:>5} {seq:>5} {variant:>20} {compiled_ms:>12.3f} {eager_ms:>9.3f} {err:>10.2e}")
    try:
        model(torch.zeros(1, 600, dtype=torch.int64), torch.ones(1, 600, dtype=torch.bool))
    except loader.GuardError as e:
        print(f"out of range is refused, not crashed: GuardError: {e}")


if __name__ == "__main__":
    main()
