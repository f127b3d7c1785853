"""The local cache where packs are unpacked, once, for every process on the host.

Layout (see ``loader/constants.py``), in ``${PRECOMPILE_CACHE:-${XDG_CACHE_HOME:-~/.cache}/precompile}``:
a ``CACHEDIR.TAG``; ``artifacts/<digest>/``, one read-only artifact folder per manifest digest
(content-addressed, so packs of the same artifact share it, wherever they came from); beside each, a
``<digest>.verified`` record of its files' identities when last hashed; ``locks/<digest>.lock``;
``tmp/`` for unpacking.

Install is atomic: a pack is unpacked into ``tmp/<digest>.<random>/``, every member checked against
the manifest (sizes, sha256), flushed to disk and made read-only, then renamed to
``artifacts/<digest>``. Only a rename makes an entry, so a process killed mid-unpack leaves only a
temporary folder, which nothing trusts and the next install of that digest removes. Processes loading
the same pack at once take ``locks/<digest>.lock`` in turn: one unpacks, the others find the entry.
The lock only saves work; a rename that finds the entry already there keeps the one there.

Every load checks an entry's sizes, and hashes any file whose identity (size, mtime, ctime, inode, device)
differs from the ``.verified`` record, so repeat loads do not re-read large weights while a changed
file (any write moves its ctime) is caught. An entry that fails is discarded and unpacked again from
the pack.

Skipping the hash trusts the record, so the cache must hold nothing another user could have written:
the root, its folders, each entry, every file in it and each record must be owned by this user (or
root) and not writable by group or others, as ssh treats ``~/.ssh``; anything else is refused
(``InsecurePathError``, saying which ``chmod``/``chown`` fixes it). Folders are created 0755 whatever
the umask. Entries are also what ``load()`` maps (``loader.weights``): read-only files of this user,
which no operator's in-place rewrite reaches. ``precompile verify`` re-hashes everything.
"""

from __future__ import annotations

import json
import os
import stat
import tempfile
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from .. import constants as C
from ..artifact import read_manifest, verify_files
from ..errors import ArtifactError, LoaderError
from ..fs import check_private, fsync_dir, locked, make_read_only, remove_tree, seal, write_atomic
from ..manifest import SHA256_RE, Manifest
from .pack import PackHead, unpack


def default_root() -> Path:
    env = os.environ.get(C.CACHE_ENV)
    if env:
        return Path(env).expanduser()
    xdg = os.environ.get("XDG_CACHE_HOME")
    return (Path(xdg).expanduser() if xdg else Path.home() / ".cache") / "precompile"


@dataclass(frozen=True)
class Entry:
    digest: str
    path: Path
    manifest: Manifest | None  # None when the entry's manifest cannot be read
    size: int  # bytes of its files


