"""The local executor: each unit in a fresh process on this host, ``jobs`` at a time.

A fresh interpreter per package (spawn, so no forked OpenMP state): Inductor registers its freezing
rewrites once per process, under the first compile's options. With one job and one option candidate
the units compile in this process instead, one after the other (no interpreter start-up per unit).
"""

from __future__ import annotations

import multiprocessing
import os
from collections.abc import Iterator
from concurrent.futures import FIRST_COMPLETED, Future, ProcessPoolExecutor, wait
from concurrent.futures.process import BrokenProcessPool

from ..errors import CompileError, PrecompileError
from ..units import CompileTask
from .base import CompileJob, Outcome
from .worker import compile_in_worker, compile_unit, default_jobs, worker_died


class LocalExecutor:
    def run(self, job: CompileJob, tasks: Iterator[CompileTask]) -> Iterator[Outcome]:
        jobs = default_jobs(job.units) if job.jobs is None else max(1, min(job.jobs, job.units))
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
        threads = max(1, (os.cpu_count() or 1) // jobs)  # Inductor's own compile workers, per process
        running: dict[Future, tuple[CompileTask, ProcessPoolExecutor]] = {}
        try:
            while True:
                while len(running) < jobs:
                    task = next(tasks, None)
                    if task is None:
                        break
                    pool = ProcessPoolExecutor(max_workers=1, mp_context=multiprocessing.get_context("spawn"))
                    running[pool.submit(compile_in_worker, job.context.loaded.path, task, job.staging, threads)] = (task, pool)
                if not running:
                    return
                done, _ = wait(running, return_when=FIRST_COMPLETED)
                for future in done:
                    task, pool = running.pop(future)
                    pool.shutdown(wait=False)
                    error = future.exception()
                    if isinstance(error, BrokenProcessPool):
                        raise CompileError(worker_died(task, jobs)) from None
                    yield Outcome(task, future.result() if error is None else None, error)
        finally:
            for future, (_, pool) in running.items():  # a failure: the others' output dies with the staging folder
                future.cancel()
                pool.shutdown(wait=False, cancel_futures=True)
