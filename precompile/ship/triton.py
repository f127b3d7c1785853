"""Export artifacts as a Triton Inference Server model repository (``precompile export triton``).

    models = export_triton(["artifacts/tagger"], "triton-repo")      # one Model per artifact

Per model name (the manifest's ``name``) the repository gets a ``config.pbtxt`` derived from the
manifest, the Python-backend ``model.py`` (``precompile/ship/triton_model.py``, copied as it is) and a
version folder per artifact (its manifest ``version``) holding the artifact, copied or symlinked:

    REPO/tiny-tagger/config.pbtxt
    REPO/tiny-tagger/1/model.py
    REPO/tiny-tagger/1/artifact/...

Inputs and outputs take ``-1`` for dynamic dims. ``max_batch_size`` is the batch dim's largest size
when ``loader.serving.batch_plan`` finds one that is axis 0 of every input and output (Triton batches on
axis 0 only), with ``dynamic_batching`` preferring the static variants' batch sizes; otherwise 0
and the batch dim stays in the dims. Output dtypes and fixed sizes come from one call at the
smallest shape, so the artifact must load on this host. Anything Triton cannot describe is refused
before anything is written; the repository appears whole or not at all.

The trust and precision options (``LoadOptions``: trusted keys, minimum version, the rollback
ledger, hash checks, precision) are applied twice: at export, so that an artifact the policy refuses
is never written, and by ``model.py`` in Triton, which reads them from ``config.pbtxt`` parameters
``load.<keyword>`` (JSON values, passed to ``loader.load`` as they are), so that an artifact
replaced in the repository later is refused there too: that model is UNAVAILABLE, the others serve.
Trusted keys are written as their OpenSSH text (public keys), so the repository needs no key files.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import tempfile
from collections.abc import Iterable
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path

import loader
from loader.manifest import Manifest
from loader.outputs import flatten, output_names
from loader.precision import REQUESTS
from loader.serving.batch_plan import batch_plan
from loader.threads import wait_env
from loader.trust import public_keys

from ..errors import PrecompileError

MODEL_FILE = Path(__file__).with_name("triton_model.py")  # copied as each version's model.py
ARTIFACT_NAME = "artifact"  # the artifact's name inside a version folder (packs keep their suffixes)
NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.-]*")
LOAD_PARAMETER = "load."  # config.pbtxt parameters load.<keyword>: loader.load's keyword arguments, JSON

DATA_TYPES = {
    "bool": "TYPE_BOOL",
    "uint8": "TYPE_UINT8",
    "int8": "TYPE_INT8",
    "int16": "TYPE_INT16",
    "int32": "TYPE_INT32",
    "int64": "TYPE_INT64",
    "float16": "TYPE_FP16",
    "float32": "TYPE_FP32",
    "float64": "TYPE_FP64",
}  # bfloat16 has no numpy type, so the Python backend cannot hand it over as an array


class TritonExportError(PrecompileError):
    """An artifact Triton cannot describe, or a repository that cannot be written."""


@dataclass(frozen=True)
class LoadOptions:
    """What ``model.py`` passes to ``loader.load()`` in Triton: ``precompile serve``'s trust and
    precision options (``--trusted-key``, ``--min-version``, ``--refuse-rollback``, ``--no-verify``,
    ``--precision``). Build one with ``LoadOptions.of``, which reads and checks the keys."""

    trusted_keys: tuple[str, ...] | None = None  # OpenSSH text of each Ed25519 public key
    min_version: int | None = None
    refuse_rollback: bool = False  # the ledger of $PRECOMPILE_STATE in Triton's environment
    verify: bool = True
    precision: str = "auto"

    @classmethod
    def of(
        cls,
        *,
        trusted_keys: Iterable[str | os.PathLike] = (),
        min_version: int | None = None,
        refuse_rollback: bool = False,
        verify: bool = True,
        precision: str = "auto",
    ) -> LoadOptions:
        """The options, keys read from their files (PEM or OpenSSH); TritonExportError when they
        contradict each other."""
        keys = list(trusted_keys)
        if keys and not verify:
            raise TritonExportError(
                "--no-verify skips the sha256 checks a signature relies on; drop it or --trusted-key"
            )
        if precision not in REQUESTS:
            raise TritonExportError(f"--precision {precision}: expected one of {', '.join(REQUESTS)}")
        return cls(
            trusted_keys=tuple(_openssh(k.raw) for k in public_keys(keys)) if keys else None,
            min_version=min_version,
            refuse_rollback=refuse_rollback,
            verify=verify,
            precision=precision,
        )

    def kwargs(self) -> dict:
        """loader.load's keyword arguments."""
        options = asdict(self)
        options["trusted_keys"] = list(self.trusted_keys) if self.trusted_keys is not None else None
        return options

    def parameters(self) -> dict[str, str]:
        """config.pbtxt's parameters: ``load.<keyword>`` and its value as JSON."""
        return {LOAD_PARAMETER + k: json.dumps(v) for k, v in self.kwargs().items()}


