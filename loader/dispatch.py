"""What a loaded artifact does with a call, whatever runs its compiled code: guard the inputs, pick
the variant (static table, then the tightest dynamic range, tier by tier of precision), serve sizes
no variant covers through the pad/split policies, count stats, and give back forward()'s structure.

Everything here is shape arithmetic over plain ints and the manifest; the arrays pass through
untouched. ``loader.model.CompiledModel`` (torch tensors, torch's package loader) and
``loader.native.NativeModel`` (numpy arrays, the C interface of the compiled code) are this class
with their own guard, array operations and runners: a runner is anything with ``run(list) -> list``.
"""

from __future__ import annotations

import threading
import time
from pathlib import Path
from typing import Any

from .errors import GuardError
from .manifest import Manifest, Variant
from .opening import OnDemand, Opener
from .outputs import unflatten
from .policy import ArrayOps, Plan, Policies
from .precision import Choice
from .shapes import ShapeGuard
from .warmup import DEFAULT_WARMUP_SHAPES, after_hint
from .weights import MappedWeights

# Distinct shapes remembered by stats(); beyond this, calls are counted in shapes_not_tracked.
MAX_SHAPES_TRACKED = 10_000
# Shapes waiting for the background warm-up behind a first-calls variant (``Variant.first_calls_of``);
# beyond this, a new shape's calls stay on that variant until the queue has room again.
MAX_SHAPES_WAITING = 64


