"""Opening one CPU variant's compiled model through its container's C entry points
(``loader.native.capi``), for both loaders: ``load_native`` serves it with numpy arrays,
``loader.load`` with torch tensors (``loader.cpu_runner``).

A variant's library is copied out of its package into a private file (a folder's package hashed in
the same pass: what runs is what was hashed), opened, checked against the manifest and, unless its
constants are inside it, handed them in place: tensors viewing the weights' buffer. What runs it is
torch's libraries (libc10, libtorch_cpu: opened once per process, in the background) or, for a
standalone variant, the artifact's own tensor shim.
"""

from __future__ import annotations

import hashlib
import os
import shutil
import tempfile
import threading
from collections.abc import Callable
from pathlib import Path

from ..artifact import HeldFile
from ..errors import ArtifactError, IncompatibleArtifactError
from ..manifest import Variant
from ..source import Opened
from ..threads import concurrent_runners
from ..weights import MappedWeights
from .capi import CallFailed, Container, Shim
from .libs import TorchLibraries, expose_libtorch, start_runtime_soon, start_standalone_runtime
from .package import PackageLibrary, extract_library

USE_TORCH = "load it with loader.load(), which runs it through torch"


class NeedsTorch(IncompatibleArtifactError):
    """A variant the C entry points alone cannot run: its package needs torch's proxy executor (ops
    without a C shim), or it computes in a dtype numpy has no type for. ``loader.load`` opens such a
    variant through torch's package loader instead."""


def needs_torch(root: Path, v: Variant, why: str) -> NeedsTorch:
    other = " (or load with precision='fp32', which does not serve it)" if v.precision != "fp32" else ""
    return NeedsTorch(f"{root}: variant {v.id!r} cannot run without torch: {why}; {USE_TORCH}{other}")


class Runtimes:
    """What runs the variants' libraries: torch's (libc10, libtorch_cpu: opened in the background
    from the start unless every CPU variant is standalone, else at the first variant that needs
    them) or, for a standalone variant, the artifact's own tensor shim beside OpenMP."""

    def __init__(self, torch: TorchLibraries, threads: int | None, *, start_torch: bool):
        self._libraries, self._threads = torch, threads
        self._lock = threading.Lock()
        self._wait = start_runtime_soon(torch, threads) if start_torch else None

    def torch(self) -> Shim:
        with self._lock:
            if self._wait is None:
                self._wait = start_runtime_soon(self._libraries, self._threads)
        return self._wait()

    def for_variant(self, opened: Opened, v: Variant, standalone_only: bool) -> Shim:
        """What runs variant ``v``: the artifact's shim where every variant served is standalone;
        else torch's libraries for all (a standalone variant's calls bound to libtorch_cpu's shim,
        made global: one provider of those calls per process)."""
        if v.shim is not None and standalone_only:
            return self.standalone(opened, v)
        runtime = self.torch()
        if v.shim is not None:
            expose_libtorch(self._libraries)
        return runtime

    def standalone(self, opened: Opened, v: Variant) -> Shim:
        """The shim a standalone variant names, read once and checked against the manifest's size and
        sha256 as it is copied to a private file, which is opened and removed (what runs is what was
        hashed)."""
        root, entry = opened.root, opened.manifest.files[v.shim]
        try:
            fd = os.open(root / v.shim, os.O_RDONLY | getattr(os, "O_NOFOLLOW", 0))
            with os.fdopen(fd, "rb") as f:
                data = f.read(entry.size + 1)
        except OSError as e:
            raise ArtifactError(f"{root}: cannot read {v.shim} ({e.strerror})") from None
        if len(data) != entry.size or hashlib.sha256(data).hexdigest() != entry.sha256:
            raise ArtifactError(
                f"{root}: {v.shim} does not match its size and sha256 in the manifest (changed or corrupt)"
            )
        folder = Path(tempfile.mkdtemp(prefix="precompile-shim-"))
        try:
            copy = folder / "aoti_shim.so"
            copy.write_bytes(data)
            return start_standalone_runtime(copy, self._libraries, self._threads)
        finally:
            shutil.rmtree(folder, ignore_errors=True)


def container_opener(
    runtimes: Runtimes,
    opened: Opened,
    variants: dict[str, Variant],
    packages: dict[str, tuple[PackageLibrary, HeldFile]],
    weights: MappedWeights,
) -> Callable[[str], Container]:
    """What opens one variant's container by id (``loader.opening`` decides when): its library
    copied out of its package (hashed in the same pass, for a folder), opened, checked against the
    manifest and, unless its constants are inside it, handed them as views of ``weights``' buffer.
    ``runtimes`` gives what runs it (torch's libraries, waited for once the library is out, or the
    artifact's shim). NeedsTorch for a package that calls torch's proxy executor."""
    root, manifest = opened.root, opened.manifest
    standalone_only = all(v.shim is not None for v in variants.values())

    def open_one(variant_id: str) -> Container:
        v, (package, held) = variants[variant_id], packages[variant_id]
        folder = Path(tempfile.mkdtemp(prefix="precompile-native-"))  # mode 0700: private to this user
        try:
            library = folder / f"{v.id}.so"
            with library.open("wb") as out:
                entry, sha256 = manifest.files[v.file], opened.package_sha256(v)
                proxy = extract_library(package, out, size=entry.size, sha256=sha256, source=held.path)
            held.close()  # read once: a variant that failed to open is refused for good (loader.opening)
            problem = package.problem(proxy_calls=proxy)
            if problem is not None:
                raise needs_torch(root, v, problem)
            try:
                runtime = runtimes.for_variant(opened, v, standalone_only)
                container = Container(
                    runtime, library, own_constants=bool(v.embedded_constants), runners=concurrent_runners()
                )
            except CallFailed as e:
                raise ArtifactError(f"{root}: variant {v.id!r}: cannot open {v.file}: {e}") from None
        finally:
            shutil.rmtree(folder, ignore_errors=True)  # the opened library stays mapped; nothing is left on disk
        try:
            if (container.num_inputs, container.num_outputs) != (len(manifest.inputs), manifest.output.count()):
                raise ArtifactError(
                    f"{root}: variant {v.id!r}: the compiled code takes {container.num_inputs} inputs and gives "
                    f"{container.num_outputs} outputs, the manifest says {len(manifest.inputs)} and "
                    f"{manifest.output.count()} (files from different artifacts?)"
                )
            if not v.embedded_constants:  # a frozen package holds its own (hashed with it)
                hand_constants(container, root, v, weights)
        except BaseException:
            container.close()
            raise
        return container

    return open_one


def hand_constants(container: Container, root: Path, v: Variant, weights: MappedWeights) -> None:
    """Give the container every constant it expects, in place: tensors viewing the weights' buffer
    (which the model keeps alive), shaped as the safetensors header says."""
    shim = container.shim
    names = container.constant_names()
    if set(names) != set(v.constants):
        raise ArtifactError(
            f"{root}: variant {v.id!r}: the compiled code needs constants {sorted(set(names) - set(v.constants))[:5]} "
            f"that the manifest does not list (files from different artifacts?)"
        )
    base = weights.address
    handles = {}
    try:
        for fqn, name in names.items():
            stored = weights.stored[v.constant_prefix + fqn]
            handles[name] = shim.tensor(base + stored.offset, stored.shape, stored.dtype)
        container.use_constants(handles)
    except CallFailed as e:
        raise ArtifactError(f"{root}: variant {v.id!r}: the compiled code refused the weights: {e}") from None
    finally:
        for handle in handles.values():
            shim.delete(handle)
