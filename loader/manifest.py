"""The manifest: schema, strict parsing and serialization.

The manifest is untrusted input on the serving side, so it is parsed by hand into frozen dataclasses
with every type, range and cross-reference checked; anything unexpected raises ``ArtifactError``
naming the key (``manifest.json: variants[0].dims.seq: ...``). The build side creates the same
dataclasses and calls ``Manifest.to_json()``, so writer and reader cannot drift apart.

Each section has its own parser, named for it (``_parse_target``, ``_parse_variants``,
``_parse_check``...), returning that section's dataclass; ``parse_manifest`` reads as their list.
Nothing the build wrote is read as a raw dict on the call path: the build's own record (``check``:
its measurements, which ``loader.Batcher`` decides padding on, and its references, which
``precompile verify --run`` recomputes) is a ``CheckRecord`` of typed entries too.
"""

from __future__ import annotations

import datetime
import json
import re
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any, Union

from . import constants as C
from .errors import ArtifactError

NAME_RE = re.compile(r"^[a-z0-9][a-z0-9._-]*$")
IDENT_RE = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*$")
VARIANT_ID_RE = re.compile(r"^[a-z0-9][a-z0-9_-]{0,63}$")
SHA256_RE = re.compile(r"^[0-9a-f]{64}$")
MAX_INT = 2**53  # anything larger is not a real size and would not survive JSON round trips

Shape = tuple[Union[str, int], ...]
POLICIES = ("error", "pad", "split")
CAPABILITY_RE = re.compile(r"^\d{1,3}\.\d{1,3}$")
CODE_OBJECT_RE = re.compile(r"^(sm|compute)_\d{2,4}[af]?$")  # a kernel target: sm_90a (SASS), compute_80 (PTX)


@dataclass(frozen=True)
class DimRange:
    min: int
    max: int

    def __contains__(self, size: int) -> bool:
        return self.min <= size <= self.max

    def __str__(self) -> str:
        return f"[{self.min}, {self.max}]"


@dataclass(frozen=True)
class InputSpec:
    name: str
    dtype: str
    shape: Shape  # a dim name (dynamic or ranged) or an int (static size)
    # Integer inputs: the values the compiled code accepts (an embedding's rows), checked on every
    # call; None: values unguarded. Not part of the call signature (compare=False): a new version
    # may widen or narrow it, as it may its dim ranges.
    range: DimRange | None = field(default=None, compare=False)

    def to_dict(self) -> dict[str, Any]:
        out: dict[str, Any] = {"name": self.name, "dtype": self.dtype, "shape": list(self.shape)}
        if self.range is not None:
            out["range"] = [self.range.min, self.range.max]
        return out


@dataclass(frozen=True)
class OutputSpec:
    """Structure of what forward() returns: a tensor, or tuples/lists/dicts of them."""

    kind: str  # "tensor" | "tuple" | "list" | "dict"
    items: tuple[OutputSpec, ...] = ()
    keys: tuple[str, ...] = ()

    def count(self) -> int:
        return 1 if self.kind == "tensor" else sum(item.count() for item in self.items)

    def to_dict(self) -> dict[str, Any]:
        if self.kind == "tensor":
            return {"kind": "tensor"}
        out: dict[str, Any] = {"kind": self.kind, "items": [item.to_dict() for item in self.items]}
        if self.kind == "dict":
            out["keys"] = list(self.keys)
        return out


@dataclass(frozen=True)
class ConstantSpec:
    """dtype and shape of one tensor in weights.safetensors, as the compiled code expects it."""

    dtype: str
    shape: tuple[int, ...]


@dataclass(frozen=True)
class FileEntry:
    size: int
    sha256: str


@dataclass(frozen=True)
class Variant:
    id: str
    kind: str  # "static" | "dynamic"
    file: str
    dims: dict[str, DimRange]  # for static variants min == max for every dim
    hint: dict[str, int]  # the sizes the variant was exported and tuned with
    constants: tuple[str, ...]  # the constant names the compiled code asks for
    device: str = "cpu"  # device type the code runs on
    dtype: str | None = None  # compute dtype floating inputs are cast to (None: as declared)
    constant_prefix: str = ""  # weights.safetensors stores constant c as constant_prefix + c
    # The package carries its own constants (frozen, oneDNN-prepacked weights that have no storage
    # safetensors could hold); ``constants`` is then empty and the runner is given none.
    embedded_constants: bool = False
    # fp32, or a lower precision the build's gate measured (gate: accuracy against fp32 eager, speed
    # against the fp32 twin); cpu_features: what the host's CPU must have to run its kernels.
    precision: str = "fp32"
    cpu_features: tuple[str, ...] = ()
    gate: dict[str, Any] | None = None
    # The x86-64 level the code was compiled for (``loader.isa``: "x86-64-v3"); cpu_features then
    # holds every feature of that level. None: the build host's own ISA (-march=native), checked
    # against the target's aoti_cpu_isa as before.
    isa: str | None = None
    # A CPU variant's reason why only the torch loader can run it (ops without a C shim need torch's
    # proxy executor, ...), found by the build; None: the torch-free loader can, or an older build did
    # not look (that loader looks again when it opens the package).
    needs_torch: str | None = None
    # A standalone CPU variant (``precompile.standalone``): its library calls no libtorch, only the
    # tensor shim in this artifact file (listed in files), which the torch-free loader opens instead
    # of libc10 and libtorch_cpu. not_standalone: why a variant asked to be standalone is not (an
    # extern kernel left, ...); it runs on torch's libraries as before.
    shim: str | None = None
    not_standalone: str | None = None
    # A dynamic variant's hottest shapes in the build's traffic after its hint (the profile's
    # plan.warm_shapes), hottest first: load's warm-up runs them too (loader.warmup), so that their
    # first calls find oneDNN's primitives created.
    warm: tuple[dict[str, int], ...] = ()
    # A dynamic variant that serves the first calls of another (``first_calls_of``: its id, same
    # ranges, device and precision) at shapes that one has not run yet in this process: compiled with
    # no per-shape kernel (``compile.conv_routes``), so its first call at a shape costs its steady one,
    # while the loader runs the other at that shape in the background (oneDNN creates its kernels);
    # later calls there go to the other. Never chosen by dispatch on its own.
    first_calls_of: str | None = None

    def to_dict(self) -> dict[str, Any]:
        out = {
            "id": self.id,
            "kind": self.kind,
            "file": self.file,
            "dims": {k: [r.min, r.max] for k, r in self.dims.items()},
            "hint": dict(self.hint),
            "constants": list(self.constants),
            "device": self.device,
            "dtype": self.dtype,
            "constant_prefix": self.constant_prefix,
        }
        if self.embedded_constants:  # only when set: artifacts without such variants stay readable by older loaders
            out["embedded_constants"] = True
        if self.precision != "fp32":  # older loaders refuse such a variant rather than serve it blind to its CPU needs
            out["precision"] = self.precision
            out["cpu_features"] = list(self.cpu_features)
            out["gate"] = self.gate
        if self.isa is not None:  # older loaders refuse such a variant rather than serve it blind to its ISA
            out["isa"] = self.isa
            out["cpu_features"] = list(self.cpu_features)
        if (
            self.needs_torch is not None
        ):  # only when set: artifacts without such variants stay readable by older loaders
            out["needs_torch"] = self.needs_torch
        if self.shim is not None:  # only when set, as above
            out["shim"] = self.shim
        if self.not_standalone is not None:
            out["not_standalone"] = self.not_standalone
        if self.warm:  # only when set, as above
            out["warm"] = [dict(s) for s in self.warm]
        if self.first_calls_of is not None:  # older loaders refuse it rather than dispatch to it as a variant
            out["first_calls_of"] = self.first_calls_of
        return out


