"""The input guards of ``loader.guards``, for numpy arrays: nothing reaches compiled code before they pass.

The shape checks (rank, static sizes, dim ranges, shared dims) are ``loader.shapes``', so both loaders
refuse a wrong shape with the same words; here are what an array itself must be: a plain
``numpy.ndarray`` (a ``numpy.memmap`` too: plain memory), of the input's dtype in this machine's
byte order, C-contiguous, aligned, and, for an integer input with a value range, within it.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np

from ..errors import GuardError
from ..manifest import DimRange, InputSpec
from ..policy import ArrayOps
from ..shapes import ShapeGuard, check_bool_bytes, not_plain, value_outside
from .capi import NUMPY_DTYPES

# Subclasses that are plain memory. Others (numpy.ma.MaskedArray, numpy.matrix, ...) carry meaning
# the compiled code would ignore, so they are refused.
PLAIN_ARRAY_TYPES = (np.ndarray, np.memmap)


class ArrayGuard(ShapeGuard):
    """Binds call arguments to the artifact's inputs and checks them; ``check(args, kwargs)`` returns
    the arrays in forward() order and the size of every named dim, or raises GuardError."""

    def __init__(self, inputs: Sequence[InputSpec], dims: dict[str, DimRange], unchecked: set[str] = frozenset()):
        super().__init__(inputs, dims, unchecked)
        self._plan = [
            (name, NUMPY_DTYPES[dtype], ndim, axes, values) for name, dtype, ndim, axes, values in self.input_plan()
        ]

    def check(self, args: tuple, kwargs: dict[str, Any]) -> tuple[list, dict[str, int]]:
        arrays = self.bind(args, kwargs)
        sizes: dict[str, int] = {}
        for a, (name, dtype, ndim, axes, values) in zip(arrays, self._plan):
            if type(a) not in PLAIN_ARRAY_TYPES:
                raise _not_plain(name, a)
            if a.dtype != dtype:
                raise GuardError(
                    f"input {name!r}: dtype is {_dt(a.dtype)}, the artifact needs {dtype.name}", reason="dtype"
                )
            self.check_shape(name, a.shape, ndim, axes, sizes)
            flags = a.flags
            if not flags.c_contiguous:
                raise GuardError(
                    f"input {name!r}: array is not C-contiguous (strides {tuple(s // a.itemsize for s in a.strides)}); "
                    "the compiled code expects contiguous inputs: pass np.ascontiguousarray(a)",
                    reason="not_contiguous",
                )
            if not flags.aligned:
                raise GuardError(
                    f"input {name!r}: array data is not aligned to its {a.itemsize}-byte elements; pass a.copy()",
                    reason="not_aligned",
                )
            if dtype == np.bool_ and a.size:
                check_bool_bytes(name, a)
            elif values is not None and a.size:
                low, high = int(a.min()), int(a.max())
                if low < values.min or high > values.max:
                    value = low if low < values.min else high
                    raise value_outside(name, value, [int(i) for i in np.argwhere(a == value)[0]], values)
        return arrays, sizes


def _not_plain(name: str, a: Any) -> GuardError:
    return not_plain(
        name, a, np.ndarray, "numpy.ndarray", "arrays", "pass np.asarray(a) if its data is what to compute on"
    )


def _dt(dtype: np.dtype) -> str:
    if dtype.byteorder not in ("=", "|") and dtype.newbyteorder("=") != dtype:
        return f"{dtype.name} in {'big' if dtype.byteorder == '>' else 'little'}-endian byte order"
    return dtype.name


def _index(axis: int, start: int, size: int) -> tuple:
    return (slice(None),) * axis + (slice(start, start + size),)


NUMPY_OPS = ArrayOps(
    cat=lambda arrays, axis: np.concatenate(arrays, axis=axis),
    fill=lambda like, shape, value: np.full(shape, value, dtype=like.dtype),
    take=lambda a, axis, start, size: np.ascontiguousarray(a[_index(axis, start, size)]),
    narrow=lambda a, axis, start, size: a[_index(axis, start, size)],
)
