"""Stage tune: choose each variant's Inductor options by measurement.

A profile may ask for several option sets (``compile.tune.candidates``, or a named preset from
``options.PRESETS``). Every variant is compiled under each of them (in parallel, by the executors),
and here each candidate package is opened, checked against eager and timed on the shapes its variant will serve, weighted by
the observed traffic. The fastest candidate that matches eager is kept; the trials of all of them go
into the manifest, so ``precompile inspect`` shows what was tried and why one won.

A dynamic variant also serves shapes no call met before, and there a candidate may pay more than its
steady time: oneDNN creates (JIT-compiles) a primitive for every convolution the first time it meets
an input shape, where a convolution routed to a GEMM or a generated loop (``compile.conv_routes``)
has nothing to create. So each candidate's first call is timed too, at shapes drawn afresh for it
(``first_call``), and the first-call bound (``compile.tune.first_call``, 1.5× by default) keeps the
fastest candidate whose first call stays within the bound of the fastest steady call, when one does.

Options are not free wins (measured on this kind of machine: freezing made a small conv net 1.3×
slower and MiniLM at 1×16 tokens 2× faster), hence measuring rather than guessing.
"""

from __future__ import annotations

import random
import statistics
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, replace
from typing import Any

import torch

from ..compare import CheckReport, compare
from ..errors import CheckError
from ..options import ISA_OPTIONS, options_label, same_as_earlier
from ..profile import Profile
from ..runners import Runner, device_sync, open_candidate, run_eager, time_calls
from ..samples import make_inputs, to_device
from ..traffic import Shape, serving_shapes
from ..units import CompiledPackage, CompiledUnit, CompiledUnits, VariantPlan, package_file


@dataclass(frozen=True)
class Trial:
    """One candidate of one variant: how it compiled, whether it matched eager, how fast it ran."""

    variant: str
    candidate: int
    options: dict[str, Any]
    compile_s: float | None = None
    ms: float | None = None  # traffic-weighted mean of the median ms per shape
    # A dynamic variant's first call at a shape no call met, over the steady call there (the median
    # over FIRST_CALL_SHAPES shapes drawn for this candidate alone; None: not measured).
    first_ratio: float | None = None
    max_abs_error: float | None = None
    error: str | None = None  # why it failed to compile or to match eager
    kept: bool = False
    first_calls: bool = False  # kept too, to serve the kept one's first calls (first_calls_twin)

    def to_dict(self) -> dict[str, Any]:
        return {k: v for k, v in asdict(self).items() if v is not None}


def measure(
    run: Runner,
    model: torch.nn.Module,
    profile: Profile,
    vp: VariantPlan,
    shapes: list[tuple[dict[str, int], float]],
    *,
    seconds_per_shape: float = 0.3,
) -> tuple[float, float]:
    """Check ``run`` (a callable taking the inputs) against eager on each shape and time it there.

    Returns (traffic-weighted mean of the median ms per shape, max abs error). Raises CheckError when
    it disagrees with eager. Runs enough calls for about ``seconds_per_shape`` per shape (at least 7).
    """
    report = CheckReport()
    weighted = 0.0
    sync = device_sync(vp.device)
    for i, (sizes, weight) in enumerate(shapes):
        args = make_inputs(profile, sizes, seed=profile.check.seed + 104729 + i)
        want = run_eager(model, args)
        args = to_device(args, vp.device, vp.dtype)
        compare(profile, want, run(*args), sizes, vp.id, report, compute_dtype=vp.dtype)
        (ms,) = time_calls(lambda: (run(*args), sync()), seconds=seconds_per_shape)
        weighted += weight * ms
    return weighted, report.max_abs_error


