"""Stage gate: a lower-precision variant (bf16, int8) is kept only when it is accurate and faster.

Each is measured against fp32 eager on held-out inputs (``calibration.gate_inputs``: drawn with the
traffic's shapes inside the variant's ranges, never an input int8 calibrated on): the profile's
``accuracy`` rule per output, its metric per output row summed up by the rule's statistic (p5 by
default: 95% of the rows at least as good; ``compare.summarize``), integer outputs equal. One that
passes is timed against its fp32 twin on the shapes the twin will serve, the twin and all its lower
precisions in the same interleaved rounds so that their times compare (the loader ranks them by it).
One that fails the rule or is not faster is dropped, with the reason printed. What was measured (rows,
statistic, threshold, value) goes into the manifest (``Variant.gate``).

    outcome = gate_precisions(profile, model, units, ctx.traffic, held_out)
    outcome.kept, outcome.results      # the units kept; a GateResult per lower-precision unit
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, replace
from typing import Any

import torch

from loader.errors import first_line
from loader.outputs import flatten

from ..calibration import Sample
from ..compare import accuracy_entries
from ..profile import Profile
from ..runners import Runner, Timer, open_candidate, run_eager, time_calls
from ..samples import make_inputs
from ..traffic import Shape, serving_shapes
from ..units import CompiledPackage, CompiledUnit, VariantPlan


@dataclass(frozen=True)
class GateResult:
    """One lower-precision variant measured against fp32: its accuracy per output and its speed."""

    variant: str
    precision: str
    against: str  # the fp32 variant it was timed against
    accuracy: list[dict[str, Any]] = field(default_factory=list)  # per output: metric, threshold, value
    samples: int = 0  # held-out inputs scored
    ms: float | None = None  # traffic-weighted mean of median ms per serving shape
    fp32_ms: float | None = None
    kept: bool = False
    reason: str = ""
    fallback: dict[str, Any] | None = None  # int8 static: the layers a failed gate made the build keep in fp32

    @property
    def speedup(self) -> float | None:
        return self.fp32_ms / self.ms if self.ms and self.fp32_ms else None

    def to_dict(self) -> dict[str, Any]:
        out = {
            "precision": self.precision,
            "against": self.against,
            "accuracy": self.accuracy,
            "samples": self.samples,
            "ms": self.ms,
            "fp32_ms": self.fp32_ms,
            "speedup": self.speedup,
            "kept": self.kept,
            "fallback": self.fallback,
        }
        if self.reason:
            out["reason"] = self.reason
        return {k: v for k, v in out.items() if v is not None}

    def describe(self) -> str:
        acc = self.accuracy_said()
        speed = f"{self.ms:.3f} ms vs fp32 {self.fp32_ms:.3f} ms ({self.speedup:.2f}×)" if self.speedup else "not timed"
        verdict = "kept" if self.kept else f"dropped: {self.reason}"
        return f"{self.variant}: {self._fallback_said()}{acc}; {speed} → {verdict}"

    def accuracy_said(self) -> str:
        """``out0 cosine p5 0.9937 ≥ 0.99 on 96 held-out rows``, per output."""
        return ", ".join(_describe_accuracy(a) for a in self.accuracy)

    def _fallback_said(self) -> str:
        """``int8 fallback kept 2 layers in fp32 (a, b), 2 builds: ``, or nothing."""
        if not self.fallback or not self.fallback["builds"]:
            return ""
        layers = self.fallback["fp32_layers"]
        names = ", ".join(layers[:4]) + (f", and {len(layers) - 4} more" if len(layers) > 4 else "")
        builds = len(self.fallback["builds"])
        return (
            f"int8 fallback kept {len(layers)} layer{'s' if len(layers) != 1 else ''} in fp32 ({names}), "
            f"{builds} build{'s' if builds != 1 else ''}: "
        )


def _describe_accuracy(a: dict[str, Any]) -> str:
    """``out0 cosine p5 0.9937 ≥ 0.99 on 96 held-out rows``."""
    if a["metric"] == "equal":
        return (
            f"out{a['output']} equal on {a['rows']} held-out input(s)" if a["passed"] else f"out{a['output']} differs"
        )
    sign = ("≤" if a["metric"] == "max_abs" else "≥") if a["passed"] else (">" if a["metric"] == "max_abs" else "<")
    statistic = "" if a["metric"] == "top1" else f" {a['statistic']}"
    value = f"{a['value']:.4g}" if a["metric"] == "max_abs" else f"{a['value']:.4f}"
    return f"out{a['output']} {a['metric']}{statistic} {value} {sign} {a['threshold']} on {a['rows']} held-out rows"


@dataclass(frozen=True)
class GateOutcome:
    kept: tuple[CompiledUnit, ...]  # every fp32 unit, and the lower-precision ones that passed
    results: tuple[GateResult, ...]  # one per lower-precision unit, in the order given


def gate_precisions(
    profile: Profile,
    model: torch.nn.Module,
    units: Sequence[CompiledUnit],
    traffic: dict[Shape, int],
    held_out: Callable[[VariantPlan], Sequence[Sample]],
    *,
    open_runner: Callable[[CompiledPackage, str], Runner] = open_candidate,
    timer: Timer = time_calls,
) -> GateOutcome:
    """Measure every lower-precision unit against fp32 eager and its fp32 twin (see the module
    docstring); return the units kept and the results. A dropped unit's file is deleted.
    ``held_out(vp)`` gives the inputs variant ``vp`` is scored on (``calibration.gate_inputs``);
    ``open_runner`` makes a package callable and ``timer`` times calls (tests hand in fakes)."""
    by_id = {u.variant.id: u for u in units}
    groups: dict[str, list[CompiledUnit]] = {}
    for u in units:
        if u.variant.precision != "fp32":
            groups.setdefault(u.variant.base_id, []).append(u)
    results: dict[str, GateResult] = {}
    for base, group in groups.items():
        twin = by_id[base]
        checked = [_check_accuracy(profile, model, u, twin.variant.id, held_out, open_runner) for u in group]
        measured = {result.variant: result for result, _ in checked}
        timed = [(result, run) for result, run in checked if run is not None]  # those that passed the accuracy rule
        if timed:
            shapes = serving_shapes(twin.variant, traffic, tuple(profile.dims))
            twin_run = open_runner(twin.package, twin.variant.device)
            measured.update((r.variant, r) for r in _check_speed(profile, twin_run, timed, shapes, timer))
        for u in group:
            result = results[u.variant.id] = replace(measured[u.variant.id], kept=not measured[u.variant.id].reason)
            if not result.kept:
                u.package.path.unlink(missing_ok=True)
    kept = tuple(u for u in units if u.variant.precision == "fp32" or results[u.variant.id].kept)
    return GateOutcome(kept, tuple(results[u.variant.id] for u in units if u.variant.id in results))


def _check_accuracy(
    profile: Profile,
    model: torch.nn.Module,
    unit: CompiledUnit,
    against: str,
    held_out: Callable[[VariantPlan], Sequence[Sample]],
    open_runner: Callable[[CompiledPackage, str], Runner],
) -> tuple[GateResult, Runner | None]:
    """The accuracy rule on the held-out inputs of the unit's ranges: the unit's result (timed
    against the fp32 variant ``against`` later) and its runner when it passed, else None with the
    result's ``reason`` saying why."""
    vp = unit.variant
    samples = held_out(vp)
    result = GateResult(vp.id, vp.precision, against, samples=len(samples))
    try:
        run = open_runner(unit.package, vp.device)
        result = replace(result, accuracy=_measure_accuracy(profile, model, run, samples))
    except RuntimeError as e:  # the compiled code failing on a calibration input
        return replace(result, reason=f"failed to run: {first_line(e, limit=300)}"), None
    failing = [a for a in result.accuracy if not a["passed"]]
    if failing:
        reason = "; ".join(_describe_accuracy(a) for a in failing) + " (accuracy gate)"
        return replace(result, reason=reason), None
    return result, run


