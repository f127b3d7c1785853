"""Which precision a loaded model serves: its fp32 variants, or the bf16 and int8 variants the build
kept because they passed the accuracy gate and beat fp32 on their traffic.

A lower-precision variant records the CPU features its kernels may use (``Variant.cpu_features``);
on a host without them it is never opened, so it cannot die of an illegal instruction: the fp32
variants serve instead. ``load(precision=...)``:

- ``"auto"`` (the default): for each fp32 variant, its lower-precision twins this host can run,
  fastest first by the build's measurement on that variant's traffic (int8 may win on short inputs
  and bf16 on long ones), then fp32 for any shape none of them covers;
- ``"fp32"``: the fp32 variants only;
- ``"bf16"`` or ``"int8"``: that precision first, fp32 for the shapes it does not cover; an error
  when the artifact has none or this host cannot run them.
"""

from __future__ import annotations

import statistics
from dataclasses import dataclass, field

from . import constants as C
from .errors import IncompatibleArtifactError
from .manifest import Variant

REQUESTS = ("auto", *C.PRECISIONS)


@dataclass(frozen=True)
class Choice:
    """The precisions served, preferred first (fp32 always last), and why others present are not."""

    order: tuple[str, ...]
    skipped: dict[str, str] = field(default_factory=dict)
    per_variant: bool = False  # auto: each fp32 variant's twins ranked by their own measured speed

    def serves(self, v: Variant) -> bool:
        return v.precision in self.order

    def tiers(self, variants: tuple[Variant, ...] | list[Variant]) -> list[list[Variant]]:
        """The served variants in tiers a call tries in turn: the first tier holding a variant for
        the call's shape serves it. Within a tier, variants cover what their fp32 twins cover."""
        served = [v for v in variants if self.serves(v)]
        if not self.per_variant:
            return [[v for v in served if v.precision == p] for p in self.order]
        twins: dict[str, list[Variant]] = {}
        for v in served:
            if v.precision != "fp32":
                twins.setdefault(_against(v), []).append(v)
        ranked = [sorted(group, key=_measured_ms) for group in twins.values()]
        depth = max((len(g) for g in ranked), default=0)
        return [[g[k] for g in ranked if k < len(g)] for k in range(depth)] + [
            [v for v in served if v.precision == "fp32"]
        ]


def choose(
    variants: tuple[Variant, ...] | list[Variant], requested: str, features: frozenset[str], source: str
) -> Choice:
    """Decide which of ``variants`` (one device's) serve, for a ``requested`` precision (one of
    ``REQUESTS``: ``load`` checks it before opening anything) on a host with CPU ``features``."""
    present: dict[str, list[Variant]] = {}
    for v in variants:
        present.setdefault(v.precision, []).append(v)
    skipped = {}
    usable = []
    for p, vs in present.items():
        if p == "fp32":
            continue
        missing = sorted({f for v in vs for f in v.cpu_features} - features)
        if missing:
            skipped[p] = f"this CPU lacks {', '.join(missing)}"
        else:
            usable.append(p)
    if requested == "fp32":
        return Choice(("fp32",), {p: "precision='fp32' asked for" for p in present if p != "fp32"})
    if requested != "auto":
        if requested not in present:
            have = ", ".join(sorted(present))
            raise IncompatibleArtifactError(
                f"{source}: no {requested} variants (the artifact has {have}); build with precision: [fp32, {requested}], "
                f"or load with precision='auto'"
            )
        if requested in skipped:
            raise IncompatibleArtifactError(
                f"{source}: the {requested} variants need CPU features {skipped[requested].removeprefix('this CPU lacks ')} "
                "that this host lacks; load with precision='auto' or 'fp32'"
            )
        return Choice(
            (requested, "fp32"), {p: f"precision={requested!r} asked for" for p in usable if p != requested} | skipped
        )
    usable.sort(key=lambda p: -_speedup(present[p]))
    return Choice((*usable, "fp32"), skipped, per_variant=True)


def _against(v: Variant) -> str:
    """The fp32 variant a lower-precision one was made from and timed against."""
    against = v.gate.get("against") if isinstance(v.gate, dict) else None
    return against if isinstance(against, str) else v.id.removeprefix(f"{v.precision}-")


def _measured_ms(v: Variant) -> float:
    ms = v.gate.get("ms") if isinstance(v.gate, dict) else None
    return float(ms) if isinstance(ms, (int, float)) and not isinstance(ms, bool) and ms > 0 else float("inf")


def _speedup(variants: list[Variant]) -> float:
    """The median speedup over fp32 the build measured for these variants (1.0 when unknown)."""
    values = [v.gate.get("speedup") for v in variants if isinstance(v.gate, dict)]
    values = [float(x) for x in values if isinstance(x, (int, float)) and not isinstance(x, bool)]
    return statistics.median(values) if values else 1.0
