"""Which variants to compile. Each variant is a set of dim ranges (min == max: static) and the example
sizes it is exported and tuned with."""

from __future__ import annotations

from dataclasses import dataclass

from .profile import Profile


@dataclass(frozen=True)
class VariantPlan:
    id: str
    kind: str  # "static" | "dynamic"
    ranges: dict[str, tuple[int, int]]
    hint: dict[str, int]


def default_plan(profile: Profile) -> list[VariantPlan]:
    """One variant covering every declared range, exported with each dim's hint."""
    ranges = {d: (spec.min, spec.max) for d, spec in profile.dims.items()}
    hint = {d: profile.hint(d) if lo != hi else lo for d, (lo, hi) in ranges.items()}
    kind = "dynamic" if any(lo != hi for lo, hi in ranges.values()) else "static"
    return [VariantPlan(id=kind, kind=kind, ranges=ranges, hint=hint)]
