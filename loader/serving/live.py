"""``Live``: serve one artifact and switch to newer versions without dropping a call.

    live = loader.Live("artifacts/current")       # loads and warms up; or Live() and swap() later
    outputs = live(ids, mask)
    live.swap("artifacts/text-classifier-v4")     # load + warm up aside, then swap in atomically
    live.watch(interval=2.0)                      # or follow "artifacts/current" as deploys replace it
    loader.Live("s3://releases/models/text-classifier/current").watch()   # a pointer object in a store
    loader.Live("artifacts/current", load=loader.load_native)   # the torch-free loader: numpy arrays

A swap loads the new artifact and warms up every variant while the old one goes on serving, checks
it can stand in for the old one (same name, inputs and output structure; not an older version unless
allowed; the caller's ``check``), and only then replaces the reference callers read. Calls already
running keep the model they started on; a swap that fails for any reason leaves the old one serving
and says why in ``status()``.

``live.call_detailed(...)`` returns the outputs, the variant and the ``Serving`` version that ran the
call, so everything about one call refers to the same version. Calls made through ``live(...)`` or
``call_detailed`` are counted in flight: a swap waits for those still running on the old version
before folding its shape counts into ``stats()``, so no call goes uncounted.
"""

from __future__ import annotations

import os
import threading
import time
from collections.abc import Callable
from concurrent.futures import Future
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from .. import constants as C
from ..artifact import read_manifest
from ..dispatch import ServedModel
from ..errors import LoaderError
from ..manifest import Manifest
from ..stores import remote
from ..stores.pack import read_head
from .traffic import Histogram, add_histograms, histogram_of

# How long a swap waits for calls still running on the old version before taking its counts anyway.
DRAIN_SECONDS = 60.0


class SwapError(LoaderError):
    """A new version was refused (wrong name or interface, a rollback, a failed warm-up or check)."""


class _InFlight:
    """Counts the calls running on one version, so a swap can wait for them to finish."""

    def __init__(self) -> None:
        self.count = 0
        self._cond = threading.Condition()

    def enter(self) -> None:
        with self._cond:
            self.count += 1

    def leave(self) -> None:
        with self._cond:
            self.count -= 1
            if self.count == 0:
                self._cond.notify_all()

    def wait_idle(self, timeout: float) -> bool:
        with self._cond:
            return self._cond.wait_for(lambda: self.count == 0, timeout)


@dataclass(frozen=True)
class Serving:
    """One loaded version: the model and where and when it came from."""

    model: ServedModel  # a CompiledModel (loader.load) or a NativeModel (loader.load_native)
    path: Path | str  # the artifact folder or pack (a URL for a remote one), after following a pointer
    digest: str  # of the manifest bytes as read, what a signature covers (names the files too)
    loaded_at: float  # time.time() when it was swapped in
    load_seconds: float  # loading plus warm-up
    in_flight: _InFlight = field(default_factory=lambda: _InFlight(), compare=False, repr=False)
    # For a URL: the identity (loader.stores.remote.identity) of the pointer object it was resolved through.
    pointer: tuple[str, ...] | None = field(default=None, compare=False, repr=False)

    @property
    def name(self) -> str:
        return self.model.manifest.name

    @property
    def version(self) -> int:
        return self.model.manifest.version

    def describe(self) -> dict[str, Any]:
        return {
            "name": self.name,
            "version": self.version,
            "digest": self.digest,
            "path": str(self.path),
            "loaded_at": self.loaded_at,
            "load_seconds": round(self.load_seconds, 4),
        }


@dataclass(frozen=True)
class SwapAttempt:
    """The outcome of the last swap: what was asked, whether it is serving, and if not, why."""

    requested: str
    path: str | None  # the folder the request resolved to, when it got that far
    ok: bool
    error: str | None
    version: int | None  # the version that attempt loaded, when it got that far
    at: float = field(default_factory=time.time)

    def describe(self) -> dict[str, Any]:
        return {
            "requested": self.requested,
            "path": self.path,
            "ok": self.ok,
            "error": self.error,
            "version": self.version,
            "at": self.at,
        }


