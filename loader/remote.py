"""Packs in object stores: ``load("s3://bucket/models/text-classifier/7.tar.zst")`` and any other
fsspec URL (``gs://``, ``https://``, ``file://``).

A remote pack is fetched into the local cache once and then treated exactly as a local pack:

- it is streamed in ranged reads of ``CHUNK`` bytes into a private temporary file in the cache's
  ``tmp/`` (sha256 computed as it streams); each read is retried on transient errors, a bounded number
  of times with exponential backoff, resuming where it stopped. The file is used only once it has the
  size the store announced; a failure removes it, so a half-downloaded pack never becomes an entry;
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

import hashlib
import json
import os
import re
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, TypeVar

from . import constants as C
from .cache import Cache
from .errors import ArtifactError, LoaderError
from .fs import check_private, write_atomic
from .pack import PackHead
from .artifact import manifest_digest, read_signature

ENDPOINT_ENV = "PRECOMPILE_S3_ENDPOINT_URL"
CHUNK = 8 << 20
RETRIES = 4  # attempts per request, transient errors only
BACKOFF = 0.25  # seconds before the second attempt, doubled each time
RECORDS_DIR = "remote"

class MissingObjectError(ArtifactError):
    """The store answered: there is no object at this URL."""


_URL_RE = re.compile(r"^[a-zA-Z][a-zA-Z0-9+.-]*://")
T = TypeVar("T")


def is_url(path: object) -> bool:
    """True for ``scheme://...`` strings (fsspec URLs); paths on disk are never URLs."""
    return isinstance(path, str) and bool(_URL_RE.match(path))


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
    try:
        return fsspec.core.url_to_fs(url, **options)
    except ImportError as e:
        raise ArtifactError(f"{url}: {e}; pip install 'precompile[s3]' (or the fsspec package for this scheme)") from None
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
                raise ArtifactError(f"{url}: cannot {what} after {RETRIES} attempts; is the store up? ({type(e).__name__}: {e})") from None
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
    ``precompile promote`` writes) or a full URL in the same kind of store.

    ArtifactError naming ``url`` for anything else; like a pointer file on disk, an error never quotes
    the object's content.
    """
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


def download(fs: Any, path: str, url: str, write: Callable[[bytes], Any] | None, size: int) -> str:
    """Stream the object to ``write`` (None: hash only) in ranged reads; return its sha256.

    ArtifactError when the store stops answering or the object is not ``size`` bytes."""
    digest, offset = hashlib.sha256(), 0
    while offset < size:
        end = min(offset + CHUNK, size)
        chunk = retried(url, f"read bytes {offset}-{end}", lambda: fs.cat_file(path, start=offset, end=end))
        if not chunk:
            break
        digest.update(chunk)
        if write is not None:
            write(chunk)
        offset += len(chunk)
    if offset != size:
        raise ArtifactError(f"{url}: the store sent {offset} bytes, the object has {size} (changed while downloading?)")
    return digest.hexdigest()


def open_url(url: str, open_pack: Callable[[Any], T], *, cache_dir: str | os.PathLike | None = None) -> T:
    """Open the pack at ``url`` through ``open_pack`` (what ``open_artifact`` does with a local pack):
    from the cache when the store's ETag matches the one recorded, else downloaded first."""
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
    cache._prepare()
    fd, tmp = tempfile.mkstemp(prefix="download-", suffix=C.PACK_SUFFIX, dir=cache.tmp_dir)
    try:
        with os.fdopen(fd, "wb") as out:
            download(fs, path, url, out.write, size)
        try:
            opened = open_pack(Path(tmp))
        except LoaderError as e:
            if len(e.args) != 1 or tmp not in str(e):
                raise
            # Name what the caller asked for, not the temporary file it was downloaded to.
            raise type(e)(str(e).replace(tmp, url)) from None
    finally:
        os.unlink(tmp)
    if etag is not None:
        try:
            record_path.parent.mkdir(mode=0o755, exist_ok=True)
            write_atomic(record_path, json.dumps({"url": url, "etag": etag, "size": size, "digest": opened.digest}).encode())
        except OSError:
            pass  # a read-only cache still serves; the next load downloads again
    return opened


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
    from .manifest import parse_manifest

    manifest = parse_manifest(manifest_bytes, source=str(entry / C.MANIFEST_FILE))
    return PackHead(entry, manifest, manifest_bytes, read_signature(entry), record["digest"])