@dataclass(frozen=True)
class TensorConfig:
    name: str
    data_type: str  # TYPE_FP32, ...
    dims: tuple[int, ...]  # without the batch dim when the model batches; -1: any size; (): none


@dataclass(frozen=True)
class ModelConfig:
    """What ``config.pbtxt`` says about one model (``to_pbtxt`` writes it)."""

    name: str
    max_batch_size: int  # 0: Triton does not batch (``unbatched`` says why)
    inputs: tuple[TensorConfig, ...]
    outputs: tuple[TensorConfig, ...]
    preferred_batch_sizes: tuple[int, ...] = ()
    instances: int = 1
    max_queue_delay_us: int = 2000
    unbatched: str = ""
    versions: tuple[int, ...] = ()
    load: LoadOptions = field(default_factory=LoadOptions)

    def to_pbtxt(self) -> str:
        lines = [
            "# Written by `precompile export triton`: the artifact's manifest in Triton's words.",
            f"name: {_quote(self.name)}",
            'backend: "python"',
            f"max_batch_size: {self.max_batch_size}",
        ]
        if self.unbatched:
            lines.append(f"# not batched by Triton: {self.unbatched}")
        lines += _tensors("input", self.inputs) + _tensors("output", self.outputs)
        if self.max_batch_size > 0:
            preferred = ", ".join(str(n) for n in self.preferred_batch_sizes)
            lines.append("dynamic_batching {")
            if preferred:
                lines.append(f"  preferred_batch_size: [ {preferred} ]")
            lines += [f"  max_queue_delay_microseconds: {self.max_queue_delay_us}", "}"]
        lines.append(f"instance_group [ {{ kind: KIND_CPU, count: {self.instances} }} ]")
        lines.append("# loader.load()'s keyword arguments in model.py (JSON values): the trust policy")
        parameters = list(self.load.parameters().items())
        lines.append("parameters [")
        for i, (key, value) in enumerate(parameters):
            comma = "," if i < len(parameters) - 1 else ""
            lines.append(f"  {{ key: {_quote(key)}, value: {{ string_value: {_quote(value)} }} }}{comma}")
        lines.append("]")
        if len(self.versions) > 1:
            versions = ", ".join(str(v) for v in self.versions)
            lines.append(f"version_policy: {{ specific: {{ versions: [ {versions} ] }} }}")
        return "\n".join(lines) + "\n"


@dataclass(frozen=True)
class Model:
    """One model written into the repository: its config and its version folders."""

    config: ModelConfig
    folder: Path
    versions: tuple[Path, ...]


