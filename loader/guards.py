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
        self,
        inputs: Sequence[InputSpec],
        dims: dict[str, DimRange],
        device: torch.device = torch.device("cpu"),
        unchecked: set[str] = frozenset(),
        copy_inputs: bool = False,
    ):
        self.inputs = tuple(inputs)
        self.names = tuple(i.name for i in inputs)
        self.index = {name: pos for pos, name in enumerate(self.names)}
        # Dims whose out-of-range sizes a pad/split policy serves: any size ≥ 1 passes the guard.
        self.dims = {d: DimRange(1, 2**62) if d in unchecked else r for d, r in dims.items()}
        self.device = device
        self.copy_inputs = copy_inputs  # move inputs on another device instead of refusing them
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
            raise GuardError(f"expected at most {n} inputs ({', '.join(self.names)}), got {len(args)} positional", reason="too_many_inputs")
        bound: list = list(args) + [None] * (n - len(args))
        given = [True] * len(args) + [False] * (n - len(args))
        for key, value in kwargs.items():
            pos = self.index.get(key)
            if pos is None:
                raise GuardError(f"unknown input {key!r} (inputs: {', '.join(self.names)})", reason="unknown_input")
            if given[pos]:
                raise GuardError(f"input {key!r} given twice, by position and by name", reason="duplicate_input")
            bound[pos] = value
            given[pos] = True
        missing = [name for name, ok in zip(self.names, given) if not ok]
        if missing:
            raise GuardError(f"missing input(s): {', '.join(missing)} (inputs: {', '.join(self.names)})", reason="missing_input")
        return bound

    def check(self, args: tuple, kwargs: dict[str, Any]) -> tuple[list, dict[str, int]]:
        tensors = self.bind(args, kwargs)
        sizes: dict[str, int] = {}
        device = self.device
        for pos, (t, (name, dtype, ndim, axes)) in enumerate(zip(tensors, self._plan)):
            if type(t) is not torch.Tensor and not isinstance(t, torch.Tensor):
                raise GuardError(f"input {name!r}: expected a torch.Tensor, got {type(t).__name__}", reason="not_a_tensor")
            if t.dtype is not dtype:
                raise GuardError(f"input {name!r}: dtype is {_dt(t.dtype)}, the artifact needs {_dt(dtype)}", reason="dtype")
            if t.device != device:
                if not self.copy_inputs or t.device.type == "meta":
                    raise GuardError(
                        f"input {name!r}: tensor is on {t.device}, the model runs on {device} "
                        f"(move it with .to({str(device)!r}), or load with copy_inputs=True)",
                        reason="device",
                    )
                t = tensors[pos] = t.to(device)
            shape = t.shape
            if len(shape) != ndim:
                raise GuardError(
                    f"input {name!r}: has {len(shape)} dimensions {tuple(shape)}, the artifact needs {ndim} "
                    f"{self._describe(name)}",
                    reason="rank",
                )
            for axis, static, dim in axes:
                size = shape[axis]
                if static is not None:
                    if size != static:
                        raise GuardError(
                            f"input {name!r}: axis {axis} is {size}, the artifact needs exactly {static} "
                            f"{self._describe(name)}",
                            reason="static_size",
                        )
                    continue
                seen = sizes.get(dim)
                if seen is None:
                    rng = self.dims[dim]
                    if not rng.min <= size <= rng.max:
                        raise GuardError(
                            f"input {name!r}: dim {dim!r} (axis {axis}) is {size}, outside the built range {rng}",
                            reason="out_of_range",
                        )
                    sizes[dim] = size
                elif seen != size:
                    raise GuardError(
                        f"input {name!r}: dim {dim!r} (axis {axis}) is {size}, but another input has {dim}={seen}; "
                        f"inputs sharing a dim must agree",
                        reason="dim_mismatch",
                    )
            if not t.is_contiguous():
                raise GuardError(
                    f"input {name!r}: tensor is not contiguous (strides {t.stride()}); the compiled code "
                    "expects contiguous inputs: pass t.contiguous()",
                    reason="not_contiguous",
                )
        return tensors, sizes

    def _describe(self, name: str) -> str:
        spec = self.inputs[self.index[name]]
        return "(shape [" + ", ".join(str(s) for s in spec.shape) + "])"


def _dt(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")
