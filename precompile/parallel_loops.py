"""Generated loops split over threads deep enough for the smallest size of a range, not its hint.

Inductor's C++ backend parallelises a loop nest's outer loops until their product of iterations
reaches the thread count (``CppKernel.decide_parallel_depth``), counting each loop at its size's hint.
A dynamic variant's loops take their sizes at run time: a routed convolution's loop over batch,
height, width and channels counted the batch at its hint (2 on a 2-thread build host) and split the
batch alone, so a call of batch 1 ran it on one thread and a call of batch 3 on two threads, one of
them with twice the work (MobileNetV2 standalone, every convolution routed, 2 threads: 14.98 ms at
1×224² and 14.42 ms at 3×116×155 before this, 10.54 and 12.11 ms after; bench/results/standalone_convnet.md).

``parallel_for_the_least_sizes`` counts a dynamic loop at the least size its range allows instead
(batch 1-4: one), so the split goes on to the next loop (height) while a call of the range's
smallest sizes would leave threads idle; the work estimate that stops splitting a small loop nest
keeps the hints. Loops of static sizes are decided as Inductor decides them.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any


def least(expr: Any, hint: int) -> int:
    """The least value ``expr`` (a loop's size over the graph's size symbols) takes in their ranges;
    ``hint`` where that is not known.

    The shape environment keeps a size's range from 2 up (sizes 0 and 1 are specialised at trace
    time), while an exported program whose range starts at 1 runs at size 1 too: a range that
    starts at 2 is taken from 1 here."""
    from torch._inductor.virtualized import V
    from torch.utils._sympy.value_ranges import ValueRanges, bound_sympy

    try:
        known = V.graph.sizevars.shape_env.var_to_range
        ranges = {}
        for symbol in expr.free_symbols:
            r = known[symbol]
            ranges[symbol] = ValueRanges(1, r.upper) if r.lower == 2 else r
        low = bound_sympy(expr, ranges).lower
    except Exception:  # a symbol or expression the range analysis cannot bound: the hint, as before
        return hint
    return max(1, int(low)) if low.is_finite else hint


@contextlib.contextmanager
def parallel_for_the_least_sizes() -> Iterator[None]:
    """Inductor's C++ loops parallelised as the module docstring says while the block runs."""
    try:
        from torch._inductor import config
        from torch._inductor.codegen.cpp import CppKernel, ParallelDepth
        from torch._inductor.virtualized import V
    except ImportError:  # pragma: no cover - a torch without Inductor compiles nothing here
        yield
        return
    original = CppKernel.__dict__["decide_parallel_depth"]

    def decide_parallel_depth(self: Any, max_parallel_depth: Any, threads: int) -> Any:
        start = max_parallel_depth.start_depth
        ranges = self.call_ranges[start : start + max_parallel_depth.parallel_depth]
        if not any(getattr(r, "free_symbols", None) for r in ranges):
            return original(self, max_parallel_depth, threads)
        seq, par, depth = self.size_hint(), 1, 0
        for expr in ranges:  # Inductor's loop, with ``par`` counted at the least sizes
            hint = V.graph.sizevars.optimization_hint(expr, fallback=8192)
            if par >= 2 * threads or par == threads:
                break
            if seq // threads < config.cpp.min_chunk_size:
                break
            depth += 1
            par *= least(expr, hint)
            seq /= hint
        if config.cpp.dynamic_threads and depth == 0 and len(ranges) > 0:
            depth = 1
        return ParallelDepth(parallel_depth=depth, start_depth=start)

    CppKernel.decide_parallel_depth = decide_parallel_depth
    try:
        yield
    finally:
        CppKernel.decide_parallel_depth = original
