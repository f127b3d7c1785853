"""``Batcher``: gather concurrent calls into batches the compiled variants serve.

    batcher = loader.Batcher(live, max_batch=8, max_delay_ms=2)   # a CompiledModel or a Live
    outputs = batcher(ids, mask)                                   # from any number of threads
    future = batcher.submit(ids=ids, mask=mask)                    # or: (outputs, variant, serving)

Each call is checked by the model's guards in the caller's thread (a refused call fails alone, before
it is queued), then waits at most ``max_delay_ms`` for company. Calls of equal shape except the batch
dim are concatenated along it, run once, and the outputs cut back, so each caller gets what its own
call returns (within the build's tolerance).

The batch dim and the dims calls may differ in come from the artifact's ``batching`` section (the
profile's ``batching:``, checked by the build against eager on padded samples). Calls that differ
in a padded dim (sequence length) batch together when every one of them lies within the tightest
dynamic variant's range holding the oldest: each input is grown to the largest size in the batch
with its pad value, and every output axis following the dim is cut back to each caller's own size.
Other dims must be equal.

Without that section (artifacts built before it, or profiles without it), the batch dim is the dim
named ``batch`` when it is axis 0 of every input and, per the manifest's ``output_dims``, of every
output, and calls batch only with calls of equal shape except the batch dim. A model without one is
served call by call. When the profile declared no ``outputs`` (no ``output_dims``), every batch's
outputs are checked to have axis 0 of the batch's size; the first that does not is retried call by
call and the model is then served call by call.

Batch size: calls are taken oldest first up to ``max_batch`` rows and never beyond the largest batch a
variant serves for that shape. A batch whose shape has no static variant is padded up to a static
variant's shape (batch size, and padded dims) only when the build's measurements (``check.measure``)
show that static variant at most as slow as the dynamic one would be on the real work, estimated as
``dynamic_ms * real / padded`` (rows times the padded dims' sizes; a conservative estimate: a dynamic
variant's time grows less than linearly at small sizes); otherwise it runs at its largest sizes.
Padding rows repeat the batch's last row, so they pass the same value guards, and are cut off the
outputs.

A batch that fails is retried call by call, so one bad call cannot fail its batch-mates. A call whose
future was cancelled before its batch ran (the caller went away) is dropped from it.
"""

from __future__ import annotations

import bisect
import threading
import time
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import Any, Callable

import torch

from .errors import LoaderError
from .live import Live, Serving
from .model import CompiledModel

BATCH_DIM = "batch"  # the batch dim of artifacts without a ``batching`` section
# Upper bounds (ms) of the queue-wait histogram's buckets; the last bucket is everything above.
WAIT_BUCKETS_MS = (0.5, 1.0, 2.0, 5.0, 10.0, 20.0, 50.0, 100.0)


class BatcherFull(LoaderError):
    """The batcher's queue holds ``max_queue`` calls already: try again later (HTTP 503)."""


class BatcherClosed(LoaderError):
    """The batcher was closed; it takes no more calls."""


@dataclass(frozen=True)
class BatchPlan:
    """How one model is batched: its batch dim (None: call by call, ``why`` says why), the static
    batch sizes per shape of the other dims, which of them padding may aim at, the batch axis of
    each input and output, and the dims calls may differ in (padded) with the axes they touch."""

    batch_dim: str | None
    why: str = ""
    statics: dict[tuple, list[int]] = field(default_factory=dict)  # other dims' sizes -> static batch sizes
    pad_to: dict[tuple, dict[int, tuple[float, float]]] = field(default_factory=dict)  # -> size -> (static_ms, dynamic_ms)
    others: tuple[str, ...] = ()  # the dims other than the batch dim, in the manifest's order (the keys above)
    input_axes: tuple[int, ...] = ()  # per input, its batch axis (empty: axis 0 of every input)
    output_axes: tuple[int, ...] | None = None  # per flat output, its batch axis; None: axis 0, checked per batch
    pad_dims: tuple[str, ...] = ()  # the dims calls may differ in, padded to the batch's largest
    pad_inputs: tuple[tuple[tuple[int, ...], ...], ...] = ()  # per pad dim, per input: the axes it is on
    pad_outputs: tuple[tuple[tuple[int, ...], ...], ...] = ()  # per pad dim, per flat output: the axes following it
    pad_values: tuple[float, ...] = ()  # per input, what padding fills it with

    def input_axis(self, i: int) -> int:
        return self.input_axes[i] if self.input_axes else 0


