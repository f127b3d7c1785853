"""Execution instances: at most N calls of a model run at once, each on a thread that owns its OpenMP
team, with a bounded queue in front; a call beyond the queue is refused at once (503 / UNAVAILABLE).

Concurrent requests that all enter the compiled code together each start an OpenMP team on the same
cores: the teams contend, every call slows down, and throughput falls as clients are added (see
bench/results/serve_load.md). Triton Inference Server's answer is an instance count per model with a
queue in front; this is the same. Each instance is a thread that sets its own OpenMP team size
before its first call (``torch.set_num_threads``; on the torch-free path, libgomp's
``omp_set_num_threads``, once the loader has opened it): OpenMP's thread count is a per-thread
setting, and the compiled code is built with ``cpp.dynamic_threads``, so it reads it at every call: the process's threads are split between the
instances rather than every call asking for all of them.

    instances = Instances(count=1, threads=2, queue_size=64)
    future = instances.submit(live.call_detailed, ids=ids)   # InstancesFull when the queue is full
    outputs, variant, serving = future.result()
    instances.close()
"""

from __future__ import annotations

import collections
import ctypes
import logging
import sys
import threading
from collections.abc import Callable
from concurrent.futures import Future
from typing import Any

from loader.serving.idle import IdleStack
from loader.threads import cpu_allowance, default_threads

log = logging.getLogger("precompile.serve")


class InstancesFull(Exception):
    """Every instance is busy and the queue in front of them is full (answered 503 / UNAVAILABLE)."""

    def __init__(self, queue_size: int):
        super().__init__(
            f"the server is at capacity: every execution instance is busy and {queue_size} calls are waiting "
            "(--queue-size); retry later"
        )


class InstancesClosed(Exception):
    """The server is stopping: no new call is taken (answered 503 / UNAVAILABLE)."""

    def __init__(self) -> None:
        super().__init__("the server is stopping")