@dataclass(frozen=True)
class CudaInfo:
    """What the CUDA variants were built on and for."""

    torch_cuda: str  # torch.version.cuda on the build host
    capability: str  # compute capability of the build GPU, "9.0"
    archs: tuple[str, ...]  # capabilities the kernels were built for (SASS)
    multi_arch: bool  # PTX emitted too: newer GPUs can JIT it
    cuda_graphs: bool  # capture a graph per static variant at warm-up
    device_name: str = ""
    # The code objects the packages' kernels hold, as read at build time: "sm_90a" (SASS), "compute_90a"
    # (PTX). Empty: not recorded (older builds); loader.cuda derives them from capability and multi_arch.
    kernels: tuple[str, ...] = ()

    def to_dict(self) -> dict[str, Any]:
        return {
            "torch_cuda": self.torch_cuda,
            "capability": self.capability,
            "archs": list(self.archs),
            "multi_arch": self.multi_arch,
            "cuda_graphs": self.cuda_graphs,
            "device_name": self.device_name,
            **({"kernels": list(self.kernels)} if self.kernels else {}),
        }


@dataclass(frozen=True)
class Batching:
    """How ``loader.Batcher`` may batch calls, as the profile's ``batching:`` section said and the
    build checked: concatenate along ``dim`` (one axis of every input and, per ``output_dims``, of
    every output), and pad the ``pad`` dims to a common size with ``pad_value`` per input, cutting
    every output axis that follows them back to each caller's size."""

    dim: str
    pad: tuple[str, ...] = ()
    pad_value: dict[str, float] = field(default_factory=dict)  # per input holding a padded dim
    checked: dict[str, Any] = field(default_factory=dict)  # what the build compared: samples, max_abs_error

    def to_dict(self) -> dict[str, Any]:
        return {"dim": self.dim, "pad": list(self.pad), "pad_value": dict(self.pad_value), "checked": self.checked}


@dataclass(frozen=True)
class Measurement:
    """One static variant timed against the dynamic variant that would serve its shape otherwise
    (``check.measure``): the build kept it only when it was fast enough, and ``loader.Batcher``
    pads a batch up to a kept one's shape only when these times say it pays."""

    variant: str
    dims: dict[str, int]
    static_ms: float
    dynamic_ms: float
    against: str  # the dynamic variant's id
    speedup: float  # dynamic_ms / static_ms (inf when static_ms is 0)
    kept: bool

    def to_dict(self) -> dict[str, Any]:
        return {
            "variant": self.variant,
            "dims": dict(self.dims),
            "static_ms": self.static_ms,
            "dynamic_ms": self.dynamic_ms,
            "against": self.against,
            "speedup": self.speedup,
            "kept": self.kept,
        }


@dataclass(frozen=True)
class AccuracyRecord:
    """How a lower-precision variant's output is compared with its fp32 reference: the gate's
    ``metric`` and ``threshold`` (metric ``equal`` for outputs that are not floating point), and
    ``build_value``, the metric the variant reached on this reference's rows on the build host (at
    their worst row; top1: the share agreeing). None in manifests written before it was recorded."""

    metric: str
    threshold: float
    build_value: float | None = None

    def to_dict(self) -> dict[str, Any]:
        out: dict[str, Any] = {"metric": self.metric, "threshold": self.threshold}
        if self.build_value is not None:
            out["build_value"] = self.build_value
        return out


@dataclass(frozen=True)
class Reference:
    """A stored input/output pair for one variant (``check.references``): tensor names in
    ``references.safetensors`` that ``precompile verify --run`` recomputes on a serving host,
    within one ``(atol, rtol)`` per output, or, for a bf16/int8 variant, its gate's rule per output."""

    variant: str
    dims: dict[str, int]
    inputs: tuple[str, ...]
    outputs: tuple[str, ...]
    tolerance: tuple[tuple[float, float], ...]  # per output
    device: str = "cpu"
    accuracy: tuple[AccuracyRecord, ...] | None = None  # per output; None: compared by tolerance

    def to_dict(self) -> dict[str, Any]:
        out: dict[str, Any] = {
            "variant": self.variant,
            "dims": dict(self.dims),
            "inputs": list(self.inputs),
            "outputs": list(self.outputs),
            "device": self.device,
            "tolerance": [list(pair) for pair in self.tolerance],
        }
        if self.accuracy is not None:
            out["accuracy"] = [a.to_dict() for a in self.accuracy]
        return out


@dataclass(frozen=True)
class CheckRecord:
    """What the build checked and measured (the manifest's ``check``): shapes compared with eager
    and the largest error, the references, the static variants' measurements; and, for people
    reading ``precompile inspect``, the traffic the plan used and the tuning and precision-gate
    records (JSON objects kept as written: no loader decision depends on them)."""

    shapes: int = 0
    max_abs_error: float = 0.0
    references: tuple[Reference, ...] = ()
    measure: tuple[Measurement, ...] = ()
    plan: dict[str, Any] | None = None
    tuning: tuple[dict[str, Any], ...] = ()
    precision: tuple[dict[str, Any], ...] = ()

    @classmethod
    def from_dict(cls, value: dict[str, Any], *, source: str = "check") -> CheckRecord:
        """The record the build assembles as plain JSON values, checked as the loader will check it
        (``ArtifactError`` naming the field), so the build cannot write what the loader refuses."""
        return _parse_check(_Reader(source), value, variants=None, dims=None)

    def __bool__(self) -> bool:
        return self != CheckRecord()

    def to_dict(self) -> dict[str, Any]:
        if not self:
            return {}
        out: dict[str, Any] = {
            "shapes": self.shapes,
            "max_abs_error": self.max_abs_error,
            "references": [r.to_dict() for r in self.references],
            "measure": [m.to_dict() for m in self.measure],
            "plan": self.plan,
        }
        if self.tuning:
            out["tuning"] = list(self.tuning)
        if self.precision:
            out["precision"] = list(self.precision)
        return out


