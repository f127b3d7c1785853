"""The profile's schema: pydantic models, extra keys refused. The JSON Schema is generated from them
(``json_schema``, written to profiles/schema.json by ``make schema``)."""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any, Literal, Optional, Union

from pydantic import BaseModel, ConfigDict, Field

from loader.constants import DTYPES

from ..options import ALL_CONV_ROUTES, CONV_ROUTES, PRESETS, STANDALONE

Dtype = Literal[DTYPES]  # type: ignore[valid-type]

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
    factory: Optional[str] = Field(
        default=None,
        pattern=r"^[A-Za-z_][\w.]*:[A-Za-z_][\w.]*$",
        description=(
            '"module:callable" returning a torch.nn.Module; the profile\'s folder is on sys.path while importing '
            "(required, unless precompile.build is given the exported program, which replaces factory, kwargs and weights)"
        ),
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


class SampleSpec(_Strict):
    range: tuple[float, float] = Field(
        description=(
            "inclusive [low, high] the build's sample inputs are drawn from (ints: integers drawn uniformly; floats: "
            "uniform; bool: [1, 1] all true, [0, 0] all false), within the input's range: e.g. an attention mask "
            "sampled as ones ({range: [1, 1]}) whose valid values are [0, 1]"
        )
    )


class InputSpec(_Strict):
    shape: list[Union[str, int]] = Field(description="per axis: a dim name from `dims`, or an int for a static size")
    dtype: Dtype = Field(description="torch dtype name")
    range: Optional[tuple[float, float]] = Field(
        default=None,
        description=(
            "inclusive [low, high] of the input's valid values: for integer inputs the loader refuses every call with a "
            "value outside it (default: [0, rows - 1] of the table the input indexes, found by the build); the build's "
            "samples are drawn from it unless `sample` says otherwise"
        ),
    )
    sample: Optional[SampleSpec] = Field(
        default=None, description="how the build's sample inputs are drawn, when not from the whole valid range"
    )

    def sample_range(self) -> tuple[float, float] | None:
        """The values samples are drawn from: ``sample.range``, else the valid ``range``."""
        return self.sample.range if self.sample is not None else self.range


class DimSpec(_Strict):
    min: int = Field(ge=0, description="smallest size served")
    max: int = Field(ge=1, description="largest size served")
    hint: Optional[int] = Field(
        default=None,
        ge=2,
        description="size to export and tune with (default: geometric mean of min and max, at least 2)",
    )


class TuneSpec(_Strict):
    preset: Optional[str] = Field(default=None, description="a named list of candidates (docs/compile-options.md)")
    candidates: list[dict[str, Any]] = Field(
        default_factory=list, description="Inductor option sets to try, each merged over compile.inductor"
    )
    max_seconds: Optional[float] = Field(
        default=None,
        gt=0,
        description="stop compiling further candidates after this long; the first candidate always compiles",
    )
    first_call: Optional[float] = Field(
        default=1.5,
        ge=1,
        description="a dynamic variant's bound on the first call at a shape no call met, as a multiple of the fastest "
        "candidate's steady call (oneDNN compiles each convolution at each new shape): on a CPU, where the fastest's "
        "first call is over it, the candidate whose first call costs least is kept beside it for the first calls "
        "(first_calls); elsewhere the fastest candidate within it, when one is; null: the fastest steady call alone",
    )
    first_calls: Optional[bool] = Field(
        default=None,
        description="where the fastest candidate's first call is over first_call, keep a second variant for the first "
        "calls at shapes it has not run (a larger artifact, a longer load); false: keep one, the fastest within the "
        "bound; default: true with the convnet preset, false otherwise",
    )

    @property
    def keeps_first_calls(self) -> bool:
        """``first_calls`` as set, else its default: a second variant for first calls is what the convnet
        preset is for (oneDNN's per-shape kernels); elsewhere a first call's figure over the bound is
        mostly the build host's noise."""
        return self.first_calls if self.first_calls is not None else self.preset == "convnet"


class CompileSpec(_Strict):
    inductor: dict[str, Any] = Field(
        default_factory=dict, description="Inductor options passed through, e.g. {freezing: true}"
    )
    tune: Optional[TuneSpec] = Field(
        default=None,
        description="compile every variant under several option sets and keep the fastest that matches eager",
    )

    standalone: bool = Field(
        default=False,
        description="CPU variants that run without libc10 and libtorch_cpu: no extern kernel left (C++ GEMM "
        "templates, attention decomposed), linked without libtorch, served by the torch-free loader on the "
        "artifact's own tensor shim; a variant that cannot be is compiled as usual and says why",
    )

    conv_routes: Optional[list[Literal[ALL_CONV_ROUTES]]] = Field(  # type: ignore[valid-type]
        default=None,
        description="the fp32 convolutions compiled without a per-shape oneDNN primitive (no JIT at the first call "
        "at a new image size): conv1x1_as_gemm (1×1 ones as matrix products), depthwise_as_loops (generated "
        "loops), stem_as_loops (a dense one over few input channels, an image's stem, as an im2col and a matrix "
        "product), dense_as_gemm (any dense one so); [] "
        "keeps every convolution oneDNN's; unset: the model kind's default (docs/compile-options.md)",
    )

    def candidates(self) -> list[dict[str, Any]]:
        """The option sets each variant is compiled with: compile.inductor alone without tuning, else
        each candidate (preset first, then the listed ones, duplicates dropped) merged over it; each
        marked standalone (``precompile.standalone.OPTION``) when asked, and with the convolution
        routes asked for (``options.CONV_ROUTES``)."""
        mark: dict[str, Any] = {STANDALONE: True} if self.standalone else {}
        if self.conv_routes is not None:
            mark[CONV_ROUTES] = list(dict.fromkeys(self.conv_routes))
        if self.tune is None:
            return [{**self.inductor, **mark}]
        listed = (PRESETS.get(self.tune.preset, []) if self.tune.preset else []) + list(self.tune.candidates)
        out: list[dict[str, Any]] = []
        for c in listed or [{}]:
            merged = {**self.inductor, **c, **mark}
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
    warm_shapes: int = Field(
        default=8,
        ge=0,
        le=64,
        description="per dynamic variant, the hottest observed shapes it serves (besides its hint) that the "
        "loader's warm-up runs, so their first calls meet compiled kernels",
    )
    measure: bool = Field(default=False, description="time static candidates at build time, keep those that pay")
    min_speedup: float = Field(
        default=1.05, ge=1.0, description="with measure: minimum speedup over the dynamic variant"
    )


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
    threshold: float = Field(default=0.99, description="cosine and top1: at least this; max_abs: at most this")
    statistic: Literal["p5", "worst", "mean"] = Field(
        default="p5",
        description=(
            "how the gate sums up cosine and max_abs over its held-out rows: p5, the 5% worst rows' bound (95% of "
            "rows have a cosine at least it, or a max_abs at most it), stable from run to run and over row counts; "
            "worst: the worst row (grows stricter with every row scored); mean. top1 is always the share of rows"
        ),
    )


class AccuracySpec(AccuracyRule):
    samples: int = Field(
        default=64,
        ge=1,
        le=4096,
        description=(
            "held-out inputs the gate scores each bf16 or int8 variant on: drawn with the traffic's shapes inside the "
            "variant's ranges (other seeds than calibration's), or the calibration file's held-out quarter; never "
            "an input int8 calibrated on"
        ),
    )
    outputs: dict[int, AccuracyRule] = Field(
        default_factory=dict, description="per flat output index, a rule replacing the default one above"
    )
    min_speedup: float = Field(
        default=1.0,
        ge=0,
        description=(
            "a bf16 or int8 variant is kept only if this much faster than fp32 on its traffic "
            "(> 1.0 by default; 0 keeps any that is accurate)"
        ),
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


class FallbackSpec(_Strict):
    layers: int = Field(
        default=8,
        ge=0,
        le=1024,
        description=(
            "int8 static failing the accuracy gate: keep at most this many more layers in fp32, the most sensitive "
            "first (each layer's error measured alone), until the gate passes; 0 turns the fallback off"
        ),
    )
    builds: int = Field(default=2, ge=1, le=16, description="int8 static fallback: at most this many compiles tried")


class QuantizationSpec(_Strict):
    int8: Literal["auto", "dynamic", "static"] = Field(
        default="auto",
        description=(
            "dynamic: torchao int8 weights and per-call int8 activations for Linear layers (no calibration needed); "
            "static: PT2E with X86InductorQuantizer, activations calibrated (convolutions need this); auto: static "
            "when the model has convolutions, else dynamic"
        ),
    )
    observer: Literal["histogram", "minmax", "percentile"] = Field(
        default="histogram",
        description=(
            "int8 static: how calibration sets each activation's range: histogram (torchao's default, the "
            "range that minimizes the L2 error), minmax (everything seen), percentile (0.01st to 99.99th)"
        ),
    )
    keep: list[str] = Field(
        default_factory=list,
        description=(
            "int8 static: layers left in fp32: first and last (the first and the last convolution or linear layer "
            "that runs: a convnet's stem and classifier), or module names (e.g. 'resnet.encoder.stages.3')"
        ),
    )
    fallback: FallbackSpec = Field(
        default_factory=FallbackSpec,
        description="int8 static: what the build does when the int8 variant fails the accuracy gate",
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
    cuda_graphs: bool = Field(
        default=False, description="capture one CUDA graph per static variant at warm-up and replay it"
    )


class CpuSpec(_Strict):
    isa: list[Literal["native", "x86-64-v3", "x86-64-v4"]] = Field(
        default_factory=lambda: ["native"],
        description=(
            "instruction sets each CPU variant is compiled for, once per entry: native (the build host's own: "
            "-march=native, its widest vector ISA; runs on CPUs like it), or an x86-64 level, compiled for exactly "
            "that level (x86-64-v3: AVX2; x86-64-v4: AVX-512 F/BW/CD/DQ/VL); the loader serves the best one a host "
            "runs. Default [native]: one compile per variant, as before"
        ),
    )


class Profile(_Strict):
    name: str = Field(pattern=r"^[a-z0-9][a-z0-9._-]*$", description="artifact name")
    model: ModelSpec = Field(default_factory=ModelSpec, description="the model: its factory, weights, outputs kept")
    inputs: dict[str, InputSpec] = Field(description="inputs in forward() order")
    dims: dict[str, DimSpec] = Field(default_factory=dict, description="every dim name used in an input shape")
    target: Union[Literal["cpu", "cuda"], list[Literal["cpu", "cuda"]]] = Field(
        default="cpu", description="device(s) the code is compiled for; a list builds one artifact for several"
    )
    cuda: CudaSpec = Field(default_factory=CudaSpec, description="options for CUDA variants")
    cpu: CpuSpec = Field(default_factory=CpuSpec, description="options for CPU variants")
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
        default_factory=CalibrationSpec,
        description="inputs the gate measures accuracy on and int8 static calibrates with",
    )
    quantization: QuantizationSpec = Field(
        default_factory=QuantizationSpec, description="how int8 variants are quantized"
    )
    compile: CompileSpec = Field(default_factory=CompileSpec)
    check: CheckSpec = Field(default_factory=CheckSpec)
    distribution: DistributionSpec = Field(default_factory=DistributionSpec, description="observed traffic")
    outputs: Optional[list[OutputDecl]] = Field(
        default=None,
        description="flat outputs in order; named dims say which output axes follow input dims (pad/split)",
    )
    plan: PlanSpec = Field(default_factory=PlanSpec)
    policy: PolicySpec = Field(default_factory=PolicySpec)
    batching: Optional[BatchingSpec] = Field(
        default=None,
        description="how loader.Batcher may batch concurrent calls: the batch dim, and the dims it may pad",
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
        return (
            self.check.atol if self.check.atol is not None else atol,
            self.check.rtol if self.check.rtol is not None else rtol,
        )


class LoadedProfile(BaseModel):
    """A valid profile and the folder it came from (model imports and weights are relative to it)."""

    model_config = ConfigDict(frozen=True, arbitrary_types_allowed=True)
    profile: Profile
    path: Path  # a profile given as a dict or a Profile: <folder>/<profile>, named so in errors
    program: Optional[Path] = None  # a saved torch.export program replacing model.factory (precompile.build)

    @property
    def folder(self) -> Path:
        return self.path.parent


def json_schema() -> dict[str, Any]:
    schema = Profile.model_json_schema()
    schema["$schema"] = "https://json-schema.org/draft/2020-12/schema"
    schema["title"] = "precompile profile"
    return schema
