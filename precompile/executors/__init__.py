"""Where the units of compile work run: ``local`` (a fresh process per unit on this host, the default)
or ``ray`` (a task per unit on a Ray cluster; ``precompile.executors.ray``, imported only when asked for).

A unit is a ``precompile.build.CompileTask`` (a variant under one option candidate, in one precision).
Both executors have one method: ``run(job, tasks)`` takes the units as an iterator, pulls the next one
only when it has room for it (so the caller can stop feeding it, as the tuning budget does), and yields
one ``Outcome`` per unit as each finishes. Closing the generator (the build failed) cancels what still
runs. Every package an outcome returns lies in ``job.staging``, wherever it was compiled; assembling
the artifact stays with the build.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Iterator, Protocol

from ..errors import PrecompileError

if TYPE_CHECKING:
    import torch

    from ..build import CompileTask
    from ..profile import LoadedProfile
    from ..progress import Progress

EXECUTORS = ("local", "ray")


@dataclass(frozen=True)
class CompileJob:
    """What every unit of one build shares."""

    loaded: LoadedProfile
    model: torch.nn.Module  # resolved on the driver; an executor running units in this process uses it
    staging: Path  # packages end up in staging/variants/<task.file>
    jobs: int | None  # units at once (None: the executor's own default)
    units: int  # how many units the build has at most
    tuning: bool  # several option candidates per variant (names carry "[candidate k]")
    progress: Progress | None = None  # for a note about where the units go


@dataclass(frozen=True)
class Outcome:
    """One finished unit: ``_compile_one``'s result, or the error it ended with."""

    task: CompileTask
    result: tuple[Any, ...] | None
    error: BaseException | None = None
    where: str | None = None  # the host that compiled it, when that is not this process


class Executor(Protocol):
    def run(self, job: CompileJob, tasks: Iterator[CompileTask]) -> Iterator[Outcome]: ...


def executor_named(name: str, *, address: str | None = None, cpus: int = 1) -> Executor:
    """The executor ``precompile build --executor NAME`` asks for. ``address`` and ``cpus`` (CPUs each
    unit reserves) are Ray's; PrecompileError for an unknown name, or Ray options without Ray."""
    if name == "local":
        if address is not None or cpus != 1:
            option = "--address" if address is not None else "--ray-cpus"
            raise PrecompileError(f"{option} is an option of the Ray executor: use it with --executor ray")
        from .local import LocalExecutor

        return LocalExecutor()
    if name == "ray":
        from .ray import RayExecutor

        return RayExecutor(address, cpus=cpus)
    raise PrecompileError(f"--executor {name}: unknown (choose one of {', '.join(EXECUTORS)})")
