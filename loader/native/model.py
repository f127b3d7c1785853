"""``load_native()``: an artifact's CPU variants served with numpy arrays, torch never imported.

What ``loader.load`` checks before it opens compiled code is done by the same code (``loader.source``:
manifest, signature, expiry, rollback, host and ISA compatibility, sizes and hashes; the host facts
come from ``loader.native.libs``); the call path is ``loader.dispatch``'s (guards, static table,
tightest dynamic range, pad/split policies, stats). What differs is what runs the compiled code: each
variant's library is opened with ctypes and driven through its C interface (``loader.native.capi``),
its weights handed over in place from the same memory map (``weights.safetensors``, zero-copy).
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterable
from dataclasses import replace
from pathlib import Path
from typing import Any

import numpy as np

from ..artifact import HeldFile
from ..constants import MANIFEST_FILE
from ..dispatch import ServedModel
from ..errors import IncompatibleArtifactError
from ..host import native_cpu_problem
from ..isa import AUTO, IsaChoice, choose_isa
from ..manifest import Manifest, Variant
from ..opening import DEFAULT_OPEN, LoadOptions, OnDemand, open_model, open_variants
from ..precision import Choice, choose
from ..source import Opened
from ..warmup import DEFAULT_WARMUP_SHAPES
from ..weights import MappedWeights
from .capi import NUMPY_DTYPES, Container
from .containers import USE_TORCH, Runtimes, container_opener, needs_torch
from .libs import find_torch, host_facts
from .npguards import NUMPY_OPS, ArrayGuard
from .package import PackageLibrary, read_package


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

    def close(self) -> None:
        self.container.close()


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
    but is not imported. Before it opens the OpenMP runtime, ``loader.threads.wait_env()`` (a short spin, then sleep)
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
    options = LoadOptions.of(locals())  # checked here, before anything is read
    torch = find_torch()
    # Opening torch's libraries overlaps the checks below; it opens nothing of the artifact. Not
    # opened at all where every CPU variant is standalone (it runs on the artifact's own shim).
    shim = Runtimes(torch, threads, start_torch=_may_need_torch(path))

    def build(opened: Opened) -> tuple[NativeModel, list[OnDemand]]:
        root, manifest = opened.root, opened.manifest
        _refuse_inputs(manifest, str(root))
        weights = opened.weights()
        host = host_facts(torch)
        isa = choose_isa(manifest.variants, cpu_isa, host.cpu_features, native_cpu_problem(manifest, host), str(root))
        choice, served, packages = _choose(root, manifest, precision, host.cpu_features, isa)
        containers = container_opener(shim, opened, {v.id: v for v in served}, packages, weights)

        def open_one(variant_id: str) -> _Runner:
            dtype = dtypes[variant_id]
            return _Runner(containers(variant_id), NUMPY_DTYPES[dtype] if dtype is not None else None)

        dtypes = {v.id: v.dtype for v in served}
        runners, pending = open_variants([v.id for v in served], open_one, open)
        model = NativeModel(root, manifest, weights, runners, digest=opened.digest, precision=choice, isa=isa)
        return model, pending

    return open_model(
        path,
        build,
        options,
        device="cpu",
        host=host_facts(torch),
        refused_hint=f"the torch-free loader runs CPU variants only; for others {USE_TORCH}",
    )


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
            raise needs_torch(root, v, why[v.id])
        if v.dtype is not None and v.dtype not in NUMPY_DTYPES:
            raise needs_torch(root, v, f"it computes in {v.dtype}, which numpy cannot cast to")
    if not served:
        raise IncompatibleArtifactError(f"{root}: no CPU variants to serve; {USE_TORCH}")
    return choice, served, {v.id: (packages[v.id], held[v.id]) for v in served}


def _refuse_inputs(manifest: Manifest, source: str) -> None:
    for spec in manifest.inputs:
        if spec.dtype not in NUMPY_DTYPES:
            raise IncompatibleArtifactError(
                f"{source}: input {spec.name!r} is {spec.dtype}, which numpy has no dtype for; {USE_TORCH}"
            )


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
