"""Profiles: the YAML file that says what to build. Parsed into pydantic models (extra keys refused),
then checked as a whole; every problem is reported as ``place: message``.

    name: text-classifier
    model: {factory: "models:text_classifier"}
    inputs:
      ids:  {shape: [batch, seq], dtype: int64, range: [0, 999]}
      mask: {shape: [batch, seq], dtype: bool}
    dims:
      batch: {min: 1, max: 64}
      seq:   {min: 8, max: 512}
"""

from __future__ import annotations

import math
import re
from pathlib import Path
from typing import Any, Literal, Optional, Union

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError

from loader.constants import DTYPES

from .errors import ProfileError

Dtype = Literal[DTYPES]  # type: ignore[valid-type]

# Inductor options precompile sets itself; a profile may not override them.
MANAGED_INDUCTOR_OPTIONS = {
    "aot_inductor.package": "precompile always writes an AOTInductor package",
    "aot_inductor.package_cpp_only": "precompile needs the compiled library, not C++ sources",
    "aot_inductor.output_path": "the artifact's layout is precompile's",
    "aot_inductor.package_constants_in_so": "weights are kept out of the library and stored once, memory-mapped",
    "aot_inductor.package_constants_on_disk_format": "precompile extracts the weights itself",
}

# Default comparison tolerance against eager, per output dtype (atol, rtol).
DEFAULT_TOLERANCE = {
    "float64": (1e-7, 1e-7),
    "float32": (1e-4, 1e-4),
    "float16": (1e-2, 1e-2),
    "bfloat16": (5e-2, 5e-2),
}


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


class ModelSpec(_Strict):
    factory: str = Field(
        pattern=r"^[A-Za-z_][\w.]*:[A-Za-z_][\w.]*$",
        description='"module:callable" returning a torch.nn.Module; the profile\'s folder is on sys.path while importing',
    )
    kwargs: dict[str, Any] = Field(default_factory=dict, description="keyword arguments passed to the factory")
    weights: Optional[str] = Field(
        default=None, description=".safetensors file relative to the profile, loaded with strict=True"
    )
    outputs: Optional[list[Union[str, int]]] = Field(
        default=None,
        description=(
            "the outputs to keep when forward() returns a dict, a ModelOutput or a tuple: keys (or indices), in the "
            "order served; the rest (caches, hidden states) is dropped. Served as a dict of the named keys, a tuple of "
            "the indexed items"
        ),
    )


class InputSpec(_Strict):
    shape: list[Union[str, int]] = Field(description="per axis: a dim name from `dims`, or an int for a static size")
    dtype: Dtype = Field(description="torch dtype name")
    range: Optional[tuple[float, float]] = Field(
        default=None,
        description=(
            "inclusive [low, high] of sample values (ints: integers drawn uniformly; floats: uniform); for integer "
            "inputs also the values the loader accepts at every call (default: [0, rows - 1] of the table the input "
            "indexes, found by the build)"
        ),
    )


class DimSpec(_Strict):
    min: int = Field(ge=0, description="smallest size served")
    max: int = Field(ge=1, description="largest size served")
    hint: Optional[int] = Field(
        default=None, ge=2, description="size to export and tune with (default: geometric mean of min and max, at least 2)"
    )


class TuneSpec(_Strict):
    preset: Optional[str] = Field(default=None, description="a named list of candidates (README: Choosing compile options)")
    candidates: list[dict[str, Any]] = Field(
        default_factory=list, description="Inductor option sets to try, each merged over compile.inductor"
    )
    max_seconds: Optional[float] = Field(
        default=None, gt=0, description="stop compiling further candidates after this long; the first candidate always compiles"
    )


