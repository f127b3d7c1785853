"""Packs in object stores: ``load("s3://bucket/models/text-classifier/7.tar.zst")`` and any other
fsspec URL (``gs://``, ``https://``, ``file://``).

A remote pack is fetched into the local cache once and then treated exactly as a local pack:

- it is streamed in ranged reads (``FIRST_CHUNK`` growing to ``CHUNK`` bytes) into a private
  temporary file in the cache's ``tmp/`` (sha256 computed as it streams); each read is retried on
  transient errors, a bounded number of times with exponential backoff, resuming where it stopped.
  The file is used only once it has the size the store announced; a failure removes it, so a
  half-downloaded pack never becomes an entry;
- the pack's head (manifest and signature, its first members) is judged as soon as it has arrived
  (trust, expiry, host), so a refused pack costs one small read whatever follows it; an object larger
  than ``max_bytes`` or than the size the model's ``index.json`` records is refused before any read;
- the local pack is then opened by the same code as any pack (manifest, signature, expiry, host,
  then the strict unpack into ``artifacts/<digest>``, every member hashed), and deleted;
- ``remote/<sha256 of the URL>.json`` records the URL's ETag, size and manifest digest. A later load
  asks the store for the object's ETag only (one small request); when it matches and the entry is
  there, nothing is downloaded. A record is trusted only if this user owns it, like the cache itself.

A pointer object (``<url>/<name>/current``, holding ``7.tar.zst``) designates the pack to serve, so a
deploy is one small write (``precompile promote``); ``resolve_pointer`` reads it and ``identity`` is
what ``Live.watch`` polls (ETag and size: one metadata request per look).

fsspec (and s3fs for ``s3://``) is imported only for URLs: ``import loader`` stays light.
Credentials come the standard way (for S3: the AWS environment variables and config files); an S3
compatible endpoint is ``PRECOMPILE_S3_ENDPOINT_URL``, else ``AWS_ENDPOINT_URL``, which botocore reads.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import re
import tempfile
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TypeVar

from .. import constants as C
from ..artifact import is_url, manifest_digest, read_signature
from ..errors import ArtifactError, LoaderError
from ..fs import check_private, write_atomic
from ..manifest import MAX_INT, NAME_RE, _Reader
from . import oci
from .cache import Cache
from .pack import MAX_HEAD_BYTES, PackHead, max_pack_bytes, read_partial_head

ENDPOINT_ENV = "PRECOMPILE_S3_ENDPOINT_URL"
CHUNK = 8 << 20
FIRST_CHUNK = 256 << 10  # reads grow from this to CHUNK: a pack's head arrives, and is judged, early
RETRIES = 4  # attempts per request, transient errors only
BACKOFF = 0.25  # seconds before the second attempt, doubled each time
RECORDS_DIR = "remote"


class MissingObjectError(ArtifactError):
    """The store answered: there is no object at this URL."""


T = TypeVar("T")


def filesystem(url: str) -> tuple[Any, str]:
    """The fsspec filesystem for ``url`` and the path inside it, with the endpoint from the
    environment for ``s3://``. ArtifactError naming the URL when the scheme needs a package that
    is not installed (``pip install precompile[s3]``)."""
    try:
        import fsspec.core
    except ImportError:
        raise ArtifactError(f"{url}: loading from a URL needs fsspec; pip install 'precompile[s3]'") from None
    options: dict[str, Any] = {}
    if url.startswith(("s3://", "s3a://")):
        endpoint = os.environ.get(ENDPOINT_ENV)
        if endpoint:
            options["endpoint_url"] = endpoint
        options["use_listings_cache"] = False  # another host may have pushed since: always ask
        # Fail in seconds, not minutes, on a store that is down; our own retries take over from there.
        options["config_kwargs"] = {
            "connect_timeout": 5,
            "read_timeout": 30,
            "retries": {"max_attempts": 2},
            # S3 compatibles (rclone, MinIO, Ceph) differ on the newer CRC checksums; the pack carries
            # its own sha256 for every member, so ask for checksums only where S3 requires them.
            "request_checksum_calculation": "when_required",
            "response_checksum_validation": "when_required",
        }
    if url.startswith("file://"):
        options["auto_mkdir"] = True  # a fresh store is an empty folder: writing a model's first pack makes its folder
    try:
        return fsspec.core.url_to_fs(url, **options)
    except ImportError as e:
        raise ArtifactError(
            f"{url}: {e}; pip install 'precompile[s3]' (or the fsspec package for this scheme)"
        ) from None
    except ValueError as e:
        raise ArtifactError(f"{url}: not a URL fsspec knows ({e})") from None


def retried(url: str, what: str, call: Callable[[], T]) -> T:
    """``call()``, again after a transient error (connection, timeout, server error), at most
    ``RETRIES`` times; ArtifactError naming the URL once it gives up. A missing object or a refused
    permission is not transient and fails at once."""
    for attempt in range(RETRIES):
        try:
            return call()
        except FileNotFoundError:
            raise MissingObjectError(f"{url}: no such object in the store") from None
        except PermissionError as e:
            raise ArtifactError(f"{url}: access refused by the store ({e}); check the credentials") from None
        except Exception as e:  # fsspec backends raise their own transport errors (aiohttp, botocore)
            if attempt + 1 == RETRIES:
                raise ArtifactError(
                    f"{url}: cannot {what} after {RETRIES} attempts; is the store up? ({type(e).__name__}: {e})"
                ) from None
            time.sleep(BACKOFF * 2**attempt)
    raise AssertionError("unreachable")


def stat(fs: Any, path: str, url: str) -> tuple[str | None, int]:
    """The object's ETag (None if the store gives none) and size."""
    info = _info(fs, path, url)
    etag = info.get("ETag") or info.get("etag")
    return (str(etag) if etag is not None else None), int(info.get("size") or 0)


