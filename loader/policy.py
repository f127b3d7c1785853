"""Out-of-range policies: serve a size no variant covers by padding it up or splitting it.

``pad``: grow the dim up to the smallest covered size, filling inputs with their pad value, then cut
every output axis that follows the dim back to the caller's size (all of them: attention scores
``[batch, seq, seq]`` are cut on both seq axes). ``split``: cut the dim into pieces within range, run
each, and concatenate the outputs along the one axis of each output that follows the dim. An output
with the dim on no axis or on several cannot be put back together from pieces, so split refuses such
artifacts' out-of-range calls (and the build refuses such profiles: ``split_problem``). Both undo
themselves only through the output axes the profile declared (``output_dims`` in the manifest).

The decisions are shape arithmetic; the few array operations they need (``ArrayOps``) come from the
caller, so the torch loader and the torch-free one (numpy arrays) serve a policy alike (and batch
alike: ``loader.serving.batch_tensors`` joins and cuts with the same operations).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from .errors import GuardError
from .manifest import DimRange, Manifest, Variant

Run = Callable[[list, dict], tuple[list, list]]  # (tensors, sizes) -> (flat outputs, variant ids)
OutputDims = Sequence[Sequence["str | None"]]  # per flat output, per axis: the dim it follows


@dataclass(frozen=True)
class ArrayOps:
    """What a pad or split does to arrays, for one kind of array (torch tensors, numpy arrays)."""

    cat: Callable[[list, int], Any]  # (arrays, axis) -> one array
    fill: Callable[[Any, list[int], float], Any]  # (like, shape, value) -> a new array of like's dtype
    take: Callable[[Any, int, int, int], Any]  # (array, axis, start, size) -> a contiguous copy of that slice
    narrow: Callable[[Any, int, int, int], Any]  # (array, axis, start, size) -> a view of that slice


def split_sizes(size: int, lo: int, hi: int) -> list[int] | None:
    """Cut ``size`` into as few pieces as possible, each within [lo, hi], as even as possible."""
    if hi < 1:
        return None
    pieces = -(-size // hi)
    base, extra = divmod(size, pieces)
    if base < lo:
        return None
    return [base + 1] * extra + [base] * (pieces - extra)


def axes_following(dim: str, output_dims: OutputDims) -> list[tuple[int, ...]]:
    """Per flat output, the axes that follow ``dim``."""
    return [tuple(axis for axis, d in enumerate(axes) if d == dim) for axes in output_dims]


def split_problem(dim: str, output_dims: OutputDims | None) -> str | None:
    """Why splitting ``dim`` cannot give the unsplit call's outputs, or None when it can.

    Concatenating pieces rebuilds an output only along one axis: an output that does not follow the
    dim would come back once per piece, and one that follows it on several axes (attention scores
    ``[batch, seq, seq]`` split on seq) misses every cross-piece entry.
    """
    if output_dims is None:
        return "the artifact does not say which output axes follow it"
    for i, axes in enumerate(axes_following(dim, output_dims)):
        if len(axes) != 1:
            where = "no axis" if not axes else f"axes {', '.join(map(str, axes))}"
            return (
                f"output {i} follows {dim!r} on {where}; pieces can be concatenated back only along "
                "exactly one axis of every output"
            )
    return None


@dataclass(frozen=True)
class Plan:
    """How the policies serve a call that no variant holds: the pieces they run, each with its sizes
    and the variant that runs it (``CompiledModel.select`` answers with this)."""

    policies: tuple[tuple[str, str], ...]  # (dim, policy) applied, outermost first
    pieces: tuple[tuple[dict[str, int], Variant], ...]

    @property
    def id(self) -> str:
        """The variants used, as ``call_detailed`` names them (``dynamic-0``, ``static-0+dynamic-1``)."""
        return "+".join(dict.fromkeys(v.id for _, v in self.pieces))


class Policies:
    """The manifest's policies, with the input and output axes each dim touches precomputed."""

    def __init__(self, manifest: Manifest, ops: ArrayOps):
        self.ops = ops
        self.dims: dict[str, DimRange] = manifest.dims
        self.policy = {d: p for d, p in manifest.policy.items() if p != "error"}
        self.input_axes = {
            d: [(i, axis) for i, spec in enumerate(manifest.inputs) for axis, s in enumerate(spec.shape) if s == d]
            for d in self.policy
        }
        self.pad_values = [manifest.pad_value.get(spec.name, 0.0) for spec in manifest.inputs]
        outputs = manifest.output_dims or ()
        self.output_axes = {d: axes_following(d, outputs) for d in self.policy}
        # An artifact whose split cannot be undone still serves every in-range call.
        self.unsplittable = {
            d: problem
            for d, p in self.policy.items()
            if p == "split" and (problem := split_problem(d, manifest.output_dims)) is not None
        }

    def needed(self, sizes: dict[str, int]) -> bool:
        for d in self.policy:
            r = self.dims[d]
            if not r.min <= sizes[d] <= r.max:
                return True
        return False

    def step(self, sizes: dict[str, int]) -> tuple[str, str, list[int]] | None:
        """The first policy ``sizes`` need: (dim, policy, the sizes of its pieces: one for pad), or None
        when every policy dim is in range. GuardError when that policy cannot serve them."""
        for d, policy in self.policy.items():
            r, n = self.dims[d], sizes[d]
            if r.min <= n <= r.max:
                continue
            if policy == "split":
                if d in self.unsplittable:
                    raise GuardError(
                        f"dim {d!r} is {n}, outside the built range {r}; its policy is split, which this artifact "
                        f"cannot undo: {self.unsplittable[d]}",
                        reason="policy",
                    )
                pieces = split_sizes(n, r.min, r.max) if n > r.max else None
                if pieces is None:
                    raise GuardError(
                        f"dim {d!r} is {n}, outside the built range {r}; its policy is split, which serves sizes "
                        f"above {r.max} that cut into pieces within the range",
                        reason="policy",
                    )
                return d, policy, pieces
            if n > r.max:
                raise GuardError(
                    f"dim {d!r} is {n}, above the built range {r}; its policy is pad, which only serves sizes "
                    f"below {r.min}",
                    reason="policy",
                )
            return d, policy, [r.min]
        return None

    def plan(self, sizes: dict[str, int], dispatch: Callable[[dict[str, int]], Variant]) -> Plan:
        """What ``run`` would do with a call of ``sizes``, without running it."""
        applied: dict[str, str] = {}
        pieces: list[tuple[dict[str, int], Variant]] = []

        def walk(sizes: dict[str, int]) -> None:
            step = self.step(sizes)
            if step is None:
                pieces.append((sizes, dispatch(sizes)))
                return
            d, policy, parts = step
            applied.setdefault(d, policy)
            for size in parts:
                walk({**sizes, d: size})

        walk(dict(sizes))
        return Plan(tuple(applied.items()), tuple(pieces))

    def run(self, tensors: list, sizes: dict[str, int], run: Run) -> tuple[list, list]:
        """Serve one call, applying the first policy the sizes need, recursively."""
        step = self.step(sizes)
        if step is None:
            return run(tensors, sizes)
        d, policy, pieces = step
        if policy == "split":
            return self._split(d, pieces, tensors, sizes, run)
        return self._pad(d, pieces[0], sizes[d], tensors, sizes, run)

    def _split(self, d: str, pieces: list[int], tensors: list, sizes: dict, run: Run) -> tuple[list, list]:
        parts, ids, offset = [], [], 0
        for size in pieces:
            sub = list(tensors)
            for i, axis in self.input_axes[d]:
                sub[i] = self.ops.take(sub[i], axis, offset, size)
            outputs, used = self.run(sub, {**sizes, d: size}, run)
            parts.append(outputs)
            ids += used
            offset += size
        return [self.ops.cat([p[k] for p in parts], axes[0]) for k, axes in enumerate(self.output_axes[d])], ids

    def _pad(self, d: str, to: int, n: int, tensors: list, sizes: dict, run: Run) -> tuple[list, list]:
        ops = self.ops
        padded = list(tensors)
        for i, axis in self.input_axes[d]:
            t = padded[i]
            shape = list(t.shape)
            shape[axis] = to - n
            padded[i] = ops.cat([t, ops.fill(t, shape, self.pad_values[i])], axis)
        outputs, ids = self.run(padded, {**sizes, d: to}, run)
        cut = []
        for o, axes in zip(outputs, self.output_axes[d]):
            for axis in axes:
                o = ops.narrow(o, axis, 0, n)
            cut.append(o)
        return cut, ids
