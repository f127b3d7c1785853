"""``load()`` and the callable it returns: guards, dispatch to a variant, output structure.

Loading never compiles: each variant's shared library is opened through the C++ package loader
(``torch._C._aoti.AOTIModelPackageLoader``), which does not import ``torch._inductor`` (about 1 s
on a small host), and the weights (read privately from a folder, or mapped from a pack's read-only
cache entry) are handed over as views, shared by all variants.
"""

from __future__ import annotations

import os
import threading
import time
from pathlib import Path
from typing import Any, Iterable

import torch

from . import constants as C
from .errors import ArtifactError, GuardError, IncompatibleArtifactError
from .guards import TORCH_DTYPES, InputGuard
from .host import host_facts
from .manifest import Manifest, OutputSpec, Variant
from .cuda import GraphedRunner, parse_device
from .policy import Plan, Policies
from .precision import REQUESTS, Choice, choose
from .source import open_artifact
from .threads import fit_threads
from .weights import MappedWeights


# Distinct shapes remembered by stats(); beyond this, calls are counted in shapes_not_tracked.
MAX_SHAPES_TRACKED = 10_000


def open_package(path: str, *, single_threaded: bool = False, device_index: int | None = None) -> Any:
    """Open one AOTInductor package without importing torch._inductor.

    ``torch._C._aoti.AOTIModelPackageLoader`` is what ``torch._inductor.aoti_load_package`` wraps; it is
    private, so this is the only place that names it. Arguments: package path, model name inside the
    package, run single-threaded (needed for CUDA graph capture), number of runners, device index
    (-1: the default one).
    """
    index = -1 if device_index is None else device_index
    return torch._C._aoti.AOTIModelPackageLoader(path, C.AOTI_MODEL_NAME, single_threaded, 1, index)


