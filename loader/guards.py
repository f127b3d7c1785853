"""Input guards: everything the compiled code assumes about its inputs, checked in Python first.

An AOTInductor runner given a wrong static size aborts the whole process, and one given a dynamic
size outside its range silently computes garbage, so no tensor reaches compiled code before these
checks pass. They run on every call: keep them to plain attribute reads and comparisons.
"""

from __future__ import annotations

from typing import Any, Sequence

import torch

from .errors import GuardError
from .manifest import DimRange, InputSpec

TORCH_DTYPES = {
    "float32": torch.float32,
    "float64": torch.float64,
    "float16": torch.float16,
    "bfloat16": torch.bfloat16,
    "int64": torch.int64,
    "int32": torch.int32,
    "int16": torch.int16,
    "int8": torch.int8,
    "uint8": torch.uint8,
    "bool": torch.bool,
}


class InputGuard:
    """Binds call arguments to the artifact's inputs and checks them.

    ``check(args, kwargs)`` returns the flat list of tensors in forward() order and a dict of the
    size of every named dim, or raises GuardError naming the input, axis and allowed values.
    """

    def __init__(
        self, inputs: Sequence[InputSpec], dims: dict[str, DimRange], device: str = "cpu", unchecked: set[str] = frozenset()
    ):
        self.inputs = tuple(inputs)
        self.names = tuple(i.name for i in inputs)
        self.index = {name: pos for pos, name in enumerate(self.names)}
        # Dims whose out-of-range sizes a pad/split policy serves: any size ≥ 1 passes the guard.
        self.dims = {d: DimRange(1, 2**62) if d in unchecked else r for d, r in dims.items()}
        self.device = device
        # Per input: (name, dtype, ndim, [(axis, static size or None, dim name or None)])
        self._plan = []
        for spec in inputs:
            axes = tuple((axis, s, None) if isinstance(s, int) else (axis, None, s) for axis, s in enumerate(spec.shape))
            self._plan.append((spec.name, TORCH_DTYPES[spec.dtype], len(spec.shape), axes))

    def bind(self, args: tuple, kwargs: dict[str, Any]) -> list:
        n = len(self.names)
        if not kwargs and len(args) == n:
            return list(args)
        if len(args) > n:
            raise GuardError(f"expected at most {n} inputs ({', '.join(self.names)}), got {len(args)} positional")
        bound: list = list(args) + [None] * (n - len(args))
        given = [True] * len(args) + [False] * (n - len(args))
        for key, value in kwargs.items():
            pos = self.index.get(key)
            if pos is None:
                raise GuardError(f"unknown input {key!r} (inputs: {', '.join(self.names)})")
            if given[pos]:
                raise GuardError(f"input {key!r} given twice, by position and by name")
            bound[pos] = value
            given[pos] = True
        missing = [name for name, ok in zip(self.names, given) if not ok]
        if missing:
            raise GuardError(f"missing input(s): {', '.join(missing)} (inputs: {', '.join(self.names)})")
        return bound

    def check(self, args: tuple, kwargs: dict[str, Any]) -> tuple[list, dict[str, int]]:
        tensors = self.bind(args, kwargs)
        sizes: dict[str, int] = {}
        device = self.device
        for t, (name, dtype, ndim, axes) in zip(tensors, self._plan):
            if type(t) is not torch.Tensor and not isinstance(t, torch.Tensor):
                raise GuardError(f"input {name!r}: expected a torch.Tensor, got {type(t).__name__}")
            if t.dtype is not dtype:
                raise GuardError(f"input {name!r}: dtype is {_dt(t.dtype)}, the artifact needs {_dt(dtype)}")
            if t.device.type != device:
                raise GuardError(f"input {name!r}: tensor is on {t.device}, the artifact runs on {device}")
            shape = t.shape
            if len(shape) != ndim:
                raise GuardError(
                    f"input {name!r}: has {len(shape)} dimensions {tuple(shape)}, the artifact needs {ndim} "
                    f"{self._describe(name)}"
                )
            for axis, static, dim in axes:
                size = shape[axis]
                if static is not None:
                    if size != static:
                        raise GuardError(
                            f"input {name!r}: axis {axis} is {size}, the artifact needs exactly {static} "
                            f"{self._describe(name)}"
                        )
                    continue
                seen = sizes.get(dim)
                if seen is None:
                    rng = self.dims[dim]
                    if not rng.min <= size <= rng.max:
                        raise GuardError(
                            f"input {name!r}: dim {dim!r} (axis {axis}) is {size}, outside the built range {rng}"
                        )
                    sizes[dim] = size
                elif seen != size:
                    raise GuardError(
                        f"input {name!r}: dim {dim!r} (axis {axis}) is {size}, but another input has {dim}={seen}; "
                        f"inputs sharing a dim must agree"
                    )
            if not t.is_contiguous():
                raise GuardError(
                    f"input {name!r}: tensor is not contiguous (strides {t.stride()}); the compiled code "
                    "expects contiguous inputs: pass t.contiguous()"
                )
        return tensors, sizes

    def _describe(self, name: str) -> str:
        spec = self.inputs[self.index[name]]
        return "(shape [" + ", ".join(str(s) for s in spec.shape) + "])"


def _dt(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")
