"""Stage measure: a static variant is kept only where it pays (``plan.measure``).

Each static variant is timed against the dynamic variant that would serve its shape otherwise, calls
interleaved (``runners.time_calls``); one less than ``plan.min_speedup`` times faster is dropped, and
with it its lower-precision twins.

    timings = measure_statics(compiled, profile)      # a StaticTiming per static fp32 variant
    dropped = dropped_variants(timings, variants)
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import asdict, dataclass
from typing import Any

import loader

from ..profile import Profile
from ..runners import Timer, device_sync, time_calls
from ..samples import make_inputs, to_device
from ..units import VariantPlan


@dataclass(frozen=True)
class StaticTiming:
    variant: str
    dims: dict[str, int]
    static_ms: float
    dynamic_ms: float
    against: str  # the dynamic variant it was timed against
    speedup: float
    kept: bool

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    def describe(self) -> str:
        return (
            f"{self.variant}: {self.static_ms:.3f} ms static vs {self.dynamic_ms:.3f} ms dynamic "
            f"({self.speedup:.2f}×) → {'kept' if self.kept else 'dropped'}"
        )


def measure_statics(
    compiled: loader.CompiledModel, profile: Profile, seconds: float = 0.5, *, timer: Timer = time_calls
) -> list[StaticTiming]:
    """Time each static fp32 variant of ``compiled`` (on its device) against its dynamic fallback.
    ``timer`` defaults to ``runners.time_calls`` (tests hand in a fake clock)."""
    out = []
    mine = [v for v in compiled.variants if v.device == compiled.device_type and v.precision == "fp32"]
    dynamic = [v for v in mine if v.kind == "dynamic" and v.first_calls_of is None]  # what dispatch falls back to
    for v in mine:
        if v.kind != "static":
            continue
        sizes = {d: r.min for d, r in v.dims.items()}
        fallback = next((d for d in dynamic if all(sizes[k] in d.dims[k] for k in sizes)), None)
        if fallback is None:
            continue
        args = to_device(make_inputs(profile, sizes, seed=profile.check.seed), v.device, None)
        sync = device_sync(v.device)
        static_ms, dynamic_ms = timer(
            lambda: (compiled.run_variant(v.id, *args), sync()),
            lambda: (compiled.run_variant(fallback.id, *args), sync()),
            seconds=seconds,
        )
        speedup = dynamic_ms / static_ms if static_ms > 0 else float("inf")
        out.append(
            StaticTiming(v.id, sizes, static_ms, dynamic_ms, fallback.id, speedup, speedup >= profile.plan.min_speedup)
        )
    return out


def dropped_variants(timings: Sequence[StaticTiming], variants: Sequence[VariantPlan]) -> set[str]:
    """The static variants that did not pay, and their twins: in a lower precision, and for the other
    CPU ISAs (timed for the best ISA this host runs: its timing on this host says more about the
    shape than another ISA's would, which a host like this one does not serve)."""
    ids = {vp.id: vp.plan_id for vp in variants}
    dropped = {ids.get(t.variant, t.variant) for t in timings if not t.kept}
    return {vp.id for vp in variants if vp.plan_id in dropped}
