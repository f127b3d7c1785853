"""The batch plan: which calls to one model may run together, and at what shape. Pure functions of
the manifest, the variants and a call's sizes, with no thread and no tensor work, so that a test can
check every decision ``loader.Batcher`` makes without running one (the rules are in the module
docstring of ``loader.serving.batch``).

    plan = batch_plan(model)                     # once per model version
    spot = place(plan, model, tensors, sizes, variant, max_batch=8)  # per call: batch-mates, limits
    key, size = aim(plan, key, rows, max_rows, reach)        # per batch: the shape it runs at
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from ..dispatch import ServedModel
    from ..manifest import Variant

BATCH_DIM = "batch"  # the batch dim of artifacts without a ``batching`` section
PadTimes = dict[tuple, dict[int, tuple[float, float]]]  # other dims' sizes -> batch size -> (static_ms, dynamic_ms)


@dataclass(frozen=True)
class BatchPlan:
    """How one model is batched: its batch dim (None: call by call, ``why`` says why), the static
    batch sizes per shape of the other dims, which of them padding may aim at, the batch axis of
    each input and output, and the dims calls may differ in (padded) with the axes they touch."""

    batch_dim: str | None
    why: str = ""
    statics: dict[tuple, list[int]] = field(default_factory=dict)  # other dims' sizes -> static batch sizes
    pad_to: PadTimes = field(default_factory=dict)  # the static shapes padding may aim at (measured, kept)
    others: tuple[str, ...] = ()  # the dims other than the batch dim, in the manifest's order (the keys above)
    input_axes: tuple[int, ...] = ()  # per input, its batch axis (empty: axis 0 of every input)
    output_axes: tuple[int, ...] | None = None  # per flat output, its batch axis; None: axis 0, checked per batch
    pad_dims: tuple[str, ...] = ()  # the dims calls may differ in, padded to the batch's largest
    pad_inputs: tuple[tuple[tuple[int, ...], ...], ...] = ()  # per pad dim, per input: the axes it is on
    pad_outputs: tuple[tuple[tuple[int, ...], ...], ...] = ()  # per pad dim, per flat output: the axes following it
    pad_values: tuple[float, ...] = ()  # per input, what padding fills it with

    def input_axis(self, i: int) -> int:
        return self.input_axes[i] if self.input_axes else 0

    def output_axis(self, k: int) -> int:
        return self.output_axes[k] if self.output_axes is not None else 0


@dataclass(frozen=True)
class Placement:
    """Where one call stands in the queue: ``key`` (equal for the calls it may batch with), its
    rows, the most rows a batch it starts may hold, the sizes of the plan's other dims and padded
    dims, and ``reach``: per padded dim, the sizes calls batched with it as the oldest may have."""

    key: tuple
    rows: int
    max_rows: int
    other_sizes: tuple = ()
    pads: tuple = ()
    reach: tuple = ()


def batch_plan(model: ServedModel) -> BatchPlan:
    """Find ``model``'s batch dim, padded dims and static sizes (see ``loader.serving.batch``)."""
    m = model.manifest
    section = m.batching
    if section is not None:
        dim = section.dim
        shapes = [(spec.name, spec.shape) for spec in m.inputs]
        plan = section_plan(dim, section.pad, section.pad_value, shapes, m.output_dims or ())
    else:
        dim = BATCH_DIM
        why = _why_unbatched(model, dim)
        if why:
            return BatchPlan(None, why)
        output_axes = tuple(0 for _ in m.output_dims) if m.output_dims is not None else None
        plan = BatchPlan(dim, output_axes=output_axes, pad_values=tuple(0.0 for _ in m.inputs))
    others = tuple(d for d in m.dims if d != dim)
    return replace(
        plan, statics=_static_sizes(model, dim, others), pad_to=_measured_pads(model, dim, others), others=others
    )