def _check_speed(
    profile: Profile,
    twin: Runner,
    timed: list[tuple[GateResult, Runner]],
    shapes: list[tuple[dict[str, int], float]],
    timer: Timer,
) -> list[GateResult]:
    """Time the twin and the units that passed in the same interleaved rounds: their results with
    the times, a unit not fast enough (``accuracy.min_speedup``) with its reason."""
    try:
        fp32_ms, *ms = _time_together(profile, [twin] + [run for _, run in timed], shapes, timer)
    except RuntimeError as e:
        return [replace(result, reason=f"failed to run: {first_line(e, limit=300)}") for result, _ in timed]
    wanted = profile.accuracy.min_speedup
    out = []
    for (result, _), mine in zip(timed, ms):
        result = replace(result, ms=mine, fp32_ms=fp32_ms)
        if not _fast_enough(result.speedup, wanted):
            what = "faster than fp32" if wanted == 1.0 else f"{wanted}× fp32's speed"
            result = replace(
                result, reason=f"not {what} ({result.ms:.3f} vs {result.fp32_ms:.3f} ms, accuracy.min_speedup)"
            )
        out.append(result)
    return out


def _fast_enough(speedup: float, wanted: float) -> bool:
    """1.0 (the default) means strictly faster; another value, at least that."""
    return speedup > 1.0 if wanted == 1.0 else speedup >= wanted


