"""``Batcher``: gather concurrent calls into batches the compiled variants serve.

    batcher = loader.Batcher(live, max_batch=8, max_delay_ms=2)   # a CompiledModel or a Live
    outputs = batcher(ids, mask)                                   # from any number of threads
    future = batcher.submit(ids=ids, mask=mask)                    # or: (outputs, variant, serving)

Each call is checked by the model's guards in the caller's thread (a refused call fails alone, before
it is queued), then waits at most ``max_delay_ms`` for company. Calls of equal shape except the batch
dim are concatenated along it, run once, and the outputs cut back, so each caller gets what its own
call returns (within the build's tolerance). Calls that differ in another dim (sequence length) are
grouped by equal shape; padding such dims to batch them together needs the profile's ``batching:``
section, a later step.

The batch dim is the dim named ``batch`` when it is axis 0 of every input and, per the manifest's
``output_dims``, of every output. A model without one is served call by call. When the profile
declared no ``outputs`` (no ``output_dims``), every batch's outputs are checked to have axis 0 of
the batch's size; the first that does not is retried call by call and the model is then served
call by call.

Batch size: calls are taken oldest first up to ``max_batch`` rows and never beyond the largest batch a
variant serves for that shape. A batch whose size has no static variant is padded up to the next
static size only when the build's measurements (``check.measure``) show that static variant at most
as slow as the dynamic one would be on the real rows, estimated as ``dynamic_ms * rows / size`` (a
conservative estimate: a dynamic variant's time grows less than linearly at small sizes). Padding
rows repeat the batch's last row, so they pass the same value guards, and are cut off the outputs.

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

BATCH_DIM = "batch"  # until profiles name it in a ``batching:`` section
# Upper bounds (ms) of the queue-wait histogram's buckets; the last bucket is everything above.
WAIT_BUCKETS_MS = (0.5, 1.0, 2.0, 5.0, 10.0, 20.0, 50.0, 100.0)


class BatcherFull(LoaderError):
    """The batcher's queue holds ``max_queue`` calls already: try again later (HTTP 503)."""


class BatcherClosed(LoaderError):
    """The batcher was closed; it takes no more calls."""


@dataclass(frozen=True)
class BatchPlan:
    """How one model is batched: its batch dim (None: call by call, ``why`` says why), the static
    batch sizes per shape of the other dims, and which of them padding may aim at."""

    batch_dim: str | None
    why: str = ""
    statics: dict[tuple, list[int]] = field(default_factory=dict)  # other dims' sizes -> static batch sizes
    pad_to: dict[tuple, dict[int, tuple[float, float]]] = field(default_factory=dict)  # -> size -> (static_ms, dynamic_ms)


def batch_plan(model: CompiledModel) -> BatchPlan:
    """Find ``model``'s batch dim and its static batch sizes (see the module docstring)."""
    m = model.manifest
    if BATCH_DIM not in m.dims:
        return BatchPlan(None, f"no dim named {BATCH_DIM!r}")
    for spec in m.inputs:
        if not spec.shape or spec.shape[0] != BATCH_DIM or BATCH_DIM in spec.shape[1:]:
            return BatchPlan(None, f"input {spec.name!r}: {BATCH_DIM!r} is not its axis 0 alone")
    for i, axes in enumerate(m.output_dims or ()):
        if not axes or axes[0] != BATCH_DIM or BATCH_DIM in axes[1:]:
            return BatchPlan(None, f"output {i}: {BATCH_DIM!r} is not its axis 0 alone")
    others = [d for d in m.dims if d != BATCH_DIM]
    statics: dict[tuple, list[int]] = {}
    for v in model.variants:
        if v.kind == "static":
            statics.setdefault(tuple(v.dims[d].min for d in others), []).append(v.dims[BATCH_DIM].min)
    for sizes in statics.values():
        sizes.sort()
    measured = {entry["variant"]: entry for entry in m.check.get("measure", []) if entry.get("kept")}
    pad_to: dict[tuple, dict[int, tuple[float, float]]] = {}
    for v in model.variants:
        entry = measured.get(v.id)
        if v.kind == "static" and entry is not None:
            key = tuple(v.dims[d].min for d in others)
            pad_to.setdefault(key, {})[v.dims[BATCH_DIM].min] = (entry["static_ms"], entry["dynamic_ms"])
    return BatchPlan(BATCH_DIM, "", statics, pad_to)


def padded_size(plan: BatchPlan, key: tuple, rows: int, max_rows: int) -> int:
    """The batch size to run ``rows`` real rows at: ``rows``, or a larger static size up to
    ``max_rows`` where padding to it was measured to pay (see the module docstring)."""
    sizes = [s for s in plan.statics.get(key, []) if s <= max_rows]
    if rows in sizes:
        return rows
    i = bisect.bisect_right(sizes, rows)
    if i == len(sizes):
        return rows
    size = sizes[i]
    timing = plan.pad_to.get(key, {}).get(size)
    if timing is not None and timing[0] <= timing[1] * rows / size:
        return size
    return rows


