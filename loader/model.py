"""``load()`` and the callable it returns: guards, dispatch to a variant, output structure.

Loading never compiles: each CPU variant's shared library is copied out of its package and driven
through its container's C entry points (``loader.cpu_runner``: off the GIL, closed with the model);
a CUDA variant, or one that needs torch's proxy executor, is opened through the C++ package loader
(``torch._C._aoti.AOTIModelPackageLoader``). Neither imports ``torch._inductor`` (about 1 s on a
small host). The weights (read privately from a folder, or mapped from a pack's read-only cache
entry) are handed over as views, shared by all variants.
"""

from __future__ import annotations

import os
from collections.abc import Iterable
from pathlib import Path
from typing import Any

import torch

from .aoti import load_constants, open_package
from .artifact import HeldFile, sha256_file
from .cpu_runner import direct_opener
from .cuda import CudaRunner, GraphedRunner, parse_device
from .dispatch import ServedModel
from .errors import ArtifactError, IncompatibleArtifactError, first_line
from .guards import TORCH_DTYPES, InputGuard
from .host import host_facts, native_cpu_problem
from .isa import AUTO, IsaChoice, choose_isa
from .manifest import Manifest, Variant
from .native.containers import NeedsTorch
from .opening import DEFAULT_OPEN, LoadOptions, OnDemand, open_model, open_variants
from .pages import ConstantsRelease, mapped_libraries
from .policy import ArrayOps
from .precision import Choice, choose
from .source import Opened
from .threads import concurrent_runners, fit_threads
from .warmup import DEFAULT_WARMUP_SHAPES
from .weights import MappedWeights


def _take(t: torch.Tensor, axis: int, start: int, size: int) -> torch.Tensor:
    return t.narrow(axis, start, size).contiguous()


TORCH_OPS = ArrayOps(
    cat=lambda tensors, axis: torch.cat(tensors, dim=axis),
    fill=lambda like, shape, value: torch.full(shape, value, dtype=like.dtype, device=like.device),
    take=_take,
    narrow=lambda t, axis, start, size: t.narrow(axis, start, size),
)