def batch_plan(model: CompiledModel) -> BatchPlan:
    """Find ``model``'s batch dim, padded dims and static sizes (see the module docstring)."""
    m = model.manifest
    section = m.batching
    if section is not None:
        dim = section.dim
        input_axes = tuple(spec.shape.index(dim) for spec in m.inputs)
        output_axes: tuple[int, ...] | None = tuple(axes.index(dim) for axes in m.output_dims or ())
    else:
        dim, input_axes, output_axes = BATCH_DIM, (), None
        if dim not in m.dims:
            return BatchPlan(None, f"no dim named {dim!r}")
        for spec in m.inputs:
            if not spec.shape or spec.shape[0] != dim or dim in spec.shape[1:]:
                return BatchPlan(None, f"input {spec.name!r}: {dim!r} is not its axis 0 alone")
        for i, axes in enumerate(m.output_dims or ()):
            if not axes or axes[0] != dim or dim in axes[1:]:
                return BatchPlan(None, f"output {i}: {dim!r} is not its axis 0 alone")
        if m.output_dims is not None:
            output_axes = tuple(0 for _ in m.output_dims)
    others = tuple(d for d in m.dims if d != dim)
    statics: dict[tuple, list[int]] = {}
    for v in model.variants:
        if v.kind == "static":
            statics.setdefault(tuple(v.dims[d].min for d in others), []).append(v.dims[dim].min)
    for sizes in statics.values():
        sizes.sort()
    measured = {entry["variant"]: entry for entry in m.check.get("measure", []) if entry.get("kept")}
    pad_to: dict[tuple, dict[int, tuple[float, float]]] = {}
    for v in model.variants:
        entry = measured.get(v.id)
        if v.kind == "static" and entry is not None:
            key = tuple(v.dims[d].min for d in others)
            pad_to.setdefault(key, {})[v.dims[dim].min] = (entry["static_ms"], entry["dynamic_ms"])
    pad_dims = section.pad if section is not None else ()
    return BatchPlan(
        dim,
        "",
        statics,
        pad_to,
        others=others,
        input_axes=input_axes,
        output_axes=output_axes,
        pad_dims=pad_dims,
        pad_inputs=tuple(tuple(_axes(spec.shape, d) for spec in m.inputs) for d in pad_dims),
        pad_outputs=tuple(tuple(_axes(axes, d) for axes in m.output_dims or ()) for d in pad_dims),
        pad_values=tuple(section.pad_value.get(spec.name, 0.0) if section is not None else 0.0 for spec in m.inputs),
    )


def _axes(shape: tuple, dim: str) -> tuple[int, ...]:
    return tuple(axis for axis, s in enumerate(shape) if s == dim)


def aim(plan: BatchPlan, key: tuple, rows: int, max_rows: int, reach: tuple = ()) -> tuple[tuple, int]:
    """The shape to run ``rows`` real rows at, whose other dims are ``key`` (padded dims already at the
    batch's largest): ``(key, rows)``, or a static variant's larger shape, up to ``max_rows`` and
    within ``reach`` (per padded dim, the range the batch was gathered in), where padding to it was
    measured to pay (see the module docstring)."""
    if rows in plan.statics.get(key, ()):
        return key, rows
    at = [plan.others.index(d) for d in plan.pad_dims]
    work = rows * _product(key[i] for i in at)
    best, best_work = (key, rows), None
    for other, sizes in plan.pad_to.items():
        if any(other[i] != key[i] for i in range(len(key)) if i not in at):
            continue
        if any(not key[i] <= other[i] <= hi for i, (_, hi) in zip(at, reach or [(0, 2**62)] * len(at))):
            continue
        for size, (static_ms, dynamic_ms) in sizes.items():
            padded = size * _product(other[i] for i in at)
            if rows <= size <= max_rows and static_ms <= dynamic_ms * work / padded and (best_work is None or padded < best_work):
                best, best_work = (other, size), padded
    return best


