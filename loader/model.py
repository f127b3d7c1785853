"""``load()`` and the callable it returns: guards, dispatch to a variant, output structure.

Loading never compiles: each variant's shared library is opened through the C++ package loader
(``torch._C._aoti.AOTIModelPackageLoader``), which does not import ``torch._inductor`` (about 1 s
on a small host), and the weights are handed over as views of one memory map, shared by all variants.
"""

from __future__ import annotations

import os
import threading
import time
from pathlib import Path
from typing import Any

import torch

from . import constants as C
from .artifact import read_manifest, verify_files
from .errors import ArtifactError, GuardError
from .guards import TORCH_DTYPES, InputGuard
from .host import check_compatible
from .manifest import Manifest, OutputSpec, Variant
from .policy import Policies
from .weights import MappedWeights


# Distinct shapes remembered by stats(); beyond this, calls are counted in shapes_not_tracked.
MAX_SHAPES_TRACKED = 10_000


def _open_package(path: str) -> Any:
    """Open one AOTInductor package without importing torch._inductor.

    ``torch._C._aoti.AOTIModelPackageLoader`` is what ``torch._inductor.aoti_load_package`` wraps; it is
    private, so this is the only place that names it. Arguments: package path, model name inside the
    package, run single-threaded, number of runners, device index (-1: the default one).
    """
    return torch._C._aoti.AOTIModelPackageLoader(path, C.AOTI_MODEL_NAME, False, 1, -1)


class CompiledModel:
    """A loaded artifact. Call it like the module's forward(); see ``load``."""

    def __init__(self, root: Path, manifest: Manifest, weights: MappedWeights, runners: dict[str, Any], device: str):
        self.path = root
        self.manifest = manifest
        self.device = device
        self._weights = weights  # keeps the memory map alive as long as the runners use it
        self._runners = runners
        self._guard = InputGuard(manifest.inputs, manifest.dims, device, unchecked={d for d, p in manifest.policy.items() if p != "error"})
        self._policies = Policies(manifest) if any(p != "error" for p in manifest.policy.values()) else None
        self._dim_order = tuple(manifest.dims)
        self._static: dict[tuple[int, ...], tuple[Variant, Any]] = {}
        dynamic = []
        for v in manifest.variants:
            if v.kind == "static":
                self._static[tuple(v.dims[d].min for d in self._dim_order)] = (v, runners[v.id])
            else:
                dynamic.append(v)
        # Tightest range first, so a call lands on the most specific variant that holds it.
        dynamic.sort(key=lambda v: _volume(v))
        self._dynamic = [(v, runners[v.id], [(d, v.dims[d].min, v.dims[d].max) for d in self._dim_order]) for v in dynamic]
        self._output = manifest.output
        self._single_tensor = manifest.output.kind == "tensor"
        self._stats_lock = threading.Lock()
        self.reset_stats()

    @property
    def name(self) -> str:
        return self.manifest.name

    @property
    def variants(self) -> tuple[Variant, ...]:
        return self.manifest.variants

    @property
    def input_names(self) -> tuple[str, ...]:
        return self._guard.names

    def select(self, *args: Any, **kwargs: Any) -> Variant:
        """The variant a call with these inputs would run on (checks the guards, runs nothing)."""
        tensors, sizes = self._guard.check(args, kwargs)
        return self._dispatch(sizes)[0]

    def run_variant(self, variant_id: str, *args: Any, **kwargs: Any) -> Any:
        """Run one named variant, bypassing dispatch (for checks); its ranges are still guarded."""
        variant = next((v for v in self.manifest.variants if v.id == variant_id), None)
        if variant is None:
            raise GuardError(f"no variant {variant_id!r} (variants: {', '.join(v.id for v in self.variants)})")
        tensors, sizes = self._guard.check(args, kwargs)
        for d, r in variant.dims.items():
            if sizes[d] not in r:
                raise GuardError(f"variant {variant_id!r} serves {d} in {r}, got {d}={sizes[d]}")
        return self._outputs(self._runners[variant_id].run(tensors))

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        return self.call_detailed(*args, **kwargs)[0]

    def call_detailed(self, *args: Any, **kwargs: Any) -> tuple[Any, str]:
        """Like calling the model, and also say which variant served the call ("a+b" when a pad or
        split policy ran pieces on several)."""
        tensors, sizes = self._guard.check(args, kwargs)
        key = tuple(sizes[d] for d in self._dim_order)
        if self._policies is not None and self._policies.needed(sizes):
            outputs, ids = self._policies.run(tensors, sizes, self._run_one)
            variant_id = "+".join(dict.fromkeys(ids))
        else:
            outputs, ids = self._run_one(tensors, sizes)
            variant_id = ids[0]
        self._record_shape(key)
        return self._outputs(outputs), variant_id

    def _run_one(self, tensors: list, sizes: dict[str, int]) -> tuple[list, list]:
        variant, runner = self._dispatch(sizes)
        start = time.perf_counter()
        outputs = runner.run(tensors)
        seconds = time.perf_counter() - start
        with self._stats_lock:
            entry = self._calls[variant.id]
            entry[0] += 1
            entry[1] += seconds
        return outputs, [variant.id]

    def _record_shape(self, key: tuple[int, ...]) -> None:
        with self._stats_lock:
            count = self._shapes.get(key)
            if count is not None:
                self._shapes[key] = count + 1
            elif len(self._shapes) < MAX_SHAPES_TRACKED:
                self._shapes[key] = 1
            else:
                self._shapes_dropped += 1

    def stats(self) -> dict[str, Any]:
        """Calls and compute time per variant, and the histogram of shapes seen.

        ``shapes`` uses the ``{"dims": {...}, "count": N}`` form that a profile's
        ``distribution.file`` reads (one object a line), so serving traffic can feed the next build.
        """
        with self._stats_lock:
            return {
                "variants": {vid: {"calls": c, "seconds": s} for vid, (c, s) in self._calls.items()},
                "shapes": [
                    {"dims": dict(zip(self._dim_order, key)), "count": n}
                    for key, n in sorted(self._shapes.items(), key=lambda kv: (-kv[1], kv[0]))
                ],
                "shapes_not_tracked": self._shapes_dropped,
            }

    def reset_stats(self) -> None:
        with self._stats_lock:
            self._calls = {vid: [0, 0.0] for vid in self._runners}
            self._shapes = {}
            self._shapes_dropped = 0

    def warmup(self) -> None:
        """Run every variant once on its hint shape, so the first real request meets warm code.

        Warm-up calls are not counted in ``stats()``.
        """
        for v in self.manifest.variants:
            args = [
                torch.zeros([v.hint[s] if isinstance(s, str) else s for s in spec.shape], dtype=TORCH_DTYPES[spec.dtype])
                for spec in self.manifest.inputs
            ]
            self.run_variant(v.id, *args)

    def _outputs(self, outputs: list) -> Any:
        if self._single_tensor:
            return outputs[0]
        return _unflatten(self._output, iter(outputs))

    def _dispatch(self, sizes: dict[str, int]) -> tuple[Variant, Any]:
        if self._static:
            hit = self._static.get(tuple(sizes[d] for d in self._dim_order))
            if hit is not None:
                return hit
        for v, runner, bounds in self._dynamic:
            for d, lo, hi in bounds:
                if not lo <= sizes[d] <= hi:
                    break
            else:
                return v, runner
        shape = ", ".join(f"{d}={sizes[d]}" for d in self._dim_order)
        covered = "; ".join(
            f"{v.id}: " + ", ".join(f"{d} {v.dims[d]}" for d in self._dim_order) for v in self.manifest.variants
        )
        raise GuardError(f"no compiled variant covers {shape} (variants: {covered})")

    def __repr__(self) -> str:
        return f"<CompiledModel {self.name!r} from {str(self.path)!r}: {len(self._runners)} variant(s) on {self.device}>"


