"""The array work of a batch: join the calls' inputs into one batch, split its outputs back per
call. Pure functions of arrays and a ``BatchPlan``; ``loader.Batcher`` calls them from its worker
thread (the rules are in the module docstring of ``loader.serving.batch``). The arrays are the model's own
kind (torch tensors, numpy arrays), worked on through its ``ArrayOps`` (``model.ops``), so this
module imports neither torch nor numpy.

    inputs = join_inputs(ops, plan, [call.tensors for call in batch], pads=target, rows=rows, size=size)
    pieces = split_outputs(ops, plan, spec, outputs, [(call.rows, call.pads) for call in batch], size=size)
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from ..manifest import OutputSpec
from ..outputs import flatten, unflatten
from ..policy import ArrayOps
from .batch_plan import BatchPlan


class NotBatched(Exception):
    """An output whose batch axis does not have the batch's size: the model cannot be batched this way."""


def join_inputs(
    ops: ArrayOps, plan: BatchPlan, calls: Sequence[Sequence[Any]], *, pads: Sequence[int], rows: int, size: int
) -> list[Any]:
    """Per input, the calls' tensors grown to ``pads`` (per padded dim, the batch's size) with the
    input's pad value and concatenated along its batch axis; ``size - rows`` padding rows repeat the
    last row, so they pass the same value guards."""
    inputs = []
    for i in range(len(calls[0])):
        axis = plan.input_axis(i)
        parts = [tensors[i] for tensors in calls]
        for j, n in enumerate(pads):
            parts = [grow(ops, t, plan.pad_inputs[j][i], n, plan.pad_values[i]) for t in parts]
        if size > rows:
            last = ops.narrow(parts[-1], axis, parts[-1].shape[axis] - 1, 1)
            parts.extend([last] * (size - rows))
        inputs.append(ops.cat(parts, axis))
    return inputs


def grow(ops: ArrayOps, t: Any, axes: tuple[int, ...], size: int, value: float) -> Any:
    """``t`` grown to ``size`` along each of ``axes``, the new entries filled with ``value``."""
    for axis in axes:
        missing = size - t.shape[axis]
        if missing > 0:
            shape = list(t.shape)
            shape[axis] = missing
            t = ops.cat([t, ops.fill(t, shape, value)], axis)
    return t


def split_outputs(
    ops: ArrayOps, plan: BatchPlan, spec: OutputSpec, outputs: Any, shares: Sequence[tuple[int, tuple]], *, size: int
) -> list[Any]:
    """Per call (``shares``: its rows and its padded dims' sizes, in batch order), its rows of every
    output along the output's batch axis (the padding rows, up to ``size``, left out), every axis
    following a padded dim cut back to the call's own size, in forward()'s structure (``spec``).
    Raises ``NotBatched`` when an output's batch axis is not ``size`` long."""
    per_call: list[list[Any]] = [[] for _ in shares]
    for k, t in enumerate(flatten(outputs)):
        axis = plan.output_axis(k)
        if t.ndim <= axis or t.shape[axis] != size:
            raise NotBatched(
                f"an output of shape {tuple(t.shape)} for a batch of {size}: its axis {axis} does not follow the batch"
            )
        start = 0
        for c, (rows, pads) in enumerate(shares):
            per_call[c].append(cut(ops, plan, k, t, start=start, rows=rows, pads=pads))
            start += rows
    return [unflatten(spec, pieces) for pieces in per_call]


def cut(ops: ArrayOps, plan: BatchPlan, k: int, t: Any, *, start: int, rows: int, pads: Sequence[int]) -> Any:
    """One call's part of flat output ``k`` (``t``): its ``rows`` rows from ``start`` along the
    output's batch axis, every axis following a padded dim narrowed to the call's size in that dim
    (``pads``, per padded dim). The build's check of a ``batching`` section cuts with it too."""
    piece = ops.narrow(t, plan.output_axis(k), start, rows)
    for j, n in enumerate(pads):
        for a in plan.pad_outputs[j][k]:
            piece = ops.narrow(piece, a, 0, n)
    return piece
