"""The profile's checks that span fields (a dim used but undeclared, a range past what a dtype holds,
a batching claim the profile itself contradicts, Inductor options the installed torch does not know),
each returning ``(place, message)`` problems."""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

from ..options import MANAGED, PRESETS
from .schema import CompileSpec, InputSpec, Profile


def semantic_problems(profile: Profile) -> list[tuple[str, str]]:
    """Problems that span fields: dims used but undeclared, declared but unused, empty ranges."""
    problems = []
    known = ", ".join(profile.dims) or "none declared"
    used = set()
    if not profile.inputs:
        problems.append(("inputs", "at least one input is needed"))
    for name, spec in profile.inputs.items():
        if not name.isidentifier():
            problems.append((f"inputs.{name}", "input names must be Python identifiers (forward() argument names)"))
        for axis, s in enumerate(spec.shape):
            if isinstance(s, str):
                if s not in profile.dims:
                    problems.append((f"inputs.{name}.shape[{axis}]", f"unknown dim {s!r} (known: {known})"))
                used.add(s)
            elif s < 0:
                problems.append((f"inputs.{name}.shape[{axis}]", f"static size {s} is negative"))
        problems += _value_range_problems(name, spec) + _sample_range_problems(name, spec)
    for name, dim in profile.dims.items():
        if not name.isidentifier():
            problems.append((f"dims.{name}", "dim names must be identifiers"))
        if dim.min > dim.max:
            problems.append((f"dims.{name}", f"min {dim.min} > max {dim.max}"))
        elif dim.hint is not None and not dim.min <= dim.hint <= dim.max:
            problems.append((f"dims.{name}.hint", f"{dim.hint} is outside [{dim.min}, {dim.max}]"))
        elif dim.max < 2 and dim.min != dim.max:
            problems.append((f"dims.{name}", "a range within [0, 1] cannot be exported dynamically; use a static size"))
        if name not in used:
            problems.append((f"dims.{name}", "declared but used in no input shape"))
    problems += _plan_problems(profile)
    problems += batching_problems(profile)
    if not profile.targets:
        problems.append(("target", "name at least one device (cpu, cuda)"))
    for i, arch in enumerate(profile.cuda.arch or []):
        if not re.fullmatch(r"\d+\.\d+", arch):
            problems.append((f"cuda.arch[{i}]", f"{arch!r} is not a compute capability like '9.0'"))
    problems += cpu_isa_problems(profile)
    return problems


def cpu_isa_problems(profile: Profile) -> list[tuple[str, str]]:
    """cpu.isa: at least one, each once (whether the build host runs them is the build's check)."""
    isas = profile.cpu.isa
    if not isas:
        return [("cpu.isa", "name at least one instruction set (native, x86-64-v3, x86-64-v4)")]
    return [(f"cpu.isa[{i}]", f"{isa} is listed twice") for i, isa in enumerate(isas) if isa in isas[:i]]


# Integer ranges are stored in the manifest, whose integers stay within what JSON carries exactly.
_INT_LIMITS = {"int64": 2**53, "int32": 2**31 - 1, "int16": 2**15 - 1, "int8": 127, "uint8": 255}


def _value_range_problems(name: str, spec: InputSpec) -> list[tuple[str, str]]:
    """An integer input's range is the guard's range: whole numbers the dtype can hold."""
    if spec.range is None:
        return []
    low, high = spec.range
    place = f"inputs.{name}.range"
    if low > high:
        return [(place, f"low {low:g} > high {high:g}")]
    limit = _INT_LIMITS.get(spec.dtype)
    if limit is None:
        return []
    if low != int(low) or high != int(high):
        return [(place, f"[{low:g}, {high:g}]: an {spec.dtype} input's range needs whole numbers")]
    lowest = 0 if spec.dtype == "uint8" else -limit if spec.dtype == "int64" else -limit - 1
    if low < lowest or high > limit:
        return [(place, f"[{low:g}, {high:g}] goes past what {spec.dtype} values can be here ([{lowest}, {limit}])")]
    return []


