"""``load_native()``: an artifact's CPU variants served with numpy arrays, torch never imported.

What ``loader.load`` checks before it opens compiled code is done by the same code (``loader.source``:
manifest, signature, expiry, rollback, host and ISA compatibility, sizes and hashes; the host facts
come from ``loader.native.libs``); the call path is ``loader.dispatch``'s (guards, static table,
tightest dynamic range, pad/split policies, stats). What differs is what runs the compiled code: each
variant's library is opened with ctypes and driven through its C interface (``loader.native.capi``),
its weights handed over in place from the same memory map (``weights.safetensors``, zero-copy).
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import tempfile
import threading
from collections.abc import Callable, Iterable
from dataclasses import replace
from pathlib import Path
from typing import Any

import numpy as np

from ..artifact import HeldFile
from ..constants import MANIFEST_FILE
from ..dispatch import ServedModel
from ..errors import ArtifactError, IncompatibleArtifactError
from ..host import native_cpu_problem
from ..isa import AUTO, IsaChoice, choose_isa
from ..manifest import Manifest, Variant
from ..opening import DEFAULT_OPEN, OnDemand, check_open_mode, open_variants, start_background
from ..precision import REQUESTS, Choice, choose
from ..source import Opened, open_artifact
from ..threads import concurrent_runners
from ..warmup import DEFAULT_WARMUP_SHAPES, check_warmup_shapes
from ..weights import MappedWeights
from .capi import NUMPY_DTYPES, CallFailed, Container, Shim
from .libs import (
    TorchLibraries,
    expose_libtorch,
    find_torch,
    host_facts,
    start_runtime_soon,
    start_standalone_runtime,
)
from .npguards import NUMPY_OPS, ArrayGuard
from .package import PackageLibrary, extract_library, read_package

USE_TORCH = "load it with loader.load(), which runs it through torch"


class NativeModel(ServedModel):
    """A loaded artifact served without torch: call it with numpy arrays like the module's forward();
    the result has forward()'s structure, with numpy arrays. See ``load_native``."""

    device = "cpu"
    device_type = "cpu"

    def __init__(
        self,
        root: Path,
        manifest: Manifest,
        weights: MappedWeights,
        runners: dict[str, Any],
        *,
        digest: str | None = None,
        precision: Choice = Choice(("fp32",)),
        isa: IsaChoice = IsaChoice(),
    ):
        self.cpu_isa = isa.isa  # as loader.load's model says it
        guard = ArrayGuard(
            manifest.inputs, manifest.dims, unchecked={d for d, p in manifest.policy.items() if p != "error"}
        )
        super().__init__(root, manifest, weights, runners, guard, NUMPY_OPS, digest=digest, precision=precision)

    def _full(self, shape: list[int], value: float, dtype: str) -> np.ndarray:
        return np.full(shape, value, dtype=NUMPY_DTYPES[dtype])

    def close(self) -> None:
        """Free every variant's compiled model now (calls after this raise); the weights' memory is
        released with the last reference to this object."""
        for runner in self._runners.values():
            if isinstance(runner, OnDemand):
                runner.close(lambda r: r.container.close())
            else:
                runner.container.close()

    def __repr__(self) -> str:
        return f"<NativeModel {self.name!r} from {str(self.path)!r}: {len(self._runners)} variant(s) on cpu, without torch>"


class _Runner:
    """Runs one variant's container; floating inputs are cast first for a variant that computes in
    another dtype (``Variant.dtype``)."""

    def __init__(self, container: Container, dtype: np.dtype | None):
        self.container = container
        self.dtype = dtype

    def run(self, arrays: list[np.ndarray]) -> list[np.ndarray]:
        if self.dtype is not None:
            arrays = [a.astype(self.dtype) if a.dtype.kind == "f" else a for a in arrays]
        return self.container.run(arrays)