class CompiledModel:
    """A loaded artifact. Call it like the module's forward(); see ``load``."""

    def __init__(
        self,
        root: Path,
        manifest: Manifest,
        weights: MappedWeights,
        runners: dict[str, Any],
        device: str,
        *,
        device_weights: dict[str, torch.Tensor] | None = None,
        copy_inputs: bool = False,
        digest: str | None = None,
        precision: Choice = Choice(("fp32",)),
    ):
        self.path = root
        self.manifest = manifest
        # The digest of the manifest bytes as read (what a signature covers), not of a re-serialization.
        self.digest = digest
        self.device_type, index = parse_device(device)
        self.device = "cpu" if index is None else f"cuda:{index}"
        self._weights = weights  # keeps the memory map alive as long as the runners use it
        self._device_weights = device_weights  # constants copied to a GPU, used in place by the runners
        self._runners = runners
        self._variants = tuple(v for v in manifest.variants if v.id in runners)
        self.precision = precision  # the precisions served, preferred first, and why others are not
        self.variant_precision = {v.id: v.precision for v in self._variants}
        self._guard = InputGuard(
            manifest.inputs,
            manifest.dims,
            torch.device(self.device),
            unchecked={d for d, p in manifest.policy.items() if p != "error"},
            copy_inputs=copy_inputs,
        )
        self._policies = Policies(manifest) if any(p != "error" for p in manifest.policy.values()) else None
        self._dim_order = tuple(manifest.dims)
        self._index_tables()
        self._output = manifest.output
        self._single_tensor = manifest.output.kind == "tensor"
        self._stats_lock = threading.Lock()
        self.reset_stats()

    def _index_tables(self) -> None:
        # One table pair per tier of precisions served (loader.precision.Choice.tiers), preferred
        # first: a call runs on the first tier with a variant for its shape (the build made every
        # precision's variants alike, but its gate may have dropped some).
        self._tiers = []
        for tier in self.precision.tiers(self._variants):
            static, dynamic = self._tables(tier)
            if static or dynamic:
                self._tiers.append((static, dynamic))

    def _tables(self, variants: list[Variant]) -> tuple[dict, list]:
        runners = self._runners
        static: dict[tuple[int, ...], tuple[Variant, Any]] = {}
        dynamic = []
        for v in variants:
            if v.kind == "static":
                static[tuple(v.dims[d].min for d in self._dim_order)] = (v, runners[v.id])
            else:
                dynamic.append(v)
        # Tightest range first, so a call lands on the most specific variant that holds it.
        dynamic.sort(key=lambda v: _volume(v))
        return static, [(v, runners[v.id], [(d, v.dims[d].min, v.dims[d].max) for d in self._dim_order]) for v in dynamic]

    @property
    def name(self) -> str:
        return self.manifest.name

    @property
    def variants(self) -> tuple[Variant, ...]:
        """The variants loaded for this model's device."""
        return self._variants

    @property
    def input_names(self) -> tuple[str, ...]:
        return self._guard.names

    def select(self, *args: Any, **kwargs: Any) -> Variant | Plan:
        """The variant a call with these inputs would run on, or for a call that a pad or split policy
        serves, the policy's ``Plan`` (its pieces and the variant of each; ``id`` as ``call_detailed``
        reports it). Checks the guards, runs nothing; raises the GuardError the call would raise."""
        tensors, sizes = self._guard.check(args, kwargs)
        if self._policies is not None and self._policies.needed(sizes):
            return self._policies.plan(sizes, lambda s: self._dispatch(s)[0])
        return self._dispatch(sizes)[0]

    def check(self, *args: Any, **kwargs: Any) -> tuple[list[torch.Tensor], dict[str, int], Variant | None]:
        """Check a call as calling would, without running it: its inputs in forward() order, the size
        of each named dim, and the variant that would serve it (None when a pad or split policy serves
        it in pieces). Raises the GuardError the call would raise."""
        tensors, sizes = self._guard.check(args, kwargs)
        if self._policies is not None and self._policies.needed(sizes):
            return tensors, sizes, None
        return tensors, sizes, self._dispatch(sizes)[0]

    def run_variant(self, variant_id: str, *args: Any, **kwargs: Any) -> Any:
        """Run one named variant, bypassing dispatch (for checks); its ranges are still guarded."""
        variant = next((v for v in self._variants if v.id == variant_id), None)
        if variant is None:
            raise GuardError(f"no variant {variant_id!r} (variants: {', '.join(v.id for v in self.variants)})", reason="no_variant")
        tensors, sizes = self._guard.check(args, kwargs)
        for d, r in variant.dims.items():
            if sizes[d] not in r:
                raise GuardError(f"variant {variant_id!r} serves {d} in {r}, got {d}={sizes[d]}", reason="out_of_range")
        return self._outputs(self._runners[variant_id].run(tensors))

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        return self.call_detailed(*args, **kwargs)[0]

    def call_detailed(self, *args: Any, **kwargs: Any) -> tuple[Any, str]:
        """Like calling the model, and also say which variant served the call ("a+b" when a pad or
        split policy ran pieces on several)."""
        tensors, sizes = self._guard.check(args, kwargs)
        key = tuple(sizes[d] for d in self._dim_order)
        runs: list[tuple[str, float]] = []
        if self._policies is not None and self._policies.needed(sizes):
            outputs, ids = self._policies.run(tensors, sizes, lambda t, s: self._run_timed(t, s, runs))
        else:
            outputs, ids = self._run_timed(tensors, sizes, runs)
        variant_id = "+".join(dict.fromkeys(ids))
        self._count(key, runs)
        return self._outputs(outputs), variant_id

    def _run_timed(self, tensors: list, sizes: dict[str, int], runs: list[tuple[str, float]]) -> tuple[list, list]:
        """Run one call (or one piece of a pad or split call) and note (variant, seconds) for ``_count``."""
        variant, runner = self._dispatch(sizes)
        start = time.perf_counter()
        outputs = runner.run(tensors)
        runs.append((variant.id, time.perf_counter() - start))
        return outputs, [variant.id]

    def _count(self, key: tuple[int, ...], runs: list[tuple[str, float]]) -> None:
        """Count one finished call: once in total and once per variant it ran on, each run of compiled
        code (a split's pieces) as a piece, and its shape."""
        with self._stats_lock:
            self._total += 1
            counted = set()
            for vid, seconds in runs:
                entry = self._calls[vid]
                if vid not in counted:
                    counted.add(vid)
                    entry[0] += 1
                entry[1] += 1
                entry[2] += seconds
            count = self._shapes.get(key)
            if count is not None:
                self._shapes[key] = count + 1
            elif len(self._shapes) < MAX_SHAPES_TRACKED:
                self._shapes[key] = 1
            else:
                self._shapes_dropped += 1

    def stats(self) -> dict[str, Any]:
        """Calls and compute time per variant, and the histogram of shapes seen.

        ``calls`` counts every finished call once. Per variant, ``calls`` counts the calls that ran on
        it (a pad or split call counts once on each variant its pieces used), ``pieces`` the runs of its
        compiled code (a split call of three pieces adds three) and ``seconds`` their time.
        ``shapes`` uses the ``{"dims": {...}, "count": N}`` form that a profile's
        ``distribution.file`` reads (one object a line), so serving traffic can feed the next build.
        """
        with self._stats_lock:
            return {
                "calls": self._total,
                "variants": {
                    vid: {"calls": c, "pieces": p, "seconds": s, "precision": self.variant_precision[vid]}
                    for vid, (c, p, s) in self._calls.items()
                },
                "precision": {"served": list(self.precision.order), "skipped": dict(self.precision.skipped)},
                "shapes": [
                    {"dims": dict(zip(self._dim_order, key)), "count": n}
                    for key, n in sorted(self._shapes.items(), key=lambda kv: (-kv[1], kv[0]))
                ],
                "shapes_not_tracked": self._shapes_dropped,
            }

    def reset_stats(self) -> None:
        with self._stats_lock:
            self._total = 0
            self._calls = {vid: [0, 0, 0.0] for vid in self._runners}  # calls, pieces, seconds
            self._shapes = {}
            self._shapes_dropped = 0

    def warmup(self) -> None:
        """Run every variant once on its hint shape, so the first real request meets warm code.

        On CUDA, with ``cuda_graphs`` in the profile, this also captures one CUDA graph per static
        variant; later calls of that shape replay it. Warm-up calls are not counted in ``stats()``.
        """
        graphs = self.device_type == "cuda" and self.manifest.cuda is not None and self.manifest.cuda.cuda_graphs
        for v in self._variants:
            args = self.example_inputs(v)
            self.run_variant(v.id, *args)
            if graphs and v.kind == "static" and not isinstance(self._runners[v.id], GraphedRunner):
                runner = self._runners[v.id]
                cast = runner.dtype if isinstance(runner, _Cast) else None
                example = [a.to(cast) if cast is not None and a.is_floating_point() else a for a in args]
                graphed = GraphedRunner(runner.runner if cast is not None else runner, example)
                self._runners[v.id] = _Cast(graphed, cast) if cast is not None else graphed
        if graphs:
            self._index_tables()
            torch.cuda.synchronize(self.device)

    def example_inputs(self, variant: Variant) -> list[torch.Tensor]:
        """Valid inputs at ``variant``'s hint shape, on the model's device (for warm-up and probes)."""
        return [
            torch.full(  # the smallest valid value: 0 may be outside an integer input's range
                [variant.hint[s] if isinstance(s, str) else s for s in spec.shape],
                spec.range.min if spec.range is not None else 0,
                dtype=TORCH_DTYPES[spec.dtype],
                device=self.device,
            )
            for spec in self.manifest.inputs
        ]

    def _outputs(self, outputs: list) -> Any:
        if self._single_tensor:
            return outputs[0]
        return _unflatten(self._output, iter(outputs))

    def _dispatch(self, sizes: dict[str, int]) -> tuple[Variant, Any]:
        for static, dynamic in self._tiers:
            if static:
                hit = static.get(tuple(sizes[d] for d in self._dim_order))
                if hit is not None:
                    return hit
            for v, runner, bounds in dynamic:
                for d, lo, hi in bounds:
                    if not lo <= sizes[d] <= hi:
                        break
                else:
                    return v, runner
        shape = ", ".join(f"{d}={sizes[d]}" for d in self._dim_order)
        covered = "; ".join(f"{v.id}: " + ", ".join(f"{d} {v.dims[d]}" for d in self._dim_order) for v in self._variants)
        raise GuardError(f"no compiled variant covers {shape} (variants: {covered})", reason="no_variant")

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