def padded_size(plan: BatchPlan, key: tuple, rows: int, max_rows: int) -> int:
    """The batch size to run ``rows`` real rows at: ``rows``, or a larger static size up to
    ``max_rows`` where padding to it was measured to pay (see the module docstring)."""
    return aim(plan, key, rows, max_rows)[1]


def grow(t: torch.Tensor, axes: tuple[int, ...], size: int, value: float) -> torch.Tensor:
    """``t`` grown to ``size`` along each of ``axes``, the new entries filled with ``value``."""
    for axis in axes:
        missing = size - t.shape[axis]
        if missing > 0:
            shape = list(t.shape)
            shape[axis] = missing
            t = torch.cat([t, torch.full(shape, value, dtype=t.dtype, device=t.device)], dim=axis)
    return t


def _product(values) -> int:
    out = 1
    for v in values:
        out *= v
    return out


@dataclass
class _Call:
    model: CompiledModel  # the version whose guards passed the call
    tensors: list[torch.Tensor]
    key: tuple  # (model, shapes and dtypes of every input but the batch axis and the padded axes)
    rows: int
    max_rows: int
    plan: BatchPlan
    other_sizes: tuple  # sizes of plan.others
    future: Future
    queued_at: float
    pads: tuple = ()  # sizes of plan.pad_dims
    reach: tuple = ()  # per padded dim, (lo, hi): the sizes calls batched with this one as the oldest may have
    waited: float = 0.0

    def joins(self, first: _Call) -> bool:
        """Whether this call may run in a batch whose oldest call is ``first``."""
        return self.key == first.key and all(lo <= n <= hi for n, (lo, hi) in zip(self.pads, first.reach))


