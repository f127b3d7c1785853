"""The tensor work of a batch: join the calls' inputs into one batch, split its outputs back per
call. Pure functions of tensors and a ``BatchPlan``; ``loader.Batcher`` calls them from its worker
thread (the rules are in the module docstring of ``loader.batch``).

    inputs = join_inputs(plan, [call.tensors for call in batch], pads=target, rows=rows, size=size)
    pieces = split_outputs(plan, spec, outputs, [(call.rows, call.pads) for call in batch], size=size)
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

from .batch_plan import BatchPlan
from .manifest import OutputSpec
from .outputs import flatten, unflatten


class NotBatched(Exception):
    """An output whose batch axis does not have the batch's size: the model cannot be batched this way."""


def join_inputs(
    plan: BatchPlan, calls: Sequence[Sequence[torch.Tensor]], *, pads: Sequence[int], rows: int, size: int
) -> list[torch.Tensor]:
    """Per input, the calls' tensors grown to ``pads`` (per padded dim, the batch's size) with the
    input's pad value and concatenated along its batch axis; ``size - rows`` padding rows repeat the
    last row, so they pass the same value guards."""
    inputs = []
    for i in range(len(calls[0])):
        axis = plan.input_axis(i)
        parts = [tensors[i] for tensors in calls]
        for j, n in enumerate(pads):
            parts = [grow(t, plan.pad_inputs[j][i], n, plan.pad_values[i]) for t in parts]
        if size > rows:
            last = parts[-1].narrow(axis, parts[-1].shape[axis] - 1, 1)
            shape = list(last.shape)
            shape[axis] = size - rows
            parts.append(last.expand(shape))
        inputs.append(torch.cat(parts, dim=axis))
    return inputs


def grow(t: torch.Tensor, axes: tuple[int, ...], size: int, value: float) -> torch.Tensor:
    """``t`` grown to ``size`` along each of ``axes``, the new entries filled with ``value``."""
    for axis in axes:
        missing = size - t.shape[axis]
        if missing > 0:
            shape = list(t.shape)
            shape[axis] = missing
            t = torch.cat([t, torch.full(shape, value, dtype=t.dtype, device=t.device)], dim=axis)
    return t


def split_outputs(
    plan: BatchPlan, spec: OutputSpec, outputs: Any, shares: Sequence[tuple[int, tuple]], *, size: int
) -> list[Any]:
    """Per call (``shares``: its rows and its padded dims' sizes, in batch order), its rows of every
    output along the output's batch axis (the padding rows, up to ``size``, left out), every axis
    following a padded dim cut back to the call's own size, in forward()'s structure (``spec``).
    Raises ``NotBatched`` when an output's batch axis is not ``size`` long."""
    per_call: list[list[torch.Tensor]] = [[] for _ in shares]
    for k, t in enumerate(flatten(outputs)):
        axis = plan.output_axis(k)
        if t.dim() <= axis or t.shape[axis] != size:
            raise NotBatched(
                f"an output of shape {tuple(t.shape)} for a batch of {size}: its axis {axis} does not follow the batch"
            )
        start = 0
        for c, (rows, pads) in enumerate(shares):
            piece = t.narrow(axis, start, rows)
            for j, n in enumerate(pads):
                for a in plan.pad_outputs[j][k]:
                    piece = piece.narrow(a, 0, n)
            per_call[c].append(piece)
            start += rows
    return [unflatten(spec, pieces) for pieces in per_call]