@dataclass(frozen=True)
class Target:
    device: str
    cpu_capability: str  # what torch.backends.cpu.get_cpu_capability() said on the build host
    aoti_cpu_isa: str  # what AOTInductor recorded in the package metadata
    platform: str
    machine: str


@dataclass(frozen=True)
class Manifest:
    """A parsed manifest: one attribute per section (``parse_manifest`` builds it from the file,
    the build assembles it and writes ``to_json()``)."""

    name: str
    torch_version: str
    precompile_version: str
    created: str
    target: Target
    inputs: tuple[InputSpec, ...]
    dims: dict[str, DimRange]
    output: OutputSpec
    variants: tuple[Variant, ...]
    constants: dict[str, ConstantSpec]
    files: dict[str, FileEntry]
    check: CheckRecord = field(default_factory=CheckRecord)  # what the build checked and measured
    version: int = 1  # increases with every release of the same name; loaders can refuse rollbacks
    expires: str | None = None  # ISO 8601 date-time after which loaders refuse the artifact
    # What the loader does with a size outside every variant, per dim: "error" (default), "pad", "split".
    policy: dict[str, str] = field(default_factory=dict)
    pad_value: dict[str, float] = field(default_factory=dict)  # per input, for "pad"
    # Per flat output, per axis: the dim that axis follows (None: fixed). Needed by pad and split.
    output_dims: tuple[tuple[str | None, ...], ...] | None = None
    cuda: CudaInfo | None = None  # present when the artifact has CUDA variants
    batching: Batching | None = None  # the profile's checked batching section

    def to_dict(self) -> dict[str, Any]:
        out = {
            "format": C.FORMAT_NAME,
            "format_version": C.FORMAT_VERSION,
            "name": self.name,
            "torch_version": self.torch_version,
            "precompile_version": self.precompile_version,
            "created": self.created,
            "target": {
                "device": self.target.device,
                "cpu_capability": self.target.cpu_capability,
                "aoti_cpu_isa": self.target.aoti_cpu_isa,
                "platform": self.target.platform,
                "machine": self.target.machine,
            },
            "inputs": [i.to_dict() for i in self.inputs],
            "dims": {k: {"min": r.min, "max": r.max} for k, r in self.dims.items()},
            "output": self.output.to_dict(),
            "variants": [v.to_dict() for v in self.variants],
            "constants": {k: {"dtype": c.dtype, "shape": list(c.shape)} for k, c in sorted(self.constants.items())},
            "files": {k: {"size": f.size, "sha256": f.sha256} for k, f in sorted(self.files.items())},
            "check": self.check.to_dict(),
            "version": self.version,
            "expires": self.expires,
            "policy": dict(self.policy),
            "pad_value": dict(self.pad_value),
            "output_dims": None if self.output_dims is None else [list(axes) for axes in self.output_dims],
            "cuda": None if self.cuda is None else self.cuda.to_dict(),
        }
        if self.batching is not None:  # only when set: artifacts without it stay readable by older loaders
            out["batching"] = self.batching.to_dict()
        return out

    def to_json(self) -> str:
        return json.dumps(self.to_dict(), indent=2, sort_keys=False) + "\n"


# --- parsing ---------------------------------------------------------------------------------
#
# ``parse_manifest`` reads as the list of the manifest's sections; each section has its own parser,
# named for it, that checks its types, ranges and its references to the sections before it, and
# returns that section's dataclass. Every failure is an ArtifactError naming the field.

TOP_KEYS = (
    "format", "format_version", "name", "torch_version", "precompile_version", "created",
    "target", "inputs", "dims", "output", "variants", "constants", "files", "check", "version", "expires",
    "policy", "pad_value", "output_dims", "cuda", "batching",
)  # fmt: skip
OPTIONAL_KEYS = ("check", "version", "expires", "policy", "pad_value", "output_dims", "cuda", "batching")


def parse_manifest(data: bytes | str, source: str = C.MANIFEST_FILE) -> Manifest:
    """Parse and validate manifest bytes; raise ArtifactError naming the first problem."""
    r = _Reader(source)
    raw = _parse_document(r, data)
    header = _parse_header(r, raw)
    dims = _parse_dims(r, raw["dims"])
    inputs = _parse_inputs(r, raw["inputs"], dims)
    output = _parse_output(r, raw["output"], "output", depth=0)
    files = _parse_files(r, raw["files"])
    constants = _parse_constants(r, raw["constants"])
    variants = _parse_variants(r, raw["variants"], dims=dims, files=files, constants=constants)
    output_dims = _parse_output_dims(r, raw.get("output_dims"), dims=dims, output=output)
    policy = _parse_policy(r, raw.get("policy"), dims=dims, output_dims=output_dims)
    pad_value = _parse_pad_value(r, raw.get("pad_value"), inputs=inputs, policy=policy)
    return Manifest(
        name=header.name,
        torch_version=header.torch_version,
        precompile_version=header.precompile_version,
        created=header.created,
        target=_parse_target(r, raw["target"]),
        inputs=inputs,
        dims=dims,
        output=output,
        variants=variants,
        constants=constants,
        files=files,
        check=_parse_check(r, raw.get("check"), variants=variants, dims=dims),
        version=header.version,
        expires=header.expires,
        policy=policy,
        pad_value=pad_value,
        output_dims=output_dims,
        cuda=_parse_cuda(r, raw.get("cuda"), variants=variants),
        batching=_parse_batching(r, raw.get("batching"), dims=dims, inputs=inputs, output_dims=output_dims),
    )


