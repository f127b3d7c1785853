"""The one opening path of both loaders (``open_model``: the checks of their options, the artifact
verified by ``loader.source``, the model built, warmed and recorded), and when a loaded artifact's
variants are opened: all before ``load()`` returns, or the first one then and the others on demand
(``load(..., open=...)``).

Opening a variant is most of a load's cost (its package read and, for a folder, hashed as it is read;
its library mapped; a frozen variant's constants copied out of it; a warm-up call), and a call needs
only one variant. So:

- ``"eager"``: every variant is opened (and warmed, with ``warmup``) before ``load()`` returns.
- ``"background"`` (the default): the first variant (the manifest's first served, whose hint is the
  likeliest first call) is opened and warmed on its hint before ``load()`` returns; a thread of lower
  CPU priority then runs its other warm-up shapes (the largest of its ranges and its traffic's,
  ``loader.warmup``: seconds for a large convnet, which a cold start no longer waits for), and opens
  and warms the others, one after the other.
- ``"lazy"``: the first variant as above; each other one is opened by the first call that needs it.

Either way a call that lands on a variant not open yet waits for it (opening it itself, or waiting
for the thread that is): it never fails for it, and it runs only once the variant's files passed
their checks. A variant that cannot be opened (a file changed since the load: its hash fails) is
refused on every call with the same ArtifactError; the others serve on. ``stats()`` lists every
variant from the start, opened or not.
"""

from __future__ import annotations

import atexit
import logging
import os
import threading
import time
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, fields
from typing import Any, TypeVar

from .errors import ArtifactError, IncompatibleArtifactError, first_line
from .host import HostFacts
from .precision import REQUESTS
from .source import Opened, open_artifact
from .threads import lower_priority
from .warmup import check_warmup_shapes

OPEN_MODES = ("eager", "background", "lazy")
DEFAULT_OPEN = "background"

log = logging.getLogger("loader")
Model = TypeVar("Model")  # a loader.dispatch.ServedModel: CompiledModel or NativeModel


def check_open_mode(mode: str) -> None:
    if mode not in OPEN_MODES:
        raise ValueError(f"open={mode!r}: expected one of {', '.join(OPEN_MODES)}")


@dataclass(frozen=True)
class LoadOptions:
    """The options ``loader.load`` and ``loader.load_native`` both take (see ``loader.load``), checked
    when made, before anything is read. ``LoadOptions.of(locals())``, first thing in a loader, takes
    them by name from its arguments."""

    verify: bool
    trusted_keys: Iterable[Any] | None
    min_version: int | None
    refuse_rollback: bool
    cache_dir: str | os.PathLike | None
    state_dir: str | os.PathLike | None
    max_bytes: int | None
    precision: str
    warmup: bool
    warmup_shapes: str
    open: str

    def __post_init__(self) -> None:
        if self.precision not in REQUESTS:
            raise ValueError(f"precision={self.precision!r}: expected one of {', '.join(REQUESTS)}")
        check_open_mode(self.open)
        check_warmup_shapes(self.warmup_shapes)

    @classmethod
    def of(cls, arguments: Mapping[str, Any]) -> LoadOptions:
        return cls(**{f.name: arguments[f.name] for f in fields(cls)})


def open_model(
    path: str | os.PathLike,
    build: Callable[[Opened], tuple[Model, list[OnDemand]]],
    options: LoadOptions,
    *,
    device: str | None,
    host: HostFacts | None = None,
    refused_hint: str | None = None,
    warmup_errors: tuple[type[BaseException], ...] = (),
) -> Model:
    """What ``loader.load`` and ``loader.load_native`` do with their ``options``: the artifact at
    ``path`` verified (``loader.source.open_artifact``, each variant's package hashed as it is
    opened), ``build(opened)`` for the model and its variants still to open, a warm-up (one of
    ``warmup_errors`` it raises becomes an ArtifactError naming the artifact), the version recorded
    for ``refuse_rollback``, then the other variants opened in the background when ``open`` says so.
    ``refused_hint``: said after an IncompatibleArtifactError of the checks before anything is opened."""
    try:
        opened = open_artifact(
            path,
            device=device,
            verify=options.verify,
            trusted_keys=options.trusted_keys,
            min_version=options.min_version,
            refuse_rollback=options.refuse_rollback,
            cache_dir=options.cache_dir,
            state_dir=options.state_dir,
            max_bytes=options.max_bytes,
            host=host,
            defer_packages=True,
        )
    except IncompatibleArtifactError as e:
        if refused_hint is None:
            raise
        raise IncompatibleArtifactError(f"{e}\n  ({refused_hint})") from None
    with opened:  # holds the rollback ledger's lock, with refuse_rollback, until the version is recorded
        model, pending = build(opened)
        model.warmup_shapes = options.warmup_shapes
        background = options.open == "background"
        if options.warmup:
            try:
                model.warmup(hint_only=background)
            except warmup_errors as e:
                raise ArtifactError(f"{opened.root}: the warm-up call failed: {first_line(e)}") from e
        opened.loaded()
    if background:
        rest = [v for v in model.warmed if options.warmup]  # the variants warmed on their hint alone
        model.opening = start_background(pending, model.warm_variant, str(opened.root), rest, model.warm_rest)
    return model