def load_native(
    path: str | os.PathLike,
    *,
    verify: bool = True,
    trusted_keys: Iterable[Any] | None = None,
    min_version: int | None = None,
    refuse_rollback: bool = False,
    cache_dir: str | os.PathLike | None = None,
    state_dir: str | os.PathLike | None = None,
    threads: int | None = None,
    precision: str = "auto",
    max_bytes: int | None = None,
    warmup: bool = True,
    warmup_shapes: str = DEFAULT_WARMUP_SHAPES,
    cpu_isa: str = AUTO,
    open: str = DEFAULT_OPEN,
) -> NativeModel:
    """Load an artifact's CPU variants without importing torch; call the result with numpy arrays.

    The options are ``loader.load``'s (``device`` is always CPU; ``copy_inputs`` has no use: numpy
    arrays live in CPU memory). The torch wheel must be installed (its shared libraries run the code)
    but is not imported. Before it opens the OpenMP runtime, ``OMP_WAIT_POLICY=PASSIVE`` (unless set)
    and ``OMP_NUM_THREADS`` (``threads``, by default torch's count cut to the CPUs this process gets)
    are put in the environment.

    Raises what ``loader.load`` raises, for the same reasons; and IncompatibleArtifactError, saying to
    use ``loader.load``, for what this path cannot run: variants that need torch's proxy executor (ops
    without a C shim), CUDA-only artifacts, bfloat16 inputs (numpy has no bfloat16).

    ``open`` (``loader.opening``): ``"background"`` (default) opens and warms the first variant before
    returning and the others in a thread of lower priority; ``"lazy"`` opens each other one at its
    first call; ``"eager"`` opens every variant first. A call never fails for a variant not open yet:
    it waits for it. A folder's variant package is hashed as it is read to be opened (its library is
    copied out in the same pass), so what runs is what was hashed.

    >>> model = load_native("artifacts/text-classifier")
    >>> logits = model(ids, mask)        # numpy int64 and bool arrays in, a numpy float32 array out
    """
    if precision not in REQUESTS:
        raise ValueError(f"precision={precision!r}: expected one of {', '.join(REQUESTS)}")
    check_open_mode(open)
    check_warmup_shapes(warmup_shapes)
    torch = find_torch()
    # Opening torch's libraries overlaps the checks below; it opens nothing of the artifact. Not
    # opened at all where every CPU variant is standalone (it runs on the artifact's own shim).
    shim = _Runtimes(torch, threads, start_torch=_may_need_torch(path))
    try:
        opened = open_artifact(
            path,
            device="cpu",
            verify=verify,
            trusted_keys=trusted_keys,
            min_version=min_version,
            refuse_rollback=refuse_rollback,
            cache_dir=cache_dir,
            state_dir=state_dir,
            max_bytes=max_bytes,
            host=host_facts(torch),
            defer_packages=True,
        )
    except IncompatibleArtifactError as e:
        raise IncompatibleArtifactError(
            f"{e}\n  (the torch-free loader runs CPU variants only; for others {USE_TORCH})"
        ) from None
    with opened:  # holds the rollback ledger's lock, with refuse_rollback, until the version is recorded
        root, manifest = opened.root, opened.manifest
        _refuse_inputs(manifest, str(root))
        weights = opened.weights()
        weights.check(manifest.constants)
        host = host_facts(torch)
        isa = choose_isa(manifest.variants, cpu_isa, host.cpu_features, native_cpu_problem(manifest, host), str(root))
        choice, served, packages = _choose(root, manifest, precision, host.cpu_features, isa)
        runners, pending = open_variants(
            [v.id for v in served], _opener(shim, opened, {v.id: v for v in served}, packages, weights), open
        )
        model = NativeModel(root, manifest, weights, runners, digest=opened.digest, precision=choice, isa=isa)
        model.warmup_shapes = warmup_shapes
        if warmup:
            model.warmup()
        opened.loaded()
    if open == "background":
        model.opening = start_background(pending, model.warm_variant, str(root))
    return model


def manifest_problem(manifest: Manifest) -> str | None:
    """Why ``load_native`` cannot serve this artifact, as far as its manifest says, or None: no CPU
    variants, an input numpy has no dtype for, or a CPU variant the build recorded as needing torch
    (``Variant.needs_torch``) or computing in such a dtype. For a choice made before loading
    (``precompile serve --runtime auto``); the load checks each package again."""
    cpu = [v for v in manifest.variants if v.device == "cpu"]
    if manifest.target.device != "cpu" or not cpu:
        return f"it is built for {manifest.target.device}; the torch-free loader runs CPU variants only"
    for spec in manifest.inputs:
        if spec.dtype not in NUMPY_DTYPES:
            return f"input {spec.name!r} is {spec.dtype}, which numpy has no dtype for"
    for v in cpu:
        if v.needs_torch:
            return f"variant {v.id!r} cannot run without torch: {v.needs_torch}"
        if v.dtype is not None and v.dtype not in NUMPY_DTYPES:
            return f"variant {v.id!r} computes in {v.dtype}, which numpy cannot cast to"
    return None