class _Reader:
    """Typed accessors that raise ArtifactError with the key path of the offending value."""

    def __init__(self, source: str):
        self.source = source

    def fail(self, where: str, what: str) -> ArtifactError:
        return ArtifactError(f"{self.source}: {where}: {what}")

    def obj(self, value: Any, where: str, keys: Iterable[str], optional: Iterable[str] = ()) -> dict:
        """``value`` as an object holding every one of ``keys`` but the ``optional`` ones, and no other."""
        if not isinstance(value, dict):
            raise self.fail(where, f"expected an object, got {_kind(value)}")
        missing = set(keys) - set(optional) - value.keys()
        if missing:
            raise self.fail(where, f"missing key(s) {sorted(missing)}")
        unknown = value.keys() - set(keys)
        if unknown:
            raise self.fail(where, f"unknown key(s) {sorted(unknown)}")
        return value

    def mapping(self, value: Any, where: str) -> dict:
        """``value`` as an object of any keys (each checked by the caller)."""
        if not isinstance(value, dict):
            raise self.fail(where, f"expected an object, got {_kind(value)}")
        return value

    def str(self, value: Any, where: str, pattern: re.Pattern | None = None, choices=None) -> str:
        if not isinstance(value, str):
            raise self.fail(where, f"expected a string, got {_kind(value)}")
        if len(value) > 4096:
            raise self.fail(where, "string is longer than 4096 characters")
        if pattern is not None and not pattern.match(value):
            raise self.fail(where, f"{value!r} does not match {pattern.pattern}")
        if choices is not None and value not in choices:
            raise self.fail(where, f"{value!r} is not one of {list(choices)}")
        return value

    def int(self, value: Any, where: str, lo: int = 0, hi: int = MAX_INT) -> int:
        if isinstance(value, bool) or not isinstance(value, int):
            raise self.fail(where, f"expected an integer, got {_kind(value)}")
        if not lo <= value <= hi:
            raise self.fail(where, f"{value} is outside [{lo}, {hi}]")
        return value

    def number(self, value: Any, where: str, *, lo: float = -1e300, infinite: bool = False) -> float:
        """A finite number not below ``lo`` (``infinite``: +inf allowed too), as a float. NaN and
        infinities are refused: a pad value of NaN would poison every padded row."""
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise self.fail(where, f"expected a finite number, got {_kind(value)}")
        if value == float("inf") and infinite:
            return float(value)
        if value != value or abs(value) > 1e300:
            raise self.fail(where, f"expected a finite number, got {value!r}")
        if value < lo:
            raise self.fail(where, f"{value!r} is below {lo:g}")
        return float(value)

    def bool(self, value: Any, where: str) -> bool:
        if not isinstance(value, bool):
            raise self.fail(where, f"expected true or false, got {_kind(value)}")
        return value

    def list(self, value: Any, where: str, max_len: int = 100_000) -> list:
        if not isinstance(value, list):
            raise self.fail(where, f"expected a list, got {_kind(value)}")
        if len(value) > max_len:
            raise self.fail(where, f"list has {len(value)} items, more than {max_len}")
        return value

    def strs(self, value: Any, where: str, max_len: int = 100_000, pattern: re.Pattern | None = None) -> tuple:
        """A list of strings, as a tuple of them."""
        return tuple(self.str(s, f"{where}[{i}]", pattern) for i, s in enumerate(self.list(value, where, max_len)))

    def sizes(self, value: Any, where: str, dims: dict[str, DimRange] | None) -> dict[str, int]:
        """An object of dim name to size; each name one of ``dims`` (when given)."""
        out = {}
        for name, size in self.mapping(value, where).items():
            if dims is not None and name not in dims:
                raise self.fail(f"{where}.{name}", "not a dim of this artifact")
            out[name] = self.int(size, f"{where}.{name}")
        return out

    def dim_range(self, value: Any, where: str, lo: int = 0) -> DimRange:
        """``[min, max]``; ``lo`` is the smallest value allowed (negative for value ranges)."""
        pair = self.list(value, where, max_len=2)
        if len(pair) != 2:
            raise self.fail(where, "expected [min, max]")
        lo, hi = self.int(pair[0], f"{where}[0]", lo), self.int(pair[1], f"{where}[1]", lo)
        if lo > hi:
            raise self.fail(where, f"min {lo} > max {hi}")
        return DimRange(lo, hi)


def _kind(value: Any) -> str:
    return {dict: "an object", list: "a list", str: "a string", bool: "a boolean", type(None): "null"}.get(
        type(value), type(value).__name__
    )


def _parse_document(r: _Reader, data: bytes | str) -> dict[str, Any]:
    """The bytes as a JSON object of the known top-level keys, in this loader's format and version.
    A file of another format is refused before anything of it is echoed."""
    if len(data) > C.MAX_MANIFEST_BYTES:
        raise ArtifactError(f"{r.source}: {len(data)} bytes, more than the {C.MAX_MANIFEST_BYTES} allowed")
    try:
        raw = json.loads(data)
    except (ValueError, RecursionError) as e:
        raise ArtifactError(f"{r.source}: not valid JSON ({e})") from None
    if isinstance(raw, dict) and raw.get("format") != C.FORMAT_NAME:
        raise r.fail("format", f"not {C.FORMAT_NAME!r}: this is not a precompile artifact's manifest")
    raw = r.obj(raw, "manifest", TOP_KEYS, optional=OPTIONAL_KEYS)
    version = r.int(raw["format_version"], "format_version", 0, MAX_INT)
    if version != C.FORMAT_VERSION:
        raise r.fail(
            "format_version",
            f"version {version} is not supported by this loader (it reads version {C.FORMAT_VERSION}); "
            "rebuild the artifact with a matching precompile or upgrade the loader",
        )
    return raw


@dataclass(frozen=True)
class _Header:
    """The manifest's top-level scalars: what the artifact is, what built it, its release."""

    name: str
    torch_version: str
    precompile_version: str
    created: str
    version: int
    expires: str | None


def _parse_header(r: _Reader, raw: dict[str, Any]) -> _Header:
    """``name``, ``torch_version``, ``precompile_version``, ``created``, ``version``, ``expires``."""
    return _Header(
        name=r.str(raw["name"], "name", NAME_RE),
        torch_version=r.str(raw["torch_version"], "torch_version"),
        precompile_version=r.str(raw["precompile_version"], "precompile_version"),
        created=r.str(raw["created"], "created"),
        version=r.int(raw.get("version", 1), "version", 1),
        expires=_parse_expires(r, raw.get("expires")),
    )


def expires_problem(text: str) -> str | None:
    """Why ``text`` is not a valid ``expires`` (an ISO 8601 date-time with a time zone), or None."""
    try:
        moment = datetime.datetime.fromisoformat(text)
    except ValueError:
        return f"{text!r} is not an ISO 8601 date-time"
    if moment.tzinfo is None:
        return f"{text!r} needs a time zone (e.g. 2027-01-01T00:00:00+00:00)"
    return None


def _parse_expires(r: _Reader, value: Any) -> str | None:
    if value is None:
        return None
    text = r.str(value, "expires")
    problem = expires_problem(text)
    if problem is not None:
        raise r.fail("expires", problem)
    return text


def _parse_target(r: _Reader, value: Any) -> Target:
    """``target``: the device and host the artifact was built on."""
    t = r.obj(value, "target", ("device", "cpu_capability", "aoti_cpu_isa", "platform", "machine"))
    return Target(
        device=r.str(t["device"], "target.device", choices=C.DEVICES),
        cpu_capability=r.str(t["cpu_capability"], "target.cpu_capability"),
        aoti_cpu_isa=r.str(t["aoti_cpu_isa"], "target.aoti_cpu_isa"),
        platform=r.str(t["platform"], "target.platform"),
        machine=r.str(t["machine"], "target.machine"),
    )


