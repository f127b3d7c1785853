"""The part of the input guards that does not depend on what an array is: binding a call's arguments
to the artifact's inputs, and checking each input's rank, static sizes, dim ranges and shared dims.

``loader.guards`` (torch tensors) and ``loader.native.npguards`` (numpy arrays) build on it, so both
loaders refuse a wrong shape with the same GuardError, word for word.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from .constants import INTEGER_DTYPES
from .errors import GuardError
from .manifest import DimRange, InputSpec

# Per axis: (axis, static size or None, dim name or None)
Axes = tuple[tuple[int, "int | None", "str | None"], ...]


class ShapeGuard:
    """Binds call arguments to the artifact's inputs and checks their shapes.

    Subclasses check what an input is (type, dtype, memory) and call ``check_shape`` for each.
    """

    def __init__(self, inputs: Sequence[InputSpec], dims: dict[str, DimRange], unchecked: set[str] = frozenset()):
        self.inputs = tuple(inputs)
        self.names = tuple(i.name for i in inputs)
        self.index = {name: pos for pos, name in enumerate(self.names)}
        # Dims whose out-of-range sizes a pad/split policy serves: any size ≥ 1 passes the guard.
        self.built = dict(dims)
        self.policy_dims = frozenset(unchecked)
        self.dims = {d: DimRange(1, 2**62) if d in unchecked else r for d, r in dims.items()}

    def input_plan(self) -> list[tuple[str, str, int, Axes, DimRange | None]]:
        """Per input: (name, dtype name, rank, axes, value range or None)."""
        plan = []
        for spec in self.inputs:
            axes = tuple(
                (axis, s, None) if isinstance(s, int) else (axis, None, s) for axis, s in enumerate(spec.shape)
            )
            values = spec.range if spec.dtype in INTEGER_DTYPES else None
            plan.append((spec.name, spec.dtype, len(spec.shape), axes, values))
        return plan

    def bind(self, args: tuple, kwargs: dict[str, Any]) -> list:
        n = len(self.names)
        if not kwargs and len(args) == n:
            return list(args)
        if len(args) > n:
            raise GuardError(
                f"expected at most {n} inputs ({', '.join(self.names)}), got {len(args)} positional",
                reason="too_many_inputs",
            )
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
            raise GuardError(
                f"missing input(s): {', '.join(missing)} (inputs: {', '.join(self.names)})", reason="missing_input"
            )
        return bound

    def check_shape(self, name: str, shape: Sequence[int], ndim: int, axes: Axes, sizes: dict[str, int]) -> None:
        """Check one input's shape, noting each named dim's size in ``sizes``."""
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


def value_outside(name: str, value: int, where: Sequence[int], values: DimRange) -> GuardError:
    """The refusal for an integer input holding ``value`` at index ``where``, outside ``values``."""
    return GuardError(
        f"input {name!r}: value {value} at {list(where)} is outside the valid range {values}",
        reason="value_range",
    )


def check_bool_bytes(name: str, a: Any) -> None:
    """GuardError unless every byte of the numpy bool array ``a`` is 0 or 1. An array viewed as bool
    from other bytes (``np.frombuffer(..., dtype=bool)``, ``t.view(torch.bool)``) passes every other
    check, and the compiled code reads its bytes as numbers, not as true or false: a wrong answer.
    Under a microsecond for an attention mask: up to 4 KiB as bytes (one copy and one table pass in
    C, 0.3 µs for 256 bytes where numpy's max takes 3), larger arrays by numpy's max."""
    if a.size <= BYTES_SCAN and not a.tobytes().translate(None, b"\x00\x01"):
        return
    raw = a.view("u1")
    if a.size > BYTES_SCAN and int(raw.max()) <= 1:
        return
    first = tuple(int(w[0]) for w in (raw > 1).nonzero()) if raw.ndim else ()
    raise GuardError(
        f"input {name!r}: a bool holds byte {int(raw[first])} at {list(first)}; bools must be stored as 0 or 1 "
        "(an array viewed as bool from other bytes: pass a != 0)",
        reason="bool_bytes",
    )


BYTES_SCAN = 4096  # where a bytes pass and numpy's max cost the same (about 2 µs)


def not_plain(name: str, value: Any, plain: type, what: str, things: str, fix: str) -> GuardError:
    """The refusal for an input that is not a plain ``plain`` (``what`` names it, ``things`` its
    plural): a subclass, with ``fix``, or something else altogether."""
    if isinstance(value, plain):
        return GuardError(
            f"input {name!r}: a {type(value).__module__}.{type(value).__qualname__} (a {what} subclass); the compiled "
            f"code reads plain {things} only: {fix}",
            reason="tensor_subclass",
        )
    return GuardError(f"input {name!r}: expected a {what}, got {type(value).__name__}", reason="not_a_tensor")
