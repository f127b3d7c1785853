"""The local executor: each unit in a fresh process on this host, ``jobs`` at a time.

A fresh interpreter per package (spawn, so no forked OpenMP state): Inductor registers its freezing
rewrites once per process, under the first compile's options. With one job and one option candidate
the units compile in this process instead, one after the other (no interpreter start-up per unit).

Each worker's Inductor compile pool (Triton kernels compile in subprocesses) gets its share of the
CPUs this process really has (affinity and cgroup quota, ``loader.threads``), or
``PRECOMPILE_COMPILE_THREADS`` threads where that is set (two builds sharing a host each set their
share). A worker that dies without an error (a signal: the OOM killer, a crash in native code) has
its unit compiled again in the build process, with the fault handler on: a crash then prints where it was.
"""

from __future__ import annotations

import faulthandler
import multiprocessing
import os
import threading
from collections.abc import Iterator
from concurrent.futures import FIRST_COMPLETED, Future, ProcessPoolExecutor, wait
from concurrent.futures.process import BrokenProcessPool

from loader.threads import cpu_allowance

from ..errors import PrecompileError
from ..units import CompileTask
from .base import CompileJob, Outcome
from .worker import compile_in_worker, compile_unit, default_jobs, worker_died

COMPILE_THREADS_ENV = "PRECOMPILE_COMPILE_THREADS"


def compile_threads(jobs: int, env: dict[str, str] | None = None) -> int:
    """Inductor compile threads for each of ``jobs`` workers: ``PRECOMPILE_COMPILE_THREADS`` where set,
    else this process's CPUs (``loader.threads.cpu_allowance``) shared among the workers, at least 1."""
    raw = (os.environ if env is None else env).get(COMPILE_THREADS_ENV)
    if raw is not None and raw.strip():
        try:
            value = int(raw)
        except ValueError:
            value = 0
        if value < 1:
            raise PrecompileError(f"{COMPILE_THREADS_ENV}={raw!r}: expected a whole number of threads, 1 or more")
        return value
    return max(1, cpu_allowance().cpus // max(1, jobs))


class LocalExecutor:
    def run(self, job: CompileJob, tasks: Iterator[CompileTask]) -> Iterator[Outcome]:
        jobs = default_jobs(job.units) if job.jobs is None else max(1, min(job.jobs, job.units))
        threads = compile_threads(jobs)  # per worker process; a bad PRECOMPILE_COMPILE_THREADS fails any build
        if jobs == 1 and not job.tuning:
            ctx = job.context
            for task in tasks:
                try:
                    result = compile_unit(ctx.loaded, ctx.model, task, job.staging, calibration=lambda: ctx.calibration)
                except PrecompileError as e:
                    yield Outcome(task, None, e)
                else:
                    yield Outcome(task, result)
            return
        running: dict[Future, tuple[CompileTask, ProcessPoolExecutor]] = {}
        # A worker whose unit is done takes seconds of CPU more to exit (its interpreter's teardown):
        # each pool is shut down, waiting for its worker, on a thread of its own as soon as its unit
        # is done, and those threads joined before the outcomes end, so that the tune stage never
        # times a candidate beside an exiting worker (MobileNetV2's oneDNN candidate timed at 1.6-5x
        # its steady call so, and lost to slower ones). The pool's own shutdown reaps its worker:
        # joining the worker from here too raced the pool's thread for it, and a worker reaped by
        # that thread could read as alive here.
        closing: list[threading.Thread] = []

        def close(pool: ProcessPoolExecutor, *, cancel: bool = False) -> None:
            closer = threading.Thread(
                target=pool.shutdown, kwargs={"wait": True, "cancel_futures": cancel}, name="close-compile-worker"
            )
            closer.start()
            closing.append(closer)

        try:
            while True:
                while len(running) < jobs:
                    task = next(tasks, None)
                    if task is None:
                        break
                    pool = ProcessPoolExecutor(max_workers=1, mp_context=multiprocessing.get_context("spawn"))
                    running[pool.submit(compile_in_worker, job.context.loaded, task, job.staging, threads)] = (
                        task,
                        pool,
                    )
                if not running:
                    return
                done, _ = wait(running, return_when=FIRST_COMPLETED)
                for future in done:
                    task, pool = running.pop(future)
                    close(pool)
                    error = future.exception()
                    if isinstance(error, BrokenProcessPool):
                        yield self._again_here(job, task, worker_died(task, jobs))
                        continue
                    yield Outcome(task, future.result() if error is None else None, error)
        finally:
            # A failure, or a caller that stopped early: the units still compiling are stopped (their
            # output dies with the staging folder), not left to burn the CPUs after the build returned.
            for future, (_, pool) in running.items():
                future.cancel()
                for process in list((getattr(pool, "_processes", None) or {}).values()):  # no public handle
                    process.terminate()
                close(pool, cancel=True)
            for closer in closing:  # every worker gone, on every way out
                closer.join()

    @staticmethod
    def _again_here(job: CompileJob, task: CompileTask, died: str) -> Outcome:
        """Compile a unit whose worker died in this process, with the fault handler on: if it crashes
        again, the traceback of every thread shows where; if it succeeds (the worker was most likely
        killed for memory), the build goes on with it."""
        if job.progress is not None:
            job.progress.note(f"[yellow]warning[/]: {died}; compiling it again in the build process")
        if not faulthandler.is_enabled():
            faulthandler.enable()
        try:
            ctx = job.context
            return Outcome(
                task, compile_unit(ctx.loaded, ctx.model, task, job.staging, calibration=lambda: ctx.calibration)
            )
        except PrecompileError as e:
            return Outcome(task, None, e)
