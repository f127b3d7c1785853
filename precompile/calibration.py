"""Calibration inputs: what static int8 quantization calibrates on, read from the profile's
``calibration.file`` (a .safetensors of ``<sample>/<input>`` tensors, or JSON lines of inputs) or drawn
with the observed traffic's shapes; and the held-out inputs the precision gate scores, disjoint from them.

    samples = calibration_inputs(loaded, traffic)     # [(sizes, inputs), ...]: what int8 calibrates on
    held = gate_inputs(loaded, traffic, vp.ranges)    # what the gate scores vp on: none of the above
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
        calibrate, _ = _split_file(read_calibration_file(loaded))
        return calibrate
    return _draw(profile, traffic, None, profile.calibration.samples, CALIBRATION_SEED)


def gate_inputs(
    loaded: LoadedProfile, traffic: dict[Shape, int], ranges: dict[str, tuple[int, int]], *, calibrated: bool = True
) -> list[Sample]:
    """The held-out inputs the precision gate scores a variant with ``ranges`` on, never one that
    calibration saw: ``accuracy.samples`` drawn with the ``traffic``'s shapes inside ``ranges`` (any
    size inside them when no traffic falls there) from seeds calibration does not use; with a
    ``calibration.file``, its samples inside ``ranges`` (only its held-out quarter, every fourth
    sample, for a variant ``calibrated`` on the rest: int8 static), else drawn. Deterministic for
    the profile's seed."""
    profile = loaded.profile
    if profile.calibration.file is not None:
        every = read_calibration_file(loaded)
        held = _split_file(every)[1] if calibrated else every
        mine = [s for s in held if inside(s[0], ranges)]
        if mine:
            return mine
    return _draw(profile, traffic, ranges, profile.accuracy.samples, GATE_SEED)


# Seed offsets of the two draws: calibration's samples take seeds base + k for k < 4096 (the most
# calibration.samples allows), the gate's start far past them, so no gate input is a calibration input.
CALIBRATION_SEED = 15485863
GATE_SEED = 86028121


def _draw(
    profile: Profile, traffic: dict[Shape, int], ranges: dict[str, tuple[int, int]] | None, count: int, offset: int
) -> list[Sample]:
    """``count`` inputs with the traffic's shapes (weighted by count) inside ``ranges`` (None: any)."""
    seed = profile.check.seed + offset
    dims = tuple(profile.dims)
    distribution = [(dict(zip(dims, key)), n) for key, n in traffic.items() if n > 0]
    if ranges is not None:
        distribution = [(s, n) for s, n in distribution if inside(s, ranges)]
    bounds = ranges or {d: (max(s.min, 1), s.max) for d, s in profile.dims.items()}
    rng = random.Random(seed)
    out = []
    for k in range(count):
        if distribution:
            sizes = rng.choices([s for s, _ in distribution], weights=[n for _, n in distribution])[0]
        else:
            sizes = {d: rng.randint(max(lo, 1), hi) for d, (lo, hi) in bounds.items()}
        out.append((sizes, make_inputs(profile, sizes, seed=seed + k)))
    return out


def _split_file(samples: list[Sample]) -> tuple[list[Sample], list[Sample]]:
    """A calibration file's samples as (calibrate on, hold out for the gate): every fourth one held
    out, when the file has two or more."""
    if len(samples) < 2:
        return samples, []
    return [s for i, s in enumerate(samples) if i % 4 != 3], [s for i, s in enumerate(samples) if i % 4 == 3]


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