class CompileSpec(_Strict):
    inductor: dict[str, Any] = Field(
        default_factory=dict, description="Inductor options passed through, e.g. {freezing: true}"
    )
    tune: Optional[TuneSpec] = Field(
        default=None,
        description="compile every variant under several option sets and keep the fastest that matches eager",
    )

    def candidates(self) -> list[dict[str, Any]]:
        """The option sets each variant is compiled with: compile.inductor alone without tuning, else
        each candidate (preset first, then the listed ones, duplicates dropped) merged over it."""
        if self.tune is None:
            return [dict(self.inductor)]
        from .tune import PRESETS

        listed = (PRESETS.get(self.tune.preset, []) if self.tune.preset else []) + list(self.tune.candidates)
        out: list[dict[str, Any]] = []
        for c in listed or [{}]:
            merged = {**self.inductor, **c}
            if merged not in out:
                out.append(merged)
        return out


class CheckSpec(_Strict):
    atol: Optional[float] = Field(default=None, ge=0, description="absolute tolerance (default per output dtype)")
    rtol: Optional[float] = Field(default=None, ge=0, description="relative tolerance (default per output dtype)")
    random_shapes: int = Field(default=4, ge=0, le=100, description="random shapes checked besides the range ends")
    seed: int = Field(default=0, description="seed for sample inputs and random shapes")


class DistributionSpec(_Strict):
    shapes: list[dict[str, int]] = Field(
        default_factory=list, description="observed shapes, each {<dim>: size, ..., count: N}"
    )
    file: Optional[str] = Field(
        default=None,
        description='JSON-lines file relative to the profile, one {"dims": {...}, "count": N} a line (what model.stats() and the server record)',
    )


class OutputDecl(_Strict):
    shape: list[Union[str, int]] = Field(description="per axis: a dim name it follows, or an int / any other name")


class PlanSpec(_Strict):
    max_specialized: int = Field(default=4, ge=0, le=64, description="at most this many static-shape variants")
    coverage: float = Field(
        default=0.8, ge=0, le=1, description="stop adding static variants once they serve this share of traffic"
    )
    ranges: dict[str, list[int]] = Field(
        default_factory=dict, description="split points per dim: one dynamic variant per sub-range"
    )
    measure: bool = Field(default=False, description="time static candidates at build time, keep those that pay")
    min_speedup: float = Field(default=1.05, ge=1.0, description="with measure: minimum speedup over the dynamic variant")


class PolicySpec(_Strict):
    out_of_range: dict[str, Literal["error", "pad", "split"]] = Field(
        default_factory=dict, description="per dim, for sizes no variant covers: error (default) | pad | split"
    )
    pad_value: dict[str, float] = Field(default_factory=dict, description="per input, the value pad fills with")


class BatchingSpec(_Strict):
    dim: str = Field(
        default="batch",
        description="the batch dim: concurrent calls are concatenated along it; on exactly one axis of every input and every output",
    )
    pad: list[str] = Field(
        default_factory=list,
        description=(
            "other dims concurrent calls may differ in: padded to a common size and every output axis following them "
            "cut back (the build checks on padded samples that this leaves the real outputs unchanged)"
        ),
    )
    pad_value: dict[str, float] = Field(
        default_factory=dict,
        description="per input, the value padding fills with (default: policy.pad_value's, else 0); an attention mask's is 0",
    )


Precision = Literal["fp32", "bf16", "int8"]


class AccuracyRule(_Strict):
    metric: Literal["cosine", "max_abs", "top1"] = Field(
        default="cosine",
        description=(
            "cosine: smallest cosine similarity of output rows (last axis) with fp32 eager's; max_abs: largest "
            "absolute difference; top1: share of rows whose argmax over the last axis agrees"
        ),
    )
    threshold: float = Field(
        default=0.99, description="cosine and top1: at least this; max_abs: at most this"
    )


class AccuracySpec(AccuracyRule):
    outputs: dict[int, AccuracyRule] = Field(
        default_factory=dict, description="per flat output index, a rule replacing the default one above"
    )
    min_speedup: float = Field(
        default=1.0,
        ge=0,
        description="a bf16 or int8 variant is kept only if this much faster than fp32 on its traffic (> 1.0 by default; 0 keeps any that is accurate)",
    )

    def rule(self, output: int) -> AccuracyRule:
        return self.outputs.get(output, self)