class OnDemand:
    """One variant's runner, opened by ``open()`` the first time it is needed; a runner itself
    (``run(list) -> list``), so dispatch needs nothing else. Thread-safe: one opens, others wait."""

    def __init__(self, variant_id: str, open: Callable[[], Any]):
        self.variant_id = variant_id
        self._open = open
        self._runner: Any = None
        self._failed: str | None = None
        self._closed = False
        self._lock = threading.Lock()

    @property
    def opened(self) -> bool:
        return self._runner is not None

    def get(self) -> Any:
        """The opened runner (opening it now if no one has)."""
        runner = self._runner
        if runner is not None:
            return runner
        with self._lock:
            if self._runner is None:
                if self._closed:
                    raise ArtifactError(f"variant {self.variant_id!r}: the model was closed")
                if self._failed is not None:
                    raise ArtifactError(self._failed)
                try:
                    self._runner = self._open()
                except Exception as e:
                    # Refused for good: files that failed their check are not read again.
                    self._failed = str(e) if isinstance(e, ArtifactError) else f"{type(e).__name__}: {first_line(e)}"
                    raise
            return self._runner

    def run(self, tensors: list) -> list:
        return self.get().run(tensors)

    def close(self, close_runner: Callable[[Any], None]) -> None:
        """Close the runner if it was opened, and refuse to open it from now on."""
        with self._lock:
            self._closed = True
            if self._runner is not None:
                close_runner(self._runner)


def open_variants(ids: list[str], open_one: Callable[[str], Any], mode: str) -> tuple[dict[str, Any], list[OnDemand]]:
    """The runners of ``ids`` (in the manifest's order): all opened (``"eager"``), or the first one
    opened and the others ``OnDemand`` (returned too, for ``start_background``)."""
    check_open_mode(mode)
    runners: dict[str, Any] = {}
    pending: list[OnDemand] = []
    for i, vid in enumerate(ids):
        if mode == "eager" or i == 0:
            runners[vid] = open_one(vid)
        else:
            runners[vid] = OnDemand(vid, lambda vid=vid: open_one(vid))
            pending.append(runners[vid])
    return runners, pending


class Opener:
    """The thread ``start_background`` runs, and the means to stop it between two of its steps."""

    def __init__(self, thread: threading.Thread, stop: threading.Event):
        self.thread, self._stop = thread, stop

    def join(self, timeout: float | None = None) -> None:
        self.thread.join(timeout)

    def is_alive(self) -> bool:
        return self.thread.is_alive()

    def ask(self) -> None:
        """Ask it to stop after the step it is in."""
        self._stop.set()

    def stop(self) -> None:
        """Stop it after the step it is in (an open or a warm-up: compiled code running on the
        model's containers) and wait for that step, so that the model can free them; from the
        opener thread itself (a warm-up that closes its model), only ask."""
        self.ask()
        if threading.current_thread() is not self.thread:
            self.thread.join()


def start_background(
    pending: list[OnDemand],
    warm: Callable[[str], None],
    name: str,
    rest: Iterable[str] = (),
    warm_rest: Callable[[str], None] | None = None,
) -> Opener | None:
    """In a daemon thread of lower CPU priority: the rest of the warm-up of the variants ``rest``
    names (open, warmed on their hint: ``warm_rest``), then open and warm each of ``pending``; a
    variant that fails is logged, and refused when called. At interpreter exit the thread is stopped
    between two steps and waited for, so no compiled code runs while the process tears down its libraries;
    a model's ``close()`` does the same for its own (``Opener.stop``)."""
    rest = list(rest) if warm_rest is not None else []
    if not pending and not rest:
        return None
    stop = threading.Event()

    def work() -> None:
        lower_priority()  # the first calls get the CPUs before it
        for vid in rest:
            if stop.is_set():
                return
            try:
                warm_rest(vid)
            except Exception as e:  # noqa: BLE001 -- a warm-up shape is no call: the variant serves on
                log.warning("%s: variant %r: a warm-up call failed: %s", name, vid, first_line(e))
        for runner in pending:
            if stop.is_set():
                return
            try:
                runner.get()
                if not stop.is_set():
                    warm(runner.variant_id)
            except Exception as e:  # noqa: BLE001 -- kept by the runner, raised to the calls that need it
                log.warning("%s: variant %r could not be opened: %s", name, runner.variant_id, first_line(e))

    thread = threading.Thread(target=work, name=f"open-variants:{name}", daemon=True)
    with _openers_lock:
        global _exit_registered
        if not _exit_registered:
            # Registered after the first variant's container (weakref.finalize registers its own exit
            # hook then): atexit runs hooks last-registered first, so this one runs before those.
            atexit.register(_stop_openers)
            _exit_registered = True
        _openers[:] = [o for o in _openers if o.is_alive()]  # those done: nothing to stop
        opener = Opener(thread, stop)
        _openers.append(opener)
    thread.start()
    return opener


_openers: list[Opener] = []
_openers_lock = threading.Lock()
_exit_registered = False


def wait_openers(timeout: float | None = None) -> bool:
    """Wait, at most ``timeout`` seconds in all, for every background opener of this process
    (``load(open="background")``: the other variants and the rest of the warm-up); True once none
    runs. For a process that changes files under its models, or measures, after loading them."""
    deadline = None if timeout is None else time.monotonic() + timeout
    with _openers_lock:
        openers = list(_openers)
    for opener in openers:
        opener.join(None if deadline is None else max(0.0, deadline - time.monotonic()))
    return not any(o.is_alive() for o in openers)


def _stop_openers() -> None:
    with _openers_lock:
        openers = list(_openers)
    for opener in openers:  # all asked first, so they stop together
        opener.ask()
    for opener in openers:
        opener.stop()