def _sample_range_problems(name: str, spec: InputSpec) -> list[tuple[str, str]]:
    """Samples are drawn from ``sample.range``: an ordered range, inside the valid one (a sample the
    loader would refuse checks nothing), whole numbers for an integer input."""
    if spec.sample is None:
        return []
    low, high = spec.sample.range
    place = f"inputs.{name}.sample.range"
    if low > high:
        return [(place, f"low {low:g} > high {high:g}")]
    if spec.dtype in _INT_LIMITS and (low != int(low) or high != int(high)):
        return [(place, f"[{low:g}, {high:g}]: an {spec.dtype} input's samples are whole numbers")]
    if spec.range is not None and not spec.range[0] <= low <= high <= spec.range[1]:
        return [
            (
                place,
                f"[{low:g}, {high:g}] goes outside inputs.{name}.range [{spec.range[0]:g}, {spec.range[1]:g}], "
                "the values every call may hold",
            )
        ]
    return []


def _plan_problems(profile: Profile) -> list[tuple[str, str]]:
    """pad/split must be undoable (``outputs`` says which output axes follow the dim); names must exist."""
    problems = []
    known = ", ".join(profile.dims) or "none declared"
    for d, policy in profile.policy.out_of_range.items():
        place = f"policy.out_of_range.{d}"
        if d not in profile.dims:
            problems.append((place, f"unknown dim {d!r} (known: {known})"))
        elif policy != "error" and profile.outputs is None:
            problems.append((place, f"{policy} needs `outputs:` to declare which output axes follow {d!r}"))
        elif policy == "split":
            for i, out in enumerate(profile.outputs or []):
                if d not in out.shape:
                    problems.append(
                        (place, f"split needs every output to follow {d!r}; outputs[{i}] has shape {out.shape}")
                    )
    for name in profile.policy.pad_value:
        if name not in profile.inputs:
            problems.append((f"policy.pad_value.{name}", f"unknown input (inputs: {', '.join(profile.inputs)})"))
    problems += pad_value_problems(profile)
    for d, points in profile.plan.ranges.items():
        if d not in profile.dims:
            problems.append((f"plan.ranges.{d}", f"unknown dim {d!r} (known: {known})"))
            continue
        for p in points:
            if not profile.dims[d].min <= p <= profile.dims[d].max:
                problems.append(
                    (f"plan.ranges.{d}", f"split point {p} is outside [{profile.dims[d].min}, {profile.dims[d].max}]")
                )
    return problems


def pad_value_problems(profile: Profile) -> list[tuple[str, str]]:
    """pad fills an integer input with its pad value (default 0), which must lie in the input's range:
    the guard refuses out-of-range values from callers, so padding must not feed them in either."""
    padded = {d for d, p in profile.policy.out_of_range.items() if p == "pad"}
    problems = []
    for name, spec in profile.inputs.items():
        if spec.range is None or spec.dtype not in _INT_LIMITS or not padded.intersection(spec.shape):
            continue
        value = profile.policy.pad_value.get(name, 0.0)
        if not spec.range[0] <= value <= spec.range[1]:
            problems.append(
                (
                    f"policy.pad_value.{name}",
                    f"{value:g} is outside inputs.{name}.range [{spec.range[0]:g}, {spec.range[1]:g}]",
                )
            )
    return problems


def batching_pad_values(profile: Profile) -> dict[str, float]:
    """Per input that has a padded dim of the ``batching:`` section: the value padding fills it with
    (``batching.pad_value``, else ``policy.pad_value``, else 0)."""
    spec = profile.batching
    if spec is None:
        return {}
    return {
        name: spec.pad_value.get(name, profile.policy.pad_value.get(name, 0.0))
        for name, inp in profile.inputs.items()
        if set(spec.pad).intersection(s for s in inp.shape if isinstance(s, str))
    }