class ServedModel:
    """A loaded artifact's call path; see ``loader.load`` and ``loader.load_native``."""

    def __init__(
        self,
        root: Path,
        manifest: Manifest,
        weights: MappedWeights,
        runners: dict[str, Any],
        guard: ShapeGuard,
        ops: ArrayOps,
        *,
        digest: str | None = None,
        precision: Choice = Choice(("fp32",)),
    ):
        self.path = root
        self._weights = weights  # the memory the runners' constants live in: kept as long as they are
        self.manifest = manifest
        # The digest of the manifest bytes as read (what a signature covers), not of a re-serialization.
        self.digest = digest
        self._runners = runners
        self._variants = tuple(v for v in manifest.variants if v.id in runners)
        self.precision = precision  # the precisions served, preferred first, and why others are not
        self.variant_precision = {v.id: v.precision for v in self._variants}
        self._guard = guard
        self.ops = ops  # the array operations of this model's kind (policies, loader.Batcher)
        self._policies = Policies(manifest, ops) if any(p != "error" for p in manifest.policy.values()) else None
        self._dim_order = tuple(manifest.dims)
        self._index_tables()
        self._output = manifest.output
        self._single_tensor = manifest.output.kind == "tensor"
        self._stats_lock = threading.Lock()
        self._warm = threading.local()  # .done: this thread ran warmup() (warm_thread)
        self.warmup_shapes = DEFAULT_WARMUP_SHAPES  # which shapes warm_variant runs (loader.warmup)
        self.warmed: dict[str, list[dict[str, int]]] = {}  # the sizes each variant's warm-ups ran, in order
        self._hint_seconds: dict[str, float] = {}  # each variant's hint call in its last warm-up
        self.opening: Opener | None = None  # opens the variants not open yet (loader.opening)
        # A variant's first-calls variant (Variant.first_calls_of), the shapes each variant ran in
        # this process, and the background thread that runs a variant at a shape its twin served.
        self._first_calls = {
            v.first_calls_of: (v, runners[v.id])
            for v in self._variants
            if v.first_calls_of is not None and v.first_calls_of in runners
        }
        self._ran: dict[str, set[tuple[int, ...]]] = {}  # at most MAX_SHAPES_TRACKED a variant
        self._shapes_warmer = ShapesWarmer(self) if self._first_calls else None
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
            if v.first_calls_of is not None:  # serves the first calls of another, never a call of its own
                continue
            if v.kind == "static":
                static[tuple(v.dims[d].min for d in self._dim_order)] = (v, runners[v.id])
            else:
                dynamic.append(v)
        # Tightest range first, so a call lands on the most specific variant that holds it.
        dynamic.sort(key=lambda v: _volume(v))
        return static, [
            (v, runners[v.id], [(d, v.dims[d].min, v.dims[d].max) for d in self._dim_order]) for v in dynamic
        ]

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

    def check(self, *args: Any, **kwargs: Any) -> tuple[list, dict[str, int], Variant | None]:
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
            raise GuardError(
                f"no variant {variant_id!r} (variants: {', '.join(v.id for v in self.variants)})", reason="no_variant"
            )
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
        twin = self._first_calls.get(variant.id)
        warm = None
        if twin is not None:
            key = tuple(sizes[d] for d in self._dim_order)
            ran = self._ran.get(variant.id, ())
            if key not in ran and len(ran) < MAX_SHAPES_TRACKED:  # a shape it never ran: its twin answers now
                warm = variant.id
                variant, runner = twin
        start = time.perf_counter()
        outputs = runner.run(tensors)
        runs.append((variant.id, time.perf_counter() - start))
        if warm is not None:  # after the call: the warm-up's CPU does not slow the call it is for
            self._shapes_warmer.add(warm, key)
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

    def warmup(self, *, hint_only: bool = False) -> None:
        """Run every open variant once on its hint shape, so the first real request meets warm code
        (a variant still to be opened, ``load(open=...)``, is warmed as it is opened), then on the
        shapes ``warmup_shapes`` adds, unless ``hint_only`` (``warm_rest`` runs those later: a load in
        the background mode). Warm-up calls are not counted in ``stats()``."""
        for v in self._variants:
            if self.is_open(v.id):
                self.warm_variant(v.id, hint_only=hint_only)
        self._warm.done = True

    def warm_variant(self, variant_id: str, *, hint_only: bool = False) -> None:
        """Run one variant once on its hint shape (opening it first if it is not open yet), then, as
        ``warmup_shapes`` says and unless ``hint_only``, the shapes after it (``warm_rest``);
        ``warmed`` records the sizes run."""
        variant = next(v for v in self._variants if v.id == variant_id)
        runner = self._runners[variant_id]
        if isinstance(runner, OnDemand):
            runner.get()  # opened first, so that the hint's time below is the call's alone
        start = time.perf_counter()
        self.run_variant(variant_id, *self.example_inputs(variant))
        self._hint_seconds[variant_id] = time.perf_counter() - start
        self._record_warmed(variant_id, variant.hint)
        if not hint_only:
            self.warm_rest(variant_id)

    def warm_rest(self, variant_id: str) -> None:
        """Run a variant whose hint ran (``warm_variant``) on the shapes ``warmup_shapes`` warms after
        the hint: the largest shape of its ranges and its traffic's, within the budget its hint's time
        sets (``loader.warmup.after_hint``); each is added to ``warmed`` as it ran."""
        variant = next(v for v in self._variants if v.id == variant_id)
        for sizes in after_hint(variant, self.warmup_shapes, self._hint_seconds.get(variant_id, 0.0)):
            self.run_variant(variant_id, *self.example_inputs(variant, sizes))
            self._record_warmed(variant_id, sizes)

    def _record_warmed(self, variant_id: str, sizes: dict[str, int]) -> None:
        """Add ``sizes`` to what the variant's warm-ups ran. Another thread's warm-up (``warm_thread``,
        at the hints alone or at every shape) runs shapes already recorded: the record keeps them
        once and in order, never starting over while that thread is part way through."""
        done = self.warmed.setdefault(variant_id, [])
        if sizes not in done:
            done.append(dict(sizes))
        self.note_ran(variant_id, tuple(sizes[d] for d in self._dim_order))

    def note_ran(self, variant_id: str, key: tuple[int, ...]) -> None:
        """The variant ran at this shape (its sizes in dim order) in this process: calls there no longer
        go to its first-calls variant. Past MAX_SHAPES_TRACKED shapes, none does (a set's add and
        look-up are each one step under the GIL: calls read it without a lock)."""
        ran = self._ran.setdefault(variant_id, set())
        if len(ran) < MAX_SHAPES_TRACKED:
            ran.add(key)

    def wait_first_calls(self, timeout: float | None = None) -> bool:
        """Wait until the shapes the first-calls variants served have been run on the variants they
        stood in for (at most ``timeout`` seconds); True when none is left. For tests and benchmarks."""
        return self._shapes_warmer is None or self._shapes_warmer.join(timeout)

    def is_open(self, variant_id: str) -> bool:
        """Whether the variant's compiled code is open (``load(open=...)`` may leave some for later)."""
        runner = self._runners[variant_id]
        return not isinstance(runner, OnDemand) or runner.opened

    def wait_opened(self, timeout: float | None = None) -> bool:
        """Wait for the background opener (``load(open="background")``), at most ``timeout`` seconds;
        True once it has no variant left to open or warm (a variant it could not open is refused when
        called)."""
        if self.opening is not None:
            self.opening.join(timeout)
            return not self.opening.is_alive()
        return True

    def close(self) -> None:
        """Free every variant's compiled model now: its container deleted and its library closed,
        where the runner can (the C entry points' runners: every torch-free one, and ``loader.load``'s
        CPU variants); a variant not open yet is never opened. Calls after this raise. The weights'
        memory goes with the last reference to this object. Runs once the calls in flight are done,
        and once the background opener (``load(open="background")``) has finished the step it was in:
        an open or a warm-up running compiled code on these containers."""
        if self.opening is not None:
            self.opening.stop()
        if self._shapes_warmer is not None:
            self._shapes_warmer.stop()
        for runner in self._runners.values():
            if isinstance(runner, OnDemand):
                runner.close(_close_runner)
            else:
                _close_runner(runner)

    def warm_thread(self, *, hint_only: bool = False) -> None:
        """``warmup()`` in the calling thread, unless this thread has run it already.

        oneDNN's compiled kernels are shared by the process (another thread's first call finds them in
        its cache), but OpenMP starts a thread team for each thread that calls into it, at that
        thread's first parallel region, and torch keeps other state per thread: the first call of a
        thread pays for it. Call this once at the start of every thread that will call the model, e.g.
        ``ThreadPoolExecutor(initializer=model.warm_thread)``. ``hint_only``: each variant's hint
        alone, enough for the thread's own state where the load warmed the other shapes for the
        process (a new thread's first call at them then costs 1.0-1.4x its steady one, against 2-4x
        at a shape no thread ran: ``bench/results/load-stall.md``); a server warming a model while
        others serve (``precompile.serve.service``) keeps its CPUs for them.
        """
        if not getattr(self._warm, "done", False):
            self.warmup(hint_only=hint_only)

    def example_inputs(self, variant: Variant, sizes: dict[str, int] | None = None) -> list:
        """Valid inputs at ``variant``'s hint shape, or at ``sizes`` (for warm-up and probes), each
        filled with its smallest valid value (0 may be outside an integer input's range)."""
        sizes = variant.hint if sizes is None else sizes
        return [
            self._full(
                [sizes[s] if isinstance(s, str) else s for s in spec.shape],
                spec.range.min if spec.range is not None else 0,
                spec.dtype,
            )
            for spec in self.manifest.inputs
        ]

    def _full(self, shape: list[int], value: float, dtype: str) -> Any:
        """An array of the model's kind (a torch tensor on its device, a numpy array), filled with ``value``."""
        raise NotImplementedError

    def _outputs(self, outputs: list) -> Any:
        if self._single_tensor:
            return outputs[0]
        return unflatten(self._output, outputs)

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
        covered = "; ".join(
            f"{v.id}: " + ", ".join(f"{d} {v.dims[d]}" for d in self._dim_order) for v in self._variants
        )
        raise GuardError(f"no compiled variant covers {shape} (variants: {covered})", reason="no_variant")