def _volume(v: Variant) -> int:
    out = 1
    for r in v.dims.values():
        out *= r.max - r.min + 1
    return out


def _unflatten(spec: OutputSpec, flat) -> Any:
    if spec.kind == "tensor":
        return next(flat)
    items = [_unflatten(item, flat) for item in spec.items]
    if spec.kind == "tuple":
        return tuple(items)
    if spec.kind == "list":
        return items
    return dict(zip(spec.keys, items))


def load(path: str | os.PathLike, *, device: str | None = None, verify: bool = True) -> CompiledModel:
    """Load an artifact built by ``precompile build`` and return a callable model.

    ``device`` defaults to the artifact's target. ``verify`` checks every file's sha256 against the
    manifest (sizes are always checked). Raises ArtifactError for a missing, unreadable or corrupt
    artifact and IncompatibleArtifactError when it was built for another host.

    >>> model = load("artifacts/text-classifier")
    >>> logits = model(ids, mask)          # same arguments and result structure as forward()
    """
    root = Path(path)
    manifest = read_manifest(root)
    device = device or manifest.target.device
    check_compatible(manifest, device)
    verify_files(root, manifest, hashes=verify)
    weights = MappedWeights(str(root / C.WEIGHTS_FILE))
    _check_constants(manifest, weights)
    runners = {}
    for v in manifest.variants:
        try:
            runner = _open_package(str(root / v.file))
            expected = set(runner.get_constant_fqns())
        except RuntimeError as e:
            raise ArtifactError(f"{root}: variant {v.id!r}: cannot open {v.file}: {_first_line(e)}") from None
        if expected != set(v.constants):
            raise ArtifactError(
                f"{root}: variant {v.id!r}: the compiled code needs constants {sorted(expected - set(v.constants))[:5]} "
                f"that the manifest does not list (files from different artifacts?)"
            )
        # user_managed: the runner uses these tensors in place (no copy); check_full_update: every
        # constant must be given, since a missing one would be read as null by the compiled code.
        try:
            runner.load_constants({n: weights.tensors[n] for n in v.constants}, False, True, True)
        except RuntimeError as e:
            raise ArtifactError(f"{root}: variant {v.id!r}: the runner refused the weights: {_first_line(e)}") from None
        runners[v.id] = runner
    return CompiledModel(root, manifest, weights, runners, device)


def _check_constants(manifest: Manifest, weights: MappedWeights) -> None:
    for name, spec in manifest.constants.items():
        t = weights.tensors.get(name)
        if t is None:
            raise ArtifactError(f"{weights.path}: constant {name!r} is missing")
        if t.dtype is not TORCH_DTYPES[spec.dtype] or tuple(t.shape) != spec.shape:
            raise ArtifactError(
                f"{weights.path}: constant {name!r} is {t.dtype} {tuple(t.shape)}, "
                f"the compiled code expects {spec.dtype} {spec.shape}"
            )


def _first_line(e: BaseException) -> str:
    text = str(e).strip()
    return text.splitlines()[0] if text else type(e).__name__
