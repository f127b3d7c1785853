"""Out-of-range policies: serve a size no variant covers by padding it up or splitting it.

``pad``: grow the dim up to the smallest covered size, filling inputs with their pad value, then cut
every output axis that follows the dim back to the caller's size. ``split``: cut the dim into pieces
within range, run each, and concatenate the outputs along the axes that follow the dim. Both undo
themselves only through the output axes the profile declared (``output_dims`` in the manifest).
"""

from __future__ import annotations

from typing import Callable, Sequence

import torch

from .errors import GuardError
from .manifest import DimRange, Manifest

Run = Callable[[list, dict], tuple[list, list]]  # (tensors, sizes) -> (flat outputs, variant ids)


def split_sizes(size: int, lo: int, hi: int) -> list[int] | None:
    """Cut ``size`` into as few pieces as possible, each within [lo, hi], as even as possible."""
    if hi < 1:
        return None
    pieces = -(-size // hi)
    base, extra = divmod(size, pieces)
    if base < lo:
        return None
    return [base + 1] * extra + [base] * (pieces - extra)


class Policies:
    """The manifest's policies, with the input and output axes each dim touches precomputed."""

    def __init__(self, manifest: Manifest):
        self.dims: dict[str, DimRange] = manifest.dims
        self.policy = {d: p for d, p in manifest.policy.items() if p != "error"}
        self.input_axes = {
            d: [(i, axis) for i, spec in enumerate(manifest.inputs) for axis, s in enumerate(spec.shape) if s == d]
            for d in self.policy
        }
        self.pad_values = [manifest.pad_value.get(spec.name, 0.0) for spec in manifest.inputs]
        self.output_axes = {
            d: [axes.index(d) if d in axes else None for axes in (manifest.output_dims or ())] for d in self.policy
        }

    def needed(self, sizes: dict[str, int]) -> bool:
        for d in self.policy:
            r = self.dims[d]
            if not r.min <= sizes[d] <= r.max:
                return True
        return False

    def run(self, tensors: list, sizes: dict[str, int], run: Run) -> tuple[list, list]:
        """Serve one call, applying the first policy the sizes need, recursively."""
        for d, policy in self.policy.items():
            r, n = self.dims[d], sizes[d]
            if r.min <= n <= r.max:
                continue
            if policy == "split":
                return self._split(d, r, n, tensors, sizes, run)
            return self._pad(d, r, n, tensors, sizes, run)
        return run(tensors, sizes)

    def _split(self, d: str, r: DimRange, n: int, tensors: list, sizes: dict, run: Run) -> tuple[list, list]:
        pieces = split_sizes(n, r.min, r.max) if n > r.max else None
        if pieces is None:
            raise GuardError(
                f"dim {d!r} is {n}, outside the built range {r}; its policy is split, which serves sizes above "
                f"{r.max} that cut into pieces within the range",
                reason="policy",
            )
        parts, ids, offset = [], [], 0
        for size in pieces:
            sub = _narrow(tensors, self.input_axes[d], offset, size)
            outputs, used = self.run(sub, {**sizes, d: size}, run)
            parts.append(outputs)
            ids += used
            offset += size
        return [torch.cat([p[k] for p in parts], dim=axis) for k, axis in enumerate(self.output_axes[d])], ids

    def _pad(self, d: str, r: DimRange, n: int, tensors: list, sizes: dict, run: Run) -> tuple[list, list]:
        if n > r.max:
            raise GuardError(
                f"dim {d!r} is {n}, above the built range {r}; its policy is pad, which only serves sizes below {r.min}",
                reason="policy",
            )
        padded = list(tensors)
        for i, axis in self.input_axes[d]:
            t = padded[i]
            shape = list(t.shape)
            shape[axis] = r.min - n
            fill = torch.full(shape, self.pad_values[i], dtype=t.dtype, device=t.device)
            padded[i] = torch.cat([t, fill], dim=axis)
        outputs, ids = self.run(padded, {**sizes, d: r.min}, run)
        return [o if axis is None else o.narrow(axis, 0, n) for o, axis in zip(outputs, self.output_axes[d])], ids


def _narrow(tensors: Sequence, axes: list[tuple[int, int]], offset: int, size: int) -> list:
    out = list(tensors)
    for i, axis in axes:
        out[i] = out[i].narrow(axis, offset, size).contiguous()
    return out