def describe(
    artifact: str | os.PathLike,
    *,
    instances: int = 1,
    max_queue_delay_us: int = 2000,
    load: LoadOptions | None = None,
) -> ModelConfig:
    """The Triton config of one artifact (loaded here with ``load``'s policy, minus the rollback
    ledger, which only the serving host keeps: its outputs are found by one call)."""
    load = load or LoadOptions()
    model = loader.load(artifact, **{**load.kwargs(), "refuse_rollback": False})
    m = model.manifest
    where = f"{artifact}"
    if not NAME.fullmatch(m.name):
        raise TritonExportError(f"{where}: name {m.name!r} is not a Triton model name (letters, digits, '_', '.', '-')")
    for spec in m.inputs:  # before the probe call, which could not make such an input
        _data_type(where, f"input {spec.name!r}", spec.dtype)
    plan = batch_plan(model)
    probe = _probe(model)
    batch, unbatched = plan.batch_dim, plan.why
    if batch is not None and (
        any(plan.input_axis(i) for i in range(len(m.inputs))) or any(plan.output_axis(k) for k in range(len(probe)))
    ):
        batch, unbatched = None, f"{plan.batch_dim!r} is not axis 0 of every input and output"
    if batch is not None and any(t.dim() == 0 for t in probe):
        batch, unbatched = None, "an output has no axes, so no batch axis"
    inputs = tuple(
        TensorConfig(
            spec.name,
            _data_type(where, f"input {spec.name!r}", spec.dtype),
            _dims(where, f"input {spec.name!r}", m, spec.shape, batch),
        )
        for spec in m.inputs
    )
    # Without output_dims an output's axes may follow any dim, unless every dim but the batch dim is fixed.
    fixed = batch is not None and all(r.min == r.max for d, r in m.dims.items() if d != batch)
    outputs = []
    for k, (name, t) in enumerate(zip(output_names(m.output), probe)):
        axes = m.output_dims[k] if m.output_dims is not None else (None,) * t.dim()
        shape = tuple(
            d if d is not None else (size if m.output_dims is not None or fixed else "?")
            for d, size in zip(axes, t.shape)
        )
        if m.output_dims is None and batch is not None:
            shape = (batch,) + shape[1:]
        dtype = str(t.dtype).removeprefix("torch.")
        outputs.append(
            TensorConfig(
                name, _data_type(where, f"output {name!r}", dtype), _dims(where, f"output {name!r}", m, shape, batch)
            )
        )
    preferred: tuple[int, ...] = ()
    if batch is not None:
        top = m.dims[batch].max
        preferred = tuple(sorted({n for sizes in plan.statics.values() for n in sizes if 1 < n <= top}))
    return ModelConfig(
        name=m.name,
        max_batch_size=m.dims[batch].max if batch is not None else 0,
        inputs=inputs,
        outputs=tuple(outputs),
        preferred_batch_sizes=preferred,
        instances=instances,
        max_queue_delay_us=max_queue_delay_us,
        unbatched=unbatched if batch is None else "",
        versions=(m.version,),
        load=load,
    )


def export_triton(
    artifacts: Iterable[str | os.PathLike],
    repo: str | os.PathLike,
    *,
    link: bool = False,
    instances: int = 1,
    max_queue_delay_us: int = 2000,
    load: LoadOptions | None = None,
) -> list[Model]:
    """Write a Triton model repository at ``repo`` (absent or empty) serving ``artifacts``: one model
    per manifest name, one version folder per artifact. ``link`` symlinks each artifact instead of
    copying it; ``load`` is the trust policy applied here and by model.py. Raises TritonExportError
    (or the loader's UntrustedArtifactError), with nothing written, for anything Triton cannot or
    must not serve."""
    repo = Path(repo)
    if repo.exists() and (not repo.is_dir() or any(repo.iterdir())):
        raise TritonExportError(f"{repo}: exists and is not an empty folder; give a new or empty one")
    if instances < 1:
        raise TritonExportError(f"--instances {instances}: give 1 or more")
    grouped: dict[str, list[tuple[Path, ModelConfig]]] = {}
    for artifact in artifacts:
        path = Path(artifact)
        config = describe(path, instances=instances, max_queue_delay_us=max_queue_delay_us, load=load)
        grouped.setdefault(config.name, []).append((path, config))
    if not grouped:
        raise TritonExportError("no artifact given")
    configs = {name: _one_config(name, entries) for name, entries in grouped.items()}
    repo.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=f".{repo.name}.staging-", dir=repo.parent))
    try:
        models = [_write_model(staging, configs[name], entries, link=link) for name, entries in grouped.items()]
        if repo.exists():
            repo.rmdir()  # empty, checked above
        staging.rename(repo)
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)
        raise
    return [
        Model(m.config, repo / m.folder.name, tuple(repo / m.folder.name / v.name for v in m.versions)) for m in models
    ]


