"""Results of calls run on other threads (the batcher's workers, the execution instances), handed to
the event loop awaiting them with one wake-up per burst.

``asyncio.wrap_future`` wakes the loop once per future (``call_soon_threadsafe``: a write to its
self-pipe, then a pass of the loop). A batch of eight ends in eight futures set one after another
from the worker's thread: the loop woke at the first and took the GIL back and forth with the worker
for the other seven (traced under load: up to a millisecond of the worker's time per batch, before it
could take the next one). Here the futures that finish while the loop has not yet run are handed over
together, in one callback: the loader's Batcher sets a batch's futures in one burst
(``loader.serving.batch.after_burst``), and the loop is woken once at its end.

    results = loop_results()                       # the running loop's (one per loop)
    outputs = await results.wrap(batcher.submit(...))

Cancelling the awaitable cancels the future (a call still queued is dropped); a cancelled future
cancels the awaitable; an exception is raised where it is awaited.
"""

from __future__ import annotations

import asyncio
import collections
import threading
import weakref
from concurrent.futures import Future

from loader.serving.batch import after_burst

_LOOPS: weakref.WeakKeyDictionary[asyncio.AbstractEventLoop, LoopResults] = weakref.WeakKeyDictionary()


class LoopResults:
    """Futures of other threads, awaited on ``loop``; see the module docstring."""

    def __init__(self, loop: asyncio.AbstractEventLoop):
        self._loop = loop
        self._lock = threading.Lock()
        self._arrived: collections.deque[tuple[asyncio.Future, Future]] = collections.deque()
        self._woken = False  # a drain is scheduled and has not started

    def wrap(self, future: Future) -> asyncio.Future:
        """An awaitable on this loop with ``future``'s outcome (call it on the loop's thread)."""
        waiter = self._loop.create_future()
        waiter.add_done_callback(lambda w: future.cancel() if w.cancelled() else None)
        future.add_done_callback(lambda f: self._arrive(waiter, f))
        return waiter

    def _arrive(self, waiter: asyncio.Future, future: Future) -> None:
        with self._lock:
            self._arrived.append((waiter, future))
            if self._woken:
                return
            self._woken = True
        if not after_burst(self._wake):  # a batch's results: one wake-up once all of them are set
            self._wake()

    def _wake(self) -> None:
        try:
            self._loop.call_soon_threadsafe(self._drain)
        except RuntimeError:  # the loop is closed: nobody awaits it any more
            pass

    def _drain(self) -> None:
        with self._lock:
            arrived, self._arrived = self._arrived, collections.deque()
            self._woken = False
        for waiter, future in arrived:
            if waiter.done():  # cancelled meanwhile (its client went away)
                continue
            if future.cancelled():
                waiter.cancel()
                continue
            error = future.exception()
            if error is not None:
                waiter.set_exception(error)
            else:
                waiter.set_result(future.result())


def loop_results() -> LoopResults:
    """The running loop's ``LoopResults`` (made at its first use)."""
    loop = asyncio.get_running_loop()
    results = _LOOPS.get(loop)
    if results is None:
        results = _LOOPS[loop] = LoopResults(loop)
    return results