def _parse_dims(r: _Reader, value: Any) -> dict[str, DimRange]:
    """``dims``: each named dim's ``{min, max}``, the range the artifact serves."""
    dims: dict[str, DimRange] = {}
    for name, rng in r.mapping(value, "dims").items():
        r.str(name, f"dims.{name}", IDENT_RE)
        d = r.obj(rng, f"dims.{name}", ("min", "max"))
        dims[name] = r.dim_range([d["min"], d["max"]], f"dims.{name}")
    return dims


def _parse_inputs(r: _Reader, value: Any, dims: dict[str, DimRange]) -> tuple[InputSpec, ...]:
    """``inputs``: name, dtype, shape (dim names or sizes) and, for integer inputs, a value range."""
    inputs = []
    for i, item in enumerate(r.list(value, "inputs", max_len=1024)):
        where = f"inputs[{i}]"
        d = r.obj(item, where, ("name", "dtype", "shape", "range"), optional=("range",))
        name = r.str(d["name"], f"{where}.name", IDENT_RE)
        shape: list[str | int] = []
        for j, s in enumerate(r.list(d["shape"], f"{where}.shape", max_len=64)):
            if isinstance(s, str):
                if s not in dims:
                    raise r.fail(f"{where}.shape[{j}]", f"unknown dim {s!r}")
                shape.append(s)
            else:
                shape.append(r.int(s, f"{where}.shape[{j}]"))
        dtype = r.str(d["dtype"], f"{where}.dtype", choices=C.DTYPES)
        values = None
        if d.get("range") is not None:
            if dtype not in C.INTEGER_DTYPES:
                raise r.fail(f"{where}.range", f"a value range is for integer inputs, this one is {dtype}")
            values = r.dim_range(d["range"], f"{where}.range", lo=-MAX_INT)
        inputs.append(InputSpec(name, dtype, tuple(shape), values))
    if len({i.name for i in inputs}) != len(inputs):
        raise r.fail("inputs", "input names are not unique")
    return tuple(inputs)


def _parse_output(r: _Reader, value: Any, where: str, depth: int) -> OutputSpec:
    """``output``: the structure forward() returns, nested at most 32 levels."""
    if depth > 32:
        raise r.fail(where, "output structure is nested more than 32 levels")
    if not isinstance(value, dict):
        raise r.fail(where, f"expected an object, got {_kind(value)}")
    kind = r.str(value.get("kind"), f"{where}.kind", choices=("tensor", "tuple", "list", "dict"))
    if kind == "tensor":
        r.obj(value, where, ("kind",))
        return OutputSpec("tensor")
    r.obj(value, where, ("kind", "items", "keys") if kind == "dict" else ("kind", "items"))
    items = tuple(
        _parse_output(r, item, f"{where}.items[{i}]", depth + 1)
        for i, item in enumerate(r.list(value["items"], f"{where}.items", max_len=4096))
    )
    keys: tuple[str, ...] = ()
    if kind == "dict":
        keys = r.strs(value["keys"], f"{where}.keys")
        if len(keys) != len(items) or len(set(keys)) != len(keys):
            raise r.fail(f"{where}.keys", "need one unique key per item")
    return OutputSpec(kind, items, keys)


def _parse_files(r: _Reader, value: Any) -> dict[str, FileEntry]:
    """``files``: every file of the artifact with its size and sha256, at a safe relative path."""
    files: dict[str, FileEntry] = {}
    for path, entry in r.mapping(value, "files").items():
        check_member_path(path, f"{r.source}: files")
        e = r.obj(entry, f"files.{path}", ("size", "sha256"))
        files[path] = FileEntry(
            size=r.int(e["size"], f"files.{path}.size"), sha256=r.str(e["sha256"], f"files.{path}.sha256", SHA256_RE)
        )
    if C.WEIGHTS_FILE not in files:
        raise r.fail("files", f"{C.WEIGHTS_FILE} is not listed")
    return files


def _parse_constants(r: _Reader, value: Any) -> dict[str, ConstantSpec]:
    """``constants``: dtype and shape of each tensor in weights.safetensors."""
    constants: dict[str, ConstantSpec] = {}
    for cname, spec in r.mapping(value, "constants").items():
        where = f"constants.{cname}"
        c = r.obj(spec, where, ("dtype", "shape"))
        cshape = tuple(r.int(s, f"{where}.shape[{j}]") for j, s in enumerate(r.list(c["shape"], f"{where}.shape", 64)))
        constants[cname] = ConstantSpec(r.str(c["dtype"], f"{where}.dtype", choices=C.DTYPES), cshape)
    return constants


VARIANT_KEYS = (
    "id", "kind", "file", "dims", "hint", "constants", "device", "dtype", "constant_prefix", "embedded_constants",
    "needs_torch", "shim", "not_standalone", "warm", "first_calls_of",
)  # fmt: skip
# At most this many warm-up shapes per variant (the profile's plan.warm_shapes allows 64).
MAX_WARM_SHAPES = 64
PRECISION_KEYS = ("precision", "cpu_features", "gate", "isa")
CPU_FEATURE_RE = re.compile(r"^[a-z0-9_]{1,32}$")
ISA_RE = re.compile(r"^[a-z0-9][a-z0-9_-]{0,31}$")


def _parse_variants(
    r: _Reader,
    value: Any,
    *,
    dims: dict[str, DimRange],
    files: dict[str, FileEntry],
    constants: dict[str, ConstantSpec],
) -> tuple[Variant, ...]:
    """``variants``: at least one, with unique ids (each checked by ``_parse_variant``)."""
    variants = tuple(
        _parse_variant(r, item, f"variants[{i}]", dims=dims, files=files, constants=constants)
        for i, item in enumerate(r.list(value, "variants", max_len=4096))
    )
    if not variants:
        raise r.fail("variants", "the artifact has no variants")
    if len({v.id for v in variants}) != len(variants):
        raise r.fail("variants", "variant ids are not unique")
    _check_first_calls(r, variants)
    return variants