def _info(fs: Any, path: str, url: str) -> dict[str, Any]:
    info = retried(url, "reach the store", lambda: fs.info(path))
    if info.get("type") not in (None, "file"):
        raise ArtifactError(f"{url}: not an object (a folder?); give the URL of a .tar.zst pack or a pointer")
    return info


# --- pointers: a deploy is one small object write ----------------------------------------------------

POINTER_MAX_BYTES = 4096


@dataclass(frozen=True)
class RemotePointer:
    """What a URL designates now: itself when it is a pack, else the pack its pointer object names."""

    url: str  # as asked for
    target: str  # the pack's URL
    identity: tuple[str, ...]  # of the object at ``url``, as ``identity(url)`` returns it


def identity(url: str) -> tuple[str, ...]:
    """What tells a watcher that the object at ``url`` changed: its ETag and size, or its modification
    time and size where the store gives no ETag. One metadata request; nothing is downloaded."""
    if oci.is_reference(url):
        return oci.identity(url)
    fs, path = filesystem(url)
    return _identity(_info(fs, path, url))


def _identity(info: dict[str, Any]) -> tuple[str, ...]:
    size = str(info.get("size") or 0)
    etag = info.get("ETag") or info.get("etag")
    if etag is not None:
        return ("etag", str(etag), size)
    return ("mtime", str(info.get("LastModified") or info.get("mtime") or info.get("last_modified")), size)


