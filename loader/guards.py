"""Input guards: everything the compiled code assumes about its inputs, checked in Python first.

An AOTInductor runner given a wrong static size aborts the whole process, one given a dynamic size
outside its range silently computes garbage, an index past a table calls std::terminate, and a
tensor that is not plain memory (a subclass, a lazy negative view, no storage) is read as raw bytes
and crashes. So no tensor reaches compiled code before these checks pass. They run on every call:
attribute reads and comparisons, plus one min/max pass over each integer input with a value range.
"""

from __future__ import annotations

import ctypes
from collections.abc import Sequence
from typing import Any

import torch

from .errors import GuardError
from .manifest import DimRange, InputSpec
from .shapes import BYTES_SCAN, ShapeGuard, check_bool_bytes, not_plain, value_outside

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


class InputGuard(ShapeGuard):
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
        super().__init__(inputs, dims, unchecked)
        self.device = device
        self.copy_inputs = copy_inputs  # move inputs on another device instead of refusing them
        # Per input: (name, dtype, ndim, [(axis, static size or None, dim name or None)], value range or None)
        self._plan = [
            (name, TORCH_DTYPES[dtype], ndim, axes, values) for name, dtype, ndim, axes, values in self.input_plan()
        ]

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
                raise GuardError(
                    f"input {name!r}: dtype is {_dt(t.dtype)}, the artifact needs {_dt(dtype)}", reason="dtype"
                )
            if t.device != device:
                if not self.copy_inputs:
                    raise GuardError(
                        f"input {name!r}: tensor is on {t.device}, the model runs on {device} "
                        f"(move it with .to({str(device)!r}), or load with copy_inputs=True)",
                        reason="device",
                    )
                t = tensors[pos] = t.to(device)
            self.check_shape(name, t.shape, ndim, axes, sizes)
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
            if dtype is torch.bool and t.numel():
                _check_bool_bytes(name, t)
            elif values is not None and t.numel():
                low, high = torch.aminmax(t)
                low, high = int(low), int(high)
                if low < values.min or high > values.max:
                    raise _value_outside(name, t, low if low < values.min else high, values)
        return tensors, sizes


def _check_bool_bytes(name: str, t: torch.Tensor) -> None:
    """GuardError unless every byte of a bool tensor is 0 or 1 (``loader.shapes.check_bool_bytes``).
    A small CPU tensor's bytes are read straight from its memory (about 1 µs for an attention mask,
    half of what making its numpy view costs): the checks before this one made sure the tensor is
    contiguous and its storage holds every element."""
    if t.device.type == "cpu":
        n = t.numel()
        if n <= BYTES_SCAN and not ctypes.string_at(t.data_ptr(), n).translate(None, b"\x00\x01"):
            return
        check_bool_bytes(name, t.numpy())
    elif bool(t.view(torch.uint8).max() > 1):
        check_bool_bytes(name, t.cpu().numpy())  # names the first such byte


def _not_plain(name: str, t: Any) -> GuardError:
    fix = "pass a torch.Tensor (e.g. t.as_subclass(torch.Tensor) if its data is real)"
    return not_plain(name, t, torch.Tensor, "torch.Tensor", "tensors", fix)


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
        return GuardError(
            f"input {name!r}: a quantized tensor; pass t.dequantize() or the plain values", reason="quantized"
        )
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
    return value_outside(name, value, [int(i) for i in (t == value).nonzero()[0]], values)


def _dt(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")
