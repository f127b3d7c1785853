"""The build cache: a variant whose compile would be the same as one compiled before is copied from
the cache instead of compiled again (``precompile build --cache DIR``, ``build(..., cache=DIR)`` or
``$PRECOMPILE_BUILD_CACHE``; off unless asked for).

A compile takes seconds to minutes, most of it AOTInductor and the C++ compiler, and a CI that
rebuilds a model whose code and weights did not change (new traffic moved one hot shape, say) would
pay it again for every variant. The cache is keyed on everything the compiled code depends on:

- the exported program as Inductor gets it: its graph (ops, arguments, every value's shape, strides,
  dtype and device), signature, calling convention and ranges, and every weight and constant's
  bytes (SHA-256). File names and line numbers in the graph's metadata are not part of it, so a
  model's copy in another folder hits;
- the options of the compile (each custom pass by its ``uuid()``) and Inductor's global config, as
  Inductor's own cache keys them (``save_config_portable``);
- the device and target: the x86-64 level asked for, the CPU's model and capabilities and the
  thread count (the convolution prepacking probes oneDNN at it), or the GPU's name and compute
  capability, and whether PTX is emitted;
- the toolchain: torch's version and sources (Inductor's ``torch_key``), precompile's own sources,
  the C++ compiler's version.

Builds sharing a cache compile each key once: a build about to compile a key holds its lock
(``flock`` on ``<key>.lock``), and another build wanting the same key waits for it, then copies its
entry (parallel CI jobs on one host, compile workers, a test suite's processes). A program holding
anything but plain tensors (a script object, torchao's int8 weight tensors) is not cached: it
compiles as without a cache. An entry is written under a temporary name and renamed into place, so
concurrent builds never see half of one; an entry whose files do not match their recorded digests
is ignored and written again. What comes from the cache is checked against eager like any
compile. Entries are not evicted: delete the folder (or old entries in it) to reclaim space; an
entry holds the variant's code and its weights.
"""

from __future__ import annotations

import contextlib
import fcntl
import functools
import hashlib
import json
import os
import platform
import shutil
import subprocess
import tempfile
import warnings
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch

from .errors import PrecompileError

ENV = "PRECOMPILE_BUILD_CACHE"
PACKAGE = "variant.pt2"
CONSTANTS = "constants.pt"
RECORD = "record.json"
FORMAT = 1  # an entry's layout; bumped when it changes


def cache_folder(given: str | os.PathLike | None) -> Path | None:
    """The cache to use: ``given``, else ``$PRECOMPILE_BUILD_CACHE``, else none. Created if missing;
    a path that is a file or cannot be written is the user's error, said in one line."""
    chosen = given if given not in (None, "") else os.environ.get(ENV) or None
    if chosen is None:
        return None
    folder = Path(chosen).expanduser()
    where = f"the build cache {folder}" + ("" if given not in (None, "") else f" (from ${ENV})")
    if folder.exists() and not folder.is_dir():
        raise PrecompileError(f"{where} is a file, not a folder: give a folder for the cache, or unset it")
    try:
        folder.mkdir(parents=True, exist_ok=True)
        probe = tempfile.NamedTemporaryFile(dir=folder, prefix=".probe-")
        probe.close()
    except OSError as e:
        raise PrecompileError(f"{where} cannot be written ({e.strerror or e}): give a folder you can write") from None
    return folder.resolve()


def compile_key(ep: torch.export.ExportedProgram, configs: dict[str, Any], target: dict[str, Any]) -> str | None:
    """The key of the compile of ``ep`` under ``configs`` for ``target`` (device, ISA, PTX); None
    when something in it has no stable identity (then the variant is compiled and not cached)."""
    h = hashlib.sha256()

    def put(*parts: Any) -> None:
        for part in parts:
            h.update(str(part).encode())
            h.update(b"\0")

    try:
        put("format", FORMAT, json.dumps(target, sort_keys=True), *_toolchain())
        for name, value in sorted(configs.items()):
            put("option", name, _identity(value))
        put("inductor", json.dumps(_inductor_config(), sort_keys=True, default=_identity))
        put(
            "code",
            ep.graph_module.code,
            ep.graph_signature,
            ep.call_spec,
            sorted(map(str, ep.range_constraints.items())),
        )
        for node in ep.graph.nodes:
            put("node", node.name, _value(node.meta.get("val")))
        tensors = {**dict(ep.state_dict), **{f"constant:{k}": v for k, v in ep.constants.items()}}
        for name in sorted(tensors):
            put("tensor", name, _tensor_digest(tensors[name]))
    except _Uncacheable:
        return None
    except Exception as e:  # the cache only saves time: a value it cannot hash must not fail the build
        warnings.warn(
            f"precompile: the build cache is not used for this variant, its key failed "
            f"({type(e).__name__}: {e}); it is compiled",
            stacklevel=2,
        )
        return None
    return h.hexdigest()


@contextlib.contextmanager
def claimed(folder: Path, key: str) -> Iterator[None]:
    """Hold the lock of ``key``: another build of the same key waits here until this one has looked
    it up and written it. Where the file system has no locks, builds go on without one."""
    path = folder / key[:2] / f"{key}.lock"
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        handle = open(path, "a")
    except OSError:
        yield
        return
    with handle:
        try:
            fcntl.flock(handle, fcntl.LOCK_EX)
        except OSError:
            pass
        yield  # closing the file releases the lock, as does the process dying