def resolve_pointer(url: str) -> RemotePointer:
    """The pack ``url`` designates: ``url`` itself when it is a pack (named ``*.tar.zst``, or any name
    whose bytes are a pack's), else the pack its pointer object names. A pointer is a small text object
    whose first line is the pack's name relative to the pointer's folder (``7.tar.zst``: what
    ``precompile promote`` writes) or a full URL in the same kind of store. An ``oci://`` reference
    designates itself (a registry's tags are its pointers).

    ArtifactError naming ``url`` for anything else; like a pointer file on disk, an error never quotes
    the object's content.
    """
    if oci.is_reference(url):
        return RemotePointer(url, url, oci.identity(url))
    fs, path = filesystem(url)
    info = _info(fs, path, url)
    seen = _identity(info)
    if url.endswith(C.PACK_SUFFIX):
        return RemotePointer(url, url, seen)
    size = int(info.get("size") or 0)
    if size == 0:
        raise ArtifactError(f"{url}: the pointer is empty; write the pack's name in it (precompile promote)")
    head = retried(url, "read the pointer", lambda: fs.cat_file(path, start=0, end=min(size, POINTER_MAX_BYTES)))
    if head.startswith(C.ZSTD_MAGIC):
        return RemotePointer(url, url, seen)
    not_a_pointer = ArtifactError(
        f"{url}: not a pack nor a pointer naming one (a pointer holds one line: the pack's name relative to "
        "the pointer's folder, such as 7.tar.zst, or its full URL)"
    )
    if size > POINTER_MAX_BYTES:
        raise not_a_pointer
    try:
        lines = head.decode("utf-8", errors="strict").strip().splitlines()
    except UnicodeDecodeError:
        raise not_a_pointer from None
    line = lines[0].strip() if lines else ""
    if not line:
        raise ArtifactError(f"{url}: the pointer is empty; write the pack's name in it (precompile promote)")
    return RemotePointer(url, pointer_target(url, line, not_a_pointer), seen)


def pointer_target(url: str, name: str, refused: ArtifactError) -> str:
    """The URL a pointer at ``url`` holding ``name`` designates: ``name`` itself when it is a URL of the
    same scheme (a pointer never sends a loader to the local disk or another kind of store), else
    ``name`` in the pointer's folder (no ``..``: name another folder by its full URL)."""
    scheme = url.split("://", 1)[0]
    if is_url(name):
        if name.split("://", 1)[0] != scheme:
            raise refused
        return name
    parts = name.split("/")
    if name.startswith("/") or any(p in ("", ".", "..") for p in parts) or "\\" in name:
        raise refused
    return f"{url.rsplit('/', 1)[0]}/{name}"


# --- the index a store keeps per model: untrusted input, parsed strictly ----------------------------

INDEX_FILE = "index.json"
MAX_INDEX_BYTES = 16 << 20
_VERSION_KEY = re.compile(r"^[1-9][0-9]{0,15}$")
_HEX64 = re.compile(r"^[0-9a-f]{64}$")
_ENTRY_KEYS = {"file", "digest", "sha256", "size", "signed_by"}


@dataclass(frozen=True)
class IndexEntry:
    """One published version, as ``precompile push`` recorded it in ``<url>/<name>/index.json``."""

    version: int
    file: str  # "<version>.tar.zst", in the model's folder
    digest: str  # the manifest's sha256 (what a cache entry is named by)
    sha256: str  # of the pack file
    size: int  # of the pack file, in bytes
    signed_by: tuple[str, ...]  # key ids

    def to_json(self) -> dict[str, Any]:
        return {
            "file": self.file,
            "digest": self.digest,
            "sha256": self.sha256,
            "size": self.size,
            "signed_by": list(self.signed_by),
        }


@dataclass(frozen=True)
class StoreIndex:
    """A model's index: ``{"name", "versions": {"7": entry}}``; ``entries`` by version, oldest first."""

    name: str
    entries: tuple[IndexEntry, ...] = ()

    @property
    def versions(self) -> list[int]:
        return [e.version for e in self.entries]

    def get(self, version: int) -> IndexEntry | None:
        return next((e for e in self.entries if e.version == version), None)

    def with_entry(self, entry: IndexEntry) -> StoreIndex:
        kept = [e for e in self.entries if e.version != entry.version]
        return StoreIndex(self.name, tuple(sorted([*kept, entry], key=lambda e: e.version)))

    def to_bytes(self) -> bytes:
        versions = {str(e.version): e.to_json() for e in self.entries}
        return json.dumps({"name": self.name, "versions": versions}, indent=2, sort_keys=True).encode() + b"\n"


