"""The observed-shape histogram as a file: what serving saw, in the form a profile's distribution reads.

One JSON object a line, ``{"dims": {"batch": 4, "seq": 77}, "count": 12}``. A ``TrafficRecorder``
rewrites the file from a model's ``stats()`` every ``interval`` seconds and when closed (or at
interpreter exit), so any process that serves with the loader can feed the next build:

    model = loader.load("artifacts/text-classifier")          # or a loader.Live
    recorder = loader.TrafficRecorder(model, "traffic-{pid}.jsonl", interval=60)
    ...
    recorder.close()                                           # final write

``precompile profile merge PROFILE traffic-*.jsonl`` then folds such files into the profile.
The reader (``read_histogram``) lives here too, so writer and reader agree on the format.
"""

from __future__ import annotations

import atexit
import json
import os
import threading
from collections.abc import Callable
from pathlib import Path
from typing import Any, Protocol

from ..errors import LoaderError
from ..fs import write_atomic

# A histogram: the sizes of every dim, in dim order, as (name, size) pairs -> number of calls.
Histogram = dict[tuple[tuple[str, int], ...], int]

MAX_LINE_BYTES = 64 * 1024


class TrafficFileError(LoaderError):
    """A recorded traffic file is unreadable or not in the ``{"dims": {...}, "count": N}`` form."""


class HasStats(Protocol):
    def stats(self) -> dict[str, Any]: ...


def histogram_of(stats: dict[str, Any]) -> Histogram:
    """The shapes of a ``stats()`` result (CompiledModel or Live) as a Histogram."""
    return {tuple(entry["dims"].items()): entry["count"] for entry in stats["shapes"]}


def add_histograms(into: Histogram, other: Histogram) -> Histogram:
    """Add ``other``'s counts to ``into`` (in place), matching equal dims whatever their order."""
    order = [name for name, _ in next(iter(into))] if into else None
    for key, count in other.items():
        if order is not None and [name for name, _ in key] != order:
            sizes = dict(key)
            if set(sizes) == set(order):
                key = tuple((name, sizes[name]) for name in order)
        into[key] = into.get(key, 0) + count
    return into


def read_histogram(path: str | os.PathLike, *, check: Callable[[dict[str, int], str], None] | None = None) -> Histogram:
    """Read a traffic file, summing the counts of equal dims.

    Raises TrafficFileError naming ``file:line`` for anything that is not a
    ``{"dims": {name: size, ...}, "count": N}`` object, or when lines disagree on the dim names.
    Blank lines are skipped. ``check(dims, "file:line")`` may refuse a line by raising.
    """
    path = Path(path)
    try:
        f = open(path, "rb")
    except FileNotFoundError:
        raise TrafficFileError(f"{path}: no such traffic file") from None
    except OSError as e:
        raise TrafficFileError(f"{path}: cannot read ({e.strerror})") from None
    out: Histogram = {}
    names: tuple[str, ...] | None = None
    with f:
        for number, raw in enumerate(f, start=1):
            where = f"{path}:{number}"
            if len(raw) > MAX_LINE_BYTES:
                raise TrafficFileError(f"{where}: line is longer than {MAX_LINE_BYTES} bytes")
            if not raw.strip():
                continue
            key, count = _parse_line(raw, where)
            if check is not None:
                check(dict(key), where)
            line_names = tuple(name for name, _ in key)
            if names is None:
                names = line_names
            elif set(line_names) != set(names):
                raise TrafficFileError(
                    f"{where}: dims {', '.join(line_names) or 'none'} differ from the earlier lines' "
                    f"({', '.join(names) or 'none'}); one file records one model"
                )
            key = tuple((name, dict(key)[name]) for name in names)  # one order for equal dims
            out[key] = out.get(key, 0) + count
    return out