def lookup(folder: Path, key: str, out: Path) -> tuple[dict[str, torch.Tensor], bool] | None:
    """Copy the entry ``key``'s package to ``out``; return its constants and whether they are embedded
    in the package. None when there is no entry, or it does not match its record (then it is removed)."""
    entry = folder / key[:2] / key
    try:
        record = json.loads((entry / RECORD).read_text())
        for file, digest in record["files"].items():
            if _file_digest(entry / file) != digest:
                raise ValueError(f"{file} does not match its digest")
        constants = torch.load(entry / CONSTANTS, weights_only=True, map_location="cpu")
        embedded = bool(record["embedded"])
    except FileNotFoundError:
        return None
    except (OSError, ValueError, KeyError, TypeError, RuntimeError, EOFError):
        shutil.rmtree(entry, ignore_errors=True)  # damaged: compiled and written again
        return None
    shutil.copyfile(entry / PACKAGE, out)
    return constants, embedded


def store(folder: Path, key: str, package: Path, constants: dict[str, torch.Tensor], embedded: bool) -> None:
    """Write the entry ``key``: the package, its constants and their digests, renamed into place at
    once. A build that cannot write it still succeeds; another build's entry of the same key stays."""
    entry = folder / key[:2] / key
    if (entry / RECORD).is_file():
        return
    tmp = None
    try:
        entry.parent.mkdir(parents=True, exist_ok=True)
        tmp = Path(tempfile.mkdtemp(dir=entry.parent, prefix=f".{key[:8]}-"))
        shutil.copyfile(package, tmp / PACKAGE)
        torch.save(constants, tmp / CONSTANTS)
        files = {name: _file_digest(tmp / name) for name in (PACKAGE, CONSTANTS)}
        (tmp / RECORD).write_text(json.dumps({"files": files, "embedded": embedded}, indent=1) + "\n")
        os.rename(tmp, entry)
        tmp = None
    except OSError:
        pass  # a full disk or a concurrent writer of the same key: the build goes on without the entry
    finally:
        if tmp is not None:
            shutil.rmtree(tmp, ignore_errors=True)


class _Uncacheable(Exception):
    pass


def _identity(value: Any) -> str:
    """A config value as text; a custom pass by its uuid()."""
    if hasattr(value, "uuid") and callable(value.uuid):
        return f"{type(value).__qualname__}:{value.uuid()}"
    if callable(value) or isinstance(value, torch.ScriptObject):
        raise _Uncacheable(value)
    return repr(value)


def _value(value: Any) -> str:
    """A node's value as the compile sees it: a tensor's shape, strides, dtype and device."""
    if isinstance(value, torch.Tensor):
        return f"T{tuple(value.shape)}{tuple(value.stride())}{value.dtype}{value.device}"
    if isinstance(value, (list, tuple)):
        return "(" + ",".join(_value(v) for v in value) + ")"
    if isinstance(value, torch.ScriptObject):
        raise _Uncacheable(value)
    return repr(value)


def _tensor_digest(value: Any) -> str:
    if type(value) not in (torch.Tensor, torch.nn.Parameter) or value.is_quantized or value.layout != torch.strided:
        raise _Uncacheable(value)  # a tensor subclass (torchao's int8 weights) has no plain bytes to hash
    # Flattened first: a 0-dim tensor (BatchNorm's num_batches_tracked) has no byte view of its own.
    t = value.detach().cpu().contiguous().reshape(-1)
    data = t.view(torch.uint8) if t.numel() and t.element_size() else t
    return f"{t.dtype}{tuple(value.shape)}{tuple(value.stride())}:{hashlib.sha256(data.numpy().tobytes()).hexdigest()}"


def _inductor_config() -> dict[str, Any]:
    import torch._inductor.config as inductor_config  # build side only

    try:
        config = inductor_config.save_config_portable()
    except Exception as e:  # a config value without uuid(): Inductor's own cache refuses it alike
        raise _Uncacheable(e) from None
    # Filled in by AOTInductor's first compile in a process (the host's platform and ISA, which
    # _toolchain keys already): left in, a process's first build would never hit its later ones.
    config.pop("aot_inductor.metadata", None)
    return config


@functools.cache
def _toolchain() -> tuple[str, ...]:
    """What the compiled code depends on besides the program and its options, on this host."""
    from torch._inductor.codecache import torch_key
    from torch._inductor.cpp_builder import get_cpp_compiler

    compiler = get_cpp_compiler()
    try:
        version = subprocess.run([compiler, "--version"], capture_output=True, text=True, timeout=30).stdout
    except (OSError, subprocess.SubprocessError):
        version = "unknown"
    return (
        torch.__version__,
        torch_key().hex(),
        _sources_digest(),
        compiler,
        version.strip(),
        platform.machine(),
        _cpu_model(),
        json.dumps(torch.backends.cpu.get_cpu_capability()),
        str(torch.get_num_threads()),
    )


def _sources_digest() -> str:
    """precompile's own sources (its passes and options decide what Inductor compiles) and the
    loader's, which reads the packages."""
    h = hashlib.sha256()
    for root in (Path(__file__).parent, Path(__file__).parent.parent / "loader"):
        for path in sorted(_python_files(root)):
            h.update(str(path.relative_to(root.parent)).encode())
            h.update(path.read_bytes())
    return h.hexdigest()


def _python_files(root: Path) -> Iterator[Path]:
    return (p for p in root.rglob("*.py") if "__pycache__" not in p.parts)


def _cpu_model() -> str:
    """The CPU's model name and a digest of its feature flags (``/proc/cpuinfo``'s first CPU)."""
    try:
        lines = Path("/proc/cpuinfo").read_text().split("\n\n")[0].splitlines()
    except OSError:
        return platform.processor()
    model = next((line.split(":", 1)[1].strip() for line in lines if line.startswith("model name")), "")
    flags = next((line for line in lines if line.startswith("flags")), "")
    return f"{model} flags:{hashlib.sha256(flags.encode()).hexdigest()[:16]}"


def _file_digest(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(1 << 20):
            h.update(chunk)
    return h.hexdigest()
