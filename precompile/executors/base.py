"""What an executor is given and gives back: the job every unit of one build shares, and one
``Outcome`` per unit (its ``UnitResult``, or the error it ended with)."""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol

from ..context import BuildContext
from ..progress import Progress
from ..units import CompileTask, UnitResult


@dataclass(frozen=True)
class CompileJob:
    """What every unit of one build shares."""

    context: BuildContext  # the model in it is used by an executor running units in this process
    staging: Path  # packages end up in staging/variants/<task.file>
    jobs: int | None  # units at once (None: the executor's own default)
    units: int  # how many units the build has at most
    tuning: bool  # several option candidates per variant (names carry "[candidate k]")
    progress: Progress | None = None  # for a note about where the units go


@dataclass(frozen=True)
class Outcome:
    """One finished unit: what compiling it gave, or the error it ended with."""

    task: CompileTask
    result: UnitResult | None
    error: BaseException | None = None
    where: str | None = None  # the host that compiled it, when that is not this process


class Executor(Protocol):
    def run(self, job: CompileJob, tasks: Iterator[CompileTask]) -> Iterator[Outcome]: ...