def default_count(
    *, workers: int = 1, threads: int | None = None, runtime: str = "torch", gil_free: bool | None = None
) -> int:
    """The instances this worker's share of the CPUs (those the process gets, over ``workers``) can
    feed. Where a call holds the GIL for its whole length (torch's binding: a CUDA variant on the
    torch runtime), each with a full OpenMP team of ``threads`` (default: torch's, ``OMP_NUM_THREADS``
    cut to the CPUs). Where calls let go of the GIL and run side by side (``gil_free``; by default
    on the torch-free runtime; CPU variants on the torch runtime too, ``loader.cpu_runner``: a
    container instance per CPU, ``loader.threads.concurrent_runners``), as many as
    ``default_batch_count``: a lone call gets the whole team, calls at once share it. At least one."""
    allowance = cpu_allowance()
    threads = threads if threads is not None else default_threads(allowance)
    if runtime == "native" if gil_free is None else gil_free:
        return default_batch_count(workers=workers, threads=threads, gil_free=True)
    return max(1, allowance.cpus // max(1, workers) // max(1, threads))


def default_batch_count(
    *, workers: int = 1, runtime: str = "torch", threads: int | None = None, gil_free: bool | None = None
) -> int:
    """With --batch: batches at once per worker, one per CPU of its share and at most its OpenMP
    ``threads`` (default: torch's, ``OMP_NUM_THREADS`` cut to the CPUs; loader.Batcher splits them
    between the batches running and gives a lone one them all), where compiled calls can overlap
    (``gil_free``, as ``default_count`` says): they call the compiled code through ctypes, which lets
    go of the GIL. torch's binding (``AOTIModelPackageLoader.run``, a CUDA variant's) holds the GIL
    for the whole call, so a second batch would only wait for it, and the event loop with it: one."""
    if not (runtime == "native" if gil_free is None else gil_free):
        return 1
    allowance = cpu_allowance()
    threads = threads if threads is not None else default_threads(allowance)
    return max(1, min(allowance.cpus // max(1, workers), threads))


class Instances:
    """``count`` threads running the calls ``submit`` hands them, in order; at most ``queue_size``
    calls wait for a free instance. ``threads`` OpenMP threads in all: a call that runs alone, with
    nothing waiting, gets them all; calls at once get ``threads // count`` each (as loader.Batcher's
    workers do), so one client keeps the whole machine and many share it.

    A call goes to the instance idle the shortest time, whose OpenMP team is still awake
    (``loader.serving.idle``)."""

    def __init__(self, *, count: int, queue_size: int, threads: int | None = None):
        if count < 1 or queue_size < 0:
            raise ValueError(f"count must be at least 1 and queue_size at least 0, got {count} and {queue_size}")
        self.count = count
        self.queue_size = queue_size
        self.threads = max(1, threads if threads is not None else default_threads())
        self.threads_each = max(1, self.threads // count)
        self._running = 0  # instances running a call now
        self._waiting: collections.deque[tuple[Future, Callable[..., Any], dict[str, Any]]] = collections.deque()
        self._idle = 0  # instances waiting for a call
        self._lock = threading.Lock()
        self._asleep = IdleStack(self._lock, count)  # a call wakes the instance idle the shortest time
        self._closed = False
        self._each: tuple[int, Callable[[], Any] | None] = (0, None)  # (generation, what each instance runs once)
        self._threads = [
            threading.Thread(target=self._run, args=(i,), name=f"precompile-instance-{i}", daemon=True)
            for i in range(count)
        ]
        for t in self._threads:
            t.start()

    def submit(self, fn: Callable[..., Any], /, **kwargs: Any) -> Future:
        """A future for ``fn(**kwargs)`` run on a free instance; InstancesFull at once when every
        instance is busy and ``queue_size`` calls already wait. Cancelling the future before an
        instance takes it drops the call."""
        future: Future = Future()
        with self._lock:
            if self._closed:
                raise InstancesClosed()
            # Calls waiting beyond the idle instances about to take them are the queue.
            if len(self._waiting) - self._idle >= self.queue_size:
                raise InstancesFull(self.queue_size)
            self._waiting.append((future, fn, kwargs))
            self._asleep.wake_one()
        future.add_done_callback(self._forget)
        return future

    def _forget(self, future: Future) -> None:
        """A call cancelled while it waited leaves the queue (its client hung up), freeing its place."""
        if not future.cancelled():
            return
        with self._lock:
            for i, (waiting, _, _) in enumerate(self._waiting):
                if waiting is future:
                    del self._waiting[i]
                    return

    def on_each(self, fn: Callable[[], Any]) -> None:
        """Run ``fn()`` once on every instance, before the next call each takes (a newly loaded model's
        ``warm_thread``: OpenMP starts a thread team per calling thread, so each instance's first call
        would pay for its own). Replaces an earlier ``fn`` not yet run; its failures are logged."""
        with self._lock:
            self._each = (self._each[0] + 1, fn)
            self._asleep.wake_all()

    @property
    def queued(self) -> int:
        """Calls waiting for an instance now."""
        with self._lock:
            return max(0, len(self._waiting) - self._idle)

    def close(self) -> None:
        """Finish the calls already taken and queued, refuse new ones, and stop the threads."""
        with self._lock:
            self._closed = True
            self._asleep.wake_all()
        for t in self._threads:
            t.join()

    def _run(self, index: int) -> None:
        team, seen = 0, 0  # this thread's OpenMP team size as last set (0: not set yet)
        while True:
            with self._lock:
                self._idle += 1
                while not self._waiting and not self._closed and self._each[0] == seen:
                    self._asleep.sleep(index)
                self._idle -= 1
                if self._each[0] != seen and not self._closed:
                    (seen, each), job = self._each, None
                elif not self._waiting:
                    return  # closed, nothing left
                else:
                    job = self._waiting.popleft()
                    self._running += 1
                    alone = self._running == 1 and not self._waiting
            if job is None:
                if not team and set_team_size(self.threads_each):  # the runtime is loaded by the first load
                    team = self.threads_each
                try:
                    each()
                except Exception:  # noqa: BLE001: a warm-up that fails leaves the calls to say why
                    log.warning("an execution instance could not warm up", exc_info=True)
                continue
            try:
                size = self.threads if alone else self.threads_each  # this thread's team only
                if size != team and set_team_size(size):
                    team = size
                future, fn, kwargs = job
                if not future.set_running_or_notify_cancel():
                    continue  # its client gave up while it waited
                try:
                    result = fn(**kwargs)
                except BaseException as e:  # noqa: BLE001: handed to the caller, whose policy answers it
                    future.set_exception(e)
                else:
                    future.set_result(result)
            finally:
                with self._lock:
                    self._running -= 1


def set_team_size(threads: int) -> bool:
    """The calling thread's OpenMP team size: through torch where it is imported (which sets its own
    intra-op count too), else straight in the OpenMP runtime the torch-free loader opened (a per-thread
    setting). False when no OpenMP runtime is loaded yet (nothing set)."""
    torch = sys.modules.get("torch")
    if torch is not None:
        torch.set_num_threads(threads)
        return True
    from loader.native.libs import openmp_library

    running = openmp_library()
    if running is None:
        return False
    ctypes.CDLL(running).omp_set_num_threads(threads)
    return True