@dataclass
class _Call:
    model: CompiledModel  # the version whose guards passed the call
    tensors: list[torch.Tensor]
    key: tuple  # (model, shapes and dtypes of every input but the batch axis)
    rows: int
    max_rows: int
    plan: BatchPlan
    other_sizes: tuple
    future: Future
    queued_at: float
    waited: float = 0.0


class Batcher:
    """Batch concurrent calls to a ``CompiledModel`` or a ``Live`` holder; see the module docstring.

    - ``max_batch``: most rows one batch holds (default: the largest batch any variant serves).
    - ``max_delay_ms``: longest a call waits for company before its batch runs.
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
        self._queue: list[_Call] = []
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
        if plan.batch_dim is None or variant is None:  # no batch dim, or a pad/split policy serves it
            key: tuple = (id(model), object())  # batch-mates of none
            rows, max_rows, other_sizes = 1, 1, ()
        else:
            other_sizes = tuple(sizes[d] for d in model.manifest.dims if d != plan.batch_dim)
            key = (id(model), tuple((tuple(t.shape[1:]), t.dtype) for t in tensors))
            rows = sizes[plan.batch_dim]
            max_rows = self._max_rows(model, plan, sizes)
        call = _Call(model, tensors, key, rows, max_rows, plan, other_sizes, future, time.monotonic())
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
                    left = deadline - time.monotonic()
                    if left <= 0:
                        break
                    self._cond.wait(left)
                batch = self._take(first)
            if batch:
                self._run(batch)

    def _rows_waiting(self, first: _Call) -> int:
        return sum(c.rows for c in self._queue if c.key == first.key)

    def _take(self, first: _Call) -> list[_Call]:
        """Remove from the queue the oldest calls of ``first``'s shape, up to its row limit; drop
        those whose caller went away (cancelled future)."""
        taken, kept, rows, dropped = [], [], 0, 0
        now = time.monotonic()
        for call in self._queue:
            if call.key == first.key and (not taken or rows + call.rows <= first.max_rows):
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
        size = padded_size(head.plan, head.other_sizes, rows, head.max_rows)
        if len(batch) == 1 and size == rows:
            self._run_alone(head)
            self._count_batch(batch, rows, size)
            return
        try:
            inputs = []
            for i in range(len(head.tensors)):
                parts = [c.tensors[i] for c in batch]
                if size > rows:
                    last = parts[-1][-1:]
                    parts.append(last.expand(size - rows, *last.shape[1:]))
                inputs.append(torch.cat(parts, dim=0))
            outputs, variant, serving = self._call(inputs)
            pieces = _split(outputs, [c.rows for c in batch], size)
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
        self._count_batch(batch, rows, size)
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

    def _count_batch(self, batch: list[_Call], rows: int, size: int) -> None:
        with self._stats_lock:
            self._batches += 1
            self._sizes[size] = self._sizes.get(size, 0) + 1
            self._padded_rows += size - rows
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
            self._requests = self._batches = self._padded_rows = 0
            self._full = self._dropped = self._retried = 0
            self._sizes: dict[int, int] = {}
            self._request_shapes: dict[tuple, int] = {}
            self._wait_buckets = [0] * (len(WAIT_BUCKETS_MS) + 1)
            self._wait_sum = self._wait_max = 0.0

    def __repr__(self) -> str:
        return f"<Batcher max_batch={self.max_batch} max_delay_ms={self.max_delay * 1000:g} over {self.target!r}>"


class _NotBatched(Exception):
    """An output whose axis 0 is not the batch's size: the model cannot be batched this way."""


def _split(outputs: Any, rows: list[int], size: int) -> list[Any]:
    """Cut each output tensor along axis 0 into pieces of ``rows`` (the padding rows, up to
    ``size``, are left out), keeping the structure."""
    if isinstance(outputs, torch.Tensor):
        if outputs.dim() == 0 or outputs.shape[0] != size:
            raise _NotBatched(f"an output of shape {tuple(outputs.shape)} for a batch of {size}: its axis 0 does not follow the batch")
        pieces, start = [], 0
        for n in rows:
            pieces.append(outputs[start : start + n])
            start += n
        return pieces
    if isinstance(outputs, dict):
        split = {k: _split(v, rows, size) for k, v in outputs.items()}
        return [{k: split[k][i] for k in outputs} for i in range(len(rows))]
    split_items = [_split(v, rows, size) for v in outputs]
    return [type(outputs)(items[i] for items in split_items) for i in range(len(rows))]