def batching_problems(profile: Profile) -> list[tuple[str, str]]:
    """The ``batching:`` section: its dims exist, the batch dim is on exactly one axis of every input
    and every declared output (the rows cut back per caller), and each pad value is one its input may
    hold. Whether padding leaves the outputs unchanged is checked by the build (precompile.stages.batching)."""
    spec = profile.batching
    if spec is None:
        return []
    problems = []
    known = ", ".join(profile.dims) or "none declared"
    if spec.dim not in profile.dims:
        problems.append(("batching.dim", f"unknown dim {spec.dim!r} (known: {known})"))
    else:
        for name, inp in profile.inputs.items():
            axes = [axis for axis, s in enumerate(inp.shape) if s == spec.dim]
            if len(axes) != 1:
                where = "no axis" if not axes else f"axes {', '.join(map(str, axes))}"
                problems.append(
                    (
                        "batching.dim",
                        f"input {name!r} (shape {inp.shape}) has {spec.dim!r} on {where}; every input needs it on exactly one axis",
                    )
                )
        if profile.outputs is None:
            problems.append(
                ("batching", "needs `outputs:` to say which output axes follow the batch dim and the padded dims")
            )
        for i, out in enumerate(profile.outputs or []):
            axes = [axis for axis, s in enumerate(out.shape) if s == spec.dim]
            if len(axes) != 1:
                where = "no axis" if not axes else f"axes {', '.join(map(str, axes))}"
                problems.append(
                    (
                        "batching.dim",
                        f"outputs[{i}] (shape {out.shape}) follows {spec.dim!r} on {where}; "
                        "each caller's rows are cut from exactly one axis of every output",
                    )
                )
    for i, d in enumerate(spec.pad):
        place = f"batching.pad[{i}]"
        if d not in profile.dims:
            problems.append((place, f"unknown dim {d!r} (known: {known})"))
        elif d == spec.dim:
            problems.append((place, f"{d!r} is the batch dim; pad lists the other dims calls may differ in"))
        elif d in spec.pad[:i]:
            problems.append((place, f"{d!r} is listed twice"))
    values = batching_pad_values(profile)
    for name in spec.pad_value:
        place = f"batching.pad_value.{name}"
        if name not in profile.inputs:
            problems.append((place, f"unknown input (inputs: {', '.join(profile.inputs)})"))
        elif name not in values:
            problems.append(
                (place, f"input {name!r} has none of the padded dims ({', '.join(spec.pad) or 'none listed'})")
            )
    for name, value in values.items():
        inp = profile.inputs[name]
        place = f"batching.pad_value.{name}"
        if inp.dtype == "bool" and value not in (0.0, 1.0):
            problems.append((place, f"{value:g}: a bool input pads with 0 or 1"))
        elif inp.dtype in _INT_LIMITS and value != int(value):
            problems.append((place, f"{value:g}: an {inp.dtype} input pads with a whole number"))
        elif inp.dtype in _INT_LIMITS and inp.range is not None and not inp.range[0] <= value <= inp.range[1]:
            problems.append(
                (
                    place,
                    f"{value:g} is outside inputs.{name}.range [{inp.range[0]:g}, {inp.range[1]:g}]: "
                    "the loader refuses such values, widen the range to hold it",
                )
            )
    return problems


