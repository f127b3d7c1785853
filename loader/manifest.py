"""The manifest: schema, strict parsing and serialization.

The manifest is untrusted input on the serving side, so it is parsed by hand into frozen dataclasses
with every type, range and cross-reference checked; anything unexpected raises ``ArtifactError``
naming the key (``manifest.json: variants[0].dims.seq: ...``). The build side creates the same
dataclasses and calls ``Manifest.to_json()``, so writer and reader cannot drift apart.
"""

from __future__ import annotations

import datetime
import json
import re
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

    def names(self) -> list[str]:
        """One name per flat output, in order: ``output`` for a lone tensor, else the path of keys
        and indices (``logits``, ``output.0``, ``hidden.1``)."""
        if self.kind == "tensor":
            return ["output"]
        names: list[str] = []

        def walk(s: OutputSpec, path: list[str]) -> None:
            if s.kind == "tensor":
                names.append(".".join(path))
                return
            keys = list(s.keys) if s.kind == "dict" else [str(i) for i in range(len(s.items))]
            for key, item in zip(keys, s.items):
                walk(item, path + [key])

        walk(self, [] if self.kind == "dict" else ["output"])
        return names

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

    def to_dict(self) -> dict[str, Any]:
        return {
            "torch_cuda": self.torch_cuda,
            "capability": self.capability,
            "archs": list(self.archs),
            "multi_arch": self.multi_arch,
            "cuda_graphs": self.cuda_graphs,
            "device_name": self.device_name,
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
class Target:
    device: str
    cpu_capability: str  # what torch.backends.cpu.get_cpu_capability() said on the build host
    aoti_cpu_isa: str  # what AOTInductor recorded in the package metadata
    platform: str
    machine: str


@dataclass(frozen=True)
class Manifest:
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
    check: dict[str, Any] = field(default_factory=dict)
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
            "check": self.check,
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


class _Reader:
    """Typed accessors that raise ArtifactError with the key path of the offending value."""

    def __init__(self, source: str):
        self.source = source

    def fail(self, where: str, what: str) -> ArtifactError:
        return ArtifactError(f"{self.source}: {where}: {what}")

    def obj(self, value: Any, where: str, keys: set[str], optional: set[str] = frozenset()) -> dict:
        if not isinstance(value, dict):
            raise self.fail(where, f"expected an object, got {_kind(value)}")
        missing = keys - optional - value.keys()
        if missing:
            raise self.fail(where, f"missing key(s) {sorted(missing)}")
        unknown = value.keys() - keys
        if unknown:
            raise self.fail(where, f"unknown key(s) {sorted(unknown)}")
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


def parse_manifest(data: bytes | str, source: str = C.MANIFEST_FILE) -> Manifest:
    """Parse and validate manifest bytes; raise ArtifactError naming the first problem."""
    r = _Reader(source)
    if len(data) > C.MAX_MANIFEST_BYTES:
        raise ArtifactError(f"{source}: {len(data)} bytes, more than the {C.MAX_MANIFEST_BYTES} allowed")
    try:
        raw = json.loads(data)
    except (ValueError, RecursionError) as e:
        raise ArtifactError(f"{source}: not valid JSON ({e})") from None
    top_keys = {
        "format", "format_version", "name", "torch_version", "precompile_version", "created",
        "target", "inputs", "dims", "output", "variants", "constants", "files", "check", "version", "expires",
        "policy", "pad_value", "output_dims", "cuda", "batching",
    }
    if isinstance(raw, dict) and raw.get("format") != C.FORMAT_NAME:
        raise r.fail("format", f"not {C.FORMAT_NAME!r}: this is not a precompile artifact's manifest")  # never echo the file
    raw = r.obj(raw, "manifest", top_keys, optional={"check", "version", "expires", "policy", "pad_value", "output_dims", "cuda", "batching"})
    version = r.int(raw["format_version"], "format_version", 0, MAX_INT)
    if version != C.FORMAT_VERSION:
        raise r.fail(
            "format_version",
            f"version {version} is not supported by this loader (it reads version {C.FORMAT_VERSION}); "
            "rebuild the artifact with a matching precompile or upgrade the loader",
        )

    t = r.obj(raw["target"], "target", {"device", "cpu_capability", "aoti_cpu_isa", "platform", "machine"})
    target = Target(
        device=r.str(t["device"], "target.device", choices=C.DEVICES),
        cpu_capability=r.str(t["cpu_capability"], "target.cpu_capability"),
        aoti_cpu_isa=r.str(t["aoti_cpu_isa"], "target.aoti_cpu_isa"),
        platform=r.str(t["platform"], "target.platform"),
        machine=r.str(t["machine"], "target.machine"),
    )

    dims_raw = r.obj(raw["dims"], "dims", set(raw["dims"]) if isinstance(raw["dims"], dict) else set())
    dims: dict[str, DimRange] = {}
    for name, value in dims_raw.items():
        r.str(name, f"dims.{name}", IDENT_RE)
        d = r.obj(value, f"dims.{name}", {"min", "max"})
        dims[name] = r.dim_range([d["min"], d["max"]], f"dims.{name}")

    inputs = _parse_inputs(r, raw["inputs"], dims)

    output = _parse_output(r, raw["output"], "output", depth=0)

    files: dict[str, FileEntry] = {}
    files_raw = raw["files"]
    if not isinstance(files_raw, dict):
        raise r.fail("files", f"expected an object, got {_kind(files_raw)}")
    for path, entry in files_raw.items():
        check_member_path(path, f"{source}: files")
        e = r.obj(entry, f"files.{path}", {"size", "sha256"})
        files[path] = FileEntry(
            size=r.int(e["size"], f"files.{path}.size"), sha256=r.str(e["sha256"], f"files.{path}.sha256", SHA256_RE)
        )
    if C.WEIGHTS_FILE not in files:
        raise r.fail("files", f"{C.WEIGHTS_FILE} is not listed")

    constants: dict[str, ConstantSpec] = {}
    consts_raw = raw["constants"]
    if not isinstance(consts_raw, dict):
        raise r.fail("constants", f"expected an object, got {_kind(consts_raw)}")
    for cname, spec in consts_raw.items():
        where = f"constants.{cname}"
        c = r.obj(spec, where, {"dtype", "shape"})
        cshape = tuple(r.int(s, f"{where}.shape[{j}]") for j, s in enumerate(r.list(c["shape"], f"{where}.shape", 64)))
        constants[cname] = ConstantSpec(r.str(c["dtype"], f"{where}.dtype", choices=C.DTYPES), cshape)

    variants = []
    for i, item in enumerate(r.list(raw["variants"], "variants", max_len=4096)):
        where = f"variants[{i}]"
        v = r.obj(
            item,
            where,
            {"id", "kind", "file", "dims", "hint", "constants", "device", "dtype", "constant_prefix", "embedded_constants", *PRECISION_KEYS},
            optional={"device", "dtype", "constant_prefix", "embedded_constants", *PRECISION_KEYS},
        )
        vid = r.str(v["id"], f"{where}.id", VARIANT_ID_RE)
        kind = r.str(v["kind"], f"{where}.kind", choices=C.VARIANT_KINDS)
        file = r.str(v["file"], f"{where}.file")
        if file not in files:
            raise r.fail(f"{where}.file", f"{file!r} is not listed in files")
        vdims_raw = v["dims"]
        if not isinstance(vdims_raw, dict) or set(vdims_raw) != set(dims):
            raise r.fail(f"{where}.dims", f"must give a range for exactly the dims {sorted(dims)}")
        vdims = {}
        for name, rng in vdims_raw.items():
            vr = r.dim_range(rng, f"{where}.dims.{name}")
            if vr.min < dims[name].min or vr.max > dims[name].max:
                raise r.fail(f"{where}.dims.{name}", f"{vr} is outside the artifact's range {dims[name]}")
            if kind == "static" and vr.min != vr.max:
                raise r.fail(f"{where}.dims.{name}", "a static variant needs min == max")
            vdims[name] = vr
        hint_raw = v["hint"]
        if not isinstance(hint_raw, dict) or set(hint_raw) != set(dims):
            raise r.fail(f"{where}.hint", f"must give a size for exactly the dims {sorted(dims)}")
        hint = {name: r.int(size, f"{where}.hint.{name}") for name, size in hint_raw.items()}
        consts = tuple(r.str(c, f"{where}.constants[{j}]") for j, c in enumerate(r.list(v["constants"], f"{where}.constants")))
        device = r.str(v.get("device", "cpu"), f"{where}.device", choices=C.DEVICES)
        vdtype = None if v.get("dtype") is None else r.str(v["dtype"], f"{where}.dtype", choices=C.DTYPES)
        prefix = r.str(v.get("constant_prefix", ""), f"{where}.constant_prefix")
        embedded = r.bool(v.get("embedded_constants", False), f"{where}.embedded_constants")
        if embedded and consts:
            raise r.fail(f"{where}.constants", "a variant with embedded_constants takes none from weights.safetensors")
        for c in consts:
            if prefix + c not in constants:
                raise r.fail(f"{where}.constants", f"{prefix + c!r} is not declared in constants")
        precision, features, gate = _parse_precision(r, v, where, device)
        variants.append(Variant(vid, kind, file, vdims, hint, consts, device, vdtype, prefix, embedded, precision, features, gate))
    if not variants:
        raise r.fail("variants", "the artifact has no variants")
    if len({v.id for v in variants}) != len(variants):
        raise r.fail("variants", "variant ids are not unique")

    check = raw.get("check", {})
    if not isinstance(check, dict):
        raise r.fail("check", f"expected an object, got {_kind(check)}")

    policy = {}
    policy_raw = raw.get("policy", {})
    if not isinstance(policy_raw, dict):
        raise r.fail("policy", f"expected an object, got {_kind(policy_raw)}")
    for dim, what in policy_raw.items():
        if dim not in dims:
            raise r.fail(f"policy.{dim}", "not a dim of this artifact")
        policy[dim] = r.str(what, f"policy.{dim}", choices=POLICIES)
    pad_value = {}
    pad_raw = raw.get("pad_value", {})
    if not isinstance(pad_raw, dict):
        raise r.fail("pad_value", f"expected an object, got {_kind(pad_raw)}")
    input_names = {i.name for i in inputs}
    for name, value in pad_raw.items():
        if name not in input_names:
            raise r.fail(f"pad_value.{name}", "not an input of this artifact")
        if isinstance(value, bool) or not isinstance(value, (int, float)) or value != value or abs(value) > 1e300:
            raise r.fail(f"pad_value.{name}", f"expected a finite number, got {value!r}")
        pad_value[name] = float(value)
    output_dims = None
    if raw.get("output_dims") is not None:
        flat = r.list(raw["output_dims"], "output_dims", max_len=4096)
        if len(flat) != output.count():
            raise r.fail("output_dims", f"{len(flat)} entries for {output.count()} outputs")
        output_dims = []
        for i, axes in enumerate(flat):
            row = []
            for j, a in enumerate(r.list(axes, f"output_dims[{i}]", max_len=64)):
                if a is not None and (not isinstance(a, str) or a not in dims):
                    raise r.fail(f"output_dims[{i}][{j}]", f"{a!r} is not a dim of this artifact")
                row.append(a)
            output_dims.append(tuple(row))
        output_dims = tuple(output_dims)
    for dim, what in policy.items():
        if what == "split" and (output_dims is None or any(dim not in axes for axes in output_dims)):
            raise r.fail(f"policy.{dim}", "split needs output_dims to give every output an axis that follows it")
        if what == "pad" and output_dims is None:
            raise r.fail(f"policy.{dim}", "pad needs output_dims")
    _check_pad_values(r, inputs, policy, pad_value)

    cuda = None
    if raw.get("cuda") is not None:
        cu = r.obj(raw["cuda"], "cuda", {"torch_cuda", "capability", "archs", "multi_arch", "cuda_graphs", "device_name"})
        cuda = CudaInfo(
            torch_cuda=r.str(cu["torch_cuda"], "cuda.torch_cuda"),
            capability=r.str(cu["capability"], "cuda.capability", CAPABILITY_RE),
            archs=tuple(r.str(a, f"cuda.archs[{i}]", CAPABILITY_RE) for i, a in enumerate(r.list(cu["archs"], "cuda.archs", 64))),
            multi_arch=r.bool(cu["multi_arch"], "cuda.multi_arch"),
            cuda_graphs=r.bool(cu["cuda_graphs"], "cuda.cuda_graphs"),
            device_name=r.str(cu["device_name"], "cuda.device_name"),
        )
    if cuda is None and any(v.device == "cuda" for v in variants):
        raise r.fail("cuda", "the artifact has CUDA variants but no cuda section")

    return Manifest(
        name=r.str(raw["name"], "name", NAME_RE),
        torch_version=r.str(raw["torch_version"], "torch_version"),
        precompile_version=r.str(raw["precompile_version"], "precompile_version"),
        created=r.str(raw["created"], "created"),
        target=target,
        inputs=inputs,
        dims=dims,
        output=output,
        variants=tuple(variants),
        constants=constants,
        files=files,
        check=check,
        version=r.int(raw.get("version", 1), "version", 1),
        expires=_expires(r, raw.get("expires")),
        policy=policy,
        pad_value=pad_value,
        output_dims=output_dims,
        cuda=cuda,
        batching=_parse_batching(r, raw.get("batching"), dims, inputs, output_dims),
    )


def _parse_inputs(r: _Reader, value: Any, dims: dict[str, DimRange]) -> tuple[InputSpec, ...]:
    inputs = []
    for i, item in enumerate(r.list(value, "inputs", max_len=1024)):
        where = f"inputs[{i}]"
        d = r.obj(item, where, {"name", "dtype", "shape", "range"}, optional={"range"})
        name = r.str(d["name"], f"{where}.name", IDENT_RE)
        shape = []
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


def _parse_batching(
    r: _Reader, value: Any, dims: dict[str, DimRange], inputs: tuple[InputSpec, ...], output_dims
) -> Batching | None:
    """The ``batching`` section: the batch dim on exactly one axis of every input and every output,
    padded dims that exist, a finite pad value for every input holding one (within its value range)."""
    if value is None:
        return None
    b = r.obj(value, "batching", {"dim", "pad", "pad_value", "checked"})
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
    pad = tuple(r.str(d, f"batching.pad[{i}]") for i, d in enumerate(r.list(b["pad"], "batching.pad", max_len=64)))
    for i, d in enumerate(pad):
        if d not in dims or d == dim or d in pad[:i]:
            raise r.fail(f"batching.pad[{i}]", f"{d!r} is not a dim of this artifact other than the batch dim, once")
    raw_values = b["pad_value"]
    if not isinstance(raw_values, dict):
        raise r.fail("batching.pad_value", f"expected an object, got {_kind(raw_values)}")
    padded = {spec.name: spec for spec in inputs if set(pad).intersection(s for s in spec.shape if isinstance(s, str))}
    if set(raw_values) != set(padded):
        raise r.fail("batching.pad_value", f"must give a value for exactly the inputs {sorted(padded)}")
    pad_value = {}
    for name, v in raw_values.items():
        if isinstance(v, bool) or not isinstance(v, (int, float)) or v != v or abs(v) > 1e300:
            raise r.fail(f"batching.pad_value.{name}", f"expected a finite number, got {_kind(v)}")
        if padded[name].range is not None and v not in padded[name].range:
            raise r.fail(f"batching.pad_value.{name}", f"{v:g} is outside the input's value range {padded[name].range}")
        pad_value[name] = float(v)
    checked = b["checked"]
    if not isinstance(checked, dict):
        raise r.fail("batching.checked", f"expected an object, got {_kind(checked)}")
    return Batching(dim, pad, pad_value, checked)


PRECISION_KEYS = ("precision", "cpu_features", "gate")
CPU_FEATURE_RE = re.compile(r"^[a-z0-9_]{1,32}$")


def _parse_precision(r: _Reader, v: dict, where: str, device: str) -> tuple[str, tuple[str, ...], dict[str, Any] | None]:
    """A variant's precision, the CPU features it needs and its gate record (fp32 variants have none)."""
    precision = r.str(v.get("precision", "fp32"), f"{where}.precision", choices=C.PRECISIONS)
    if precision == "fp32":
        if v.get("cpu_features") or v.get("gate") is not None:
            raise r.fail(where, "an fp32 variant has no cpu_features or gate")
        return precision, (), None
    if device != "cpu":
        raise r.fail(f"{where}.precision", f"{precision} variants are CPU variants, this one is for {device}")
    features = tuple(
        r.str(f, f"{where}.cpu_features[{j}]", CPU_FEATURE_RE)
        for j, f in enumerate(r.list(v.get("cpu_features", []), f"{where}.cpu_features", max_len=32))
    )
    gate = v.get("gate")
    if gate is not None and not isinstance(gate, dict):
        raise r.fail(f"{where}.gate", f"expected an object, got {_kind(gate)}")
    return precision, features, gate


def _check_pad_values(r: _Reader, inputs: tuple[InputSpec, ...], policy: dict[str, str], pad_value: dict[str, float]) -> None:
    """A pad policy fills an input with its pad value: for a ranged input it must lie in the range,
    or padding would feed the compiled code an index the guard refuses from callers."""
    padded = {d for d, p in policy.items() if p == "pad"}
    for spec in inputs:
        if spec.range is None or not padded.intersection(s for s in spec.shape if isinstance(s, str)):
            continue
        value = pad_value.get(spec.name, 0.0)
        if value not in spec.range:
            raise r.fail(f"pad_value.{spec.name}", f"{value:g} is outside the input's value range {spec.range}")


def expires_problem(text: str) -> str | None:
    """Why ``text`` is not a valid ``expires`` (an ISO 8601 date-time with a time zone), or None."""
    try:
        moment = datetime.datetime.fromisoformat(text)
    except ValueError:
        return f"{text!r} is not an ISO 8601 date-time"
    if moment.tzinfo is None:
        return f"{text!r} needs a time zone (e.g. 2027-01-01T00:00:00+00:00)"
    return None


def _expires(r: _Reader, value: Any) -> str | None:
    if value is None:
        return None
    text = r.str(value, "expires")
    problem = expires_problem(text)
    if problem is not None:
        raise r.fail("expires", problem)
    return text


def _parse_output(r: _Reader, value: Any, where: str, depth: int) -> OutputSpec:
    if depth > 32:
        raise r.fail(where, "output structure is nested more than 32 levels")
    if not isinstance(value, dict):
        raise r.fail(where, f"expected an object, got {_kind(value)}")
    kind = r.str(value.get("kind"), f"{where}.kind", choices=("tensor", "tuple", "list", "dict"))
    if kind == "tensor":
        r.obj(value, where, {"kind"})
        return OutputSpec("tensor")
    keys_expected = {"kind", "items", "keys"} if kind == "dict" else {"kind", "items"}
    r.obj(value, where, keys_expected)
    items = tuple(
        _parse_output(r, item, f"{where}.items[{i}]", depth + 1)
        for i, item in enumerate(r.list(value["items"], f"{where}.items", max_len=4096))
    )
    keys: tuple[str, ...] = ()
    if kind == "dict":
        keys = tuple(r.str(k, f"{where}.keys[{i}]") for i, k in enumerate(r.list(value["keys"], f"{where}.keys")))
        if len(keys) != len(items) or len(set(keys)) != len(keys):
            raise r.fail(f"{where}.keys", "need one unique key per item")
    return OutputSpec(kind, items, keys)


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