class Batcher:
    """Batch concurrent calls to a ``CompiledModel`` or a ``Live`` holder; see the module docstring.

    - ``max_batch``: most rows one batch holds (default: the largest batch any variant serves).
    - ``max_delay_ms``: longest a call waits for company before its batch runs. A call alone in the
      queue right after a batch of one call (a single client) runs at once: waiting only pays when
      calls overlap, and a lone caller would otherwise pay the whole delay on every call.
      ``wait_alone=True`` delays it too (the classic fixed-delay batcher; tests use it to batch
      calls submitted one after another from a single thread).
    - ``max_queue``: calls waiting at most; one more raises ``BatcherFull``.

    - ``on_batch(size, waits)``: called after each batch ran, with its size (padding included) and
      each call's queue wait in seconds (for a server's metrics).

    ``submit(...)`` returns a Future of ``(outputs, variant, serving)`` (``serving`` is None for a
    plain model); cancelling it before its batch runs drops the call. ``batcher(...)`` waits and
    returns the outputs. ``close()`` runs what is queued and stops the worker thread.
    """

    def __init__(
        self,
        target: CompiledModel | Live,
        *,
        max_batch: int | None = None,
        max_delay_ms: float = 2.0,
        max_queue: int = 1024,
        on_batch: Callable[[int, list[float]], None] | None = None,
        wait_alone: bool = False,
    ):
        if max_batch is not None and max_batch < 1:
            raise ValueError("max_batch must be at least 1")
        if max_delay_ms < 0 or max_queue < 1:
            raise ValueError("max_delay_ms must be ≥ 0 and max_queue ≥ 1")
        self.target = target
        self.max_batch = max_batch
        self.max_delay = max_delay_ms / 1000
        self.max_queue = max_queue
        self.on_batch = on_batch
        self.wait_alone = wait_alone
        self._queue: list[_Call] = []
        self._last_batch_calls = 0  # how many calls the latest batch held: 0 or 1, nobody waits for company
        self._cond = threading.Condition()
        self._closed = False
        self._plans: dict[int, tuple[CompiledModel, BatchPlan]] = {}
        self._stats_lock = threading.Lock()
        self.reset_stats()
        self._worker = threading.Thread(target=self._loop, name="precompile-batcher", daemon=True)
        self._worker.start()

    # --- calling -------------------------------------------------------------------------------

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        return self.submit(*args, **kwargs).result()[0]

    def call_detailed(self, *args: Any, **kwargs: Any) -> tuple[Any, str, Serving | None]:
        """Like ``Live.call_detailed``: the outputs, the variant that ran the batch, the version."""
        return self.submit(*args, **kwargs).result()

    def submit(self, *args: Any, **kwargs: Any) -> Future:
        """Check the call's guards here (raising GuardError at once) and queue it; see the class."""
        model = self.target.model if isinstance(self.target, Live) else self.target
        tensors, sizes, variant = model.check(*args, **kwargs)
        plan = self._plan(model)
        future: Future = Future()
        pads: tuple = ()
        reach: tuple = ()
        if plan.batch_dim is None or variant is None:  # no batch dim, or a pad/split policy serves it
            key: tuple = (id(model), object())  # batch-mates of none
            rows, max_rows, other_sizes = 1, 1, ()
        else:
            other_sizes = tuple(sizes[d] for d in plan.others)
            key = (id(model), self._shape_key(plan, tensors))
            rows = sizes[plan.batch_dim]
            max_rows = self._max_rows(model, plan, sizes)
            if plan.pad_dims:
                pads = tuple(sizes[d] for d in plan.pad_dims)
                reach, max_rows = self._reach(model, plan, sizes, pads, max_rows)
        call = _Call(model, tensors, key, rows, max_rows, plan, other_sizes, future, time.monotonic(), pads, reach)
        with self._cond:
            if self._closed:
                raise BatcherClosed("the batcher is closed")
            if len(self._queue) >= self.max_queue:
                with self._stats_lock:
                    self._full += 1
                raise BatcherFull(f"the batch queue is full ({self.max_queue} calls waiting); try again later")
            self._queue.append(call)
            self._cond.notify()
        with self._stats_lock:
            self._requests += 1
            shape = tuple(sorted(sizes.items()))
            self._request_shapes[shape] = self._request_shapes.get(shape, 0) + 1
        return future

    def _plan(self, model: CompiledModel) -> BatchPlan:
        entry = self._plans.get(id(model))
        if entry is None or entry[0] is not model:  # the model is held, so its id is not reused meanwhile
            entry = (model, batch_plan(model))
            self._plans = {id(model): entry}  # the latest version only: a swap retires the old one
        return entry[1]

    @staticmethod
    def _shape_key(plan: BatchPlan, tensors: list[torch.Tensor]) -> tuple:
        """What calls batched together share: each input's dtype and sizes, but for its batch axis
        and the axes of padded dims."""
        free = [set() for _ in tensors]
        for per_input in plan.pad_inputs:
            for i, axes in enumerate(per_input):
                free[i].update(axes)
        return tuple(
            (tuple(-1 if a == plan.input_axis(i) or a in free[i] else n for a, n in enumerate(t.shape)), t.dtype)
            for i, t in enumerate(tensors)
        )

    def _reach(self, model: CompiledModel, plan: BatchPlan, sizes: dict[str, int], pads: tuple, max_rows: int) -> tuple[tuple, int]:
        """Per padded dim, the sizes a batch this call starts may gather (the range of the tightest
        dynamic variant holding the call, so the padded batch stays on compiled code made for such
        sizes), and its row limit there; a call no dynamic variant holds batches with equal sizes."""
        holding = [v for v in model.variants if v.kind == "dynamic" and all(sizes[d] in r for d, r in v.dims.items())]
        if not holding:
            return tuple((n, n) for n in pads), max_rows
        tightest = min(holding, key=lambda v: _product(r.max - r.min + 1 for r in v.dims.values()))
        reach = tuple((tightest.dims[d].min, tightest.dims[d].max) for d in plan.pad_dims)
        return reach, max(1, min(max_rows, tightest.dims[plan.batch_dim].max))

    def _max_rows(self, model: CompiledModel, plan: BatchPlan, sizes: dict[str, int]) -> int:
        """The most rows a batch of this shape may hold: ``max_batch``, within the variants' reach."""
        reach = max(
            (
                v.dims[plan.batch_dim].max
                for v in model.variants
                if all(sizes[d] in r for d, r in v.dims.items() if d != plan.batch_dim)
            ),
            default=1,
        )
        return max(1, min(reach, self.max_batch or reach))

    # --- the worker ----------------------------------------------------------------------------

    def _loop(self) -> None:
        while True:
            with self._cond:
                while not self._queue and not self._closed:
                    self._cond.wait()
                if not self._queue:
                    return
                first = self._queue[0]
                deadline = first.queued_at + self.max_delay
                while not self._closed and self._rows_waiting(first) < first.max_rows:
                    if not self.wait_alone and self._last_batch_calls <= 1 and len(self._queue) == 1:
                        break  # a lone caller (the last batch was one call too) is not kept waiting
                    left = deadline - time.monotonic()
                    if left <= 0:
                        break
                    self._cond.wait(left)
                batch = self._take(first)
                self._last_batch_calls = len(batch)
            if batch:
                self._run(batch)

    def _rows_waiting(self, first: _Call) -> int:
        return sum(c.rows for c in self._queue if c.joins(first))

    def _take(self, first: _Call) -> list[_Call]:
        """Remove from the queue the oldest calls of ``first``'s shape, up to its row limit; drop
        those whose caller went away (cancelled future)."""
        taken, kept, rows, dropped = [], [], 0, 0
        now = time.monotonic()
        for call in self._queue:
            if call.joins(first) and (not taken or rows + call.rows <= first.max_rows):
                if call.future.set_running_or_notify_cancel():
                    taken.append(call)
                    rows += call.rows
                    call.waited = now - call.queued_at
                    self._observe_wait(call.waited)
                else:
                    dropped += 1
            else:
                kept.append(call)
        self._queue = kept
        if dropped:
            with self._stats_lock:
                self._dropped += dropped
        return taken

    def _run(self, batch: list[_Call]) -> None:
        rows = sum(c.rows for c in batch)
        head = batch[0]
        plan = head.plan
        key = list(head.other_sizes)
        at = [plan.others.index(d) for d in plan.pad_dims]
        for j, i in enumerate(at):
            key[i] = max(c.pads[j] for c in batch)
        key, size = aim(plan, tuple(key), rows, head.max_rows, head.reach)
        target = [key[i] for i in at]
        grown = sum(1 for c in batch if list(c.pads) != target)
        if len(batch) == 1 and size == rows and not grown:
            self._run_alone(head)
            self._count_batch(batch, rows, size, grown)
            return
        try:
            inputs = []
            for i in range(len(head.tensors)):
                axis = plan.input_axis(i)
                parts = [c.tensors[i] for c in batch]
                for j, n in enumerate(target):
                    parts = [grow(t, plan.pad_inputs[j][i], n, plan.pad_values[i]) for t in parts]
                if size > rows:
                    last = parts[-1].narrow(axis, parts[-1].shape[axis] - 1, 1)
                    shape = list(last.shape)
                    shape[axis] = size - rows
                    parts.append(last.expand(shape))
                inputs.append(torch.cat(parts, dim=axis))
            outputs, variant, serving = self._call(inputs)
            pieces = _split(outputs, plan, batch, size)
        except _NotBatched as e:
            self._plans = {id(head.model): (head.model, BatchPlan(None, str(e)))}
            for call in batch:
                self._run_alone(call)
            return
        except Exception:  # noqa: BLE001: retried call by call below, each failing or not on its own
            with self._stats_lock:
                self._retried += 1
            for call in batch:
                self._run_alone(call)
            return
        self._count_batch(batch, rows, size, grown)
        for call, piece in zip(batch, pieces):
            call.future.set_result((piece, variant, serving))

    def _run_alone(self, call: _Call) -> None:
        try:
            call.future.set_result(self._call(call.tensors))
        except Exception as e:  # noqa: BLE001: the caller gets it
            call.future.set_exception(e)

    def _call(self, inputs: list[torch.Tensor]) -> tuple[Any, str, Serving | None]:
        if isinstance(self.target, Live):
            return self.target.call_detailed(*inputs)
        outputs, variant = self.target.call_detailed(*inputs)
        return outputs, variant, None

    # --- lifecycle and stats -------------------------------------------------------------------

    def close(self) -> None:
        """Run the calls already queued, then stop the worker; later calls raise BatcherClosed."""
        with self._cond:
            self._closed = True
            self._cond.notify_all()
        self._worker.join()

    def __enter__(self) -> Batcher:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

    def _observe_wait(self, seconds: float) -> None:
        ms = seconds * 1000
        with self._stats_lock:
            self._wait_buckets[bisect.bisect_left(WAIT_BUCKETS_MS, ms)] += 1
            self._wait_sum += ms
            self._wait_max = max(self._wait_max, ms)

    def _count_batch(self, batch: list[_Call], rows: int, size: int, grown: int) -> None:
        with self._stats_lock:
            self._batches += 1
            self._sizes[size] = self._sizes.get(size, 0) + 1
            self._padded_rows += size - rows
            self._grown += grown
        if self.on_batch is not None:
            self.on_batch(size, [c.waited for c in batch])

    def stats(self) -> dict[str, Any]:
        """The model's ``stats()`` (its shapes are those of the batches that ran, what the next build
        should compile for), with ``batching``: requests and their shapes, batches formed and their
        sizes (padding included), queue wait, and the calls refused, dropped or retried."""
        model_stats = self.target.stats()
        with self._stats_lock:
            waits = sum(self._wait_buckets)
            model_stats["batching"] = {
                "requests": self._requests,
                "request_shapes": [
                    {"dims": dict(key), "count": n} for key, n in sorted(self._request_shapes.items(), key=lambda kv: (-kv[1], kv[0]))
                ],
                "batches": self._batches,
                "batch_sizes": {str(s): n for s, n in sorted(self._sizes.items())},
                "padded_rows": self._padded_rows,
                "padded_calls": self._grown,
                "queue_wait_ms": {
                    "count": waits,
                    "mean": self._wait_sum / waits if waits else 0.0,
                    "max": self._wait_max,
                    "buckets": {f"le_{b}": n for b, n in zip(WAIT_BUCKETS_MS + ("inf",), self._wait_buckets)},
                },
                "refused_queue_full": self._full,
                "dropped_cancelled": self._dropped,
                "retried_batches": self._retried,
            }
        return model_stats

    def reset_stats(self) -> None:
        with self._stats_lock:
            self._requests = self._batches = self._padded_rows = self._grown = 0
            self._full = self._dropped = self._retried = 0
            self._sizes: dict[int, int] = {}
            self._request_shapes: dict[tuple, int] = {}
            self._wait_buckets = [0] * (len(WAIT_BUCKETS_MS) + 1)
            self._wait_sum = self._wait_max = 0.0

    def __repr__(self) -> str:
        return f"<Batcher max_batch={self.max_batch} max_delay_ms={self.max_delay * 1000:g} over {self.target!r}>"