def precision_problems(profile: Profile, folder: Path) -> list[tuple[str, str]]:
    """precision, accuracy, calibration: what each precision needs, checked before anything compiles."""
    problems = []
    if isinstance(profile.precision, dict):
        for device, listed in profile.precision.items():
            if device not in profile.targets:
                problems.append(
                    (f"precision.{device}", f"{device} is not a target (target: {', '.join(profile.targets)})")
                )
            if device == "cuda" and set(listed) - {"fp32"}:
                problems.append(
                    (
                        "precision.cuda",
                        "CUDA variants compute in cuda.dtype: list only fp32 here and set cuda.dtype: bfloat16 or float16",
                    )
                )
    elif set(profile.precision) - {"fp32"} and profile.targets == ("cuda",):
        problems.append(
            ("precision", "bf16 and int8 variants are built for CPU targets; for CUDA set cuda.dtype instead")
        )
    wanted = {p for d in profile.targets for p in profile.precisions(d)}
    if "int8" in wanted:
        import importlib.util

        if importlib.util.find_spec("torchao") is None:
            problems.append(
                (
                    "precision",
                    "int8 variants are quantized with torchao, which is not installed: pip install 'precompile[quant]'",
                )
            )
    rules = [("accuracy", profile.accuracy)] + [
        (f"accuracy.outputs.{i}", r) for i, r in profile.accuracy.outputs.items()
    ]
    for where, rule in rules:
        if rule.metric in ("cosine", "top1") and not -1.0 <= rule.threshold <= 1.0:
            problems.append((f"{where}.threshold", f"{rule.metric} is at most 1; {rule.threshold} can never pass"))
        if rule.metric == "max_abs" and rule.threshold < 0:
            problems.append((f"{where}.threshold", "max_abs is an absolute difference: give a threshold ≥ 0"))
    for i in profile.accuracy.outputs:
        if i < 0:
            problems.append((f"accuracy.outputs.{i}", "flat output indices start at 0"))
    file = profile.calibration.file
    if file is not None:
        if Path(file).suffix not in (".safetensors", ".jsonl"):
            problems.append(("calibration.file", f"{file!r}: give a .safetensors or .jsonl file"))
        elif not (folder / file).is_file():
            problems.append(("calibration.file", f"file not found: {folder / file}"))
    return problems


def tune_problems(spec: CompileSpec) -> list[tuple[str, str]]:
    """compile.tune: a known preset or at least one candidate, each a set of valid Inductor options."""
    if spec.tune is None:
        return []
    problems = []
    if spec.tune.preset is not None and spec.tune.preset not in PRESETS:
        problems.append(("compile.tune.preset", f"unknown preset {spec.tune.preset!r} (presets: {', '.join(PRESETS)})"))
    if spec.tune.preset is None and not spec.tune.candidates:
        problems.append(("compile.tune", "give a preset or at least one candidate"))
    for i, candidate in enumerate(spec.tune.candidates):
        problems += inductor_option_problems(candidate, f"compile.tune.candidates[{i}]")
    return problems


def inductor_option_problems(options: dict[str, Any], where: str = "compile.inductor") -> list[tuple[str, str]]:
    """Check Inductor options against the installed torch's option names and types."""
    if not options:
        return []
    import torch._inductor.config as inductor_config  # build side only: costs about 1 s

    known = inductor_config.get_config_copy()
    problems = []
    for key, value in options.items():
        place = f"{where}.{key}"
        if key in MANAGED:
            problems.append((place, f"set by precompile, not by profiles: {MANAGED[key]}"))
        elif key not in known:
            close = [k for k in known if k.split(".")[-1] == key.split(".")[-1]][:3]
            hint = f" (did you mean {', '.join(close)}?)" if close else ""
            problems.append((place, f"unknown Inductor option in torch {_torch_version()}{hint}"))
        else:
            default = known[key]
            if default is not None and not _same_type(default, value):
                problems.append((place, f"expected {type(default).__name__}, got {type(value).__name__} {value!r}"))
    return problems


def _same_type(default: Any, value: Any) -> bool:
    if isinstance(default, bool) or isinstance(value, bool):
        return isinstance(default, bool) and isinstance(value, bool)
    if isinstance(default, (int, float)):
        return isinstance(value, (int, float))
    return isinstance(value, type(default))


def _torch_version() -> str:
    import torch

    return torch.__version__