def _one_config(name: str, entries: list[tuple[Path, ModelConfig]]) -> ModelConfig:
    """One config for all versions of a model: they must describe the same tensors."""
    first_path, first = entries[0]
    seen: dict[int, Path] = {}
    for path, config in entries:
        version = config.versions[0]
        if version in seen:
            raise TritonExportError(
                f"{path}: {name!r} version {version} is also {seen[version]}; give each version once"
            )
        seen[version] = path
        if config.load.refuse_rollback and len(entries) > 1:
            raise TritonExportError(
                f"{path}: {name!r} has {len(entries)} versions and --refuse-rollback would refuse all but the newest "
                "in Triton (which loads them side by side); export one version or drop --refuse-rollback"
            )
        if (config.inputs, config.outputs, config.max_batch_size) != (
            first.inputs,
            first.outputs,
            first.max_batch_size,
        ):
            raise TritonExportError(
                f"{path}: {name!r} version {version} has other inputs, outputs or batch size than {first_path}; export them as separate models"
            )
    return replace(first, versions=tuple(sorted(seen)))


def _write_model(staging: Path, config: ModelConfig, entries: list[tuple[Path, ModelConfig]], *, link: bool) -> Model:
    folder = staging / config.name
    folder.mkdir()
    (folder / "config.pbtxt").write_text(config.to_pbtxt())
    versions = []
    for path, entry in entries:
        version = folder / str(entry.versions[0])
        version.mkdir()
        shutil.copyfile(MODEL_FILE, version / "model.py")
        target = version / (ARTIFACT_NAME + "".join(path.suffixes) if path.is_file() else ARTIFACT_NAME)
        if link:
            target.symlink_to(path.resolve(), target_is_directory=path.is_dir())
        elif path.is_dir():
            shutil.copytree(path, target)
        else:
            shutil.copyfile(path, target)
        versions.append(version)
    return Model(config, folder, tuple(versions))


def _probe(model) -> list:
    """The flat outputs of one call at every dim's smallest size (integer inputs at their range's
    lowest value, booleans true): their dtypes and fixed sizes are what the config says of them."""
    import torch

    m: Manifest = model.manifest
    sizes = {d: r.min for d, r in m.dims.items()}
    tensors = []
    for spec in m.inputs:
        shape = [s if isinstance(s, int) else sizes[s] for s in spec.shape]
        dtype = getattr(torch, spec.dtype)
        fill = spec.range.min if spec.range is not None else (True if spec.dtype == "bool" else 0)
        tensors.append(torch.full(shape, fill, dtype=dtype))
    try:
        return flatten(model(*tensors))
    except loader.GuardError as e:
        raise TritonExportError(
            f"{model.path}: a call at the smallest shape {sizes} was refused ({e}); its outputs cannot be described"
        ) from None


def _data_type(where: str, what: str, dtype: str) -> str:
    if dtype not in DATA_TYPES:
        raise TritonExportError(
            f"{where}: {what}: dtype {dtype} has no Triton Python-backend type (supported: {', '.join(DATA_TYPES)})"
        )
    return DATA_TYPES[dtype]


