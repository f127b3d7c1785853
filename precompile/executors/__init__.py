"""Where the units of compile work run: ``local`` (a fresh process per unit on this host, the default)
or ``ray`` (a task per unit on a Ray cluster; ``precompile.executors.ray``, imported only when asked for).

A unit is a ``precompile.units.CompileTask`` (a variant under one option candidate, in one precision),
and ``executors.worker`` is what compiles one. Both executors have one method: ``run(job, tasks)``
takes the units as an iterator, pulls the next one only when it has room for it (so the caller can
stop feeding it, as the tuning budget does), and yields one ``Outcome`` per unit as each finishes.
Closing the generator (the build failed) cancels what still runs. Every package an outcome returns
lies in ``job.staging``, wherever it was compiled; assembling the artifact stays with the build.

    units = compile_units(ctx, tasks, staging, jobs=None, progress=progress)   # CompiledUnits
"""

from __future__ import annotations

import time
from collections.abc import Iterator, Sequence
from dataclasses import replace
from pathlib import Path

from ..context import BuildContext
from ..errors import PrecompileError, ProfileError
from ..progress import Progress
from ..units import CompiledUnit, CompiledUnits, CompileTask, FailedUnit, smallest_tables
from .base import CompileJob, Executor, Outcome
from .local import LocalExecutor

EXECUTORS = ("local", "ray")

__all__ = ["EXECUTORS", "CompileJob", "Executor", "Outcome", "compile_units", "executor_named"]


def executor_named(name: str, *, address: str | None = None, cpus: int = 1) -> Executor:
    """The executor ``precompile build --executor NAME`` asks for. ``address`` and ``cpus`` (CPUs each
    unit reserves) are Ray's; PrecompileError for an unknown name, or Ray options without Ray."""
    if name == "local":
        if address is not None or cpus != 1:
            option = "--address" if address is not None else "--ray-cpus"
            raise PrecompileError(f"{option} is an option of the Ray executor: use it with --executor ray")
        return LocalExecutor()
    if name == "ray":
        from .ray import RayExecutor  # ray is imported only for --executor ray

        return RayExecutor(address, cpus=cpus)
    raise PrecompileError(f"--executor {name}: unknown (choose one of {', '.join(EXECUTORS)})")


def compile_units(
    ctx: BuildContext,
    tasks: Sequence[CompileTask],
    staging: Path,
    *,
    jobs: int | None,
    progress: Progress,
    executor: Executor | None = None,
    cache: Path | None = None,
) -> CompiledUnits:
    """Export and compile every task through ``executor`` (default: on this host, ``jobs`` at a time,
    each in its own process). ``cache``: the build cache's folder (``precompile.build_cache``), or none.

    A variant's first candidate failing fails the build; a later one failing is only recorded, and
    later candidates still pending after ``compile.tune.max_seconds`` are not compiled.
    """
    if cache is not None:
        tasks = [replace(task, cache=str(cache)) for task in tasks]
    tune = ctx.profile.compile.tune
    max_seconds = tune.max_seconds if tune is not None else None
    units: list[CompiledUnit] = []
    failed: list[FailedUnit] = []
    tables: dict = {}
    tuning = any(t.candidate for t in tasks)
    start = time.perf_counter()

    def admitted() -> Iterator[CompileTask]:
        """The tasks, as the executor has room for them; candidates past the budget are skipped."""
        for task in tasks:
            if task.candidate and max_seconds is not None and time.perf_counter() - start > max_seconds:
                reason = f"not compiled: compile.tune.max_seconds ({max_seconds:g} s) reached"
                failed.append(FailedUnit(task.vp.id, task.candidate, reason))
                continue
            progress.started("variant", task.label(tuning))
            yield task

    job = CompileJob(ctx, staging, jobs, len(tasks), tuning, progress)
    outcomes = (executor or LocalExecutor()).run(job, admitted())
    try:
        for outcome in outcomes:
            task, error = outcome.task, outcome.error
            label = task.label(tuning) + (f" on {outcome.where}" if outcome.where else "")
            if error is None and outcome.result is not None:
                units.append(outcome.result.unit)
                tables = smallest_tables(tables, outcome.result.tables)
                cached = " (from the build cache)" if outcome.result.unit.package.cached else ""
                progress.done("variant", label + cached, outcome.result.unit.seconds)
                continue
            progress.failed("variant", label, 0.0)
            if task.candidate == 0 or isinstance(error, ProfileError):
                raise error
            failed.append(FailedUnit(task.vp.id, task.candidate, f"{type(error).__name__}: {error}"[:2000]))
    finally:
        outcomes.close()  # a failure: the executor cancels what still runs
    return CompiledUnits(tuple(units), tuple(failed), tables)
