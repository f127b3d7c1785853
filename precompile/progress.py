"""Progress reporting for the build stages: silent for library callers, rich lines for the CLI."""

from __future__ import annotations

import time
from collections.abc import Iterator
from contextlib import contextmanager


class Progress:
    """Receives stage starts and ends; this base class says nothing."""

    @contextmanager
    def stage(self, name: str, detail: str = "") -> Iterator[None]:
        start = time.perf_counter()
        try:
            yield
        except BaseException:
            self.failed(name, detail, time.perf_counter() - start)
            raise
        self.done(name, detail, time.perf_counter() - start)

    def done(self, name: str, detail: str, seconds: float) -> None:
        pass

    def failed(self, name: str, detail: str, seconds: float) -> None:
        pass

    def note(self, text: str) -> None:
        pass


class RichProgress(Progress):
    """One line per finished stage with its duration, on stderr."""

    def __init__(self) -> None:
        from rich.console import Console

        self.console = Console(stderr=True, highlight=False)

    @contextmanager
    def stage(self, name: str, detail: str = "") -> Iterator[None]:
        with self.console.status(f"{name} {detail}…"):
            with super().stage(name, detail):
                yield

    def done(self, name: str, detail: str, seconds: float) -> None:
        self.console.print(f"[green]✓[/] {name:<8} {seconds:6.1f} s  [dim]{detail}[/]")

    def failed(self, name: str, detail: str, seconds: float) -> None:
        self.console.print(f"[red]✗[/] {name:<8} {seconds:6.1f} s  [dim]{detail}[/]")

    def note(self, text: str) -> None:
        self.console.print(f"  {text}")