class CompiledModel(ServedModel):
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
        isa: IsaChoice = IsaChoice(),
    ):
        self.device_type, index = parse_device(device)
        self.cpu_isa = isa.isa  # the x86-64 level (or "native") the CPU variants served were built for
        self.device = "cpu" if index is None else f"cuda:{index}"
        self._device_weights = device_weights  # constants copied to a GPU, used in place by the runners
        guard = InputGuard(
            manifest.inputs,
            manifest.dims,
            torch.device(self.device),
            unchecked={d for d, p in manifest.policy.items() if p != "error"},
            copy_inputs=copy_inputs,
        )
        super().__init__(root, manifest, weights, runners, guard, TORCH_OPS, digest=digest, precision=precision)

    def warmup(self, *, hint_only: bool = False) -> None:
        """Run every variant once on its hint shape, so the first real request meets warm code, then
        on the shapes ``warmup_shapes`` adds unless ``hint_only`` (``ServedModel.warmup``).

        On CUDA, with ``cuda_graphs`` in the profile, this also captures one CUDA graph per static
        variant; later calls of that shape replay it. Warm-up calls are not counted in ``stats()``.
        """
        graphs = self.device_type == "cuda" and self.manifest.cuda is not None and self.manifest.cuda.cuda_graphs
        if not graphs:
            return super().warmup(hint_only=hint_only)
        for v in self._variants:
            args = self.example_inputs(v)
            self.run_variant(v.id, *args)
            runner = self._runners[v.id]
            cast = runner.dtype if isinstance(runner, _Cast) else None
            inner = runner.runner if cast is not None else runner
            if v.kind == "static" and not isinstance(inner, GraphedRunner):
                example = [a.to(cast) if cast is not None and a.is_floating_point() else a for a in args]
                graphed = GraphedRunner(inner, example)
                self._runners[v.id] = _Cast(graphed, cast) if cast is not None else graphed
        self._index_tables()
        self._warm.done = True
        torch.cuda.synchronize(self.device)

    def _full(self, shape: list[int], value: float, dtype: str) -> torch.Tensor:
        return torch.full(shape, value, dtype=TORCH_DTYPES[dtype], device=self.device)

    def __repr__(self) -> str:
        return (
            f"<CompiledModel {self.name!r} from {str(self.path)!r}: {len(self._runners)} variant(s) on {self.device}>"
        )


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
    warmup_shapes: str = DEFAULT_WARMUP_SHAPES,
    cpu_isa: str = AUTO,
    open: str = DEFAULT_OPEN,
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
      the threading will still hurt (spin-waiting OpenMP threads on a shared host: import loader before
      torch, or set OMP_WAIT_POLICY=ACTIVE GOMP_SPINCOUNT=10000 before starting Python: a spin of 0.1 ms,
      then sleep; ``loader.threads.wait_env``).
    - ``precision``: ``"auto"`` serves the bf16/int8 variants the build's gate kept (fastest first) where
      this CPU has the features they need, fp32 elsewhere; ``"fp32"`` only fp32; ``"bf16"``/``"int8"``
      that precision first (IncompatibleArtifactError when the artifact or this CPU has none). The
      model's ``precision`` says what it serves; ``stats()`` and the variant ids (``int8-v0``) too.
    - ``max_bytes`` (a URL): refuse to download an object larger than this (the size the store's
      ``index.json`` records bounds it too).
    - ``warmup`` runs every variant once on its hint shape before returning (``model.warmup()``), so
      the first real call meets warm code; ``warmup=False`` returns at once. It runs in the calling
      thread: OpenMP keeps one thread team per calling thread, so a thread that calls for the first
      time still starts its own (call ``model.warm_thread()`` once in each, for a pool of callers). A
      new shape on a dynamic variant is still slower the first time (oneDNN compiles its kernels for
      it); ``import loader`` sizes oneDNN's caches so that the shapes already met stay compiled
      (``loader.threads.onednn_cache_env``).
    - ``warmup_shapes``: what the warm-up runs on a dynamic variant after its hint. ``"auto"`` (default):
      the largest shape its ranges hold (its buffers then mapped for any shape), then the traffic's
      hottest shapes (``plan.warm_shapes``), each part while its estimate fits ``loader.warmup.BUDGET_SECONDS``
      (``loader.warmup``); ``"range"``: all of them; ``"hint"``: the hint only. ``model.warmed`` says what ran.
    - ``cpu_isa``: an artifact built for several CPU ISAs (the profile's ``cpu.isa``) serves, by default
      (``"auto"``), the variants of the best one this CPU runs (``native`` first, then ``x86-64-v4``,
      ``x86-64-v3``); naming one (``"x86-64-v3"``) serves that one, e.g. for the same numerics on every
      host of a mixed fleet. The model's ``cpu_isa`` says which (None: the artifact has no ISA levels).
    - ``open`` (``loader.opening``), on CPU: ``"background"`` (default) opens the first variant before
      returning (warmed, with ``warmup``) and opens and warms the others in a thread of lower priority;
      ``"lazy"`` opens each other one at its first call; ``"eager"`` opens all first (always so on
      CUDA). A call on a variant not open yet waits for it, never fails for it. A folder's variant
      package is hashed just before it is opened, so a load hashes only what it opens.

    Raises ArtifactError for a missing, unreadable or corrupt artifact, IncompatibleArtifactError when
    it was built for another host, and UntrustedArtifactError when it fails the trust policy; all of
    them before any compiled code is opened.

    >>> model = load("artifacts/text-classifier")
    >>> logits = model(ids, mask)          # same arguments and result structure as forward()
    >>> model = load("text-classifier.tar.zst", trusted_keys=["release.pub"], refuse_rollback=True)

    Over 80 lines on purpose: most of it is this docstring, the reference of every option.
    """
    options = LoadOptions.of(locals())  # checked here, before anything is read
    fit_threads(threads)

    def build(opened: Opened) -> tuple[CompiledModel, list[OnDemand]]:
        root, manifest, device = opened.root, opened.manifest, opened.device
        weights = opened.weights()
        kind = parse_device(device)[0]
        isa = _choose_isa(manifest, kind, cpu_isa, str(root))
        mine = [v for v in manifest.variants if v.device == kind and isa.serves(v)]
        choice = choose(mine, precision, host_cpu_features(), str(root))
        # CUDA: device copies of the weights and CUDA graphs are made for all variants at once.
        mode = "eager" if kind == "cuda" else open
        runners, device_weights, pending = _open_runners(opened, weights, device, choice, isa, mode)
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
            isa=isa,
        )
        return model, pending

    return open_model(path, build, options, device=device, warmup_errors=(RuntimeError,))


def _choose_isa(manifest: Manifest, kind: str, requested: str, source: str) -> IsaChoice:
    """The CPU ISA whose variants serve a load on a ``kind`` device (``loader.isa.choose_isa``)."""
    if kind != "cpu":
        return IsaChoice()
    host = host_facts()
    return choose_isa(manifest.variants, requested, host.cpu_features, native_cpu_problem(manifest, host), source)


def _open_runners(
    opened: Opened,
    weights: MappedWeights,
    device: str,
    precision: Choice = Choice(("fp32",)),
    isa: IsaChoice = IsaChoice(),
    mode: str = "eager",
) -> tuple[dict[str, Any], dict[str, torch.Tensor], list[OnDemand]]:
    """The runners of the variants for ``device``, opened as ``mode`` says (``loader.opening``), the
    constants copied to the device (they must live as long as the runners) and the runners still to
    be opened.

    On CPU the runners use views of the memory map in place; on CUDA each stored tensor is copied to
    the GPU once and shared by every variant that needs it.
    """
    root, manifest = opened.root, opened.manifest
    kind, index = parse_device(device)
    graphs = kind == "cuda" and manifest.cuda is not None and manifest.cuda.cuda_graphs
    on_device: dict[str, torch.Tensor] = {}
    mine = {v.id: v for v in manifest.variants if v.device == kind and precision.serves(v) and isa.serves(v)}
    if not mine:
        have = sorted({v.device for v in manifest.variants})
        raise IncompatibleArtifactError(f"{root}: no variants for {kind} (the artifact has {', '.join(have)} variants)")

    held = {vid: HeldFile(root / v.file) for vid, v in mine.items()}  # until each is opened
    # CPU variants run through their container's C entry points, off the GIL (loader.cpu_runner).
    direct, open_direct = direct_opener(opened, mine, held, weights) if kind == "cpu" else (set(), None)

    def open_one(variant_id: str) -> Any:
        v = mine[variant_id]
        if variant_id in direct:
            try:
                runner = open_direct(variant_id)
            except NeedsTorch:  # its library calls torch's proxy executor: the package loader runs it
                held[variant_id] = HeldFile(root / v.file)
            else:
                return _Cast(runner, TORCH_DTYPES[v.dtype]) if v.dtype is not None else runner
        try:
            _check_package(opened, v, held[variant_id].path)
        except BaseException:
            held[variant_id].close()
            raise
        try:
            single = graphs and v.kind == "static"
            before = mapped_libraries() if v.embedded_constants and kind == "cpu" else None
            runner = open_package(
                held[variant_id].path,
                single_threaded=single,
                device_index=index,
                runners=concurrent_runners() if kind == "cpu" else 1,  # CUDA: one, as its graphs are captured
                standalone=v.shim is not None,
            )
            if before is not None:  # the package loader copied the constants out of the library it opened
                for library in mapped_libraries() - before:
                    ConstantsRelease(Path(library)).release()
            expected = set(runner.get_constant_fqns())
        except RuntimeError as e:
            raise ArtifactError(f"{root}: variant {v.id!r}: cannot open {v.file}: {first_line(e)}") from None
        finally:
            held[variant_id].close()  # AOTInductor copied the library out; a failed variant is refused for good
        if kind == "cuda":
            runner = CudaRunner(runner, index, single_threaded=single)
        if not v.embedded_constants:  # a frozen package holds its own (hashed with it); nothing to hand over
            _hand_constants(root, v, runner, expected, weights, kind, index, on_device)
        return _Cast(runner, TORCH_DTYPES[v.dtype]) if v.dtype is not None else runner

    runners, pending = open_variants(list(mine), open_one, mode)
    return runners, on_device, pending


def _check_package(opened: Opened, v: Variant, path: str) -> None:
    """Hash a folder's variant package (read from ``path``) just before it is opened
    (``open_artifact`` left it). AOTInductor reads it again to open it: a package rewritten in
    place in between is not caught here, as it was not when every package was hashed at load."""
    sha256 = opened.package_sha256(v)
    if sha256 is None:
        return
    try:
        digest = sha256_file(path)
    except OSError as e:
        raise ArtifactError(f"{opened.root}: {v.file}: cannot read ({e.strerror})") from None
    if digest != sha256:
        raise ArtifactError(f"{opened.root}: {v.file} does not match its sha256 in the manifest (changed or corrupt)")


def _hand_constants(
    root: Path,
    v: Variant,
    runner: Any,
    expected: set[str],
    weights: MappedWeights,
    kind: str,
    index: int | None,
    on_device: dict[str, torch.Tensor],
) -> None:
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
    try:  # in place where this torch's binding allows it (loader.aoti)
        load_constants(runner.runner if kind == "cuda" else runner, constants)
    except RuntimeError as e:
        raise ArtifactError(f"{root}: variant {v.id!r}: the runner refused the weights: {first_line(e)}") from None


class _Cast:
    """A runner computing in a lower precision: floating inputs are cast at the boundary."""

    def __init__(self, runner: Any, dtype: torch.dtype):
        self.runner = runner
        self.dtype = dtype

    def run(self, tensors: list) -> list:
        return self.runner.run([t.to(self.dtype) if t.is_floating_point() else t for t in tensors])

    def get_constant_fqns(self) -> list[str]:
        return self.runner.get_constant_fqns()

    def close(self) -> None:
        close = getattr(self.runner, "close", None)
        if close is not None:
            close()


def host_cpu_features() -> frozenset[str]:
    """This CPU's features, as the host check read them (once per process)."""
    return host_facts().cpu_features