# The first call at a new shape, as a multiple of the steady call, that the build aims for (issue 22's
# target, the loader's promise of no compilation at the first call): compile.tune.first_call's default.
FIRST_CALL_BOUND = 1.5
# A first call is timed once per shape: the median of four shapes decides. The worst of two read
# EfficientNet-B0's first call at 2.21x where bench.firstcall reads 1.2-1.8x (median 1.30-1.33x) on
# the same host, and kept a second variant that made its first calls no cheaper.
FIRST_CALL_SHAPES = 4
# The second variant doubles the artifact and the load: kept only where its first call costs at most
# this share of the fastest's own.
FIRST_CALLS_GAIN = 0.8


def first_call_cost(trial: Trial, fastest_ms: float) -> float | None:
    """``trial``'s first call at a new shape as a multiple of the fastest candidate's steady call."""
    if trial.first_ratio is None or trial.ms is None:
        return None
    return trial.first_ratio * trial.ms / fastest_ms


def fresh_shapes(vp: VariantPlan, seen: set[tuple[int, ...]], count: int, seed: int) -> list[dict[str, int]]:
    """``count`` shapes inside ``vp``'s ranges that are not in ``seen`` (added to it), drawn with
    ``seed``; fewer where the ranges hold no more."""
    rng = random.Random(seed)
    names = list(vp.ranges)
    out: list[dict[str, int]] = []
    for _ in range(100 * count):
        if len(out) == count:
            break
        sizes = {d: rng.randint(*vp.ranges[d]) for d in names}
        key = tuple(sizes[d] for d in names)
        if key not in seen:
            seen.add(key)
            out.append(sizes)
    return out