def load(
    path: str | os.PathLike,
    *,
    device: str | None = None,
    verify: bool = True,
    trusted_keys: Iterable[Any] | None = None,
    min_version: int | None = None,
    refuse_rollback: bool = False,
    cache_dir: str | os.PathLike | None = None,
    state_dir: str | os.PathLike | None = None,
    copy_inputs: bool = False,
    threads: int | None = None,
    precision: str = "auto",
    max_bytes: int | None = None,
    warmup: bool = True,
) -> CompiledModel:
    """Load an artifact built by ``precompile build``, from its folder or a pack (``precompile pack``),
    and return a callable model.

    - ``device`` defaults to the artifact's target.
    - ``verify`` checks every file's sha256 against the manifest (sizes are always checked).
    - A pack is unpacked once into the local cache (``cache_dir``, default ``$PRECOMPILE_CACHE`` or
      ``~/.cache/precompile``); later loads of it read the cache entry, re-hashing only changed files.
    - ``trusted_keys``: Ed25519 public keys (paths, PEM or OpenSSH text, or key objects); the artifact
      must carry a valid signature by one of them.
    - ``min_version`` refuses older versions; ``refuse_rollback`` refuses a version older than one this
      host loaded before with ``refuse_rollback`` (recorded under ``state_dir``, default
      ``$PRECOMPILE_STATE`` or ``~/.local/state/precompile``). Expired artifacts are always refused.
    - ``copy_inputs`` moves inputs that live on another device to the model's, instead of refusing them.
    - ``threads``: torch's CPU thread count for this process. By default torch's count is cut to the
      CPUs the process really gets (affinity mask, cgroup CPU quota); a ThreadingWarning says when
      the threading will still hurt (spin-waiting OpenMP threads on a shared host: set
      OMP_WAIT_POLICY=PASSIVE before starting Python).
    - ``precision``: ``"auto"`` serves the bf16/int8 variants the build's gate kept (fastest first) where
      this CPU has the features they need, fp32 elsewhere; ``"fp32"`` only fp32; ``"bf16"``/``"int8"``
      that precision first (IncompatibleArtifactError when the artifact or this CPU has none). The
      model's ``precision`` says what it serves; ``stats()`` and the variant ids (``int8-v0``) too.
    - ``max_bytes`` (a URL): refuse to download an object larger than this (the size the store's
      ``index.json`` records bounds it too).
    - ``warmup`` runs every variant once on its hint shape before returning (``model.warmup()``), so
      the first real call meets warm code; ``warmup=False`` returns at once. It runs in the calling
      thread: OpenMP keeps one thread team per calling thread, so a thread that calls for the first
      time still starts its own (call ``model.warmup()`` once in each, for a pool of callers). A new
      shape on a dynamic variant is still slower the first time.

    Raises ArtifactError for a missing, unreadable or corrupt artifact, IncompatibleArtifactError when
    it was built for another host, and UntrustedArtifactError when it fails the trust policy; all of
    them before any compiled code is opened.

    >>> model = load("artifacts/text-classifier")
    >>> logits = model(ids, mask)          # same arguments and result structure as forward()
    >>> model = load("text-classifier.tar.zst", trusted_keys=["release.pub"], refuse_rollback=True)
    """
    if precision not in REQUESTS:
        raise ValueError(f"precision={precision!r}: expected one of {', '.join(REQUESTS)}")
    fit_threads(threads)
    opened = open_artifact(
        path,
        device=device,
        verify=verify,
        trusted_keys=trusted_keys,
        min_version=min_version,
        refuse_rollback=refuse_rollback,
        cache_dir=cache_dir,
        state_dir=state_dir,
        max_bytes=max_bytes,
    )
    with opened:  # holds the rollback ledger's lock, with refuse_rollback, until the version is recorded
        root, manifest, device = opened.root, opened.manifest, opened.device
        weights = opened.weights()
        _check_constants(manifest, weights)
        kind = parse_device(device)[0]
        choice = choose([v for v in manifest.variants if v.device == kind], precision, host_cpu_features(), str(root))
        runners, device_weights = _open_runners(root, manifest, weights, device, choice)
        model = CompiledModel(
            root,
            manifest,
            weights,
            runners,
            device,
            device_weights=device_weights,
            copy_inputs=copy_inputs,
            digest=opened.digest,
            precision=choice,
        )
        if warmup:
            try:
                model.warmup()
            except RuntimeError as e:
                raise ArtifactError(f"{root}: the warm-up call failed: {_first_line(e)}") from e
        opened.loaded()
    return model


