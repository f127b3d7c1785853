"""Publishing packs to an object store and fetching them back: ``precompile push``, ``pull``, ``ls``.

Layout under a store URL (any fsspec URL; ``s3://`` with the ``s3`` extra)::

    <url>/<name>/<version>.tar.zst     one pack per published version, never overwritten
    <url>/<name>/index.json            {"name", "versions": {"7": {"file", "digest", "sha256", "size", "signed_by"}}}
    <url>/<name>/current               the version to serve: one line, "7.tar.zst" (``precompile promote``)

``loader.load("<url>/<name>/<version>.tar.zst")`` reads a published pack directly; the index is for
people and tools (``ls``, ``pull`` of the latest version) and bounds the loader's downloads (size,
sha256). It is untrusted input, parsed strictly in one place (``loader.stores.remote.parse_index``); a push
refuses to extend a damaged one. Transfers go through ``loader.stores.remote`` (same endpoint settings,
retries and streaming as the loader).

Not guarded against two pushes of the same version at the same moment: the store has no compare-and-
set that fsspec exposes, so the last writer of the index wins. Push from one CI job per model.
"""

from __future__ import annotations

import hashlib
import os
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from loader import constants as C
from loader.errors import ArtifactError
from loader.stores.pack import PackHead, verify_pack
from loader.stores.remote import (
    INDEX_FILE,
    IndexEntry,
    MissingObjectError,
    StoreIndex,
    download,
    filesystem,
    list_models,
    read_index,
    read_remote_head,
    retried,
    stat,
)
from loader.stores.remote import resolve_pointer as _resolve_pointer
from loader.trust import parse_signature

from ..errors import PrecompileError
from .pack import atomic_output, pack

POINTER = "current"


@dataclass(frozen=True)
class Pushed:
    url: str  # the pack's URL in the store
    name: str
    version: int
    size: int
    published: bool  # False: the same content was already there


def push(artifact: str | os.PathLike, url: str, *, level: int = 3) -> Pushed:
    """Publish an artifact folder (packed on the way) or a pack as ``<url>/<name>/<version>.tar.zst``
    and record it in ``<url>/<name>/index.json``.

    A version already published with the same bytes is left alone (``published=False``); with other
    bytes, PrecompileError: published versions never change, release a new version instead.
    """
    artifact = Path(artifact)
    with tempfile.TemporaryDirectory(prefix="precompile-push-") as scratch:
        pack_path = (
            pack(artifact, Path(scratch) / f"pack{C.PACK_SUFFIX}", level=level) if artifact.is_dir() else artifact
        )
        head = verify_pack(pack_path)  # nothing corrupt is published
        name, version = head.manifest.name, head.manifest.version
        folder = f"{url.rstrip('/')}/{name}"
        index = read_index(folder)  # a damaged index is refused before anything is written
        target = f"{folder}/{version}{C.PACK_SUFFIX}"
        sha256, size = _file_sha256(pack_path), pack_path.stat().st_size
        fs, path = filesystem(target)
        if retried(target, "reach the store", lambda: fs.exists(path)):
            if _remote_sha256(fs, path, target) != sha256:
                raise PrecompileError(
                    f"{target}: version {version} of {name} is already published with other content; "
                    "published versions never change: build and push a new version"
                )
            return Pushed(target, name, version, size, published=False)
        retried(target, "upload", lambda: fs.put_file(str(pack_path), path))
    entry = IndexEntry(version, f"{version}{C.PACK_SUFFIX}", head.digest, sha256, size, tuple(_signers(head)))
    index_url = f"{folder}/{INDEX_FILE}"
    fs, path = filesystem(index_url)
    data = index.with_entry(entry).to_bytes()
    retried(index_url, "write the index", lambda: fs.pipe_file(path, data))
    return Pushed(target, name, version, size, published=True)


def ls(url: str) -> dict[str, StoreIndex]:
    """The models under a store URL and their versions: ``{name: index}`` (``loader.stores.remote.list_models``)."""
    return list_models(url)


