"""Input guards: everything the compiled code assumes about its inputs, checked in Python first.

An AOTInductor runner given a wrong static size aborts the whole process, one given a dynamic size
outside its range silently computes garbage, an index past a table calls std::terminate, and a
tensor that is not plain memory (a subclass, a lazy negative view, no storage) is read as raw bytes
and crashes. So no tensor reaches compiled code before these checks pass. They run on every call:
attribute reads and comparisons, plus one min/max pass over each integer input with a value range.
"""

from __future__ import annotations

from typing import Any, Sequence

import torch

from .constants import INTEGER_DTYPES
from .errors import GuardError
from .manifest import DimRange, InputSpec

# What the compiled code can read: a plain tensor, or a Parameter (a plain tensor that requires grad,
# what a caller passing a module's weights hands over). Every other subclass is refused: its data
# may live anywhere or nowhere (a _make_wrapper_subclass tensor has no storage of its own).
PLAIN_TENSOR_TYPES = (torch.Tensor, torch.nn.Parameter)

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
        self.built = dict(dims)
        self.policy_dims = frozenset(unchecked)
        self.dims = {d: DimRange(1, 2**62) if d in unchecked else r for d, r in dims.items()}
        self.device = device
        self.copy_inputs = copy_inputs  # move inputs on another device instead of refusing them
        # Per input: (name, dtype, ndim, [(axis, static size or None, dim name or None)], value range or None)
        self._plan = []
        for spec in inputs:
            axes = tuple((axis, s, None) if isinstance(s, int) else (axis, None, s) for axis, s in enumerate(spec.shape))
            values = spec.range if spec.dtype in INTEGER_DTYPES else None
            self._plan.append((spec.name, TORCH_DTYPES[spec.dtype], len(spec.shape), axes, values))

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
        for pos, (t, (name, dtype, ndim, axes, values)) in enumerate(zip(tensors, self._plan)):
            if type(t) not in PLAIN_TENSOR_TYPES:
                raise _not_plain(name, t)
            if t.layout is not torch.strided or t.is_nested or t.is_meta or t.is_neg() or t.is_conj() or t.is_quantized:
                raise _not_memory(name, t)
            if t.dtype is not dtype:
                raise GuardError(f"input {name!r}: dtype is {_dt(t.dtype)}, the artifact needs {_dt(dtype)}", reason="dtype")
            if t.device != device:
                if not self.copy_inputs:
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
                        raise self._out_of_range(name, dim, axis, size)
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
            try:
                short = t.untyped_storage().nbytes() < (t.storage_offset() + t.numel()) * t.element_size()
            except (RuntimeError, NotImplementedError):  # a functorch wrapper or other storage-less tensor
                short = True
            if short:
                raise GuardError(
                    f"input {name!r}: tensor has no storage holding its {t.numel()} elements (its storage was "
                    "resized or it is a wrapper without data); pass a tensor that owns its memory",
                    reason="no_storage",
                )
            if values is not None and t.numel():
                low, high = torch.aminmax(t)
                low, high = int(low), int(high)
                if low < values.min or high > values.max:
                    raise _value_outside(name, t, low if low < values.min else high, values)
        return tensors, sizes

    def _out_of_range(self, name: str, dim: str, axis: int, size: int) -> GuardError:
        if dim in self.policy_dims:  # only sizes below 1 get here: the policy serves all others
            return GuardError(
                f"input {name!r}: dim {dim!r} (axis {axis}) is {size}; the artifact serves any size ≥ 1 on that dim "
                f"(the built range {self.built[dim]}, other sizes through its out_of_range policy)",
                reason="out_of_range",
            )
        return GuardError(
            f"input {name!r}: dim {dim!r} (axis {axis}) is {size}, outside the built range {self.dims[dim]}",
            reason="out_of_range",
        )

    def _describe(self, name: str) -> str:
        spec = self.inputs[self.index[name]]
        return "(shape [" + ", ".join(str(s) for s in spec.shape) + "])"


def _not_plain(name: str, t: Any) -> GuardError:
    if isinstance(t, torch.Tensor):
        return GuardError(
            f"input {name!r}: a {type(t).__module__}.{type(t).__qualname__} (a torch.Tensor subclass); the compiled "
            "code reads plain tensors only: pass a torch.Tensor (e.g. t.as_subclass(torch.Tensor) if its data is real)",
            reason="tensor_subclass",
        )
    return GuardError(f"input {name!r}: expected a torch.Tensor, got {type(t).__name__}", reason="not_a_tensor")


def _not_memory(name: str, t: torch.Tensor) -> GuardError:
    """Why a plain tensor is not plain strided memory; the one-line test in check() found that it is not."""
    if t.is_nested:
        return GuardError(f"input {name!r}: a nested tensor; pass one padded, strided tensor", reason="nested")
    if t.layout is not torch.strided:
        return GuardError(
            f"input {name!r}: layout is {str(t.layout).removeprefix('torch.')}; the compiled code needs a dense "
            "strided tensor: pass t.to_dense()",
            reason="layout",
        )
    if t.is_meta:
        return GuardError(f"input {name!r}: a meta tensor has no data to compute on", reason="meta")
    if t.is_quantized:
        return GuardError(f"input {name!r}: a quantized tensor; pass t.dequantize() or the plain values", reason="quantized")
    if t.is_neg():
        return GuardError(
            f"input {name!r}: a lazy negative view (its memory holds the values unnegated): pass t.resolve_neg()",
            reason="neg_view",
        )
    return GuardError(
        f"input {name!r}: a lazy conjugate view (its memory holds the values unconjugated): pass t.resolve_conj()",
        reason="conj_view",
    )


def _value_outside(name: str, t: torch.Tensor, value: int, values: DimRange) -> GuardError:
    """The refusal for a value outside the range, naming where the first such value is (slow path only)."""
    where = tuple(int(i) for i in (t == value).nonzero()[0])
    return GuardError(
        f"input {name!r}: value {value} at {list(where)} is outside the valid range {values}",
        reason="value_range",
    )


def _dt(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")
