"""Stage batching: check the profile's ``batching:`` section against eager, before anything compiles.

The section claims that concurrent calls may run as one batch: concatenated along the batch dim,
each padded dim grown to the batch's largest size with the inputs' pad values, and every output
axis following a padded dim cut back to each caller's size. ``check_batching`` tests that claim the
way ``loader.Batcher`` will act on it (with the loader's own padding code): a few batches of
sample calls of different sizes inside the declared ranges, run padded and together in eager, each
caller's outputs cut back and compared with its own eager call within the profile's tolerance.
A claim that does not hold is a ProfileError naming the dim, the output and the error, and what to
change; one that holds becomes the manifest's ``batching`` section.

    batching = check_batching(loaded, model)      # None when the profile has no batching section
"""

from __future__ import annotations

import random
from dataclasses import dataclass

import torch

from loader.manifest import Batching
from loader.model import TORCH_OPS
from loader.outputs import flatten
from loader.serving.batch_plan import BatchPlan, section_plan
from loader.serving.batch_tensors import cut, join_inputs

from ..compare import compare_tensors
from ..errors import ProfileError
from ..profile import BatchingSpec, LoadedProfile, Profile, batching_pad_values
from ..runners import run_eager
from ..samples import make_inputs

CALLS_PER_BATCH = 3  # at most; fewer when the batch dim's range cannot hold them


@dataclass(frozen=True)
class Sample:
    """One batch to check: the sizes of each call's dims, and which claim it tests."""

    calls: list[dict[str, int]]
    what: str  # the place a failure is reported at: "batching.dim" or "batching.pad[i]"
    padded: tuple[str, ...]  # the dims whose sizes differ between the calls


def check_batching(loaded: LoadedProfile, model: torch.nn.Module) -> Batching | None:
    """The manifest's ``batching`` section once the profile's claim held on every sample batch (see
    the module docstring); None without a ``batching:`` section. Raises ProfileError otherwise."""
    profile = loaded.profile
    spec = profile.batching
    if spec is None:
        return None
    pad_values = batching_pad_values(profile)
    output_axes = [
        [s if isinstance(s, str) and s in profile.dims else None for s in o.shape] for o in profile.outputs or []
    ]
    shapes = [(name, inp.shape) for name, inp in profile.inputs.items()]
    plan = section_plan(spec.dim, spec.pad, pad_values, shapes, output_axes)
    batches = samples(profile, spec)
    worst, checked = 0.0, 0
    for n, sample in enumerate(batches):
        seed = profile.check.seed + 104729 * (n + 1)
        calls = [make_inputs(profile, sizes, seed=seed + k) for k, sizes in enumerate(sample.calls)]
        alone = [flatten(run_eager(model, args)) for args in calls]
        together = flatten(run_eager(model, batch_inputs(plan, calls, sample.calls)))
        for k, (sizes, want) in enumerate(zip(sample.calls, alone)):
            got = cut_back(plan, together, output_axes, sample.calls, k)
            worst = max(worst, _compare_call(loaded, spec, sample, sizes, want, got, pad_values))
            checked += 1
    return Batching(
        dim=spec.dim,
        pad=tuple(spec.pad),
        pad_value=pad_values,
        checked={"batches": len(batches), "calls": checked, "max_abs_error": worst},
    )


