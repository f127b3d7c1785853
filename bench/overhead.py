"""Loader overhead: the Python path (guards + dispatch + stats + output structure) per call, against
the raw AOTInductor runner on the same inputs, and what the value guard (one min/max pass per
integer input with a range) and the bool guard (every byte of a bool input 0 or 1; both loaders)
cost of it.

    python -m bench.overhead [ARTIFACT] [--batch 8 --seq 512]
        (default: builds profiles/examples/text_classifier.yaml)

Prints microseconds per call for both and their difference, then the guards alone with and without
value ranges. Rounds alternate between the two so that a noisy neighbour slows both alike; the
median of the per-round medians is reported. The loader's budget is 15 µs at batch 8 × seq 512.
"""

from __future__ import annotations

import argparse
import copy
import dataclasses
import statistics
import tempfile
import threading
import time
from pathlib import Path

import torch

import loader
from loader.guards import InputGuard

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


class _Replay:
    """Stands in for a runner: returns the outputs the real one computed once."""

    def __init__(self, outputs):
        self.outputs = outputs

    def run(self, tensors):
        return self.outputs


def measure_python_path(model: loader.CompiledModel, args: tuple, rounds: int = 15, calls: int = 2000) -> float:
    """µs per call of the loader's whole Python path with the compiled code taken out (every runner
    replays outputs computed once): where a call takes milliseconds, its noise hides microseconds."""
    outputs = model._runners[model.select(*args).id].run(list(args))
    stub = copy.copy(model)
    stub._runners = {vid: _Replay(outputs) for vid in model._runners}
    stub._index_tables()
    stub._stats_lock = threading.Lock()
    stub.reset_stats()
    for _ in range(200):
        stub(*args)
    return statistics.median(per_call_us(lambda: stub(*args), calls) for _ in range(rounds))


def measure_value_guard(
    model: loader.CompiledModel, args: tuple, rounds: int = 15, calls: int = 2000
) -> dict[str, float]:
    """The guards alone, as loaded and with every value range removed: the difference is the value guard."""
    m = model.manifest
    bare = InputGuard([dataclasses.replace(spec, range=None) for spec in m.inputs], m.dims, torch.device(model.device))
    guard = model._guard  # the loaded model's own guard
    ranged = [spec.name for spec in m.inputs if spec.range is not None]
    with_values, without = [], []
    for _ in range(rounds):
        with_values.append(per_call_us(lambda: guard.check(args, {}), calls))
        without.append(per_call_us(lambda: bare.check(args, {}), calls))
    a, b = statistics.median(with_values), statistics.median(without)
    return {"guards_us": a, "guards_without_values_us": b, "value_guard_us": a - b, "ranged_inputs": ranged}


def measure_bool_guard(model: loader.CompiledModel, args: tuple, rounds: int = 15, calls: int = 2000) -> dict:
    """The guards of ``loader.load`` and of ``loader.load_native`` on the same call, with the bool
    bytes check and with it made a no-op: the difference is what it costs each."""
    import loader.guards as torch_guards
    import loader.native.npguards as numpy_guards

    native = loader.load_native(model.path, warmup=False)
    arrays = tuple(a.numpy() for a in args)
    cases = [
        ("torch", torch_guards, "_check_bool_bytes", lambda: model._guard.check(args, {})),
        ("native", numpy_guards, "check_bool_bytes", lambda: native._guard.check(arrays, {})),
    ]
    out = {}
    for name, module, attr, check in cases:
        real = getattr(module, attr)
        on, off = [], []
        for _ in range(rounds):
            on.append(per_call_us(check, calls))
            setattr(module, attr, lambda *a: None)
            try:
                off.append(per_call_us(check, calls))
            finally:
                setattr(module, attr, real)
        out[name] = (statistics.median(on), statistics.median(on) - statistics.median(off))
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("artifact", nargs="?", help="a built 2-input artifact (ids, mask)")
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--seq", type=int, default=512)
    parser.add_argument("--rounds", type=int, default=15)
    parser.add_argument("--calls", type=int, default=0, help="calls per round (default: about 0.3 s a round)")
    opts = parser.parse_args()
    torch.set_num_threads(1)
    path = opts.artifact
    if path is None:
        from precompile.pipeline import build

        path = build(ROOT / "profiles/examples/text_classifier.yaml", Path(tempfile.mkdtemp()) / "tc").path
    model = loader.load(path)
    ids = torch.randint(0, 10, (opts.batch, opts.seq))
    mask = torch.ones(opts.batch, opts.seq, dtype=torch.bool)
    args = (ids, mask)
    calls = opts.calls or max(20, min(2000, int(0.3 / max(per_call_us(lambda: model(*args), 5) * 1e-6, 1e-7))))
    r = measure(model, args, opts.rounds, calls)
    v = measure_value_guard(model, args, opts.rounds, 2000)
    path_us = measure_python_path(model, args, opts.rounds, 2000)
    print(
        f"artifact {path}, variant {r['variant']}, input [{opts.batch}, {opts.seq}], {calls} calls × {opts.rounds} rounds"
    )
    print(f"raw runner      {r['raw_us']:8.1f} µs/call")
    print(f"loader.load()() {r['loader_us']:8.1f} µs/call")
    print(f"overhead        {r['overhead_us']:8.1f} µs/call (guards + dispatch + stats + outputs)")
    print(f"python path     {path_us:8.1f} µs/call (the same, the compiled code replaced by a replay: budget 15 µs)")
    print(f"guards alone    {v['guards_us']:8.1f} µs/call ({v['guards_without_values_us']:.1f} without value ranges)")
    print(
        f"value guard     {v['value_guard_us']:8.1f} µs/call (min/max of {', '.join(v['ranged_inputs']) or 'no input'})"
    )
    for name, (guards_us, bool_us) in measure_bool_guard(model, args, opts.rounds, 2000).items():
        print(
            f"bool guard      {bool_us:8.1f} µs/call ({name}: the guards {guards_us:.1f} µs, bytes of each bool input 0/1)"
        )


if __name__ == "__main__":
    main()