def _check_first_calls(r: _Reader, variants: tuple[Variant, ...]) -> None:
    """A variant serving another's first calls (``first_calls_of``) names a dynamic variant that serves
    calls itself, the only one that does so for it, with the same ranges, device, dtype and precision."""
    by_id = {v.id: v for v in variants}
    taken: set[str] = set()
    for i, v in enumerate(variants):
        if v.first_calls_of is None:
            continue
        where = f"variants[{i}].first_calls_of"
        of = by_id.get(v.first_calls_of)
        if of is None or of is v or of.first_calls_of is not None:
            raise r.fail(where, f"{v.first_calls_of!r} is not another variant that serves calls itself")
        if of.id in taken:
            raise r.fail(where, f"variant {of.id!r} has its first calls served by two variants")
        taken.add(of.id)
        same = (v.kind, v.dims, v.device, v.dtype, v.precision) == (of.kind, of.dims, of.device, of.dtype, of.precision)
        if v.kind != "dynamic" or not same:
            raise r.fail(where, f"must be dynamic with {of.id!r}'s ranges, device, dtype and precision")


def _parse_variant(
    r: _Reader,
    item: Any,
    where: str,
    *,
    dims: dict[str, DimRange],
    files: dict[str, FileEntry],
    constants: dict[str, ConstantSpec],
) -> Variant:
    """One variant: its file among ``files``, a range within the artifact's for every dim (one size
    for a static variant), a hint size per dim, its constants declared in ``constants``."""
    v = r.obj(item, where, (*VARIANT_KEYS, *PRECISION_KEYS), optional=(*VARIANT_KEYS[6:], *PRECISION_KEYS))
    vid = r.str(v["id"], f"{where}.id", VARIANT_ID_RE)
    kind = r.str(v["kind"], f"{where}.kind", choices=C.VARIANT_KINDS)
    file = r.str(v["file"], f"{where}.file")
    if file not in files:
        raise r.fail(f"{where}.file", f"{file!r} is not listed in files")
    vdims = _parse_variant_dims(r, v["dims"], f"{where}.dims", dims=dims, static=kind == "static")
    hint_raw = v["hint"]
    if not isinstance(hint_raw, dict) or set(hint_raw) != set(dims):
        raise r.fail(f"{where}.hint", f"must give a size for exactly the dims {sorted(dims)}")
    hint = r.sizes(hint_raw, f"{where}.hint", dims)
    consts = r.strs(v["constants"], f"{where}.constants")
    device = r.str(v.get("device", "cpu"), f"{where}.device", choices=C.DEVICES)
    vdtype = None if v.get("dtype") is None else r.str(v["dtype"], f"{where}.dtype", choices=C.DTYPES)
    prefix = r.str(v.get("constant_prefix", ""), f"{where}.constant_prefix")
    embedded = r.bool(v.get("embedded_constants", False), f"{where}.embedded_constants")
    if embedded and consts:
        raise r.fail(f"{where}.constants", "a variant with embedded_constants takes none from weights.safetensors")
    for c in consts:
        if prefix + c not in constants:
            raise r.fail(f"{where}.constants", f"{prefix + c!r} is not declared in constants")
    precision, features, gate, isa = _parse_precision(r, v, where, device)
    needs_torch = None if v.get("needs_torch") is None else r.str(v["needs_torch"], f"{where}.needs_torch")
    shim = None if v.get("shim") is None else r.str(v["shim"], f"{where}.shim")
    if shim is not None and (shim not in files or device != "cpu"):
        raise r.fail(
            f"{where}.shim", f"{shim!r} is not listed in files" if device == "cpu" else "only a CPU variant has one"
        )
    not_standalone = None if v.get("not_standalone") is None else r.str(v["not_standalone"], f"{where}.not_standalone")
    warm = _parse_warm(r, v.get("warm", []), f"{where}.warm", vdims, static=kind == "static")
    first_calls_of = (
        None
        if v.get("first_calls_of") is None
        else r.str(v["first_calls_of"], f"{where}.first_calls_of", VARIANT_ID_RE)
    )
    return Variant(
        vid,
        kind,
        file,
        vdims,
        hint,
        consts,
        device,
        vdtype,
        prefix,
        embedded,
        precision,
        features,
        gate,
        isa,
        needs_torch,
        shim,
        not_standalone,
        warm,
        first_calls_of,
    )


def _parse_warm(
    r: _Reader, value: Any, where: str, vdims: dict[str, DimRange], *, static: bool
) -> tuple[dict[str, int], ...]:
    """A dynamic variant's ``warm`` shapes: each a size for exactly its dims, inside its ranges."""
    items = r.list(value, where, max_len=MAX_WARM_SHAPES)
    if items and static:
        raise r.fail(where, "a static variant has one shape, its hint; warm is for dynamic variants")
    out = []
    for i, item in enumerate(items):
        at = f"{where}[{i}]"
        if not isinstance(item, dict) or set(item) != set(vdims):
            raise r.fail(at, f"must give a size for exactly the dims {sorted(vdims)}")
        sizes = r.sizes(item, at, vdims)
        for name, n in sizes.items():
            if n not in vdims[name]:
                raise r.fail(f"{at}.{name}", f"{n} is outside the variant's range {vdims[name]}")
        out.append(sizes)
    return tuple(out)


def _parse_variant_dims(
    r: _Reader, value: Any, where: str, *, dims: dict[str, DimRange], static: bool
) -> dict[str, DimRange]:
    """A variant's ``dims``: a range for exactly the artifact's dims, within each one's range."""
    if not isinstance(value, dict) or set(value) != set(dims):
        raise r.fail(where, f"must give a range for exactly the dims {sorted(dims)}")
    vdims = {}
    for name, rng in value.items():
        vr = r.dim_range(rng, f"{where}.{name}")
        if vr.min < dims[name].min or vr.max > dims[name].max:
            raise r.fail(f"{where}.{name}", f"{vr} is outside the artifact's range {dims[name]}")
        if static and vr.min != vr.max:
            raise r.fail(f"{where}.{name}", "a static variant needs min == max")
        vdims[name] = vr
    return vdims


def _parse_precision(
    r: _Reader, v: dict, where: str, device: str
) -> tuple[str, tuple[str, ...], dict[str, Any] | None, str | None]:
    """A variant's precision, the CPU features it needs, its gate record (fp32 variants have none) and
    the ISA level it was compiled for (None: the build host's own)."""
    precision = r.str(v.get("precision", "fp32"), f"{where}.precision", choices=C.PRECISIONS)
    isa = None if v.get("isa") is None else r.str(v["isa"], f"{where}.isa", ISA_RE)
    if isa is not None and device != "cpu":
        raise r.fail(f"{where}.isa", f"an ISA level is for CPU variants, this one is for {device}")
    if precision == "fp32":
        if (v.get("cpu_features") and isa is None) or v.get("gate") is not None:
            raise r.fail(where, "an fp32 variant has no cpu_features or gate")
    elif device != "cpu":
        raise r.fail(f"{where}.precision", f"{precision} variants are CPU variants, this one is for {device}")
    if isa is not None and not v.get("cpu_features"):
        raise r.fail(f"{where}.cpu_features", f"a variant compiled for {isa} lists the CPU features it needs")
    features = r.strs(v.get("cpu_features", []), f"{where}.cpu_features", max_len=64, pattern=CPU_FEATURE_RE)
    gate = None if v.get("gate") is None else r.mapping(v["gate"], f"{where}.gate")
    return precision, features, gate, isa