def _dims(where: str, what: str, m: Manifest, shape: tuple, batch: str | None) -> tuple[int, ...]:
    """Triton dims of ``shape`` (ints and dim names; ``"?"``: unknown): -1 for a dim whose size may
    change, its size for a fixed one, the batch dim (axis 0) left out when Triton batches."""
    if batch is not None:
        shape = shape[1:]
    dims = []
    for axis, s in enumerate(shape):
        if s == "?":
            dims.append(-1)
        elif isinstance(s, str):
            r = m.dims[s]
            dims.append(r.min if r.min == r.max else -1)
        elif s >= 1:
            dims.append(s)
        else:
            raise TritonExportError(
                f"{where}: {what}: axis {axis} has size {s}; Triton dims are sizes of 1 or more, or -1"
            )
    return tuple(dims)


def _tensors(kind: str, tensors: tuple[TensorConfig, ...]) -> list[str]:
    lines = [f"{kind} ["]
    for i, t in enumerate(tensors):
        comma = "," if i < len(tensors) - 1 else ""
        # No axis (besides the batch dim): Triton wants one, so [1] on the wire, reshaped to none for the model.
        shape = f"dims: [ {', '.join(str(d) for d in t.dims)} ]" if t.dims else "dims: [ 1 ], reshape: { shape: [ ] }"
        lines.append(f"  {{ name: {_quote(t.name)}, data_type: {t.data_type}, {shape} }}{comma}")
    return lines + ["]"]


def _quote(text: str) -> str:
    return '"' + text.replace("\\", "\\\\").replace('"', '\\"').replace("\n", "\\n") + '"'


def _openssh(raw: bytes) -> str:
    """An Ed25519 public key's OpenSSH text (one line: fits a config.pbtxt string as it is)."""
    from cryptography.hazmat.primitives import serialization
    from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PublicKey

    return (
        Ed25519PublicKey.from_public_bytes(raw)
        .public_bytes(serialization.Encoding.OpenSSH, serialization.PublicFormat.OpenSSH)
        .decode()
    )


def tritonserver_command(
    repo: str | os.PathLike,
    *,
    server: str | os.PathLike,
    stub_site: str | os.PathLike | None = None,
    http_port: int,
    grpc_port: int,
    options: Iterable[str] = (),
) -> tuple[list[str], dict[str, str]]:
    """The command line and environment that run ``tritonserver`` (under ``server``: its ``bin/``
    and ``backends/``, as scripts/fetch-triton unpacks them) on loopback over ``repo``, with the
    Python backend's stub able to import ``loader`` as this interpreter does: this Python's
    libpython on LD_LIBRARY_PATH, and PYTHONPATH (which model.py adds to sys.path) holding a numpy
    < 2 first (``stub_site``), then this project and this environment's site-packages. ``options``
    are further tritonserver flags."""
    import sysconfig

    server = Path(server)
    project = Path(__file__).resolve().parents[2]
    path = [str(stub_site)] if stub_site is not None else []
    path += [str(project), sysconfig.get_paths()["purelib"]]
    env = dict(
        os.environ,
        **wait_env({k: v for k, v in os.environ.items() if k not in ("OMP_WAIT_POLICY", "GOMP_SPINCOUNT")}),
        LD_LIBRARY_PATH=os.pathsep.join(
            filter(None, [sysconfig.get_config_var("LIBDIR"), os.environ.get("LD_LIBRARY_PATH")])
        ),
        PYTHONPATH=os.pathsep.join(path),
    )
    command = [
        str(server / "bin" / "tritonserver"), "--model-repository", str(repo),
        "--backend-directory", str(server / "backends"),
        "--http-address", "127.0.0.1", "--http-port", str(http_port),
        "--grpc-address", "127.0.0.1", "--grpc-port", str(grpc_port),
        *options,
    ]  # fmt: skip
    return command, env