def parse_index(data: bytes, url: str, name: str) -> StoreIndex:
    """Parse the index at ``url`` (in the folder of model ``name``); ArtifactError naming the index,
    the key and what is wrong, as the manifest's parser does. Nothing in it is trusted: a version is
    a positive integer, an entry names its own ``<version>.tar.zst`` in the folder (never a path out
    of it), digests are sha256 hex, sizes real sizes."""
    r = _Reader(url)
    if len(data) > MAX_INDEX_BYTES:
        raise ArtifactError(f"{url}: {len(data)} bytes, more than the {MAX_INDEX_BYTES} an index may take")
    try:
        raw = json.loads(data)
    except (ValueError, RecursionError) as e:
        raise ArtifactError(f"{url}: not an index `precompile push` wrote (not valid JSON: {e})") from None
    raw = r.obj(raw, "index", {"name", "versions"})
    if r.str(raw["name"], "name", NAME_RE) != name:
        raise r.fail("name", f"{raw['name']!r}, but the index is in the folder of {name!r}")
    versions = raw["versions"]
    if not isinstance(versions, dict):
        raise r.fail("versions", "expected an object of version numbers")
    entries = []
    for key, value in versions.items():
        where = f"versions.{json.dumps(key[:40])}{'…' if len(key) > 40 else ''}"
        if not _VERSION_KEY.match(key) or int(key) > MAX_INT:
            raise r.fail(where, "the key is not a version number (a positive integer, as push writes)")
        entries.append(_index_entry(r, int(key), value, where))
    return StoreIndex(name, tuple(sorted(entries, key=lambda e: e.version)))


def _index_entry(r: _Reader, version: int, value: Any, where: str) -> IndexEntry:
    entry = r.obj(value, where, _ENTRY_KEYS)
    file = r.str(entry["file"], f"{where}.file")
    if file != f"{version}{C.PACK_SUFFIX}":
        raise r.fail(
            f"{where}.file",
            f"{file!r}: version {version} is published as {version}{C.PACK_SUFFIX} in the model's folder",
        )
    signed_by = r.list(entry["signed_by"], f"{where}.signed_by", max_len=64)
    return IndexEntry(
        version=version,
        file=file,
        digest=r.str(entry["digest"], f"{where}.digest", _HEX64),
        sha256=r.str(entry["sha256"], f"{where}.sha256", _HEX64),
        size=r.int(entry["size"], f"{where}.size", 1),
        signed_by=tuple(r.str(k, f"{where}.signed_by[{i}]", _HEX64) for i, k in enumerate(signed_by)),
    )


def read_index(folder: str) -> StoreIndex:
    """The index of model folder ``<url>/<name>``, parsed strictly; an empty one when none was
    written yet."""
    folder = folder.rstrip("/")
    url, name = f"{folder}/{INDEX_FILE}", folder.rsplit("/", 1)[-1]
    fs, path = filesystem(url)
    try:
        data = retried(url, "read the index", lambda: fs.cat_file(path, start=0, end=MAX_INDEX_BYTES + 1))
    except MissingObjectError:
        return StoreIndex(name)
    return parse_index(data, url, name)


def list_models(url: str, *, broken: dict[str, str] | None = None) -> dict[str, StoreIndex]:
    """The models under a store URL and their versions: ``{name: index}``. ``url`` may be a store
    root (every ``<name>/index.json`` under it) or one model's folder. ``broken``: a model folder
    whose index cannot be read is recorded there (name -> why) instead of failing the listing."""
    fs, path = filesystem(url)
    own = f"{url.rstrip('/')}/{INDEX_FILE}"
    own_fs, own_path = filesystem(own)
    if retried(own, "reach the store", lambda: own_fs.exists(own_path)):
        index = read_index(url)
        return {index.name: index}
    found: dict[str, StoreIndex] = {}
    try:
        listing = retried(url, "list the store", lambda: fs.ls(path, detail=True))
    except MissingObjectError:
        return found  # a fresh file:// store: nothing pushed yet
    for entry in listing:
        if entry.get("type") != "directory":
            continue
        name = entry["name"].rstrip("/").rsplit("/", 1)[-1]
        try:
            index = read_index(f"{url.rstrip('/')}/{name}")
        except ArtifactError as e:
            if broken is None:
                raise
            broken[name] = str(e)
            continue
        if index.entries:
            found[name] = index
    return found