class CalibrationSpec(_Strict):
    samples: int = Field(
        default=16,
        ge=1,
        le=4096,
        description="inputs drawn with the traffic distribution's shapes and the inputs' value ranges (when no file is given)",
    )
    file: Optional[str] = Field(
        default=None,
        description=(
            "real inputs, relative to the profile: .safetensors with tensors named '<sample>/<input>' (e.g. '0/ids'), "
            "or .jsonl with one {<input>: nested list, ...} object a line"
        ),
    )


class QuantizationSpec(_Strict):
    int8: Literal["auto", "dynamic", "static"] = Field(
        default="auto",
        description=(
            "dynamic: torchao int8 weights and per-call int8 activations for Linear layers (no calibration needed); "
            "static: PT2E with X86InductorQuantizer, activations calibrated (convolutions need this); auto: static "
            "when the model has convolutions, else dynamic"
        ),
    )


class CudaSpec(_Strict):
    dtype: Literal["float32", "bfloat16", "float16"] = Field(
        default="float32",
        description="compute dtype of CUDA variants: floating weights are cast at build time, floating inputs at the call",
    )
    arch: Optional[list[str]] = Field(
        default=None,
        description='compute capabilities the build is for, e.g. ["9.0"]; the build GPU must be one of them (default: the build GPU\'s)',
    )
    multi_arch: bool = Field(
        default=True,
        description=(
            "emit PTX beside SASS (aot_inductor.emit_multi_arch_kernel): built on 8.x, newer GPUs JIT it; built on "
            "9.0 or newer the kernels are arch-specific (sm_90a, compute_90a) and run on that GPU only"
        ),
    )
    cuda_graphs: bool = Field(default=False, description="capture one CUDA graph per static variant at warm-up and replay it")


class Profile(_Strict):
    name: str = Field(pattern=r"^[a-z0-9][a-z0-9._-]*$", description="artifact name")
    model: ModelSpec
    inputs: dict[str, InputSpec] = Field(description="inputs in forward() order")
    dims: dict[str, DimSpec] = Field(default_factory=dict, description="every dim name used in an input shape")
    target: Union[Literal["cpu", "cuda"], list[Literal["cpu", "cuda"]]] = Field(
        default="cpu", description="device(s) the code is compiled for; a list builds one artifact for several"
    )
    cuda: CudaSpec = Field(default_factory=CudaSpec, description="options for CUDA variants")
    precision: Union[list[Precision], dict[Literal["cpu", "cuda"], list[Precision]]] = Field(
        default_factory=lambda: ["fp32"],
        description=(
            "precisions compiled for CPU targets, or per target {cpu: [...], cuda: [...]}; each beyond fp32 must pass "
            "the accuracy gate and beat fp32 on its traffic to be kept (CUDA variants compute in cuda.dtype)"
        ),
    )
    accuracy: AccuracySpec = Field(
        default_factory=AccuracySpec, description="the gate a bf16 or int8 variant must pass against fp32 eager"
    )
    calibration: CalibrationSpec = Field(
        default_factory=CalibrationSpec, description="inputs the gate measures accuracy on and int8 static calibrates with"
    )
    quantization: QuantizationSpec = Field(default_factory=QuantizationSpec, description="how int8 variants are quantized")
    compile: CompileSpec = Field(default_factory=CompileSpec)
    check: CheckSpec = Field(default_factory=CheckSpec)
    distribution: DistributionSpec = Field(default_factory=DistributionSpec, description="observed traffic")
    outputs: Optional[list[OutputDecl]] = Field(
        default=None, description="flat outputs in order; named dims say which output axes follow input dims (pad/split)"
    )
    plan: PlanSpec = Field(default_factory=PlanSpec)
    policy: PolicySpec = Field(default_factory=PolicySpec)
    batching: Optional[BatchingSpec] = Field(
        default=None, description="how loader.Batcher may batch concurrent calls: the batch dim, and the dims it may pad"
    )

    @property
    def targets(self) -> tuple[str, ...]:
        """Devices to build for, primary first, without repeats."""
        return tuple(dict.fromkeys([self.target] if isinstance(self.target, str) else self.target))

    def precisions(self, device: str) -> tuple[str, ...]:
        """The precisions built for ``device``, fp32 first (it is every gate's baseline)."""
        listed = self.precision.get(device, ["fp32"]) if isinstance(self.precision, dict) else self.precision
        return tuple(dict.fromkeys(["fp32", *listed]))

    def hint(self, dim: str) -> int:
        """The size a dim is exported with: ≥ 2, since torch.export specializes sizes 0 and 1."""
        spec = self.dims[dim]
        if spec.hint is not None:
            return spec.hint
        return max(2, min(spec.max, round(math.sqrt(max(spec.min, 1) * spec.max))))

    def tolerance(self, dtype: str) -> tuple[float, float]:
        atol, rtol = DEFAULT_TOLERANCE.get(dtype, (0.0, 0.0))
        return (self.check.atol if self.check.atol is not None else atol, self.check.rtol if self.check.rtol is not None else rtol)


