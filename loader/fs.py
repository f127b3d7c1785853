"""File-system steps the cache and the version records share: atomic writes, locks, durable renames,
removing read-only trees."""

from __future__ import annotations

import os
import shutil
import stat
import tempfile
from contextlib import contextmanager
from pathlib import Path
from typing import Iterator


def write_atomic(path: Path, data: bytes) -> None:
    """Write ``path`` so that readers see the old content or the new, never a part."""
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", dir=path.parent)
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        os.chmod(tmp, 0o644)
        os.replace(tmp, path)
    except BaseException:
        try:
            os.unlink(tmp)
        except OSError:
            pass
        raise


@contextmanager
def locked(path: Path, *, blocking: bool = True) -> Iterator[bool]:
    """Hold an exclusive ``flock`` on ``path`` (created if needed) for the ``with`` block.

    Yields False, holding nothing, when ``blocking`` is False and another process holds it. Without
    fcntl (not POSIX) nothing is locked: callers must stay correct without the lock, which only saves
    duplicate work.
    """
    try:
        import fcntl
    except ImportError:
        yield True
        return
    fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX if blocking else fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            yield False
            return
        yield True
    finally:
        os.close(fd)  # releases the lock


def fsync_dir(path: Path) -> None:
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:  # not every platform opens folders
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


def seal(root: Path) -> None:
    """Flush every file under ``root`` to disk and make the tree read-only (files 0444, folders 0555)
    except ``root`` itself: renaming a folder to another parent needs write permission on it (its
    ``..`` entry changes), so the caller renames it first, then calls ``make_read_only(root)``."""
    for folder, _, files in os.walk(root, topdown=False):
        for name in files:
            path = os.path.join(folder, name)
            fd = os.open(path, os.O_RDONLY)
            try:
                os.fsync(fd)
            finally:
                os.close(fd)
            os.chmod(path, 0o444)
        if folder != str(root):
            os.chmod(folder, 0o555)
        fsync_dir(Path(folder))


def make_read_only(folder: Path) -> None:
    os.chmod(folder, 0o555)
    fsync_dir(folder)


def remove_tree(path: Path) -> None:
    """Remove a tree, read-only folders included; missing is fine."""
    if not os.path.lexists(path):
        return
    if not os.path.isdir(path) or os.path.islink(path):
        os.unlink(path)
        return
    make_writable(path)
    shutil.rmtree(path, ignore_errors=True)


def make_writable(path: Path) -> None:
    """Give the owner write permission on ``path`` and every folder below it (not on files)."""
    for folder, _, _ in os.walk(path):
        try:
            os.chmod(folder, stat.S_IRWXU | stat.S_IRGRP | stat.S_IXGRP | stat.S_IROTH | stat.S_IXOTH)
        except OSError:
            pass