def _measure_accuracy(
    profile: Profile, model: torch.nn.Module, run: Runner, samples: Sequence[Sample]
) -> list[dict[str, Any]]:
    """Each output's metric per row over all samples, summed up by its rule's statistic; integer
    outputs must be equal."""
    return accuracy_entries(profile, [(flatten(run_eager(model, args)), run(*args)) for _, args in samples])


def _time_together(
    profile: Profile, runs: list[Runner], shapes: list[tuple[dict[str, int], float]], timer: Timer
) -> list[float]:
    """Traffic-weighted mean of the median ms per shape of each of ``runs``, timed in alternating
    rounds so that a change in the machine's load hits all of them alike."""
    totals = [0.0] * len(runs)
    for i, (sizes, weight) in enumerate(shapes):
        args = make_inputs(profile, sizes, seed=profile.check.seed + 49979687 + i)
        for k, ms in enumerate(timer(*[lambda run=run: run(*args) for run in runs])):
            totals[k] += weight * ms
    return totals


def wants_fallback(profile: Profile, result: GateResult) -> bool:
    """Whether ``result`` is an int8 variant dropped for its accuracy, with the fallback on."""
    return (
        result.precision == "int8"
        and not result.kept
        and result.reason.endswith("(accuracy gate)")
        and profile.quantization.fallback.layers > 0
    )


def with_fallback(
    failed: GateResult,
    last: GateResult,
    ranked: Sequence[tuple[str, float]],
    error: float,
    tries: list[dict[str, Any]],
    limits: dict[str, int],
) -> GateResult:
    """The int8 fallback's verdict: ``last`` (the gate's result on the last build tried; ``failed``
    when none was) with its ``fallback`` record: the verdict before (``failed``'s), the layers the
    last build kept in fp32, why (the sensitivity ranking), and each build tried; a dropped one's
    reason says what was spent."""
    layers = tries[-1]["fp32_layers"] if tries else 0
    shown = max(min(limits["layers"], len(ranked)), 1)
    record = {
        "before": failed.accuracy,  # every layer int8
        "fp32_layers": [name for name, _ in ranked[:layers]],
        "why": "the most sensitive first: each layer's int8 error, the drop in noise-to-signal ratio when it alone "
        "takes fp32 activations (eager, calibration inputs)",
        "sensitivity": [{"layer": name, "drop": drop} for name, drop in ranked[:shown]],
        "error_int8": error,
        "builds": tries,
        "limits": limits,
    }
    if not last.kept and last.reason.endswith("(accuracy gate)"):
        last = replace(
            last, reason=f"{last.reason}; {_spent(tries, limits['builds'], min(limits['layers'], len(ranked)))}"
        )
    return replace(last, fallback=record)


def _spent(tries: list[dict[str, Any]], builds: int, limit: int) -> str:
    """Why the fallback gave up, for the dropped variant's reason."""
    if not tries:
        return "no int8 layer left to keep in fp32 (quantization.fallback)"
    layers = tries[-1]["fp32_layers"]
    spent = f"{builds} build(s), the limit" if len(tries) >= builds else f"{limit} layer(s), the limit"
    return f"still failing with {layers} more layer(s) in fp32 after {len(tries)} build(s): {spent} (quantization.fallback)"