class LoadedProfile(BaseModel):
    """A valid profile and the folder it came from (model imports and weights are relative to it)."""

    model_config = ConfigDict(frozen=True, arbitrary_types_allowed=True)
    profile: Profile
    path: Path

    @property
    def folder(self) -> Path:
        return self.path.parent


def json_schema() -> dict[str, Any]:
    schema = Profile.model_json_schema()
    schema["$schema"] = "https://json-schema.org/draft/2020-12/schema"
    schema["title"] = "precompile profile"
    return schema


def load_profile(path: str | Path) -> LoadedProfile:
    """Read, parse and check a profile file; raise ProfileError listing every problem found."""
    path = Path(path)
    source = str(path)
    try:
        text = path.read_text(encoding="utf-8")
    except FileNotFoundError:
        raise ProfileError(source, [("", "file not found")]) from None
    except (OSError, UnicodeDecodeError) as e:
        raise ProfileError(source, [("", f"cannot read: {e}")]) from None
    try:
        raw = yaml.safe_load(text)
    except yaml.YAMLError as e:
        mark = getattr(e, "problem_mark", None)
        where = f"line {mark.line + 1}, column {mark.column + 1}" if mark else ""
        raise ProfileError(source, [(where, f"not valid YAML: {getattr(e, 'problem', None) or e}")]) from None
    if not isinstance(raw, dict):
        raise ProfileError(source, [("", "a profile is a YAML mapping (name:, model:, inputs:, dims:)")])
    try:
        profile = Profile.model_validate(raw)
    except ValidationError as e:
        raise ProfileError(source, validation_problems(e.errors())) from None
    problems = semantic_problems(profile) + inductor_option_problems(profile.compile.inductor) + tune_problems(profile.compile)
    problems += precision_problems(profile, path.parent)
    if profile.model.weights is not None and not (path.parent / profile.model.weights).is_file():
        problems.append(("model.weights", f"file not found: {path.parent / profile.model.weights}"))
    if problems:
        raise ProfileError(source, problems)
    return LoadedProfile(profile=profile, path=path.resolve())


def validation_problems(errors: list[dict]) -> list[tuple[str, str]]:
    """pydantic's errors as ``place: message``. A field that takes a list or a mapping (``precision``)
    reports its failure under each form; the form the user did not write is dropped, and the form's
    name (``list[...]``) is left out of the place."""
    out = []
    for err in errors:
        loc = tuple(p for p in err["loc"] if not (isinstance(p, str) and "[" in p))
        out.append((loc, err))
    def form_error(loc: tuple, err: dict) -> bool:
        return err["type"] in ("dict_type", "list_type") and len(loc) < len(err["loc"])

    shown = []
    for loc, err in out:
        if form_error(loc, err):
            if any(l2[: len(loc)] == loc and not form_error(l2, e2) for l2, e2 in out):
                continue  # the user wrote the other form, whose own errors say what is wrong
            shown.append((_place(loc), "expected a list (e.g. [fp32, int8]) or a mapping per target (e.g. {cpu: [int8]})"))
            continue
        shown.append((_place(loc), _message(err)))
    return list(dict.fromkeys(shown))


