"""Stage tune: choose each variant's Inductor options by measurement.

A profile may ask for several option sets (``compile.tune.candidates``, or a named preset from
``options.PRESETS``). Every variant is compiled under each of them (in parallel, by the executors),
and here each candidate package is opened, checked against eager and timed on the shapes its variant will serve, weighted by
the observed traffic. The fastest candidate that matches eager is kept; the trials of all of them go
into the manifest, so ``precompile inspect`` shows what was tried and why one won.

Options are not free wins (measured on this kind of machine: freezing made a small conv net 1.3×
slower and MiniLM at 1×16 tokens 2× faster), hence measuring rather than guessing.
"""

from __future__ import annotations

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
    max_abs_error: float | None = None
    error: str | None = None  # why it failed to compile or to match eager
    kept: bool = False

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


def choose(trials: list[Trial]) -> Trial:
    """The fastest trial that matched eager (ties: the earlier candidate), as a new Trial marked kept."""
    good = [t for t in trials if t.error is None and t.ms is not None]
    if not good:
        reasons = "; ".join(f"candidate {t.candidate} {t.options}: {t.error}" for t in trials)
        raise CheckError(f"variant {trials[0].variant}: no tuning candidate compiled and matched eager ({reasons})")
    best = min(good, key=lambda t: (t.ms, t.candidate))
    return replace(best, kept=True)


def describe(trials: list[Trial]) -> str:
    """One line per variant for the build's output: each candidate's time, the winner marked."""
    parts = []
    for t in trials:
        label = f"{t.candidate}:{options_label(t.options)}"  # numbered: two candidates never read alike
        if t.error is not None:
            parts.append(f"{label}: failed")
        else:
            parts.append(f"{'*' if t.kept else ''}{label}: {t.ms:.3f} ms")
    return f"{trials[0].variant}: " + "  ".join(parts)


@dataclass(frozen=True)
class TuneResult:
    kept: tuple[CompiledUnit, ...]  # per variant, the winning candidate, renamed to the variant's own file
    trials: tuple[Trial, ...]  # every candidate of every variant, in order


Measure = Callable[[Runner, CompiledUnit, list[tuple[dict[str, int], float]]], tuple[float, float]]


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
) -> TuneResult:
    """Time every compiled candidate of every variant on its serving shapes; keep the fastest that
    matches eager under the variant's own file name and delete the others. ``open_runner`` and
    ``measure_unit`` (runner, unit, shapes → (ms, max abs error)) default to the real ones."""
    measure_unit = measure_unit or (lambda run, u, shapes: measure(run, model, profile, u.variant, shapes))
    kept, trials = [], []
    for vp in variants:
        shapes = serving_shapes(vp, traffic, tuple(profile.dims))
        # A variant built for an x86-64 level compiled each candidate with its level's options over it.
        level = ISA_OPTIONS.get(vp.isa or "", {})
        mine = []
        for k, options in enumerate(candidates):
            same = same_as_earlier(list(candidates), k, vp.isa)
            if same is not None:
                mine.append(Trial(vp.id, k, {**options, **level}, error=f"compiles as candidate {same} for {vp.isa}"))
            else:
                mine.append(_trial(vp, k, {**options, **level}, compiled, shapes, open_runner, measure_unit))
        best = choose(mine)
        mine = [best if t.candidate == best.candidate else t for t in mine]
        winner = compiled.get(vp.id, best.candidate)
        assert winner is not None  # choose() only picks a candidate that compiled
        for k in range(len(candidates)):
            other = compiled.get(vp.id, k)
            if other is not None and k != best.candidate:
                other.package.path.unlink()
        final = winner.package.path.with_name(package_file(vp.id))
        winner.package.path.replace(final)
        kept.append(replace(winner, package=replace(winner.package, path=final)))
        trials += mine
    return TuneResult(tuple(kept), tuple(trials))


def _trial(
    vp: VariantPlan,
    k: int,
    options: dict[str, Any],
    compiled: CompiledUnits,
    shapes: list[tuple[dict[str, int], float]],
    open_runner: Callable[[CompiledPackage, str], Runner],
    measure_unit: Measure,
) -> Trial:
    """One candidate of one variant: its compile time, and its speed and error once it ran, or why not."""
    unit = compiled.get(vp.id, k)
    if unit is None:
        return Trial(vp.id, k, options, error=compiled.failure(vp.id, k) or "not compiled")
    try:
        ms, max_abs_error = measure_unit(open_runner(unit.package, vp.device), unit, shapes)
    except (CheckError, RuntimeError) as e:
        return Trial(vp.id, k, options, compile_s=unit.seconds, error=str(e)[:2000])
    return Trial(vp.id, k, options, compile_s=unit.seconds, ms=ms, max_abs_error=max_abs_error)