def _is_pack(path: Path) -> bool:
    with open(path, "rb") as f:
        return f.read(len(C.ZSTD_MAGIC)) == C.ZSTD_MAGIC


def resolve_pointer(path: str | os.PathLike) -> Path:
    """The artifact (folder or pack) ``path`` designates now.

    ``path`` is an artifact folder or pack, a symbolic link to one (``ln -s v4 current.new`` then
    ``mv -T current.new current``), or a small text file whose first line is the artifact's path,
    relative to the file's own folder (written beside and renamed over, so readers never see half a
    file). Errors never quote the file: a path naming some other file (a secret, a config) must not
    leak its content through a status page.
    """
    path = Path(path)
    if path.is_file() and not _is_pack(path):
        not_a_pointer = LoaderError(
            f"{path}: not an artifact folder, a pack, or a pointer file naming an existing one "
            "(a pointer file holds one line: the artifact's path, relative to the file)"
        )
        try:
            with open(path, "rb") as f:
                text = f.read(4096).decode("utf-8", errors="strict")
        except OSError as e:
            raise LoaderError(f"{path}: cannot read the pointer file ({e.strerror})") from None
        except UnicodeDecodeError:
            raise not_a_pointer from None
        lines = text.strip().splitlines()
        if not lines or not lines[0].strip():
            raise LoaderError(f"{path}: the pointer file is empty; write the artifact folder's path in it")
        target = Path(lines[0].strip())
        try:
            target = (path.parent / target).resolve() if not target.is_absolute() else target.resolve()
            if not target.exists():
                raise not_a_pointer
        except (OSError, ValueError):  # a name the file system refuses (NUL, too long)
            raise not_a_pointer from None
        return target
    return path.resolve()


def read_served_manifest(path: str | os.PathLike) -> Manifest:
    """The manifest of the artifact ``path`` designates (folder, pack, link or pointer file), read
    without unpacking or hashing anything: for checks before a server starts. A URL (a remote pack or
    pointer) is fetched into the cache and checked as ``load()`` would, so the server's load finds it there."""
    if remote.is_url(path):
        from ..source import open_artifact

        return open_artifact(remote.resolve_pointer(str(path)).target).manifest
    target = resolve_pointer(path)
    if target.is_file():
        return read_head(target).manifest
    return read_manifest(target)


def _identity(folder: Path) -> tuple[str, int, int]:
    """What tells the watcher a deploy changed something: the path and its manifest's (or pack's)
    modification time and size; cheap enough to look at every interval."""
    target = folder / C.MANIFEST_FILE if folder.is_dir() else folder
    st = os.stat(target)
    return (str(folder), st.st_mtime_ns, st.st_size)