class _NotBatched(Exception):
    """An output whose axis 0 is not the batch's size: the model cannot be batched this way."""


def _split(outputs: Any, plan: BatchPlan, batch: list[_Call], size: int) -> list[Any]:
    """Per call, its rows of every output (along the output's batch axis; the padding rows, up to
    ``size``, left out) with every axis following a padded dim cut back to the call's own size,
    in forward()'s structure."""
    flat = _flatten(outputs)
    per_call: list[list[torch.Tensor]] = [[] for _ in batch]
    for k, t in enumerate(flat):
        axis = plan.output_axes[k] if plan.output_axes is not None else 0
        if t.dim() <= axis or t.shape[axis] != size:
            raise _NotBatched(f"an output of shape {tuple(t.shape)} for a batch of {size}: its axis {axis} does not follow the batch")
        start = 0
        for c, call in enumerate(batch):
            piece = t.narrow(axis, start, call.rows)
            for j, n in enumerate(call.pads):
                for a in plan.pad_outputs[j][k]:
                    piece = piece.narrow(a, 0, n)
            per_call[c].append(piece)
            start += call.rows
    return [_rebuild(outputs, iter(pieces)) for pieces in per_call]


def _flatten(value: Any) -> list[torch.Tensor]:
    """The output tensors in the manifest's flat order (dicts in their key order, as the loader builds them)."""
    if isinstance(value, torch.Tensor):
        return [value]
    items = value.values() if isinstance(value, dict) else value
    return [t for item in items for t in _flatten(item)]


def _rebuild(like: Any, flat) -> Any:
    """``like``'s structure holding the next tensors of ``flat``."""
    if isinstance(like, torch.Tensor):
        return next(flat)
    if isinstance(like, dict):
        return {k: _rebuild(v, flat) for k, v in like.items()}
    return type(like)(_rebuild(v, flat) for v in like)
