"""What the build's stages hand each other: the planned variants, the units of compile work, and
what compiling them gave. Frozen dataclasses, so a stage's result cannot be changed by the next one.

    plan = make_plan(loaded)                      # Plan: VariantPlans and the traffic they serve
    tasks = compile_tasks(variants, candidates)   # a CompileTask per variant × option candidate
    units = compile_units(context, tasks, ...)    # CompiledUnits: a CompiledUnit per task that compiled
    units.get("dynamic", 0).package.path          # variants/dynamic.pt2
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from loader import constants as C

from .analysis.value_ranges import IndexTable
from .options import options_label


@dataclass(frozen=True)
class VariantPlan:
    id: str
    kind: str  # "static" | "dynamic"
    ranges: dict[str, tuple[int, int]]
    hint: dict[str, int]
    share: float = 0.0  # share of observed traffic this variant will serve
    count: int = 0  # calls of observed traffic it will serve
    device: str = "cpu"
    dtype: str | None = None  # compute dtype (CUDA variants); None: the model's own
    precision: str = "fp32"  # fp32 | bf16 | int8 (precompile.stages.quantize)
    isa: str | None = None  # the x86-64 level a CPU variant is compiled for (cpu.isa); None: the build host's
    # A dynamic variant's hottest observed shapes (plan.warm_shapes of them, its planned hint first),
    # which the loader's warm-up runs so that their first calls meet compiled kernels (loader.warmup).
    warm: tuple[dict[str, int], ...] = ()
    # Set on a tuned dynamic variant's second package, which serves the first calls of the variant
    # with this id at shapes it has not run yet (precompile.stages.tune: first_calls_twin).
    first_calls_of: str | None = None

    @property
    def base_id(self) -> str:
        """The fp32 variant a lower-precision one was made from (itself, for an fp32 one)."""
        return self.id.removeprefix(f"{self.precision}-") if self.precision != "fp32" else self.id

    @property
    def plan_id(self) -> str:
        """The planned variant this one is a copy of, for a precision and an ISA level (``static-0``)."""
        return self.base_id.removesuffix(isa_suffix(self.isa))

    def describe(self) -> str:
        return " ".join(f"{d}={lo}" if lo == hi else f"{d}∈[{lo},{hi}]" for d, (lo, hi) in self.ranges.items())


@dataclass(frozen=True)
class Plan:
    dims: tuple[str, ...]
    variants: tuple[VariantPlan, ...]
    total: int  # calls in the distribution
    static_count: int
    dynamic_count: int
    by_policy: dict[str, int]  # out-of-range calls the loader will pad or split, per policy
    rejected_count: int  # out-of-range calls the loader will refuse (policy error)
    out_of_range: tuple[tuple[dict[str, int], int], ...] = field(default=())  # (dims, count), hottest first

    def share(self, count: int) -> float:
        return count / self.total if self.total else 0.0

    def to_dict(self) -> dict[str, Any]:
        return {
            "variants": [
                {
                    "id": v.id,
                    "kind": v.kind,
                    "ranges": {d: list(r) for d, r in v.ranges.items()},
                    "hint": v.hint,
                    "count": v.count,
                    "share": round(v.share, 6),
                }
                for v in self.variants
            ],
            "traffic": {
                "total": self.total,
                "static": {"count": self.static_count, "share": round(self.share(self.static_count), 6)},
                "dynamic": {"count": self.dynamic_count, "share": round(self.share(self.dynamic_count), 6)},
                "out_of_range_by_policy": {
                    p: {"count": c, "share": round(self.share(c), 6)} for p, c in sorted(self.by_policy.items())
                },
                "rejected": {"count": self.rejected_count, "share": round(self.share(self.rejected_count), 6)},
            },
            "out_of_range": [{"dims": d, "count": c} for d, c in self.out_of_range],
        }


@dataclass(frozen=True)
class CompileTask:
    """One unit of compile work: a variant under one candidate set of Inductor options."""

    vp: VariantPlan
    candidate: int
    options: dict[str, Any]
    file: str  # name inside the staging folder's variants/
    cache: str | None = None  # the build cache's folder (precompile.build_cache), or none

    def label(self, tuning: bool) -> str:
        """The unit in the build's output: its variant, and with tuning which candidate and its options."""
        own = f" (candidate {self.candidate}: {options_label(self.options)})" if tuning else ""
        return f"{self.vp.id} {self.vp.describe()}{own}"


@dataclass(frozen=True)
class CompiledPackage:
    path: Path  # an AOTInductor .pt2, without weights unless ``embedded``
    constants: dict[str, torch.Tensor]  # name -> contiguous tensor the compiled code expects
    metadata: dict[str, str]  # AOTInductor's own metadata (AOTI_CPU_ISA, AOTI_DEVICE_KEY, ...)
    embedded: bool = False  # the constants stay inside the package (``options.embeds_constants``)
    standalone: bool = False  # runs on the artifact's own shim, without libtorch (``precompile.standalone``)
    not_standalone: str | None = None  # asked to be standalone, why it is not
    cached: bool = False  # copied from the build cache, not compiled (precompile.build_cache)


@dataclass(frozen=True)
class CompiledUnit:
    """A compiled variant: its plan as exported (the hint export used), its package, and how long
    exporting and compiling it took."""

    variant: VariantPlan
    package: CompiledPackage
    seconds: float
    candidate: int = 0


@dataclass(frozen=True)
class UnitResult:
    """What one unit's export and compile gave: the compiled unit, and per integer input the
    smallest table its graph indexes (for the inputs' value ranges)."""

    unit: CompiledUnit
    tables: dict[str, IndexTable] = field(default_factory=dict)


@dataclass(frozen=True)
class FailedUnit:
    """A tuning candidate that did not compile (a variant's first candidate failing fails the build)."""

    variant: str
    candidate: int
    reason: str


@dataclass(frozen=True)
class CompiledUnits:
    """Every unit a build compiled, the candidates that failed and why, and per integer input the
    smallest table any variant's graph indexes."""

    units: tuple[CompiledUnit, ...] = ()
    failed: tuple[FailedUnit, ...] = ()
    tables: dict[str, IndexTable] = field(default_factory=dict)

    def get(self, variant: str, candidate: int = 0) -> CompiledUnit | None:
        return next((u for u in self.units if u.variant.id == variant and u.candidate == candidate), None)

    def first(self, variant: str) -> CompiledUnit:
        """A variant's first candidate, which every build compiles (or fails)."""
        unit = self.get(variant, 0)
        if unit is None:
            raise KeyError(f"variant {variant}: no compiled unit")
        return unit

    def failure(self, variant: str, candidate: int) -> str | None:
        return next((f.reason for f in self.failed if f.variant == variant and f.candidate == candidate), None)


def smallest_tables(*found: dict[str, IndexTable]) -> dict[str, IndexTable]:
    """Per input, the table with the fewest rows among those found (every variant's graph must fit it)."""
    out: dict[str, IndexTable] = {}
    for tables in found:
        for name, table in tables.items():
            if name not in out or table.rows < out[name].rows:
                out[name] = table
    return out


def isa_suffix(isa: str | None) -> str:
    """What a variant's id ends with when it is compiled for an x86-64 level: ``-v3`` for x86-64-v3."""
    return f"-{isa.removeprefix('x86-64-')}" if isa else ""


def package_file(variant: str, candidate: int | None = None) -> str:
    """A unit's file name in variants/: ``<id>.pt2``, or ``<id>.c<k>.pt2`` for a tuning candidate."""
    return f"{variant}{'' if candidate is None else f'.c{candidate}'}{C.VARIANT_SUFFIX}"