def pull(url: str, *, version: int | None = None, output: str | os.PathLike | None = None) -> tuple[Path, int]:
    """Download a published pack: ``url`` is a model's folder (``<store>/<name>``; the latest version
    unless ``version``) or a pack's own URL. Checked against the index's sha256 when there is one, and
    as a pack, before it is renamed into place. Returns (file, version)."""
    entry: IndexEntry | None = None
    if url.endswith(C.PACK_SUFFIX):
        if version is not None:
            raise PrecompileError(f"{url}: the URL names one pack; drop --version or give the model's folder")
        source = url
    else:
        index = read_index(url)
        if not index.entries:
            raise PrecompileError(f"{url}: nothing published here (no {INDEX_FILE}); see `precompile ls`")
        version = index.versions[-1] if version is None else version
        entry = index.get(version)
        if entry is None:
            raise PrecompileError(f"{url}: no version {version} (published: {', '.join(map(str, index.versions))})")
        source = f"{url.rstrip('/')}/{entry.file}"
    default = (
        source.rsplit("/", 1)[-1] if entry is None else f"{url.rstrip('/').rsplit('/', 1)[-1]}-{version}{C.PACK_SUFFIX}"
    )
    target = Path(output) if output is not None else Path(default)
    fs, path = filesystem(source)
    _, size = stat(fs, path, source)
    if entry is not None and size != entry.size:
        raise PrecompileError(
            f"{source}: {size} bytes in the store, {INDEX_FILE} records {entry.size} (changed in the store, or corrupt)"
        )
    writer = atomic_output(target)
    with writer as out:
        sha256 = download(fs, path, source, out.write, size)
        if entry is not None and sha256 != entry.sha256:
            raise PrecompileError(
                f"{source}: its sha256 is not the one in {INDEX_FILE} (changed in the store, or corrupt)"
            )
        out.flush()
        head = verify_pack(writer.tmp)
    return target, head.manifest.version


def promote(url: str, version: int, *, pointer: str = POINTER) -> tuple[str, str]:
    """Point ``<url>/<pointer>`` at published ``version``: the deploy, one small object write, which
    every ``precompile serve --watch <url>/<pointer>`` (``Live.watch``) picks up at its next look.
    ``url`` is a model's folder (``<store>/<name>``); the version must be in its index and its pack in
    the store, the one the index records (size, manifest, version). Going back to an older version is
    allowed here: whether a server follows is its own decision (``--allow-rollback``).

    Everything is checked before the pointer is written; a refused deploy leaves the store as it was
    (a pointer the store does not hand back is put back as it was). Returns (pointer URL, pack URL)."""
    if not pointer or "/" in pointer or pointer.endswith(C.PACK_SUFFIX) or pointer == INDEX_FILE:
        raise PrecompileError(
            f"--pointer {pointer!r}: a plain object name in the model's folder (such as current or canary)"
        )
    folder = url.rstrip("/")
    index = read_index(folder)
    entry = index.get(version)
    if entry is None:
        published = ", ".join(map(str, index.versions)) or "none"
        raise PrecompileError(f"{folder}: no version {version} published (published: {published}); push it first")
    pointer_url = f"{folder}/{pointer}"
    pack_url = f"{folder}/{entry.file}"  # the index's parser allows no other name
    _check_published(pack_url, entry)
    fs, path = filesystem(pointer_url)
    before = _current_bytes(fs, path, pointer_url)
    data = f"{entry.file}\n".encode()
    retried(pointer_url, "write the pointer", lambda: fs.pipe_file(path, data))
    try:
        handed_back = _resolve_pointer(pointer_url).target  # read back through the watcher's own path
    except ArtifactError:
        handed_back = None
    if handed_back != pack_url:
        _put_back(fs, path, pointer_url, before)
        raise PrecompileError(f"{pointer_url}: the store does not hand back the pointer just written; left as it was")
    return pointer_url, pack_url


def _check_published(pack_url: str, entry: IndexEntry) -> None:
    """The pack at ``pack_url`` is the one ``entry`` records: its size, its manifest and version (its
    head only is read)."""
    fs, path = filesystem(pack_url)
    _, size = stat(fs, path, pack_url)  # the pack is there: a MissingObjectError names it otherwise
    if size != entry.size:
        raise PrecompileError(
            f"{pack_url}: {size} bytes in the store, {INDEX_FILE} records {entry.size}; push it again or fix the index"
        )
    head = read_remote_head(pack_url)
    if head.digest != entry.digest or head.manifest.version != entry.version:
        raise PrecompileError(
            f"{pack_url}: its manifest (version {head.manifest.version}, digest {head.digest[:16]}) is not the one "
            f"{INDEX_FILE} records (version {entry.version}, digest {entry.digest[:16]}); push it again or fix the index"
        )


def _current_bytes(fs: Any, path: str, url: str) -> bytes | None:
    try:
        return retried(url, "read the pointer", lambda: fs.cat_file(path))
    except MissingObjectError:
        return None


def _put_back(fs: Any, path: str, url: str, before: bytes | None) -> None:
    if before is None:
        retried(url, "remove the pointer", lambda: fs.rm_file(path))
    else:
        retried(url, "restore the pointer", lambda: fs.pipe_file(path, before))


def _signers(head: PackHead) -> list[str]:
    if head.signature is None:
        return []
    return [parse_signature(head.signature, f"{head.path}: {C.SIGNATURE_FILE}").key_id]


def _file_sha256(path: Path) -> str:
    with open(path, "rb") as f:
        return hashlib.file_digest(f, "sha256").hexdigest()


def _remote_sha256(fs: Any, path: str, url: str) -> str:
    """Hash what the store holds, streamed (nothing written)."""
    _, size = stat(fs, path, url)
    return download(fs, path, url, None, size)