def samples(profile: Profile, spec: BatchingSpec) -> list[Sample]:
    """The batches to check: calls of equal shape (the batch dim alone); per padded dim, calls that
    differ in it from its minimum to its maximum and at random sizes between (the other dims at
    their hint); and, with several padded dims, calls that differ in all of them at once."""
    rng = random.Random(profile.check.seed)
    hints = {d: min(max(profile.hint(d), r.min), r.max) for d, r in profile.dims.items()}
    b = profile.dims[spec.dim]
    rows = max(1, b.min)
    count = max(1, min(CALLS_PER_BATCH, b.max // rows))
    call_rows = [rows] * count
    if count >= 2 and sum(call_rows) + 1 <= b.max:
        call_rows[1] += 1  # calls of several rows too

    def calls(sizes_of) -> list[dict[str, int]]:
        return [{**hints, spec.dim: r, **sizes_of(k)} for k, r in enumerate(call_rows)]

    out = [Sample(calls(lambda k: {}), "batching.dim", ())]
    for i, d in enumerate(spec.pad):
        lo, hi = profile.dims[d].min, profile.dims[d].max
        if lo == hi:
            continue
        ends = [lo, hi] + [lo + (hi - lo) // 2] * (count - 2)
        out.append(Sample(calls(lambda k: {d: ends[k]} if count > 1 else {d: lo}), f"batching.pad[{i}]", (d,)))
        drawn = [rng.randint(lo, hi) for _ in call_rows]
        out.append(Sample(calls(lambda k: {d: drawn[k]}), f"batching.pad[{i}]", (d,)))
    varying = [d for d in spec.pad if profile.dims[d].min < profile.dims[d].max]
    if len(varying) > 1:
        drawn_all = [{d: rng.randint(profile.dims[d].min, profile.dims[d].max) for d in varying} for _ in call_rows]
        out.append(Sample(calls(lambda k: drawn_all[k]), "batching.pad", tuple(varying)))
    return out


def batch_inputs(plan: BatchPlan, calls: list[tuple], sizes: list[dict[str, int]]) -> tuple:
    """The calls as one batch, as loader.Batcher forms it (``loader.serving.batch_tensors.join_inputs``):
    every padded dim grown to the largest size among the calls, then each input concatenated along
    its batch axis."""
    rows = sum(s[plan.batch_dim] for s in sizes)
    pads = [max(s[d] for s in sizes) for d in plan.pad_dims]
    return tuple(join_inputs(TORCH_OPS, plan, calls, pads=pads, rows=rows, size=rows))


def cut_back(
    plan: BatchPlan, outputs: list[torch.Tensor], output_axes: list, sizes: list[dict[str, int]], k: int
) -> list:
    """Call ``k``'s part of the batch's flat ``outputs``, as loader.Batcher cuts it
    (``loader.serving.batch_tensors.cut``): its rows along each output's batch axis, and every axis
    following a padded dim narrowed to the call's own size. An output of another rank than its
    declared axes is left whole, for the comparison to report its shape."""
    start = sum(s[plan.batch_dim] for s in sizes[:k])
    rows, pads = sizes[k][plan.batch_dim], [sizes[k][d] for d in plan.pad_dims]
    return [
        t if len(axes) != t.dim() else cut(TORCH_OPS, plan, i, t, start=start, rows=rows, pads=pads)
        for i, (t, axes) in enumerate(zip(outputs, output_axes))
    ]


def _compare_call(
    loaded: LoadedProfile,
    spec: BatchingSpec,
    sample: Sample,
    sizes: dict[str, int],
    want: list,
    got: list,
    pad_values: dict[str, float],
) -> float:
    """The largest error of one call's outputs cut from the batch against its own eager call; raise
    ProfileError at ``sample.what`` when it is beyond the profile's tolerance."""
    profile = loaded.profile
    worst = 0.0
    for i, (w, g) in enumerate(zip(want, got)):
        declared = profile.outputs[i].shape if profile.outputs is not None else "?"
        if tuple(w.shape) != tuple(g.shape):
            raise ProfileError(
                str(loaded.path),
                [
                    (
                        sample.what,
                        f"{_how(sample, sizes, pad_values)} gives output {i} the shape {tuple(g.shape)} once cut back, "
                        f"its own call {tuple(w.shape)}: outputs[{i}].shape ({declared}) must name every axis that follows "
                        f"{' or '.join(repr(d) for d in (spec.dim, *spec.pad))}",
                    )
                ],
            )
        atol, rtol = profile.tolerance(str(w.dtype).removeprefix("torch."))
        c = compare_tensors(w, g, atol=atol, rtol=rtol)
        if not c.passed:
            refusal = _refusal(spec, sample, sizes, i, declared, c.max_abs_error, (atol, rtol), pad_values)
            raise ProfileError(str(loaded.path), [(sample.what, refusal)])
        worst = max(worst, c.max_abs_error)
    return worst


def _how(sample: Sample, sizes: dict[str, int], pad_values: dict[str, float]) -> str:
    if not sample.padded:
        return f"running {len(sample.calls)} calls as one batch"
    grown = ", ".join(f"{d} from {sizes[d]} to {max(s[d] for s in sample.calls)}" for d in sample.padded)
    values = ", ".join(f"{name}={v:g}" for name, v in pad_values.items())
    return f"padding {grown} (pad values {values})"


def _refusal(
    spec: BatchingSpec,
    sample: Sample,
    sizes: dict[str, int],
    i: int,
    declared,
    error: float,
    tolerance: tuple,
    pad_values,
) -> str:
    atol, rtol = tolerance
    head = (
        f"{_how(sample, sizes, pad_values)} changes output {i} (outputs[{i}]: {declared}) of a call with "
        + ", ".join(f"{d}={n}" for d, n in sizes.items())
        + f": max abs error {error:.3g}, beyond atol={atol:g}, rtol={rtol:g}"
    )
    if not sample.padded:
        return (
            f"{head}; the model does not treat the rows of {spec.dim!r} independently (batch statistics, a sum "
            f"over rows), so its calls cannot be batched: remove the batching section, and serve it without --batch"
        )
    dims = " and ".join(repr(d) for d in sample.padded)
    return (
        f"{head}; the model does not ignore the padded positions. If an input marks the real positions (an "
        f"attention mask), its pad value must be 0 (batching.pad_value) and the model must mask with it (also in "
        f"pooling and normalization); otherwise remove {dims} from batching.pad (calls then batch only with "
        f"calls of equal {dims})"
    )