class ShapesWarmer:
    """Runs a variant, on a thread of its own at a lower CPU priority, at each shape its first-calls
    variant served for it (``ServedModel._run_timed``), one shape at a time, on inputs of that shape
    (``example_inputs``); then calls there go to the variant itself. oneDNN's kernels are shared by
    the process: created here, the serving threads' next call at the shape finds them (1.0-1.4x the
    steady call, against 2-4x at a shape no thread ran: ``bench/results/load-stall.md``). A shape
    whose run fails stays with the first-calls variant.

    The thread ends once no shape waits, and a new one starts for the next: an idle thread would keep
    its OpenMP team, and libgomp cuts every team's spin at a barrier while a process has more OpenMP
    threads than CPUs, which slowed MobileNetV2's steady calls 1.2-1.6x on 2 cores
    (``bench/results/conv_routes.md``)."""

    def __init__(self, model: ServedModel):
        self._model = model
        self._lock = threading.Condition()
        self._waiting: dict[tuple[str, tuple[int, ...]], None] = {}  # in order, oldest first
        self._failed: set[tuple[str, tuple[int, ...]]] = set()  # run, and failed: left to the first-calls variant
        self._thread: threading.Thread | None = None  # None: no shape waiting or running
        self._stopped = False

    def add(self, variant_id: str, key: tuple[int, ...]) -> None:
        item = (variant_id, key)
        with self._lock:
            if (
                self._stopped
                or item in self._waiting
                or item in self._failed
                or len(self._waiting) >= MAX_SHAPES_WAITING
            ):
                return
            self._waiting[item] = None
            if self._thread is None:
                self._thread = threading.Thread(target=self._work, name=f"first-calls:{self._model.name}", daemon=True)
                self._thread.start()

    def _work(self) -> None:
        from .threads import lower_priority

        lower_priority()  # the serving threads keep the CPUs first
        model = self._model
        while True:
            with self._lock:
                if self._stopped or not self._waiting:
                    self._thread = None
                    self._lock.notify_all()
                    return
                item = next(iter(self._waiting))
                del self._waiting[item]
            variant_id, key = item
            variant = next(v for v in model.variants if v.id == variant_id)
            try:
                model.run_variant(variant_id, *model.example_inputs(variant, dict(zip(model._dim_order, key))))
            except Exception:  # noqa: BLE001 -- its calls stay with the first-calls variant, which serves them
                with self._lock:
                    self._failed.add(item)
                continue
            model.note_ran(variant_id, key)

    def join(self, timeout: float | None = None) -> bool:
        """Wait until no shape is waiting or running; True when so."""
        with self._lock:
            return self._lock.wait_for(lambda: self._thread is None, timeout)

    def stop(self) -> None:
        """No shape run from now on; waits for the one running, if any (close() frees the code under it)."""
        with self._lock:
            self._stopped = True
            self._waiting.clear()
            thread = self._thread
        if thread is not None and thread is not threading.current_thread():
            thread.join()


def _close_runner(runner: Any) -> None:
    close = getattr(runner, "close", None)  # torch's package loader has none: its library stays
    if close is not None:
        close()


def _volume(v: Variant) -> int:
    out = 1
    for r in v.dims.values():
        out *= r.max - r.min + 1
    return out