def _open_runners(
    root: Path, manifest: Manifest, weights: MappedWeights, device: str, precision: Choice = Choice(("fp32",))
) -> tuple[dict[str, Any], dict[str, torch.Tensor]]:
    """Open the variants for ``device`` and hand each its constants; return the runners and the
    constants copied to the device (they must live as long as the runners).

    On CPU the runners use views of the memory map in place; on CUDA each stored tensor is copied to
    the GPU once and shared by every variant that needs it.
    """
    kind, index = parse_device(device)
    graphs = kind == "cuda" and manifest.cuda is not None and manifest.cuda.cuda_graphs
    on_device: dict[str, torch.Tensor] = {}
    runners = {}
    for v in manifest.variants:
        if v.device != kind or not precision.serves(v):
            continue
        try:
            runner = open_package(str(root / v.file), single_threaded=graphs and v.kind == "static", device_index=index)
            expected = set(runner.get_constant_fqns())
        except RuntimeError as e:
            raise ArtifactError(f"{root}: variant {v.id!r}: cannot open {v.file}: {_first_line(e)}") from None
        if v.embedded_constants:  # the package holds its own (hashed with it); nothing to hand over
            runners[v.id] = _Cast(runner, TORCH_DTYPES[v.dtype]) if v.dtype is not None else runner
            continue
        if expected != set(v.constants):
            raise ArtifactError(
                f"{root}: variant {v.id!r}: the compiled code needs constants {sorted(expected - set(v.constants))[:5]} "
                f"that the manifest does not list (files from different artifacts?)"
            )
        constants = {}
        for name in v.constants:
            stored = v.constant_prefix + name
            if kind == "cuda" and stored not in on_device:
                on_device[stored] = weights.tensors[stored].to(f"cuda:{index}")
            constants[name] = on_device[stored] if kind == "cuda" else weights.tensors[stored]
        # user_managed: the runner uses these tensors in place (no copy); check_full_update: every
        # constant must be given, since a missing one would be read as null by the compiled code.
        try:
            runner.load_constants(constants, False, True, True)
        except RuntimeError as e:
            raise ArtifactError(f"{root}: variant {v.id!r}: the runner refused the weights: {_first_line(e)}") from None
        runners[v.id] = _Cast(runner, TORCH_DTYPES[v.dtype]) if v.dtype is not None else runner
    if not runners:
        have = sorted({v.device for v in manifest.variants})
        raise IncompatibleArtifactError(f"{root}: no variants for {kind} (the artifact has {', '.join(have)} variants)")
    return runners, on_device


class _Cast:
    """A runner computing in a lower precision: floating inputs are cast at the boundary."""

    def __init__(self, runner: Any, dtype: torch.dtype):
        self.runner = runner
        self.dtype = dtype

    def run(self, tensors: list) -> list:
        return self.runner.run([t.to(self.dtype) if t.is_floating_point() else t for t in tensors])

    def get_constant_fqns(self) -> list[str]:
        return self.runner.get_constant_fqns()


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


def host_cpu_features() -> frozenset[str]:
    """This CPU's features, as the host check read them (once per process)."""
    return host_facts().cpu_features


def _first_line(e: BaseException) -> str:
    text = str(e).strip()
    return text.splitlines()[0] if text else type(e).__name__
