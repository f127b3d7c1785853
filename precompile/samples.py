"""Sample inputs and sample shapes, deterministic for a given seed."""

from __future__ import annotations

import random

import torch

from loader.guards import TORCH_DTYPES

from .profile import Profile


def make_inputs(profile: Profile, sizes: dict[str, int], seed: int) -> tuple[torch.Tensor, ...]:
    """One tensor per input in forward() order, shaped by ``sizes`` for the named dims."""
    gen = torch.Generator().manual_seed(seed)
    out = []
    for spec in profile.inputs.values():
        shape = [sizes[s] if isinstance(s, str) else s for s in spec.shape]
        dtype = TORCH_DTYPES[spec.dtype]
        drawn = spec.sample_range()  # sample.range, else the valid range
        if dtype is torch.bool:
            t = torch.rand(shape, generator=gen) < 0.5
            if drawn is not None and drawn[0] == drawn[1]:
                t = torch.full(shape, bool(drawn[0]))
        elif dtype.is_floating_point:
            lo, hi = drawn if drawn is not None else (-1.0, 1.0)
            t = (torch.rand(shape, generator=gen, dtype=torch.float64) * (hi - lo) + lo).to(dtype)
        else:
            lo, hi = drawn if drawn is not None else (0, 9)
            t = torch.randint(int(lo), int(hi) + 1, shape, generator=gen, dtype=torch.int64).to(dtype)
        out.append(t.contiguous())
    return tuple(out)


def check_shapes(profile: Profile, ranges: dict[str, tuple[int, int]], count: int, seed: int) -> list[dict[str, int]]:
    """Shapes to compare compiled code with eager: every range's ends, then ``count`` random ones.

    All dims at their minimum, all at their maximum, each dim alone at its min and at its max (the
    others at their hint), and random sizes inside the ranges. Duplicates are dropped, order kept.
    """
    rng = random.Random(seed)
    names = list(ranges)
    hints = {d: min(max(profile.hint(d), ranges[d][0]), ranges[d][1]) for d in names}
    shapes = [{d: ranges[d][0] for d in names}, {d: ranges[d][1] for d in names}]
    for d in names:
        for end in ranges[d]:
            shapes.append({**hints, d: end})
    for _ in range(count):
        shapes.append({d: rng.randint(*ranges[d]) for d in names})
    unique, seen = [], set()
    for s in shapes:
        key = tuple(s[d] for d in names)
        if key not in seen:
            seen.add(key)
            unique.append(s)
    return unique


def to_device(args: tuple[torch.Tensor, ...], device: str, dtype: str | None) -> tuple[torch.Tensor, ...]:
    """Move sample inputs to a variant's device, casting floating ones to its compute dtype."""
    cast = TORCH_DTYPES[dtype] if dtype is not None else None
    return tuple(
        t.to(device=device, dtype=cast) if cast is not None and t.is_floating_point() else t.to(device) for t in args
    )
