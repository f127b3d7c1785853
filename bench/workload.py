"""The requests a benchmark sends: shapes drawn from a profile's distribution, their inputs, and the
padding a hand-bucketing deployment applies.

Imports the profile models and sample-input code of ``precompile`` but never ``torch._inductor``, so a
steady-state process that only serves an artifact stays as light as a real one.
"""

from __future__ import annotations

import random
from pathlib import Path
from typing import Any

import torch
import yaml

from precompile.profile import LoadedProfile, Profile
from precompile.samples import make_inputs
from precompile.traffic import read_distribution

Shape = dict[str, int]


def read_profile(path: Path) -> Profile:
    """Parse a profile without its whole-file checks: those import Inductor, which a serving process must not."""
    return Profile.model_validate(yaml.safe_load(Path(path).read_text(encoding="utf-8")))


def distribution(path: Path) -> dict[tuple[int, ...], int]:
    """The traffic of the profile at ``path`` (``distribution.shapes`` and ``.file``), as the planner reads it."""
    return read_distribution(LoadedProfile(profile=read_profile(path), path=Path(path).resolve()))


def draw(profile: Profile, path: Path, n: int, seed: int) -> list[Shape]:
    """``n`` request shapes drawn with replacement, weighted by count, from the in-range traffic of the
    profile at ``path``."""
    dims = list(profile.dims)
    counts = [
        (dict(zip(dims, key)), c)
        for key, c in distribution(path).items()
        if c > 0 and all(profile.dims[d].min <= s <= profile.dims[d].max for d, s in zip(dims, key))
    ]
    if not counts:
        raise ValueError(f"profile {profile.name}: its distribution has no shape inside the declared dims")
    rng = random.Random(seed)
    return rng.choices([d for d, _ in counts], weights=[c for _, c in counts], k=n)


def inputs_for(profile: Profile, sizes: Shape, seed: int) -> tuple[torch.Tensor, ...]:
    return make_inputs(profile, sizes, seed=seed)


def work(sizes: Shape) -> int:
    """The product of a request's dynamic sizes: what its cost grows with (tokens, pixels)."""
    out = 1
    for n in sizes.values():
        out *= n
    return out


def bucket_for(sizes: Shape, buckets: dict[str, tuple[int, ...]]) -> Shape:
    """Per dim, the smallest bucket that holds the size (dims without buckets keep theirs)."""
    out = dict(sizes)
    for d, edges in buckets.items():
        fits = [b for b in edges if b >= sizes[d]]
        if not fits:
            raise ValueError(f"{d}={sizes[d]} is larger than the largest bucket {edges[-1]}")
        out[d] = fits[0]
    return out


def all_buckets(buckets: dict[str, tuple[int, ...]], dims: list[str], fixed: Shape) -> list[Shape]:
    """Every bucket shape (the product of the per-dim buckets; dims without buckets take ``fixed``)."""
    shapes: list[Shape] = [{}]
    for d in dims:
        shapes = [{**s, d: n} for s in shapes for n in (buckets[d] if d in buckets else (fixed[d],))]
    return shapes


def pad(profile: Profile, args: tuple[torch.Tensor, ...], target: Shape) -> tuple[torch.Tensor, ...]:
    """Grow every input to the ``target`` sizes, filling with zeros (a padding token, a masked-out
    position, a black border) as a hand-written bucketing server does."""
    out = []
    for spec, t in zip(profile.inputs.values(), args):
        shape = [target[s] if isinstance(s, str) else s for s in spec.shape]
        if list(t.shape) == shape:
            out.append(t)
            continue
        grown = torch.zeros(shape, dtype=t.dtype)
        grown[tuple(slice(0, n) for n in t.shape)] = t
        out.append(grown)
    return tuple(out)


def cut(profile: Profile, output: Any, sizes: Shape) -> Any:
    """Undo ``pad`` on a single-tensor output: slice the axes the profile's ``outputs`` says follow a dim."""
    if profile.outputs is None or not isinstance(output, torch.Tensor):
        raise ValueError(f"profile {profile.name}: hand bucketing needs `outputs:` and a single-tensor result")
    axes = profile.outputs[0].shape
    return output[tuple(slice(0, sizes[a]) if isinstance(a, str) and a in sizes else slice(None) for a in axes)]


def abs_error(got: torch.Tensor, want: torch.Tensor) -> float:
    """max |got - want|, in the output's own units (inf when the shapes differ)."""
    got, want = got.detach().double(), want.detach().double()
    if got.shape != want.shape:
        return float("inf")
    return (got - want).abs().max().item()


def relative_error(got: torch.Tensor, want: torch.Tensor) -> float:
    """max |got - want| / max |want|: one number for "is this the same result", whatever the scale."""
    return abs_error(got, want) / (want.detach().abs().max().item() or 1.0)
