"""Which idle worker thread takes the next call: the one idle the shortest time (last in, first out).

Each worker thread (``loader.Batcher``'s, ``precompile serve``'s execution instances) runs its own
OpenMP team, and the team of the worker that just finished is the one still awake. A shared
condition wakes its first waiter, the worker idle the longest: a lone client's calls then went round
the workers, each call starting a sleeping team while the last one's threads still spun (MiniLM at
1×16 on 2 CPUs: 11.6 ms a request against 6.0 with one worker; bench/results/serve_load.md).
"""

from __future__ import annotations

import threading


class IdleStack:
    """Worker ``index`` sleeps in ``sleep``; ``wake_one`` wakes the one that fell asleep last. Every
    method is called with ``lock`` held (the lock the workers' own state is guarded by)."""

    def __init__(self, lock: threading.Lock | threading.RLock, workers: int):
        self._wake = [threading.Condition(lock) for _ in range(workers)]
        self._sleeping: list[int] = []  # the last to fall asleep last

    def sleep(self, index: int) -> None:
        """Wait until woken (the caller checks again what it waits for, as with any condition)."""
        self._sleeping.append(index)
        self._wake[index].wait()
        if index in self._sleeping:  # woken by no one's choice: out of the order again
            self._sleeping.remove(index)

    def wake_one(self) -> None:
        """Wake the worker asleep the shortest time, if any."""
        if self._sleeping:
            self._wake[self._sleeping.pop()].notify()

    def wake_all(self) -> None:
        self._sleeping.clear()
        for wake in self._wake:
            wake.notify()