class Cache:
    """``Cache()`` is the default cache; ``Cache(path)`` another one."""

    def __init__(self, root: str | os.PathLike | None = None):
        self.root = Path(root) if root is not None else default_root()
        self.entries_dir = self.root / C.CACHE_ENTRIES_DIR
        self.locks_dir = self.root / C.CACHE_LOCKS_DIR
        self.tmp_dir = self.root / C.CACHE_TMP_DIR

    def entry_path(self, digest: str) -> Path:
        return self.entries_dir / digest

    def open(
        self, head: PackHead, *, verify: bool = True, fill: Callable[[Path], None] | None = None
    ) -> tuple[Path, bool]:
        """A verified artifact folder holding the pack's files, and whether this call unpacked it.

        ``verify=False`` checks sizes only on an existing entry (an install always hashes). ``fill``:
        what writes the artifact's files into an empty folder instead of unpacking ``head.path``
        (``loader.stores.oci`` downloads them); the files are hashed again before they become the entry.
        """
        entry = self.entry_path(head.digest)
        if os.path.lexists(entry) and self._check_folders():
            try:
                self._check(entry, head, verify)
                return entry, False
            except ArtifactError:
                pass  # discarded and unpacked again below, under the lock
        self._prepare()
        with locked(self.locks_dir / f"{head.digest}.lock"):
            if os.path.lexists(entry):
                try:
                    self._check(entry, head, verify)
                    return entry, False
                except ArtifactError:
                    self._discard(entry)
            self._install(head, entry, fill)
            return entry, True

    # -- maintenance

    def entries(self) -> list[Entry]:
        """Every entry, sorted by name and version."""
        out = []
        if not self.entries_dir.is_dir():
            return out
        for path in self.entries_dir.iterdir():
            if not path.is_dir() or not SHA256_RE.match(path.name):
                continue
            try:
                manifest = read_manifest(path)
            except ArtifactError:
                manifest = None
            size = sum(p.lstat().st_size for p in path.rglob("*") if p.is_file())
            out.append(Entry(path.name, path, manifest, size))
        return sorted(out, key=lambda e: (e.manifest.name, e.manifest.version) if e.manifest else ("", 0))

    def clear(self) -> tuple[int, int]:
        """Remove every entry and leftover; return (entries removed, bytes freed).

        Processes already serving from an entry keep working (their files stay open); an install in
        progress is left alone.
        """
        removed, freed = 0, 0
        for entry in self.entries():
            self._discard(entry.path)
            removed, freed = removed + 1, freed + entry.size
        if self.entries_dir.is_dir():
            for path in self.entries_dir.glob(f"*{C.CACHE_VERIFIED_SUFFIX}"):
                path.unlink(missing_ok=True)
        if self.tmp_dir.is_dir():
            for path in self.tmp_dir.iterdir():
                digest = path.name.split(".")[0]
                with locked(self.locks_dir / f"{digest}.lock", blocking=False) as free:
                    if free:
                        remove_tree(path)
        return removed, freed

    # -- steps

    def _prepare(self) -> None:
        try:
            for folder in (self.root, self.entries_dir, self.locks_dir, self.tmp_dir):
                folder.mkdir(mode=0o755, parents=True, exist_ok=True)
            self._check_folders()
            tag = self.root / C.CACHEDIR_TAG
            if not tag.exists():
                write_atomic(tag, C.CACHEDIR_TAG_TEXT.encode())
        except OSError as e:
            raise LoaderError(
                f"{self.root}: cannot use as the precompile cache ({e.strerror}); set {C.CACHE_ENV} to a writable folder"
            ) from None

    def _check_folders(self) -> bool:
        """Refuse a root or folder of the cache that others own or can write; False if one is missing."""
        fix = f"set {C.CACHE_ENV} to a folder of your own"
        try:
            check_private(self.root, "the precompile cache", fix, follow=True)
            for folder in (self.entries_dir, self.locks_dir, self.tmp_dir):
                check_private(folder, "a folder of the precompile cache", fix)
        except FileNotFoundError:
            return False
        return True

    def _check_owned(self, entry: Path, record: Path) -> None:
        """Refuse an entry, or a record, that another user could have written (see the module doc)."""
        fix = f"delete it (`precompile cache clear`) or set {C.CACHE_ENV} to a folder of your own"
        check_private(entry, "a precompile cache entry", fix)
        if not stat.S_ISDIR(os.lstat(entry).st_mode):
            raise ArtifactError(f"{entry}: a cache entry that is not a folder")
        for folder, dirs, files in os.walk(entry):
            for name in dirs + files:
                check_private(Path(folder, name), "a file of a precompile cache entry", fix)
        if os.path.lexists(record):
            check_private(record, "a precompile cache record", fix)

    def _check(self, entry: Path, head: PackHead, verify: bool) -> None:
        record = self._verified_path(head.digest)
        self._check_owned(entry, record)
        known = _read_record(record, head.digest) if verify else None
        identities = verify_files(entry, head.manifest, hashes=verify, known=known)
        if verify and identities != known:
            try:
                write_atomic(record, json.dumps({"digest": head.digest, "files": identities}).encode())
            except OSError:
                pass  # a read-only cache still serves; the next load hashes again

    def _install(self, head: PackHead, entry: Path, fill: Callable[[Path], None] | None = None) -> None:
        # Under the lock, a temporary folder of this digest belongs to a process that died.
        for stale in self.tmp_dir.glob(f"{head.digest}.*"):
            remove_tree(stale)
        try:
            tmp = Path(tempfile.mkdtemp(prefix=f"{head.digest}.", dir=self.tmp_dir))
        except OSError as e:
            raise LoaderError(
                f"{self.tmp_dir}: cannot unpack here ({e.strerror}); set {C.CACHE_ENV} to a writable folder"
            ) from None
        try:
            if fill is None:
                unpacked = unpack(head.path, tmp)
                if unpacked.digest != head.digest:
                    raise ArtifactError(f"{head.path}: the file changed while it was being loaded; load it again")
            else:
                fill(tmp)
            seal(tmp)
            identities = verify_files(tmp, head.manifest, hashes=fill is not None)
            try:
                os.rename(tmp, entry)
            except OSError:
                if not entry.is_dir():
                    raise
                # Another process installed it without the lock (a cleared lock file): keep theirs.
                remove_tree(tmp)
                self._check(entry, head, verify=True)
                return
            make_read_only(entry)
            fsync_dir(self.entries_dir)
        except OSError as e:
            remove_tree(tmp)
            raise LoaderError(f"{self.root}: cannot install {head.path} in the cache ({e.strerror or e})") from None
        except BaseException:
            remove_tree(tmp)
            raise
        try:
            write_atomic(
                self._verified_path(head.digest), json.dumps({"digest": head.digest, "files": identities}).encode()
            )
        except OSError:
            pass

    def _discard(self, entry: Path) -> None:
        """Take an entry out of use at once (a rename), then delete it."""
        self._verified_path(entry.name).unlink(missing_ok=True)
        self.tmp_dir.mkdir(parents=True, exist_ok=True)
        aside = Path(tempfile.mkdtemp(prefix=f"{entry.name}.discarded-", dir=self.tmp_dir))
        os.rmdir(aside)
        try:
            os.chmod(entry, 0o755)  # moving a folder to another parent needs write permission on it
            os.rename(entry, aside)
        except FileNotFoundError:
            return
        remove_tree(aside)

    def _verified_path(self, digest: str) -> Path:
        return self.entries_dir / f"{digest}{C.CACHE_VERIFIED_SUFFIX}"


def _read_record(path: Path, digest: str) -> dict[str, list[int]] | None:
    try:
        data = json.loads(path.read_bytes())
        files = data["files"]
        if data["digest"] != digest or not isinstance(files, dict):
            return None
        return {k: v for k, v in files.items() if isinstance(v, list)}
    except (OSError, ValueError, KeyError, TypeError):
        return None
