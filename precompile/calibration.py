"""Calibration inputs: what static int8 quantization calibrates on and the precision gate measures
accuracy with. Read from the profile's ``calibration.file`` (a .safetensors of ``<sample>/<input>``
tensors, or JSON lines of inputs), or drawn with the observed traffic's shapes.

    samples = calibration_inputs(loaded, traffic)     # [(sizes, inputs), ...]
    mine = [s for s in samples if inside(s[0], vp.ranges)] or fallback_inputs(profile, vp.ranges)
"""

from __future__ import annotations

import json
import random
from typing import Any

import torch
from safetensors.torch import load_file

from loader.guards import TORCH_DTYPES

from .errors import ProfileError
from .profile import LoadedProfile, Profile
from .samples import check_shapes, make_inputs
from .traffic import Shape

Sample = tuple[dict[str, int], tuple[torch.Tensor, ...]]


def calibration_inputs(loaded: LoadedProfile, traffic: dict[Shape, int]) -> list[Sample]:
    """The profile's calibration inputs with the size of each dim: read from ``calibration.file``, or
    ``calibration.samples`` drawn with the ``traffic``'s shapes (weighted by count) and the inputs'
    value ranges. Deterministic for the profile's seed."""
    profile = loaded.profile
    if profile.calibration.file is not None:
        return read_calibration_file(loaded)
    seed = profile.check.seed + 15485863
    dims = tuple(profile.dims)
    distribution = [(dict(zip(dims, key)), n) for key, n in traffic.items() if n > 0]
    rng = random.Random(seed)
    out = []
    for k in range(profile.calibration.samples):
        if distribution:
            sizes = rng.choices([s for s, _ in distribution], weights=[n for _, n in distribution])[0]
        else:
            sizes = {d: rng.randint(max(s.min, 1), s.max) for d, s in profile.dims.items()}
        out.append((sizes, make_inputs(profile, sizes, seed=seed + k)))
    return out


def fallback_inputs(profile: Profile, ranges: dict[str, tuple[int, int]], count: int = 3) -> list[Sample]:
    """Inputs at a variant's range ends (``ranges``) and random sizes inside, when no calibration input fits it."""
    seed = profile.check.seed + 32452843
    return [
        (s, make_inputs(profile, s, seed=seed + i)) for i, s in enumerate(check_shapes(profile, ranges, count, seed))
    ]


def read_calibration_file(loaded: LoadedProfile) -> list[Sample]:
    profile = loaded.profile
    path = loaded.folder / profile.calibration.file
    where = "calibration.file"
    raw: list[dict[str, Any]] = []
    try:
        if path.suffix == ".safetensors":
            grouped: dict[str, dict[str, torch.Tensor]] = {}
            for name, t in load_file(str(path)).items():
                sample, _, input_name = name.partition("/")
                if not input_name:
                    raise ProfileError(
                        str(loaded.path), [(where, f"{path.name}: tensor {name!r} is not named '<sample>/<input>'")]
                    )
                grouped.setdefault(sample, {})[input_name] = t
            raw = [grouped[k] for k in sorted(grouped, key=lambda k: (len(k), k))]
        else:
            for n, line in enumerate(path.read_text(encoding="utf-8").splitlines(), 1):
                if line.strip():
                    item = json.loads(line)
                    if not isinstance(item, dict):
                        raise ProfileError(
                            str(loaded.path), [(where, f"{path.name} line {n}: expected an object of inputs")]
                        )
                    raw.append(item)
    except ProfileError:
        raise
    except Exception as e:  # unreadable, not JSON, not safetensors
        raise ProfileError(str(loaded.path), [(where, f"cannot read {path}: {type(e).__name__}: {e}")]) from None
    if not raw:
        raise ProfileError(str(loaded.path), [(where, f"{path.name} holds no samples")])
    return [_sample(profile, item, f"{path.name} sample {i}", str(loaded.path)) for i, item in enumerate(raw)]


def _sample(profile: Profile, item: dict[str, Any], label: str, source: str) -> Sample:
    problems = []
    missing = [n for n in profile.inputs if n not in item]
    extra = [n for n in item if n not in profile.inputs]
    if missing or extra:
        raise ProfileError(
            source,
            [
                (
                    "calibration.file",
                    f"{label}: inputs must be exactly {list(profile.inputs)} (missing {missing}, unknown {extra})",
                )
            ],
        )
    sizes: dict[str, int] = {}
    tensors = []
    for name, spec in profile.inputs.items():
        try:
            t = torch.as_tensor(item[name], dtype=TORCH_DTYPES[spec.dtype]).contiguous()
        except (TypeError, ValueError, RuntimeError) as e:
            raise ProfileError(source, [("calibration.file", f"{label}: input {name!r}: {e}")]) from None
        if t.dim() != len(spec.shape):
            problems.append(
                (
                    "calibration.file",
                    f"{label}: input {name!r} has {t.dim()} axes, the profile declares {len(spec.shape)}",
                )
            )
            continue
        for axis, s in enumerate(spec.shape):
            n = t.shape[axis]
            if isinstance(s, int) and s != n:
                problems.append(
                    ("calibration.file", f"{label}: {name}.shape[{axis}] is {n}, the profile fixes it to {s}")
                )
            elif isinstance(s, str):
                if sizes.setdefault(s, n) != n:
                    problems.append(
                        ("calibration.file", f"{label}: dim {s!r} is {sizes[s]} in one input and {n} in {name!r}")
                    )
                elif not profile.dims[s].min <= n <= profile.dims[s].max:
                    problems.append(
                        (
                            "calibration.file",
                            f"{label}: {s}={n} is outside dims.{s} [{profile.dims[s].min}, {profile.dims[s].max}]",
                        )
                    )
        if spec.range is not None and t.numel():
            lo, hi = (float(x) for x in torch.aminmax(t.double()))
            if lo < spec.range[0] or hi > spec.range[1]:
                problems.append(
                    (
                        "calibration.file",
                        f"{label}: input {name!r} holds values in [{lo:g}, {hi:g}], outside its range {list(spec.range)}",
                    )
                )
        tensors.append(t)
    if problems:
        raise ProfileError(source, problems)
    return sizes, tuple(tensors)


def inside(sizes: dict[str, int], ranges: dict[str, tuple[int, int]]) -> bool:
    return all(lo <= sizes[d] <= hi for d, (lo, hi) in ranges.items())