def _choose(
    root: Path, manifest: Manifest, precision: str, features: frozenset[str], isa: IsaChoice = IsaChoice()
) -> tuple[Choice, list[Variant], dict[str, tuple[PackageLibrary, HeldFile]]]:
    """The precisions and CPU variants (of the chosen ISA) to serve, as ``loader.load`` chooses them,
    except that a lower precision whose variants need torch is skipped under ``precision="auto"``
    (fp32 serves instead); and each one's package, as listed, and held open (``HeldFile``) until
    the variant is opened."""
    cpu = [v for v in manifest.variants if v.device == "cpu" and isa.serves(v)]
    held = {v.id: HeldFile(root / v.file) for v in cpu}
    packages = {v.id: read_package(root / v.file, source=held[v.id].path) for v in cpu}
    # What the build recorded or, for an artifact built before it did, what the package shows.
    why = {v.id: v.needs_torch or packages[v.id].problem() for v in cpu}
    blocked = (
        {v.precision: why[v.id] for v in cpu if why[v.id] and v.precision != "fp32"} if precision == "auto" else {}
    )
    choice = choose([v for v in cpu if v.precision not in blocked], precision, features, str(root))
    if blocked:
        choice = replace(choice, skipped={**choice.skipped, **{p: f"needs torch: {w}" for p, w in blocked.items()}})
    served = [v for v in cpu if choice.serves(v)]
    for v in served:
        if why[v.id]:
            raise _needs_torch(root, v, why[v.id])
        if v.dtype is not None and v.dtype not in NUMPY_DTYPES:
            raise _needs_torch(root, v, f"it computes in {v.dtype}, which numpy cannot cast to")
    if not served:
        raise IncompatibleArtifactError(f"{root}: no CPU variants to serve; {USE_TORCH}")
    return choice, served, {v.id: (packages[v.id], held[v.id]) for v in served}


def _refuse_inputs(manifest: Manifest, source: str) -> None:
    for spec in manifest.inputs:
        if spec.dtype not in NUMPY_DTYPES:
            raise IncompatibleArtifactError(
                f"{source}: input {spec.name!r} is {spec.dtype}, which numpy has no dtype for; {USE_TORCH}"
            )


def _needs_torch(root: Path, v: Variant, why: str) -> IncompatibleArtifactError:
    other = " (or load with precision='fp32', which does not serve it)" if v.precision != "fp32" else ""
    return IncompatibleArtifactError(f"{root}: variant {v.id!r} cannot run without torch: {why}; {USE_TORCH}{other}")


class _Runtimes:
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


def _may_need_torch(path: str | os.PathLike) -> bool:
    """Whether a load of ``path`` may open torch's libraries: False only for a folder whose manifest
    (peeked at, unchecked: it decides what to start early, nothing else) lists only standalone CPU
    variants; a pack, a URL or anything unreadable: True."""
    try:
        manifest = json.loads((Path(path) / MANIFEST_FILE).read_text(encoding="utf-8"))
        cpu = [v for v in manifest["variants"] if v.get("device", "cpu") == "cpu"]
        return not cpu or any(not v.get("shim") for v in cpu)
    except (OSError, ValueError, TypeError, KeyError, AttributeError):
        return True


def _opener(
    shim: _Runtimes,
    opened: Opened,
    variants: dict[str, Variant],
    packages: dict[str, tuple[PackageLibrary, HeldFile]],
    weights: MappedWeights,
) -> Callable[[str], _Runner]:
    """What opens one variant by id (``loader.opening`` decides when): its library copied out of its
    package (hashed in the same pass, for a folder), opened, checked against the manifest and, unless
    its constants are inside it, handed them as views of ``weights``' buffer. ``shim`` gives what
    runs it (torch's libraries, waited for once the library is out, or the artifact's shim)."""
    root, manifest = opened.root, opened.manifest
    standalone_only = all(v.shim is not None for v in variants.values())

    def open_one(variant_id: str) -> _Runner:
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
                raise _needs_torch(root, v, problem)
            try:
                runtime = shim.for_variant(opened, v, standalone_only)
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
                _hand_constants(container.shim, container, root, v, weights)
        except BaseException:
            container.close()
            raise
        return _Runner(container, NUMPY_DTYPES[v.dtype] if v.dtype is not None else None)

    return open_one


def _hand_constants(shim: Shim, container: Container, root: Path, v: Variant, weights: MappedWeights) -> None:
    """Give the container every constant it expects, in place: tensors viewing the weights' buffer
    (which the model keeps alive), shaped as the safetensors header says."""
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
