"""File-system steps the cache and the version records share: atomic writes, locks, durable renames,
removing read-only trees, and refusing folders and files another user could have written."""

from __future__ import annotations

import os
import shutil
import stat
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from .errors import InsecurePathError


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
    lock = FileLock(path)
    if not lock.acquire(blocking=blocking):
        yield False
        return
    try:
        yield True
    finally:
        lock.release()


class FileLock:
    """An exclusive ``flock`` on ``path`` held from ``acquire()`` to ``release()``, for a hold that
    spans more than one block of code (``loader.trust.LedgerHold``). Threads conflict too: each
    acquire opens the file anew, and flock locks belong to the open file."""

    def __init__(self, path: Path):
        self.path = path
        self._fd: int | None = None

    def acquire(self, *, blocking: bool = True) -> bool:
        try:
            import fcntl
        except ImportError:
            return True
        fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o644)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX if blocking else fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            os.close(fd)
            return False
        except BaseException:
            os.close(fd)
            raise
        self._fd = fd
        return True

    def release(self) -> None:
        fd, self._fd = self._fd, None
        if fd is not None:
            os.close(fd)  # releases the lock

    __del__ = release  # a hold its owner forgot must not outlive it


def check_private(path: Path, what: str, fix: str, *, follow: bool = False) -> os.stat_result:
    """Refuse ``path`` unless this user (or root) owns it and neither group nor others can write it,
    as ssh treats ``~/.ssh``: whoever can write there can change what a later load trusts.

    ``follow`` follows a symbolic link (for a root folder the user may have linked elsewhere); inside
    the folder a link is refused like any other file someone else could have made. ``fix`` is the
    way out offered besides chmod/chown (e.g. "set PRECOMPILE_CACHE to a folder of your own").
    """
    st = os.stat(path) if follow else os.lstat(path)
    uid = current_uid()
    if st.st_uid not in (uid, 0):
        raise InsecurePathError(
            f"{path}: {what} is owned by uid {st.st_uid}, not by this user (uid {uid}); run `chown -R {uid} {path}` "
            f"as its owner or root, or {fix}"
        )
    if stat.S_ISLNK(st.st_mode):
        raise InsecurePathError(f"{path}: {what} is a symbolic link; remove it, or {fix}")
    if st.st_mode & (stat.S_IWGRP | stat.S_IWOTH):
        raise InsecurePathError(
            f"{path}: {what} is writable by group or others (mode {stat.S_IMODE(st.st_mode):04o}); run "
            f"`chmod go-w {path}`, or {fix}"
        )
    return st


def current_uid() -> int:
    """The user whose files are trusted (one function, so tests can pretend to be someone else)."""
    return os.geteuid()


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


def open_to_readers(root: Path) -> None:
    """Give every folder and file under ``root`` (and ``root``) the mode a new one gets from the umask:
    0755 and 0644 under the usual 022, so a service user can read an artifact a CI user wrote.
    Temporary folders start 0700 and some writers make 0600 files; ``umask 077`` keeps them private."""
    mask = os.umask(0o022)
    os.umask(mask)
    for folder, _, files in os.walk(root):
        os.chmod(folder, 0o777 & ~mask)
        for name in files:
            os.chmod(os.path.join(folder, name), 0o666 & ~mask)


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