def section_plan(
    dim: str,
    pad: Sequence[str],
    pad_value: Mapping[str, float],
    inputs: Sequence[tuple[str, Sequence[Any]]],
    output_dims: Sequence[Sequence[Any]],
) -> BatchPlan:
    """The axes a ``batching`` section (``dim``, ``pad``, ``pad_value``) joins and cuts along, from
    each input's name and shape and each flat output's dims: the batch axis of each, the axes each
    padded dim is on, each input's pad value. The one rule of both sides: the Batcher's plan from
    the manifest, the build's check of the section from the profile (``precompile.stages.batching``)."""
    return BatchPlan(
        dim,
        input_axes=tuple(tuple(shape).index(dim) for _, shape in inputs),
        output_axes=tuple(tuple(axes).index(dim) for axes in output_dims),
        pad_dims=tuple(pad),
        pad_inputs=tuple(tuple(_axes(shape, d) for _, shape in inputs) for d in pad),
        pad_outputs=tuple(tuple(_axes(axes, d) for axes in output_dims) for d in pad),
        pad_values=tuple(pad_value.get(name, 0.0) for name, _ in inputs),
    )


def _why_unbatched(model: ServedModel, dim: str) -> str:
    """Why an artifact without a ``batching`` section cannot batch on ``dim`` ("" when it can): the
    dim must be axis 0, alone, of every input and every output the manifest describes."""
    m = model.manifest
    if dim not in m.dims:
        return f"no dim named {dim!r}"
    for spec in m.inputs:
        if not spec.shape or spec.shape[0] != dim or dim in spec.shape[1:]:
            return f"input {spec.name!r}: {dim!r} is not its axis 0 alone"
    for i, axes in enumerate(m.output_dims or ()):
        if not axes or axes[0] != dim or dim in axes[1:]:
            return f"output {i}: {dim!r} is not its axis 0 alone"
    return ""


def _static_sizes(model: ServedModel, dim: str, others: tuple[str, ...]) -> dict[tuple, list[int]]:
    """Per shape of the other dims, the batch sizes static variants serve, smallest first."""
    statics: dict[tuple, list[int]] = {}
    for v in model.variants:
        if v.kind == "static":
            statics.setdefault(tuple(v.dims[d].min for d in others), []).append(v.dims[dim].min)
    for sizes in statics.values():
        sizes.sort()
    return statics


def _measured_pads(model: ServedModel, dim: str, others: tuple[str, ...]) -> PadTimes:
    """Per shape of the other dims, per static batch size the build measured and kept, its
    ``(static_ms, dynamic_ms)``: the shapes padding may aim at (``check.measure`` of the manifest)."""
    measured = {entry.variant: entry for entry in model.manifest.check.measure if entry.kept}
    pad_to: PadTimes = {}
    for v in model.variants:
        entry = measured.get(v.id)
        if v.kind == "static" and entry is not None:
            key = tuple(v.dims[d].min for d in others)
            pad_to.setdefault(key, {})[v.dims[dim].min] = (entry.static_ms, entry.dynamic_ms)
    return pad_to


def _axes(shape: Sequence[Any], dim: str) -> tuple[int, ...]:
    return tuple(axis for axis, s in enumerate(shape) if s == dim)


def place(
    plan: BatchPlan,
    model: ServedModel,
    tensors: list[Any],
    sizes: dict[str, int],
    variant: Variant | None,
    *,
    max_batch: int | None,
) -> Placement:
    """Where a call of these (guard-checked) tensors and dim sizes goes: its batch-mates' key and
    its limits (see ``Placement``). A call that cannot batch (no batch dim, or no ``variant``: a
    pad or split policy serves it) gets a key shared with no other."""
    if plan.batch_dim is None or variant is None:
        return Placement((id(model), object()), 1, 1)
    other_sizes = tuple(sizes[d] for d in plan.others)
    key = (id(model), shape_key(plan, tensors))
    rows = sizes[plan.batch_dim]
    limit = max_rows(plan, model, sizes, max_batch=max_batch)
    if not plan.pad_dims:
        return Placement(key, rows, limit, other_sizes)
    pads = tuple(sizes[d] for d in plan.pad_dims)
    reach, limit = _reach(plan, model, sizes, pads, limit)
    return Placement(key, rows, limit, other_sizes, pads, reach)