CHECK_KEYS = ("shapes", "max_abs_error", "references", "measure", "plan", "tuning", "precision")


def _parse_check(
    r: _Reader, value: Any, *, variants: tuple[Variant, ...] | None, dims: dict[str, DimRange] | None
) -> CheckRecord:
    """``check``: what the build checked and measured (see ``CheckRecord``); every key optional. With
    ``variants`` and ``dims`` (a whole manifest), references name its variants and dims."""
    if value is None:
        return CheckRecord()
    c = r.obj(value, "check", CHECK_KEYS, optional=CHECK_KEYS)
    ids = None if variants is None else {v.id for v in variants}
    return CheckRecord(
        shapes=r.int(c.get("shapes", 0), "check.shapes"),
        max_abs_error=r.number(c.get("max_abs_error", 0.0), "check.max_abs_error", lo=0.0, infinite=True),
        references=tuple(
            _parse_reference(r, item, f"check.references[{i}]", ids=ids, dims=dims)
            for i, item in enumerate(r.list(c.get("references", []), "check.references", max_len=4096))
        ),
        measure=tuple(
            _parse_measurement(r, item, f"check.measure[{i}]")
            for i, item in enumerate(r.list(c.get("measure", []), "check.measure", max_len=4096))
        ),
        plan=None if c.get("plan") is None else r.mapping(c["plan"], "check.plan"),
        tuning=_records(r, c.get("tuning", []), "check.tuning"),
        precision=_records(r, c.get("precision", []), "check.precision"),
    )


def _records(r: _Reader, value: Any, where: str) -> tuple[dict[str, Any], ...]:
    """A list of JSON objects kept as written (records people read; the loader acts on none)."""
    return tuple(r.mapping(item, f"{where}[{i}]") for i, item in enumerate(r.list(value, where, max_len=4096)))


MEASUREMENT_KEYS = ("variant", "dims", "static_ms", "dynamic_ms", "against", "speedup", "kept")


def _parse_measurement(r: _Reader, value: Any, where: str) -> Measurement:
    """One ``check.measure`` entry (its variant may be one the build then dropped)."""
    m = r.obj(value, where, MEASUREMENT_KEYS)
    return Measurement(
        variant=r.str(m["variant"], f"{where}.variant", VARIANT_ID_RE),
        dims=r.sizes(m["dims"], f"{where}.dims", None),
        static_ms=r.number(m["static_ms"], f"{where}.static_ms", lo=0.0),
        dynamic_ms=r.number(m["dynamic_ms"], f"{where}.dynamic_ms", lo=0.0),
        against=r.str(m["against"], f"{where}.against", VARIANT_ID_RE),
        speedup=r.number(m["speedup"], f"{where}.speedup", lo=0.0, infinite=True),
        kept=r.bool(m["kept"], f"{where}.kept"),
    )


REFERENCE_KEYS = ("variant", "dims", "inputs", "outputs", "device", "tolerance", "accuracy")


def _parse_reference(
    r: _Reader, value: Any, where: str, *, ids: set[str] | None, dims: dict[str, DimRange] | None
) -> Reference:
    """One ``check.references`` entry: a variant of the artifact, tensor names, and one tolerance
    (and, for a lower precision, one accuracy rule) per output."""
    e = r.obj(value, where, REFERENCE_KEYS, optional=("device", "accuracy"))
    variant = r.str(e["variant"], f"{where}.variant", VARIANT_ID_RE)
    if ids is not None and variant not in ids:
        raise r.fail(f"{where}.variant", f"{variant!r} is not a variant of this artifact")
    outputs = r.strs(e["outputs"], f"{where}.outputs", max_len=4096)
    tolerance = []
    for j, pair in enumerate(r.list(e["tolerance"], f"{where}.tolerance", max_len=4096)):
        pair = r.list(pair, f"{where}.tolerance[{j}]", max_len=2)
        if len(pair) != 2:
            raise r.fail(f"{where}.tolerance[{j}]", "expected [atol, rtol]")
        tolerance.append(tuple(r.number(x, f"{where}.tolerance[{j}][{k}]", lo=0.0) for k, x in enumerate(pair)))
    if len(tolerance) != len(outputs):
        raise r.fail(f"{where}.tolerance", f"{len(tolerance)} entries for {len(outputs)} outputs")
    accuracy = None
    if e.get("accuracy") is not None:
        accuracy = tuple(
            _parse_accuracy(r, rule, f"{where}.accuracy[{j}]")
            for j, rule in enumerate(r.list(e["accuracy"], f"{where}.accuracy", max_len=4096))
        )
        if len(accuracy) != len(outputs):
            raise r.fail(f"{where}.accuracy", f"{len(accuracy)} entries for {len(outputs)} outputs")
    return Reference(
        variant=variant,
        dims=r.sizes(e["dims"], f"{where}.dims", dims),
        inputs=r.strs(e["inputs"], f"{where}.inputs", max_len=1024),
        outputs=outputs,
        tolerance=tuple(tolerance),
        device=r.str(e.get("device", "cpu"), f"{where}.device", choices=C.DEVICES),
        accuracy=accuracy,
    )


# The values each metric's build_value can take (cosine of two rows, a share of rows, an error).
BUILD_VALUE_RANGES = {"cosine": (-1.0, 1.0), "top1": (0.0, 1.0), "max_abs": (0.0, 1e300)}


def _parse_accuracy(r: _Reader, value: Any, where: str) -> AccuracyRecord:
    a = r.obj(value, where, ("metric", "threshold", "build_value"), optional=("build_value",))
    metric = r.str(a["metric"], f"{where}.metric", IDENT_RE)
    built = None
    if a.get("build_value") is not None:
        if metric not in BUILD_VALUE_RANGES:
            raise r.fail(
                f"{where}.build_value", f"metric {metric!r} has no build value (only {', '.join(BUILD_VALUE_RANGES)})"
            )
        lo, hi = BUILD_VALUE_RANGES[metric]
        built = r.number(a["build_value"], f"{where}.build_value", lo=lo - 1e-9)  # a cosine's rounding
        if built > hi + 1e-9:
            raise r.fail(f"{where}.build_value", f"{built!r} is above {hi:g}, the most a {metric} can be")
    return AccuracyRecord(metric, r.number(a["threshold"], f"{where}.threshold"), built)


