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

Instances: ``instances=N`` worker threads take batches from the one queue, each as soon as it is
free (Triton's dynamic batcher with N model instances). A compiled call at a small batch keeps
little of a second core busy (its parallel loops are short), so on a small host one batch at a time
leaves CPUs idle while the next batch waits; N batches at once use them. With ``team`` (a function
setting the calling thread's OpenMP team size), a worker runs its batch with all ``threads`` when no
other worker is running one and nothing else waits (a lone caller keeps the whole machine), else
with ``threads // N``, so that busy workers share the threads rather than each asking for all.

This module is the worker thread and its queue; the decisions above are ``loader.serving.batch_plan``'s
(pure functions of the manifest and a call's sizes) and the joining of inputs and cutting of
outputs ``loader.serving.batch_tensors``'s.
"""

from __future__ import annotations

import bisect
import logging
import threading
import time
from collections.abc import Callable
from concurrent.futures import Future
from dataclasses import dataclass
from typing import Any

from ..dispatch import ServedModel
from ..errors import LoaderError
from .batch_plan import BatchPlan, Placement, aim, batch_plan, place
from .batch_tensors import NotBatched, join_inputs, split_outputs
from .idle import IdleStack
from .live import Live, Serving

log = logging.getLogger("loader")
_EACH = object()  # what _next_batch returns when on_each gave a function a worker has not run yet

# Upper bounds (ms) of the queue-wait histogram's buckets; the last bucket is everything above.
# The results of one batch are set inside a burst (``_together``): a done-callback that would wake
# another thread (an event loop awaiting the futures) asks ``after_burst`` to do so once, at its end,
# rather than once per future while the loop races the worker for the GIL between two of them.
_burst = threading.local()


def after_burst(wake: Callable[[], None]) -> bool:
    """Inside a burst of futures set together on this thread, have ``wake`` called once when the burst
    ends (however many of its futures ask) and return True; outside one, return False (wake now)."""
    pending = getattr(_burst, "pending", None)
    if pending is None:
        return False
    if wake not in pending:
        pending.append(wake)
    return True


class _together:
    def __enter__(self) -> None:
        _burst.pending = []

    def __exit__(self, *exc: object) -> None:
        pending, _burst.pending = _burst.pending, None
        for wake in pending:
            wake()


WAIT_BUCKETS_MS = (0.5, 1.0, 2.0, 5.0, 10.0, 20.0, 50.0, 100.0)


class BatcherFull(LoaderError):
    """The batcher's queue holds ``max_queue`` calls already: try again later (HTTP 503)."""


class BatcherClosed(LoaderError):
    """The batcher was closed; it takes no more calls."""


@dataclass
class _Call:
    model: ServedModel  # the version whose guards passed the call
    tensors: list[Any]  # of the model's kind: torch tensors, or numpy arrays for the torch-free loader
    spot: Placement  # its batch-mates' key, rows and limits
    plan: BatchPlan
    future: Future
    queued_at: float
    waited: float = 0.0

    @property
    def rows(self) -> int:
        return self.spot.rows

    def joins(self, first: _Call) -> bool:
        """Whether this call may run in a batch whose oldest call is ``first``."""
        mine, oldest = self.spot, first.spot
        return mine.key == oldest.key and all(lo <= n <= hi for n, (lo, hi) in zip(mine.pads, oldest.reach))


class Batcher:
    """Batch concurrent calls to a loaded model or a ``Live`` holder; see the module docstring. The
    model may be either loader's (``loader.load``: torch tensors; ``loader.load_native``: numpy arrays):
    batches are joined and cut with its own array operations (``model.ops``).

    - ``max_batch``: most rows one batch holds (default: the largest batch any variant serves).
    - ``max_delay_ms``: longest a call waits for company before its batch runs. A call alone in the
      queue right after a batch of one call (a single client) runs at once: waiting only pays when
      calls overlap, and a lone caller would otherwise pay the whole delay on every call.
      ``wait_alone=True`` delays it too (the classic fixed-delay batcher; tests use it to batch
      calls submitted one after another from a single thread).
    - ``max_queue``: calls waiting at most; one more raises ``BatcherFull``.

    - ``instances``: batches running at once, each on a worker thread of its own (default 1).
    - ``threads``, ``team``: the OpenMP threads the workers share, and the function that sets the
      calling thread's team size and returns True once it has (``precompile serve`` passes its
      ``set_team_size``); without ``team``, team sizes are left as they are (see the module docstring).

    - ``on_batch(size, waits)``: called after each batch ran, with its size (padding included) and
      each call's queue wait in seconds (for a server's metrics).
    - ``on_each(fn)``: every worker runs ``fn()`` before its next batch, once per team size it runs
      batches with (a newly loaded model's ``warmup``; see ``on_each``).

    ``submit(...)`` returns a Future of ``(outputs, variant, serving)`` (``serving`` is None for a
    plain model); cancelling it before its batch runs drops the call. ``batcher(...)`` waits and
    returns the outputs. ``close()`` runs what is queued and stops the worker thread.
    """

    def __init__(
        self,
        target: ServedModel | Live,
        *,
        max_batch: int | None = None,
        max_delay_ms: float = 2.0,
        max_queue: int = 1024,
        on_batch: Callable[[int, list[float]], None] | None = None,
        wait_alone: bool = False,
        instances: int = 1,
        threads: int = 1,
        team: Callable[[int], Any] | None = None,
    ):
        if max_batch is not None and max_batch < 1:
            raise ValueError("max_batch must be at least 1")
        if instances < 1 or threads < 1:
            raise ValueError("instances and threads must be at least 1")
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
        lock = threading.RLock()
        self._cond = threading.Condition(lock)  # the queue's changes, for a worker waiting for company
        self._idle = IdleStack(lock, instances)  # a new call wakes the worker idle the shortest time
        self._company = 0  # workers waiting for more calls to join their batch
        self._closed = False
        self._running = 0  # workers running a batch now
        self.instances = instances
        self.threads = threads
        self._team = team
        self._plans: dict[int, tuple[ServedModel, BatchPlan]] = {}
        self._each: tuple[int, Callable[[], Any] | None] = (0, None)  # (generation, fn) for on_each
        self._stats_lock = threading.Lock()
        self.reset_stats()
        self._workers = [
            threading.Thread(target=self._loop, args=(i,), name=f"precompile-batcher-{i}", daemon=True)
            for i in range(instances)
        ]
        for worker in self._workers:
            worker.start()

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
        spot = place(plan, model, tensors, sizes, variant, max_batch=self.max_batch)
        future: Future = Future()
        call = _Call(model, tensors, spot, plan, future, time.monotonic())
        with self._cond:
            if self._closed:
                raise BatcherClosed("the batcher is closed")
            if len(self._queue) >= self.max_queue:
                with self._stats_lock:
                    self._full += 1
                raise BatcherFull(f"the batch queue is full ({self.max_queue} calls waiting); try again later")
            self._queue.append(call)
            if self._company:
                self._cond.notify_all()  # it may join their batch; one that takes its batch wakes another
            else:
                self._idle.wake_one()
        with self._stats_lock:
            self._requests += 1
            shape = tuple(sorted(sizes.items()))
            self._request_shapes[shape] = self._request_shapes.get(shape, 0) + 1
        return future

    def _plan(self, model: ServedModel) -> BatchPlan:
        entry = self._plans.get(id(model))
        if entry is None or entry[0] is not model:  # the model is held, so its id is not reused meanwhile
            entry = (model, batch_plan(model))
            self._plans = {id(model): entry}  # the latest version only: a swap retires the old one
        return entry[1]

    # --- the worker ----------------------------------------------------------------------------

    def on_each(self, fn: Callable[[], Any]) -> None:
        """Have every worker run ``fn()`` before its next batch, once with each team size it runs
        batches with (all of ``threads`` alone, its share beside others): a newly loaded model's
        ``warmup``: ideep plans each convolution or matmul per calling thread, and oneDNN compiles
        its kernels per thread count, so a worker's first batch would otherwise pay both (MobileNetV2
        at its hint: 39 of 72 oneDNN kernels compiled again at 1 thread after a warm-up at 2). Replaces
        an earlier ``fn`` not yet run; its failures are logged, and the batches then say why."""
        with self._cond:
            self._each = (self._each[0] + 1, fn)
            self._wake_all()

    def _wake_all(self) -> None:
        """Wake every worker, asleep or waiting for company (``_cond`` held)."""
        self._idle.wake_all()
        self._cond.notify_all()

    def _loop(self, index: int) -> None:
        team, seen = 0, 0  # this worker's OpenMP team size as last set (0: not set yet); on_each's generation
        while True:
            with self._cond:
                batch = self._next_batch(seen, index)
                if batch is None:
                    return
                if batch is _EACH:
                    seen, each = self._each[0], self._each[1]
                else:
                    self._running += 1
                    alone = self._running == 1 and not self._queue
            if batch is _EACH:
                team = self._run_each(each, team)
                continue
            size = self.threads if alone else max(1, self.threads // self.instances)
            if self._team is not None and size != team and self._team(size):
                team = size
            try:
                if batch:
                    self._run(batch)
            finally:
                with self._cond:
                    self._running -= 1

    def _run_each(self, each: Callable[[], Any] | None, team: int) -> int:
        """``each()`` at every team size this worker runs batches with; the team size left set."""
        sizes = dict.fromkeys((max(1, self.threads // self.instances), self.threads))
        for size in sizes if self._team is not None else (None,):
            if size is not None and size != team and self._team(size):
                team = size
            try:
                if each is not None:
                    each()
            except Exception:  # noqa: BLE001: a warm-up that fails leaves the batches to say why
                log.warning("a batch worker could not warm up", exc_info=True)
        return team

    def _next_batch(self, seen: int = 0, index: int = 0) -> list[_Call] | object | None:
        """Wait (holding ``_cond``) for calls and take the next batch (empty when every call of it was
        cancelled); ``_EACH`` when ``on_each`` gave a function newer than generation ``seen``; None
        once closed with nothing queued. ``index``: the worker's, whose condition it sleeps on."""
        while True:
            while not self._queue and not self._closed and self._each[0] == seen:
                self._idle.sleep(index)
            if self._each[0] != seen and not self._closed:
                return _EACH
            if not self._queue:
                return None
            first = self._queue[0]
            deadline = first.queued_at + self.max_delay
            while not self._closed and self._rows_waiting(first) < first.spot.max_rows:
                if not self.wait_alone and self._last_batch_calls <= 1 and len(self._queue) == 1:
                    break  # a lone caller (the last batch was one call too) is not kept waiting
                left = deadline - time.monotonic()
                if left <= 0:
                    break
                self._company += 1
                try:
                    self._cond.wait(left)
                finally:
                    self._company -= 1
                if not self._queue or self._queue[0] is not first:
                    break  # another worker took it meanwhile
            if self._queue and self._queue[0] is first:
                batch = self._take(first)
                self._last_batch_calls = len(batch)
                if self._queue:  # calls left for another batch: a worker for them
                    self._idle.wake_one()
                return batch

    def _rows_waiting(self, first: _Call) -> int:
        return sum(c.rows for c in self._queue if c.joins(first))

    def _take(self, first: _Call) -> list[_Call]:
        """Remove from the queue the oldest calls of ``first``'s shape, up to its row limit; drop
        those whose caller went away (cancelled future)."""
        taken, kept, rows, dropped = [], [], 0, 0
        now = time.monotonic()
        for call in self._queue:
            if call.joins(first) and (not taken or rows + call.rows <= first.spot.max_rows):
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
        plan, spot = head.plan, head.spot
        key = list(spot.other_sizes)
        at = [plan.others.index(d) for d in plan.pad_dims]
        for j, i in enumerate(at):
            key[i] = max(c.spot.pads[j] for c in batch)
        key, size = aim(plan, tuple(key), rows, spot.max_rows, spot.reach)
        target = [key[i] for i in at]
        grown = sum(1 for c in batch if list(c.spot.pads) != target)
        if len(batch) == 1 and size == rows and not grown:
            self._run_alone(head)
            self._count_batch(batch, rows, size, grown)
            return
        try:
            ops = head.model.ops
            inputs = join_inputs(ops, plan, [c.tensors for c in batch], pads=target, rows=rows, size=size)
            outputs, variant, serving = self._call(inputs)
            shares = [(c.rows, c.spot.pads) for c in batch]
            pieces = split_outputs(ops, plan, head.model.manifest.output, outputs, shares, size=size)
        except NotBatched as e:
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
        with _together():
            for call, piece in zip(batch, pieces):
                call.future.set_result((piece, variant, serving))

    def _run_alone(self, call: _Call) -> None:
        try:
            call.future.set_result(self._call(call.tensors))
        except Exception as e:  # noqa: BLE001: the caller gets it
            call.future.set_exception(e)

    def _call(self, inputs: list[Any]) -> tuple[Any, str, Serving | None]:
        if isinstance(self.target, Live):
            return self.target.call_detailed(*inputs)
        outputs, variant = self.target.call_detailed(*inputs)
        return outputs, variant, None

    # --- lifecycle and stats -------------------------------------------------------------------

    def close(self) -> None:
        """Run the calls already queued, then stop the workers; later calls raise BatcherClosed."""
        with self._cond:
            self._closed = True
            self._wake_all()
        for worker in self._workers:
            worker.join()

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
                    {"dims": dict(key), "count": n}
                    for key, n in sorted(self._request_shapes.items(), key=lambda kv: (-kv[1], kv[0]))
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
        return (
            f"<Batcher max_batch={self.max_batch} max_delay_ms={self.max_delay * 1000:g} instances={self.instances} "
            f"over {self.target!r}>"
        )