def _place(loc: tuple) -> str:
    out = ""
    for part in loc:
        if isinstance(part, int):
            out += f"[{part}]"
        else:
            out += ("." if out else "") + str(part)
    return out


def _message(err: dict) -> str:
    if err["type"] == "extra_forbidden":
        return "unknown key"
    if err["type"] == "literal_error":
        return f"{err['input']!r} is not one of: {err['ctx']['expected']}"
    return err["msg"]


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
        problems += _value_range_problems(name, spec)
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
    return problems


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
                    problems.append((place, f"split needs every output to follow {d!r}; outputs[{i}] has shape {out.shape}"))
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
                problems.append((f"plan.ranges.{d}", f"split point {p} is outside [{profile.dims[d].min}, {profile.dims[d].max}]"))
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
                (f"policy.pad_value.{name}", f"{value:g} is outside inputs.{name}.range [{spec.range[0]:g}, {spec.range[1]:g}]")
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
    hold. Whether padding leaves the outputs unchanged is checked by the build (precompile.batching)."""
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
                    ("batching.dim", f"input {name!r} (shape {inp.shape}) has {spec.dim!r} on {where}; every input needs it on exactly one axis")
                )
        if profile.outputs is None:
            problems.append(("batching", "needs `outputs:` to say which output axes follow the batch dim and the padded dims"))
        for i, out in enumerate(profile.outputs or []):
            axes = [axis for axis, s in enumerate(out.shape) if s == spec.dim]
            if len(axes) != 1:
                where = "no axis" if not axes else f"axes {', '.join(map(str, axes))}"
                problems.append(
                    ("batching.dim", f"outputs[{i}] (shape {out.shape}) follows {spec.dim!r} on {where}; each caller's rows are cut from exactly one axis of every output")
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
            problems.append((place, f"input {name!r} has none of the padded dims ({', '.join(spec.pad) or 'none listed'})"))
    for name, value in values.items():
        inp = profile.inputs[name]
        place = f"batching.pad_value.{name}"
        if inp.dtype == "bool" and value not in (0.0, 1.0):
            problems.append((place, f"{value:g}: a bool input pads with 0 or 1"))
        elif inp.dtype in _INT_LIMITS and value != int(value):
            problems.append((place, f"{value:g}: an {inp.dtype} input pads with a whole number"))
        elif inp.dtype in _INT_LIMITS and inp.range is not None and not inp.range[0] <= value <= inp.range[1]:
            problems.append(
                (place, f"{value:g} is outside inputs.{name}.range [{inp.range[0]:g}, {inp.range[1]:g}]: the loader refuses such values, widen the range to hold it")
            )
    return problems


def precision_problems(profile: Profile, folder: Path) -> list[tuple[str, str]]:
    """precision, accuracy, calibration: what each precision needs, checked before anything compiles."""
    problems = []
    if isinstance(profile.precision, dict):
        for device, listed in profile.precision.items():
            if device not in profile.targets:
                problems.append((f"precision.{device}", f"{device} is not a target (target: {', '.join(profile.targets)})"))
            if device == "cuda" and set(listed) - {"fp32"}:
                problems.append(
                    ("precision.cuda", "CUDA variants compute in cuda.dtype: list only fp32 here and set cuda.dtype: bfloat16 or float16")
                )
    elif set(profile.precision) - {"fp32"} and profile.targets == ("cuda",):
        problems.append(("precision", "bf16 and int8 variants are built for CPU targets; for CUDA set cuda.dtype instead"))
    wanted = {p for d in profile.targets for p in profile.precisions(d)}
    if "int8" in wanted:
        import importlib.util

        if importlib.util.find_spec("torchao") is None:
            problems.append(("precision", "int8 variants are quantized with torchao, which is not installed: pip install 'precompile[quant]'"))
    rules = [("accuracy", profile.accuracy)] + [(f"accuracy.outputs.{i}", r) for i, r in profile.accuracy.outputs.items()]
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
    from .tune import PRESETS

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
        if key in MANAGED_INDUCTOR_OPTIONS:
            problems.append((place, f"set by precompile, not by profiles: {MANAGED_INDUCTOR_OPTIONS[key]}"))
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