def _parse_output_dims(
    r: _Reader, value: Any, *, dims: dict[str, DimRange], output: OutputSpec
) -> tuple[tuple[str | None, ...], ...] | None:
    """``output_dims``: per flat output, per axis, the dim it follows (null: fixed)."""
    if value is None:
        return None
    flat = r.list(value, "output_dims", max_len=4096)
    if len(flat) != output.count():
        raise r.fail("output_dims", f"{len(flat)} entries for {output.count()} outputs")
    rows = []
    for i, axes in enumerate(flat):
        row = []
        for j, a in enumerate(r.list(axes, f"output_dims[{i}]", max_len=64)):
            if a is not None and (not isinstance(a, str) or a not in dims):
                raise r.fail(f"output_dims[{i}][{j}]", f"{a!r} is not a dim of this artifact")
            row.append(a)
        rows.append(tuple(row))
    return tuple(rows)


def _parse_policy(
    r: _Reader, value: Any, *, dims: dict[str, DimRange], output_dims: tuple[tuple[str | None, ...], ...] | None
) -> dict[str, str]:
    """``policy``: per dim, what a size outside every variant gets; pad and split need the outputs'
    axes (``output_dims``), split an axis following the dim in every output."""
    policy = {}
    for dim, what in r.mapping(value if value is not None else {}, "policy").items():
        if dim not in dims:
            raise r.fail(f"policy.{dim}", "not a dim of this artifact")
        policy[dim] = r.str(what, f"policy.{dim}", choices=POLICIES)
        if policy[dim] == "split" and (output_dims is None or any(dim not in axes for axes in output_dims)):
            raise r.fail(f"policy.{dim}", "split needs output_dims to give every output an axis that follows it")
        if policy[dim] == "pad" and output_dims is None:
            raise r.fail(f"policy.{dim}", "pad needs output_dims")
    return policy


def _parse_pad_value(
    r: _Reader, value: Any, *, inputs: tuple[InputSpec, ...], policy: dict[str, str]
) -> dict[str, float]:
    """``pad_value``: per input, what a pad policy fills it with; for a ranged input it must lie in
    the range, or padding would feed the compiled code an index the guard refuses from callers."""
    names = {i.name for i in inputs}
    pad_value = {}
    for name, number in r.mapping(value if value is not None else {}, "pad_value").items():
        if name not in names:
            raise r.fail(f"pad_value.{name}", "not an input of this artifact")
        pad_value[name] = r.number(number, f"pad_value.{name}")
    padded = {d for d, p in policy.items() if p == "pad"}
    for spec in inputs:
        if spec.range is None or not padded.intersection(s for s in spec.shape if isinstance(s, str)):
            continue
        fill = pad_value.get(spec.name, 0.0)
        if fill not in spec.range:
            raise r.fail(f"pad_value.{spec.name}", f"{fill:g} is outside the input's value range {spec.range}")
    return pad_value


def _parse_cuda(r: _Reader, value: Any, *, variants: tuple[Variant, ...]) -> CudaInfo | None:
    """``cuda``: what the CUDA variants were built on and for; needed when there are any."""
    if value is None:
        if any(v.device == "cuda" for v in variants):
            raise r.fail("cuda", "the artifact has CUDA variants but no cuda section")
        return None
    cu = r.obj(
        value,
        "cuda",
        ("torch_cuda", "capability", "archs", "multi_arch", "cuda_graphs", "device_name", "kernels"),
        optional=("kernels",),
    )
    return CudaInfo(
        torch_cuda=r.str(cu["torch_cuda"], "cuda.torch_cuda"),
        capability=r.str(cu["capability"], "cuda.capability", CAPABILITY_RE),
        archs=r.strs(cu["archs"], "cuda.archs", 64, CAPABILITY_RE),
        multi_arch=r.bool(cu["multi_arch"], "cuda.multi_arch"),
        cuda_graphs=r.bool(cu["cuda_graphs"], "cuda.cuda_graphs"),
        device_name=r.str(cu["device_name"], "cuda.device_name"),
        kernels=r.strs(cu.get("kernels", []), "cuda.kernels", 64, CODE_OBJECT_RE),
    )


def _parse_batching(
    r: _Reader,
    value: Any,
    *,
    dims: dict[str, DimRange],
    inputs: tuple[InputSpec, ...],
    output_dims: tuple[tuple[str | None, ...], ...] | None,
) -> Batching | None:
    """The ``batching`` section: the batch dim on exactly one axis of every input and every output,
    padded dims that exist, a finite pad value for every input holding one (within its value range)."""
    if value is None:
        return None
    b = r.obj(value, "batching", ("dim", "pad", "pad_value", "checked"))
    dim = r.str(b["dim"], "batching.dim")
    if dim not in dims:
        raise r.fail("batching.dim", f"{dim!r} is not a dim of this artifact")
    for spec in inputs:
        if sum(s == dim for s in spec.shape) != 1:
            raise r.fail("batching.dim", f"input {spec.name!r} does not have {dim!r} on exactly one axis")
    if output_dims is None:
        raise r.fail("batching", "needs output_dims")
    for i, axes in enumerate(output_dims):
        if sum(a == dim for a in axes) != 1:
            raise r.fail("batching.dim", f"output {i} does not follow {dim!r} on exactly one axis")
    pad = r.strs(b["pad"], "batching.pad", max_len=64)
    for i, d in enumerate(pad):
        if d not in dims or d == dim or d in pad[:i]:
            raise r.fail(f"batching.pad[{i}]", f"{d!r} is not a dim of this artifact other than the batch dim, once")
    raw_values = r.mapping(b["pad_value"], "batching.pad_value")
    padded = {spec.name: spec for spec in inputs if set(pad).intersection(s for s in spec.shape if isinstance(s, str))}
    if set(raw_values) != set(padded):
        raise r.fail("batching.pad_value", f"must give a value for exactly the inputs {sorted(padded)}")
    pad_value = {}
    for name, v in raw_values.items():
        pad_value[name] = r.number(v, f"batching.pad_value.{name}")
        if padded[name].range is not None and v not in padded[name].range:
            raise r.fail(f"batching.pad_value.{name}", f"{v:g} is outside the input's value range {padded[name].range}")
    return Batching(dim, pad, pad_value, r.mapping(b["checked"], "batching.checked"))


def check_member_path(path: str, where: str) -> None:
    """Refuse paths that could leave the artifact folder: absolute, '..', backslashes, empty parts."""
    parts = path.split("/") if isinstance(path, str) else []
    if (
        not parts
        or len(path) > 255
        or path.startswith("/")
        or "\\" in path
        or "\x00" in path
        or any(p in ("", ".", "..") for p in parts)
    ):
        raise ArtifactError(f"{where}: unsafe file path {path!r}")