def fresh_per_candidate(vp: VariantPlan, seen: int, candidates: int) -> int:
    """How many fresh shapes each candidate's first call is timed at: ``FIRST_CALL_SHAPES``, or an
    even share of those ``vp``'s ranges hold beyond the ``seen`` ones where they are too few for every
    candidate to have as many (a batch of 1-8 alone: 7 left for 3 candidates, 2 each), so that no
    candidate is left without a figure (one is then taken to be within the bound: ``choose``)."""
    volume = 1
    for lo, hi in vp.ranges.values():
        volume *= hi - lo + 1
        if volume >= seen + FIRST_CALL_SHAPES * candidates:
            return FIRST_CALL_SHAPES
    return max(1, (volume - seen) // max(1, candidates))


def first_call(
    run: Runner, profile: Profile, vp: VariantPlan, shapes: list[dict[str, int]], *, seconds_per_shape: float = 0.2
) -> float | None:
    """The median, over ``shapes`` (none met by ``run`` before), of the first call's time over the
    steady call's at the same shape; None without shapes. The largest shape runs first, as the
    loader's warm-up runs it (``loader.warmup``): what remains is what a served first call pays."""
    sync = device_sync(vp.device)
    largest = {d: hi for d, (_, hi) in vp.ranges.items()}
    run(*to_device(make_inputs(profile, largest, seed=profile.check.seed), vp.device, vp.dtype))
    ratios = []
    for i, sizes in enumerate(shapes):
        args = to_device(make_inputs(profile, sizes, seed=profile.check.seed + 7919 + i), vp.device, vp.dtype)
        start = time.perf_counter()
        run(*args)
        sync()
        first = (time.perf_counter() - start) * 1000
        (steady,) = time_calls(lambda: (run(*args), sync()), seconds=seconds_per_shape)
        ratios.append(first / max(steady, 1e-6))
    return statistics.median(ratios) if ratios else None


def choose(trials: list[Trial], first_call: float | None = None) -> Trial:
    """The fastest trial that matched eager (ties: the earlier candidate), as a new Trial marked kept.

    With a ``first_call`` bound, the fastest among those whose first call at a new shape costs at
    most that many of the fastest steady call (``first_call_cost``), when any does; a candidate whose
    first call was not measured (a static variant) counts as within it. When none is, the fastest."""
    good = [t for t in trials if t.error is None and t.ms is not None]
    if not good:
        reasons = "; ".join(f"candidate {t.candidate} {t.options}: {t.error}" for t in trials)
        raise CheckError(f"variant {trials[0].variant}: no tuning candidate compiled and matched eager ({reasons})")
    if first_call is not None:
        fastest = min(t.ms for t in good if t.ms is not None)
        within = [t for t in good if (first_call_cost(t, fastest) or 0.0) <= first_call]
        good = within or good
    best = min(good, key=lambda t: (t.ms, t.candidate))
    return replace(best, kept=True)


def first_calls_twin(trials: list[Trial], first_call: float | None) -> tuple[Trial, Trial] | None:
    """Two candidates to keep instead of one, where the fastest's first call at a new shape costs
    more than ``first_call`` of its steady call (oneDNN creating its kernels there): the fastest
    serves the calls, and the candidate whose first call costs least (``first_call_cost``, against the
    fastest's steady call) the first call at each shape the fastest has not run yet in the process,
    while the loader runs the fastest there in the background (``loader.dispatch.ShapesWarmer``).
    The steady call is the fastest's, a first call the other's. None where the fastest's first call
    is within the bound or was not measured, or no other candidate's costs at most ``FIRST_CALLS_GAIN``
    of it. Returns (the fastest, the other), marked."""
    good = [t for t in trials if t.error is None and t.ms is not None]
    if first_call is None or not good:
        return None
    fastest = min(good, key=lambda t: (t.ms, t.candidate))
    if fastest.first_ratio is None or fastest.first_ratio <= first_call:
        return None
    others = [t for t in good if t.candidate != fastest.candidate and t.first_ratio is not None]
    if not others:
        return None
    twin = min(others, key=lambda t: (first_call_cost(t, fastest.ms), t.candidate))
    if first_call_cost(twin, fastest.ms) > FIRST_CALLS_GAIN * fastest.first_ratio:
        return None
    return replace(fastest, kept=True), replace(twin, first_calls=True)


def describe(trials: list[Trial]) -> str:
    """One line per variant for the build's output: each candidate's time, the winner marked."""
    parts = []
    for t in trials:
        label = f"{t.candidate}:{options_label(t.options)}"  # numbered: two candidates never read alike
        if t.error is not None:
            parts.append(f"{label}: failed")
        else:
            first = f" (first call {t.first_ratio:.2f}×)" if t.first_ratio is not None else ""
            mark = "*" if t.kept else "+" if t.first_calls else ""  # +: serves the first calls of *
            parts.append(f"{mark}{label}: {t.ms:.3f} ms{first}")
    return f"{trials[0].variant}: " + "  ".join(parts)


@dataclass(frozen=True)
class TuneResult:
    # Per variant, the winning candidate, renamed to the variant's own file; after it, where one was
    # kept, the candidate serving its first calls (``first_calls_twin``), as variant ``<id>-first``.
    kept: tuple[CompiledUnit, ...]
    trials: tuple[Trial, ...]  # every candidate of every variant, in order


Measure = Callable[[Runner, CompiledUnit, list[tuple[dict[str, int], float]]], tuple[float, float]]
FirstCall = Callable[[Runner, CompiledUnit, list[dict[str, int]]], float | None]


def tune_variants(
    profile: Profile,
    model: torch.nn.Module,
    variants: Sequence[VariantPlan],
    compiled: CompiledUnits,
    candidates: Sequence[dict[str, Any]],
    traffic: dict[Shape, int],
    *,
    open_runner: Callable[[CompiledPackage, str], Runner] = open_candidate,
    measure_unit: Measure | None = None,
    measure_first: FirstCall | None = None,
    first_call_bound: float | None = FIRST_CALL_BOUND,
    first_calls: bool = True,
) -> TuneResult:
    """Time every compiled candidate of every variant on its serving shapes, and a dynamic variant's
    first call at shapes none met; keep the fastest that matches eager under the variant's own file
    name, with, on a CPU, the one that serves its first calls beside it where its own first call
    costs more than ``first_call_bound`` (``first_calls_twin``; not with ``first_calls`` False), and
    elsewhere the fastest within the bound (``choose``); delete the others. ``open_runner``,
    ``measure_unit`` (runner, unit, shapes → (ms, max abs error)) and ``measure_first`` (runner, unit,
    fresh shapes → first ÷ steady) default to the real ones."""
    measure_unit = measure_unit or (lambda run, u, shapes: measure(run, model, profile, u.variant, shapes))
    measure_first = measure_first or (lambda run, u, fresh: first_call(run, profile, u.variant, fresh))
    kept, trials = [], []
    for vp in variants:
        shapes = serving_shapes(vp, traffic, tuple(profile.dims))
        # Each candidate's first call is timed at shapes of its own: oneDNN keeps the primitives one
        # created for a shape, and another candidate's convolutions at that shape would find them.
        seen = {tuple(s[d] for d in vp.ranges) for s, _ in shapes} | {tuple(vp.hint[d] for d in vp.ranges)}
        per_candidate = fresh_per_candidate(vp, len(seen), len(candidates))
        # A variant built for an x86-64 level compiled each candidate with its level's options over it.
        level = ISA_OPTIONS.get(vp.isa or "", {})
        mine = []
        for k, options in enumerate(candidates):
            same = same_as_earlier(list(candidates), k, vp.isa)
            if same is not None:
                mine.append(Trial(vp.id, k, {**options, **level}, error=f"compiles as candidate {same} for {vp.isa}"))
            else:
                fresh = (
                    fresh_shapes(vp, seen, per_candidate, seed=profile.check.seed + 31 * k)
                    if vp.kind == "dynamic" and first_call_bound is not None
                    else []
                )
                mine.append(
                    _trial(
                        vp, k, {**options, **level}, compiled, (shapes, fresh), open_runner, measure_unit, measure_first
                    )
                )
        twin = first_calls and vp.kind == "dynamic" and vp.device == "cpu"
        pair = first_calls_twin(mine, first_call_bound) if twin else None
        chosen = [choose(mine, first_call_bound)] if pair is None else list(pair)
        mine = [next((c for c in chosen if c.candidate == t.candidate), t) for t in mine]
        for k in range(len(candidates)):
            other = compiled.get(vp.id, k)
            if other is not None and all(k != c.candidate for c in chosen):
                other.package.path.unlink()
        for trial, plan in zip(chosen, (vp, replace(vp, id=f"{vp.id}-first", first_calls_of=vp.id))):
            unit = compiled.get(vp.id, trial.candidate)
            assert unit is not None  # choose() only picks a candidate that compiled
            final = unit.package.path.with_name(package_file(plan.id))
            unit.package.path.replace(final)
            kept.append(replace(unit, variant=plan, package=replace(unit.package, path=final)))
        trials += mine
    return TuneResult(tuple(kept), tuple(trials))


def _trial(
    vp: VariantPlan,
    k: int,
    options: dict[str, Any],
    compiled: CompiledUnits,
    shapes: tuple[list[tuple[dict[str, int], float]], list[dict[str, int]]],
    open_runner: Callable[[CompiledPackage, str], Runner],
    measure_unit: Measure,
    measure_first: FirstCall,
) -> Trial:
    """One candidate of one variant: its compile time, and its speed and error once it ran, or why not.
    ``shapes``: the serving shapes with their weights, and the fresh shapes of its first calls (first:
    no call met them before)."""
    unit = compiled.get(vp.id, k)
    if unit is None:
        return Trial(vp.id, k, options, error=compiled.failure(vp.id, k) or "not compiled")
    serving, fresh = shapes
    try:
        run = open_runner(unit.package, vp.device)
        ms, max_abs_error = measure_unit(run, unit, serving)  # warms it at its serving shapes, as a load does
        first_ratio = measure_first(run, unit, fresh) if fresh else None
    except (CheckError, RuntimeError) as e:
        return Trial(vp.id, k, options, compile_s=unit.seconds, error=str(e)[:2000])
    return Trial(vp.id, k, options, compile_s=unit.seconds, ms=ms, max_abs_error=max_abs_error, first_ratio=first_ratio)
