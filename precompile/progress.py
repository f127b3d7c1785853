"""Progress reporting for the build stages: silent for library callers, rich lines for the CLI."""

from __future__ import annotations

import time
from collections.abc import Iterator
from contextlib import contextmanager


class Progress:
    """Receives stage starts and ends; this base class says nothing."""

    @contextmanager
    def stage(self, name: str, detail: str = "") -> Iterator[None]:
        self.started(name, detail)
        start = time.perf_counter()
        try:
            yield
        except BaseException:
            self.failed(name, detail, time.perf_counter() - start)
            raise
        self.done(name, detail, time.perf_counter() - start)

    def started(self, name: str, detail: str) -> None:
        pass

    def done(self, name: str, detail: str, seconds: float) -> None:
        pass

    def failed(self, name: str, detail: str, seconds: float) -> None:
        pass

    def note(self, text: str) -> None:
        pass


def escape(text: str) -> str:
    """``text`` shown as written: rich would read "[candidate 1]" in a detail as markup and drop it."""
    from rich.markup import escape as rich_escape

    return rich_escape(text)


class RichProgress(Progress):
    """One line per finished stage with its duration, on stderr. On a terminal a spinner shows what
    runs; in a pipe or a CI log, where no spinner is drawn, a line says when each stage (and each
    compile unit) starts, so a long compile is not minutes of silence."""

    def __init__(self) -> None:
        from rich.console import Console

        self.console = Console(stderr=True, highlight=False)

    @contextmanager
    def stage(self, name: str, detail: str = "") -> Iterator[None]:
        if not self.console.is_terminal:
            with super().stage(name, detail):
                yield
            return
        with self.console.status(f"{name} {escape(detail)}…"):
            with super().stage(name, detail):
                yield

    def started(self, name: str, detail: str) -> None:
        if not self.console.is_terminal:
            self.console.print(f"… {name:<8} started   [dim]{escape(detail)}[/]")

    def done(self, name: str, detail: str, seconds: float) -> None:
        self.console.print(f"[green]✓[/] {name:<8} {seconds:6.1f} s  [dim]{escape(detail)}[/]")

    def failed(self, name: str, detail: str, seconds: float) -> None:
        self.console.print(f"[red]✗[/] {name:<8} {seconds:6.1f} s  [dim]{escape(detail)}[/]")

    def note(self, text: str) -> None:
        self.console.print(f"  {text}")