def index_entry(url: str) -> IndexEntry | None:
    """What the index beside the pack at ``url`` records for it; None when the folder has no index
    or the index does not list this file (a pack put there by other means)."""
    folder, file = url.rsplit("/", 1)
    if "/" not in folder.split("://", 1)[-1]:
        return None  # a pack at the top of a bucket: no model folder, no index
    return next((e for e in read_index(folder).entries if e.file == file), None)


def download(fs: Any, path: str, url: str, write: Callable[[bytes], Any] | None, size: int) -> str:
    """Stream the object to ``write`` (None: hash only) in ranged reads; return its sha256.

    The reads grow from ``FIRST_CHUNK`` to ``CHUNK`` bytes, so that ``write`` sees a pack's head after
    one small read and can stop the download there by raising. ArtifactError when the store stops
    answering, sends more than was asked, or the object is not ``size`` bytes."""
    digest, offset = hashlib.sha256(), 0
    while offset < size:
        end = min(offset + min(CHUNK, max(FIRST_CHUNK, offset)), size)
        chunk = retried(url, f"read bytes {offset}-{end}", lambda: fs.cat_file(path, start=offset, end=end))
        if not chunk:
            break
        if len(chunk) > end - offset:
            raise ArtifactError(
                f"{url}: the store sent {len(chunk)} bytes for a read of {end - offset} (it ignores ranges?)"
            )
        digest.update(chunk)
        if write is not None:
            write(chunk)
        offset += len(chunk)
    if offset != size:
        raise ArtifactError(f"{url}: the store sent {offset} bytes, the object has {size} (changed while downloading?)")
    return digest.hexdigest()


def open_url(
    url: str,
    open_pack: Callable[[Any], T],
    *,
    admit: Callable[[PackHead], Any] | None = None,
    max_bytes: int | None = None,
    cache_dir: str | os.PathLike | None = None,
) -> T:
    """Open the pack at ``url`` through ``open_pack`` (what ``open_artifact`` does with a local pack):
    from the cache when the store's ETag matches the one recorded, else downloaded first.

    A download is refused before it starts when the object is larger than ``max_bytes`` or than the
    size the store's index records for it (``index.json`` beside it, when there is one), and as soon
    as its first bytes hold the pack's head when ``admit(head)`` raises (the trust policy, expiry,
    host): a hostile object costs one small read, and what was written to ``tmp/`` is removed."""
    if max_bytes is not None and (isinstance(max_bytes, bool) or not isinstance(max_bytes, int) or max_bytes < 1):
        raise LoaderError(f"max_bytes={max_bytes!r}: expected a positive number of bytes")
    cache = Cache(cache_dir)
    fs, path = filesystem(url)
    etag, size = stat(fs, path, url)
    record_path = cache.root / RECORDS_DIR / f"{hashlib.sha256(url.encode()).hexdigest()}.json"
    head = _cached_head(cache, record_path, etag, size)
    if head is not None:
        try:
            return open_pack(head)
        except ArtifactError:
            if os.path.lexists(head.path):
                raise  # refused on its merits (signature, host, ...), not for a damaged entry
            # The entry failed its check and the cache discarded it: fetch the pack again.
    entry = index_entry(url)
    if entry is not None and size != entry.size:
        raise ArtifactError(
            f"{url}: the store's object is {size} bytes, its {INDEX_FILE} records {entry.size}; refusing to download it"
        )
    if max_bytes is not None and size > max_bytes:
        raise ArtifactError(
            f"{url}: the store's object is {size} bytes, more than max_bytes={max_bytes}; refusing to download it"
        )
    cache._prepare()
    fd, tmp = tempfile.mkstemp(prefix="download-", suffix=C.PACK_SUFFIX, dir=cache.tmp_dir)
    try:
        with _named_as(tmp, url), os.fdopen(fd, "wb") as out:
            sha256 = download(fs, path, url, _HeadWatch(out, Path(tmp), size, admit).write, size)
            if entry is not None and sha256 != entry.sha256:
                raise ArtifactError(
                    f"{url}: its sha256 is not the one in {INDEX_FILE} (changed in the store, or corrupt)"
                )
            out.close()
            opened = open_pack(Path(tmp))
    finally:
        os.unlink(tmp)
    if etag is not None:
        try:
            record_path.parent.mkdir(mode=0o755, exist_ok=True)
            write_atomic(
                record_path, json.dumps({"url": url, "etag": etag, "size": size, "digest": opened.digest}).encode()
            )
        except OSError:
            pass  # a read-only cache still serves; the next load downloads again
    return opened