class Live:
    """Holds the serving version of one artifact and swaps in new versions; see the module docstring.

    ``Live(path)`` loads and warms up ``path`` before returning (raising what ``loader.load`` raises);
    ``Live()`` starts empty (``ready`` is False) for a caller that loads in the background with
    ``swap``. ``check(model)`` runs on every new version after warm-up; raising refuses it.
    ``load_options`` go to ``loader.load`` for every version (``device``, ``verify``,
    ``trusted_keys``, ...).
    """

    def __init__(
        self,
        path: str | os.PathLike | None = None,
        *,
        warmup: bool = True,
        allow_rollback: bool = False,
        check: Callable[[ServedModel], None] | None = None,
        load: Callable[..., ServedModel] | None = None,
        **load_options: Any,
    ):
        self.source = _source(path) if path is not None else None
        self.load = load
        self.warmup = warmup
        self.allow_rollback = allow_rollback
        self.check = check
        self.load_options = load_options
        self._serving: Serving | None = None
        self._enter = threading.Lock()  # reading the version and counting a call in it are one step
        self._swap_lock = threading.Lock()  # one swap at a time; callers never wait on it
        self._retired: Histogram = {}  # shape counts of the versions swapped out
        self._draining: list[Serving] = []  # swapped out, calls still finishing on them
        self._retired_lock = threading.Lock()
        self.last_attempt: SwapAttempt | None = None
        self._listeners: list[Callable[[SwapAttempt], None]] = []
        self._watch_stop = threading.Event()
        self._watcher: threading.Thread | None = None
        if path is not None:
            self.swap(path)

    # --- serving -------------------------------------------------------------------------------

    @property
    def serving(self) -> Serving:
        """The current version; raises LoaderError while nothing is loaded yet."""
        serving = self._serving
        if serving is None:
            raise LoaderError(self._not_ready_message())
        return serving

    @property
    def current(self) -> Serving | None:
        """The current version, or None while nothing is loaded."""
        return self._serving

    @property
    def model(self) -> ServedModel:
        """The current model. Read it once per call (see the module docstring)."""
        return self.serving.model

    @property
    def ready(self) -> bool:
        """True once a version is loaded and warmed up."""
        return self._serving is not None

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        return self.call_detailed(*args, **kwargs)[0]

    def call_detailed(self, *args: Any, **kwargs: Any) -> tuple[Any, str, Serving]:
        """Call the current version; return its outputs, the variant that ran and that version."""
        with self._enter:
            serving = self.serving
            serving.in_flight.enter()
        try:
            outputs, variant = serving.model.call_detailed(*args, **kwargs)
        finally:
            serving.in_flight.leave()
        return outputs, variant, serving

    def stats(self) -> dict[str, Any]:
        """The current model's ``stats()``, with the shapes of every version served since start.

        Calls made on a ``live.model`` reference rather than through the holder are counted only if
        they finish before that version is swapped out.
        """
        with self._retired_lock:  # the serving version and those draining, as one consistent set
            serving = self._serving
            current = (
                serving.model.stats()
                if serving is not None
                else {"calls": 0, "variants": {}, "shapes": [], "shapes_not_tracked": 0}
            )
            shapes = add_histograms(histogram_of(current), self._retired)
            for old in self._draining:
                add_histograms(shapes, histogram_of(old.model.stats()))
        current["shapes"] = [
            {"dims": dict(key), "count": n} for key, n in sorted(shapes.items(), key=lambda kv: (-kv[1], kv[0]))
        ]
        return current

    # --- swapping ------------------------------------------------------------------------------

    def swap(self, path: str | os.PathLike | None = None, *, allow_rollback: bool | None = None) -> Serving:
        """Load ``path`` (default: the path given at construction), warm it up, check it, swap it in.

        Runs in the calling thread; other threads keep calling the old version meanwhile. Raises
        LoaderError (ArtifactError, SwapError, ...) when the new version is refused, and the old one
        keeps serving; either way ``last_attempt`` says what happened.
        """
        requested = path if path is not None else self.source
        if requested is None:
            raise LoaderError("no artifact path: give one to swap() or to Live()")
        with self._swap_lock:
            resolved: Path | str | None = None
            version = None
            pointer = None
            try:
                if remote.is_url(requested):  # a pack in a store, or a pointer object naming one
                    designated = remote.resolve_pointer(str(requested))
                    resolved, pointer = designated.target, designated.identity
                else:
                    resolved = resolve_pointer(requested)
                start = time.perf_counter()
                model = self._load()(resolved, warmup=False, **self.load_options)  # warmed below: SwapError if it fails
                version = model.manifest.version
                digest = model.digest
                self._refuse_mismatch(
                    model, rollback_ok=self.allow_rollback if allow_rollback is None else allow_rollback
                )
                if self.warmup:
                    try:
                        model.warmup()
                    except Exception as e:
                        raise SwapError(f"{resolved}: warm-up failed: {type(e).__name__}: {e}") from e
                self._open_every_variant(model, resolved)
                if self.check is not None:
                    try:
                        self.check(model)
                    except Exception as e:
                        raise SwapError(f"{resolved}: refused by the check: {type(e).__name__}: {e}") from e
                new = Serving(model, resolved, digest, time.time(), time.perf_counter() - start, pointer=pointer)
            except Exception as e:
                self._attempted(SwapAttempt(str(requested), _str(resolved), False, _message(e), version))
                if isinstance(e, LoaderError):
                    raise
                raise LoaderError(f"{requested}: {_message(e)}") from e
            with self._enter, self._retired_lock:
                old = self._serving
                self._serving = new  # the swap: calls from here on run on the new version
                if old is not None:
                    self._draining.append(old)
            if old is not None:
                old.in_flight.wait_idle(DRAIN_SECONDS)  # then its counts are final
                with self._retired_lock:
                    add_histograms(self._retired, histogram_of(old.model.stats()))
                    self._draining.remove(old)
            self._attempted(SwapAttempt(str(requested), str(resolved), True, None, new.version))
            return new

    @staticmethod
    def _open_every_variant(model: ServedModel, resolved: Path | str) -> None:
        """Wait for ``load()``'s background opener (``loader.opening``): a version takes traffic only
        once every variant is open and warm, so no call after a swap waits for one to open; a variant
        that cannot be opened refuses the version, as it did when every variant opened in ``load()``."""
        wait = getattr(model, "wait_opened", None)
        if wait is None:
            return
        wait()
        for v in model.variants:
            if not model.is_open(v.id):  # the opener stopped at it: its error, raised here
                try:
                    model.warm_variant(v.id)
                except Exception as e:
                    raise SwapError(f"{resolved}: variant {v.id!r} cannot be opened: {_message(e)}") from e

    def swap_in_background(self, path: str | os.PathLike | None = None, **options: Any) -> Future:
        """``swap`` on a new daemon thread; the Future holds the new Serving or the error."""
        future: Future = Future()

        def run() -> None:
            try:
                future.set_result(self.swap(path, **options))
            except BaseException as e:  # noqa: BLE001: the Future carries it to whoever waits
                future.set_exception(e)

        threading.Thread(target=run, name="live-swap", daemon=True).start()
        return future

    def _load(self) -> Callable[..., ServedModel]:
        if self.load is None:
            from ..model import load  # torch: only a holder that serves through it imports it

            self.load = load
        return self.load

    def on_attempt(self, listener: Callable[[SwapAttempt], None]) -> None:
        """Call ``listener(attempt)`` after every swap attempt, refused ones too (in the swapping thread)."""
        self._listeners.append(listener)

    def _attempted(self, attempt: SwapAttempt) -> None:
        self.last_attempt = attempt
        for listener in list(self._listeners):
            listener(attempt)

    def _refuse_mismatch(self, model: ServedModel, *, rollback_ok: bool) -> None:
        old = self._serving
        if old is None:
            return
        new_m, old_m = model.manifest, old.model.manifest
        where = str(model.path)
        if new_m.name != old_m.name:
            raise SwapError(f"{where}: artifact {new_m.name!r} cannot replace {old_m.name!r} (another model)")
        if new_m.inputs != old_m.inputs:
            raise SwapError(
                f"{where}: inputs {_signature(new_m.inputs)} differ from the serving version's "
                f"{_signature(old_m.inputs)}; callers would break"
            )
        if new_m.output != old_m.output:
            raise SwapError(f"{where}: its output structure differs from the serving version's; callers would break")
        if new_m.version < old_m.version and not rollback_ok:
            raise SwapError(
                f"{where}: version {new_m.version} is older than the serving version {old_m.version} (a rollback); "
                "to allow it, serve with --allow-rollback (Live(..., allow_rollback=True) or swap(..., allow_rollback=True))"
            )

    # --- watching ------------------------------------------------------------------------------

    def watch(self, path: str | os.PathLike | None = None, *, interval: float = 2.0) -> None:
        """Follow ``path`` (a link or pointer file; default: the construction path) on a daemon thread.

        Every ``interval`` seconds, if it designates another artifact or that artifact's manifest (or
        pack) changed, swap to it. A refused version is not retried until the path changes again; ``last_attempt``
        says why it was refused. ``path`` may be a URL: a pointer object in a store (``s3://.../current``)
        or a pack; each look asks the store for its ETag and size only (``loader.stores.remote.identity``), and
        a change loads the pack it names now, through the cache like any URL.
        """
        target = _source(path) if path is not None else self.source
        if target is None:
            raise LoaderError("nothing to watch: give a path to watch() or to Live()")
        if interval <= 0:
            raise ValueError(f"interval must be positive seconds, got {interval}")
        if self._watcher is not None:
            raise LoaderError("already watching; call close() first")
        self._watch_stop.clear()
        self._watcher = threading.Thread(
            target=self._watch_loop, args=(target, interval), name="live-watch", daemon=True
        )
        self._watcher.start()

    def _watch_loop(self, target: Path | str, interval: float) -> None:
        serving = self._serving
        if serving is None:
            last = None
        elif remote.is_url(target):
            last = serving.pointer
        else:
            last = _identity(serving.path) if not remote.is_url(serving.path) else None
        while not self._watch_stop.wait(interval):
            try:
                seen = remote.identity(target) if remote.is_url(target) else _identity(resolve_pointer(target))
            except (OSError, LoaderError):
                continue  # mid-replacement or gone for a moment: look again next time
            if seen == last:
                continue
            last = seen
            try:
                self.swap(target)
            except Exception:  # noqa: BLE001: recorded in last_attempt; the old version serves on
                pass

    def close(self) -> None:
        """Stop watching (the model itself stays usable)."""
        self._watch_stop.set()
        if self._watcher is not None:
            self._watcher.join()
            self._watcher = None

    def unload(self) -> None:
        """Stop watching and serving: the version served is dropped and, once the calls running on it
        are done (at most ``DRAIN_SECONDS``), its model closed (``ServedModel.close``: containers
        deleted, libraries closed). Calls after this raise LoaderError, as before the first load."""
        self.close()
        with self._swap_lock:
            with self._enter, self._retired_lock:
                old, self._serving = self._serving, None
            if old is not None:
                old.in_flight.wait_idle(DRAIN_SECONDS)
                old.model.close()

    # --- reporting -----------------------------------------------------------------------------

    def status(self) -> dict[str, Any]:
        """What is serving and how the last swap went, as plain data (for logs and status endpoints)."""
        serving = self._serving
        return {
            "ready": serving is not None,
            "serving": serving.describe() if serving is not None else None,
            "last_attempt": self.last_attempt.describe() if self.last_attempt is not None else None,
        }

    def _not_ready_message(self) -> str:
        attempt = self.last_attempt
        if attempt is not None and not attempt.ok:
            return f"no artifact loaded: {attempt.error}"
        return "no artifact loaded yet"

    def __repr__(self) -> str:
        serving = self._serving
        if serving is None:
            return "<Live: nothing loaded>"
        return f"<Live {serving.name!r} version {serving.version} from {str(serving.path)!r}>"


def _source(path: str | os.PathLike) -> Path | str:
    """A URL stays a string (``Path`` would fold its ``//``); anything else is a path."""
    return path if remote.is_url(path) else Path(path)


def _signature(inputs) -> str:
    return "(" + ", ".join(f"{i.name}: {i.dtype}[{', '.join(str(s) for s in i.shape)}]" for i in inputs) + ")"


def _message(e: BaseException) -> str:
    text = str(e).strip()
    return text if text else type(e).__name__


def _str(path: Path | None) -> str | None:
    return str(path) if path is not None else None