def _parse_line(raw: bytes, where: str) -> tuple[tuple[tuple[str, int], ...], int]:
    try:
        entry = json.loads(raw)
    except (ValueError, RecursionError) as e:
        raise TrafficFileError(f"{where}: not valid JSON ({e})") from None
    if not isinstance(entry, dict) or set(entry) != {"dims", "count"}:
        raise TrafficFileError(f'{where}: expected {{"dims": {{...}}, "count": N}}, got {_short(raw)}')
    dims, count = entry["dims"], entry["count"]
    if not isinstance(dims, dict):
        raise TrafficFileError(f'{where}: "dims" must be an object of sizes, got {_short(json.dumps(dims))}')
    for name, size in dims.items():
        if not name.isidentifier():
            raise TrafficFileError(f"{where}: dim name {name!r} is not an identifier")
        if isinstance(size, bool) or not isinstance(size, int) or size < 0:
            raise TrafficFileError(f"{where}: dims.{name} must be a size (an integer >= 0), got {json.dumps(size)}")
    if isinstance(count, bool) or not isinstance(count, int) or count < 0:
        raise TrafficFileError(f'{where}: "count" must be an integer >= 0, got {json.dumps(count)}')
    return tuple(dims.items()), count


def _short(text: str | bytes) -> str:
    if isinstance(text, bytes):
        text = text.decode("utf-8", "replace")
    text = text.strip()
    return text if len(text) <= 80 else text[:77] + "..."


def format_histogram(histogram: Histogram) -> str:
    """The file's text: most frequent shapes first, ties in size order."""
    lines = (
        json.dumps({"dims": dict(key), "count": count}, separators=(", ", ": "))
        for key, count in sorted(histogram.items(), key=lambda kv: (-kv[1], kv[0]))
    )
    return "".join(line + "\n" for line in lines)


def write_histogram(path: str | os.PathLike, histogram: Histogram) -> None:
    """Replace ``path`` atomically: readers never see half a file."""
    write_atomic(Path(path), format_histogram(histogram).encode("utf-8"))


def expand_path(path: str | os.PathLike) -> Path:
    """Replace ``{pid}`` by this process's id: several processes (server workers) then write one file each."""
    return Path(str(path).replace("{pid}", str(os.getpid())))


class TrafficRecorder:
    """Keeps ``path`` equal to the shape histogram a model (or ``Live``) has seen.

    The file is rewritten whole, atomically, every ``interval`` seconds by a daemon thread, and once
    more by ``close()`` or at interpreter exit. Counts already in the file when the recorder starts are
    kept and added to, so a restarted process goes on counting. ``{pid}`` in the path is replaced by
    the process id. ``interval=None`` writes only on ``write()`` and ``close()``.
    """

    def __init__(self, source: HasStats, path: str | os.PathLike, *, interval: float | None = 60.0):
        if interval is not None and interval <= 0:
            raise ValueError(f"interval must be positive seconds or None, got {interval}")
        self.source = source
        self.path = expand_path(path)
        self.interval = interval
        if not self.path.parent.is_dir():
            raise TrafficFileError(f"{self.path}: folder {self.path.parent} does not exist")
        self._base = read_histogram(self.path) if self.path.exists() else {}
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._closed = False
        self.last_error: BaseException | None = None
        self._thread: threading.Thread | None = None
        if interval is not None:
            self._thread = threading.Thread(target=self._loop, name=f"traffic-recorder {self.path.name}", daemon=True)
            self._thread.start()
        atexit.register(self.close)

    def histogram(self) -> Histogram:
        """What the file holds after the next write: the counts found at start plus those seen since."""
        # the model's dim order first, so the file keeps it
        return add_histograms(histogram_of(self.source.stats()), self._base)

    def write(self) -> int:
        """Write the file now; return the number of distinct shapes written."""
        with self._lock:
            histogram = self.histogram()
            write_histogram(self.path, histogram)
            return len(histogram)

    def close(self) -> None:
        """Stop the interval thread and write a last time (idempotent)."""
        if self._closed:
            return
        self._closed = True
        self._stop.set()
        if self._thread is not None and self._thread is not threading.current_thread():
            self._thread.join()
        atexit.unregister(self.close)
        self.write()

    def _loop(self) -> None:
        while not self._stop.wait(self.interval):
            try:
                self.write()
                self.last_error = None
            except OSError as e:  # a full disk must not stop serving; the next interval tries again
                self.last_error = e

    def __enter__(self) -> TrafficRecorder:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __repr__(self) -> str:
        every = f"every {self.interval:g} s" if self.interval else "on close"
        return f"<TrafficRecorder {str(self.path)!r} {every}>"