def shape_key(plan: BatchPlan, tensors: list[Any]) -> tuple:
    """What calls batched together share: each input's dtype and sizes, but for its batch axis
    and the axes of padded dims."""
    free: list[set[int]] = [set() for _ in tensors]
    for per_input in plan.pad_inputs:
        for i, axes in enumerate(per_input):
            free[i].update(axes)
    return tuple(
        (tuple(-1 if a == plan.input_axis(i) or a in free[i] else n for a, n in enumerate(t.shape)), t.dtype)
        for i, t in enumerate(tensors)
    )


def max_rows(plan: BatchPlan, model: ServedModel, sizes: dict[str, int], *, max_batch: int | None) -> int:
    """The most rows a batch of this shape may hold: ``max_batch``, within the variants' reach."""
    reach = max(
        (
            v.dims[plan.batch_dim].max
            for v in model.variants
            if all(sizes[d] in r for d, r in v.dims.items() if d != plan.batch_dim)
        ),
        default=1,
    )
    return max(1, min(reach, max_batch or reach))


def _reach(plan: BatchPlan, model: ServedModel, sizes: dict[str, int], pads: tuple, limit: int) -> tuple[tuple, int]:
    """Per padded dim, the sizes a batch this call starts may gather (the range of the tightest
    dynamic variant holding the call, so the padded batch stays on compiled code made for such
    sizes), and its row limit there; a call no dynamic variant holds batches with equal sizes."""
    holding = [v for v in model.variants if v.kind == "dynamic" and all(sizes[d] in r for d, r in v.dims.items())]
    if not holding:
        return tuple((n, n) for n in pads), limit
    tightest = min(holding, key=lambda v: _product(r.max - r.min + 1 for r in v.dims.values()))
    reach = tuple((tightest.dims[d].min, tightest.dims[d].max) for d in plan.pad_dims)
    return reach, max(1, min(limit, tightest.dims[plan.batch_dim].max))


def aim(plan: BatchPlan, key: tuple, rows: int, max_rows: int, reach: tuple = ()) -> tuple[tuple, int]:
    """The shape to run ``rows`` real rows at, whose other dims are ``key`` (padded dims already at the
    batch's largest): ``(key, rows)``, or a static variant's larger shape, up to ``max_rows`` and
    within ``reach`` (per padded dim, the range the batch was gathered in), where padding to it was
    measured to pay (see ``loader.serving.batch``)."""
    if rows in plan.statics.get(key, ()):
        return key, rows
    at = [plan.others.index(d) for d in plan.pad_dims]
    work = rows * _product(key[i] for i in at)
    best, best_work = (key, rows), None
    for other, sizes in plan.pad_to.items():
        if any(other[i] != key[i] for i in range(len(key)) if i not in at):
            continue
        if any(not key[i] <= other[i] <= hi for i, (_, hi) in zip(at, reach or [(0, 2**62)] * len(at))):
            continue
        for size, (static_ms, dynamic_ms) in sizes.items():
            padded = size * _product(other[i] for i in at)
            pays = static_ms <= dynamic_ms * work / padded
            if rows <= size <= max_rows and pays and (best_work is None or padded < best_work):
                best, best_work = (other, size), padded
    return best


def padded_size(plan: BatchPlan, key: tuple, rows: int, max_rows: int) -> int:
    """The batch size to run ``rows`` real rows at: ``rows``, or a larger static size up to
    ``max_rows`` where padding to it was measured to pay (see ``loader.serving.batch``)."""
    return aim(plan, key, rows, max_rows)[1]


def _product(values) -> int:
    out = 1
    for v in values:
        out *= v
    return out