class _HeadWatch:
    """A download's ``write``: the bytes go to ``out`` (the file at ``path``) and, until they hold the
    pack's head, are read back for it after each chunk; ``admit(head)`` then runs once. ArtifactError
    as soon as the bytes are not a pack's head, or still hold none after ``MAX_HEAD_BYTES``, or the
    object (``size`` bytes) is larger than a pack of that manifest can be."""

    def __init__(self, out: Any, path: Path, size: int, admit: Callable[[PackHead], Any] | None):
        self.out, self.path, self.size, self.admit = out, path, size, admit
        self.written = 0
        self.head: PackHead | None = None

    def write(self, chunk: bytes) -> None:
        self.out.write(chunk)
        self.written += len(chunk)
        if self.head is not None:
            return
        self.out.flush()
        self.head = read_partial_head(self.path)
        if self.head is None:
            if self.written > MAX_HEAD_BYTES:
                raise ArtifactError(
                    f"{self.path}: no pack head (manifest, signature) in its first {MAX_HEAD_BYTES} bytes; not a pack"
                )
            return
        if self.admit is not None:
            self.admit(self.head)
        most = max_pack_bytes(self.head)
        if self.size > most:
            raise ArtifactError(
                f"{self.path}: {self.size} bytes, more than the {most} a pack of its manifest can take (bytes appended?)"
            )


class _Enough(Exception):
    """Stops a download once what was wanted has arrived."""


def read_remote_head(url: str) -> PackHead:
    """The head of the pack at ``url`` (manifest, signature, digest), from its first bytes only;
    nothing is cached. (``precompile promote`` checks a pack this way before deploying it.)"""
    fs, path = filesystem(url)
    _, size = stat(fs, path, url)
    fd, tmp = tempfile.mkstemp(prefix="precompile-head-", suffix=C.PACK_SUFFIX)

    def enough(head: PackHead) -> None:
        raise _Enough

    try:
        with _named_as(tmp, url), os.fdopen(fd, "wb") as out:
            watch = _HeadWatch(out, Path(tmp), size, enough)
            try:
                download(fs, path, url, watch.write, size)
            except _Enough:
                pass
    finally:
        os.unlink(tmp)
    if watch.head is None:  # the whole object arrived and it ends inside the head
        raise ArtifactError(f"{url}: the pack ends early, in its head (truncated copy?)")
    return watch.head


@contextlib.contextmanager
def _named_as(tmp: str, url: str) -> Iterator[None]:
    """Errors name what the caller asked for, not the temporary file it was downloaded to."""
    try:
        yield
    except LoaderError as e:
        if len(e.args) != 1 or tmp not in str(e):
            raise
        raise type(e)(str(e).replace(tmp, url)) from None


def _cached_head(cache: Cache, record_path: Path, etag: str | None, size: int) -> PackHead | None:
    """The head of the cache entry the record names, when the record matches the store's object."""
    if etag is None or not record_path.is_file():
        return None
    check_private(record_path, "a precompile cache record", f"delete it or set {C.CACHE_ENV} to a folder of your own")
    try:
        record = json.loads(record_path.read_bytes())
        if record["etag"] != etag or record["size"] != size:
            return None
        entry = cache.entry_path(str(record["digest"]))
        manifest_bytes = (entry / C.MANIFEST_FILE).read_bytes()
    except (OSError, ValueError, KeyError, TypeError):
        return None
    if manifest_digest(manifest_bytes) != record["digest"]:
        return None
    from ..manifest import parse_manifest

    manifest = parse_manifest(manifest_bytes, source=str(entry / C.MANIFEST_FILE))
    return PackHead(entry, manifest, manifest_bytes, read_signature(entry), record["digest"])
