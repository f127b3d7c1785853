"""Publishing packs to an object store and fetching them back: ``precompile push``, ``pull``, ``ls``.

Layout under a store URL (any fsspec URL; ``s3://`` with the ``s3`` extra)::

    <url>/<name>/<version>.tar.zst     one pack per published version, never overwritten
    <url>/<name>/index.json            {"name", "versions": {"7": {"file", "digest", "sha256", "size", "signed_by"}}}
    <url>/<name>/current               the version to serve: one line, "7.tar.zst" (``precompile promote``)

``loader.load("<url>/<name>/<version>.tar.zst")`` reads a published pack directly; the index is for
people and tools (``ls``, ``pull`` of the latest version). Transfers go through ``loader.remote``
(same endpoint settings, retries and streaming as the loader).

Not guarded against two pushes of the same version at the same moment: the store has no compare-and-
set that fsspec exposes, so the last writer of the index wins. Push from one CI job per model.
"""

from __future__ import annotations

import hashlib
import json
import os
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from loader import constants as C
from loader.pack import PackHead, verify_pack
from loader.remote import MissingObjectError, download, filesystem, retried, stat
from loader.remote import resolve_pointer as _resolve_pointer
from loader.trust import parse_signature

from .errors import PrecompileError
from .ship import _atomic_output, pack

INDEX_FILE = "index.json"
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
        pack_path = pack(artifact, Path(scratch) / f"pack{C.PACK_SUFFIX}", level=level) if artifact.is_dir() else artifact
        head = verify_pack(pack_path)  # nothing corrupt is published
        name, version = head.manifest.name, head.manifest.version
        folder = f"{url.rstrip('/')}/{name}"
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
    index = read_index(folder)
    index["versions"][str(version)] = {
        "file": f"{version}{C.PACK_SUFFIX}",
        "digest": head.digest,
        "sha256": sha256,
        "size": size,
        "signed_by": _signers(head),
    }
    index_url = f"{folder}/{INDEX_FILE}"
    fs, path = filesystem(index_url)
    data = json.dumps(index, indent=2, sort_keys=True).encode() + b"\n"
    retried(index_url, "write the index", lambda: fs.pipe_file(path, data))
    return Pushed(target, name, version, size, published=True)


def read_index(folder: str) -> dict[str, Any]:
    """The index of ``<url>/<name>``; an empty one when none was written yet."""
    url = f"{folder.rstrip('/')}/{INDEX_FILE}"
    fs, path = filesystem(url)
    try:
        data = retried(url, "read the index", lambda: fs.cat_file(path))
    except MissingObjectError:
        return {"name": folder.rstrip("/").rsplit("/", 1)[-1], "versions": {}}
    try:
        index = json.loads(data)
        if not isinstance(index.get("versions"), dict):
            raise ValueError("no versions")
    except (ValueError, AttributeError) as e:
        raise PrecompileError(f"{url}: not an index `precompile push` wrote ({e})") from None
    return index


def ls(url: str) -> dict[str, dict[str, Any]]:
    """The models under a store URL and their versions: ``{name: index}``. ``url`` may be a store
    root (every ``<name>/index.json`` under it) or one model's folder."""
    fs, path = filesystem(url)
    own = f"{url.rstrip('/')}/{INDEX_FILE}"
    own_fs, own_path = filesystem(own)
    if retried(own, "reach the store", lambda: own_fs.exists(own_path)):
        index = read_index(url)
        return {index.get("name", url.rstrip("/").rsplit("/", 1)[-1]): index}
    found: dict[str, dict[str, Any]] = {}
    for entry in retried(url, "list the store", lambda: fs.ls(path, detail=True)):
        if entry.get("type") != "directory":
            continue
        name = entry["name"].rstrip("/").rsplit("/", 1)[-1]
        index = read_index(f"{url.rstrip('/')}/{name}")
        if index["versions"]:
            found[name] = index
    return found


def pull(url: str, *, version: int | None = None, output: str | os.PathLike | None = None) -> tuple[Path, int]:
    """Download a published pack: ``url`` is a model's folder (``<store>/<name>``; the latest version
    unless ``version``) or a pack's own URL. Checked against the index's sha256 when there is one, and
    as a pack, before it is renamed into place. Returns (file, version)."""
    entry: dict[str, Any] | None = None
    if url.endswith(C.PACK_SUFFIX):
        if version is not None:
            raise PrecompileError(f"{url}: the URL names one pack; drop --version or give the model's folder")
        source = url
    else:
        index = read_index(url)
        versions = sorted(int(v) for v in index["versions"])
        if not versions:
            raise PrecompileError(f"{url}: nothing published here (no {INDEX_FILE}); see `precompile ls`")
        version = versions[-1] if version is None else version
        entry = index["versions"].get(str(version))
        if entry is None:
            raise PrecompileError(f"{url}: no version {version} (published: {', '.join(map(str, versions))})")
        source = f"{url.rstrip('/')}/{entry['file']}"
    default = source.rsplit("/", 1)[-1] if entry is None else f"{url.rstrip('/').rsplit('/', 1)[-1]}-{version}{C.PACK_SUFFIX}"
    target = Path(output) if output is not None else Path(default)
    fs, path = filesystem(source)
    _, size = stat(fs, path, source)
    writer = _atomic_output(target)
    with writer as out:
        sha256 = download(fs, path, source, out.write, size)
        if entry is not None and sha256 != entry["sha256"]:
            raise PrecompileError(f"{source}: its sha256 is not the one in {INDEX_FILE} (changed in the store, or corrupt)")
        out.flush()
        head = verify_pack(writer.tmp)
    return target, head.manifest.version


def promote(url: str, version: int, *, pointer: str = POINTER) -> tuple[str, str]:
    """Point ``<url>/<pointer>`` at published ``version``: the deploy, one small object write, which
    every ``precompile serve --watch <url>/<pointer>`` (``Live.watch``) picks up at its next look.
    ``url`` is a model's folder (``<store>/<name>``); the version must be in its index and its pack in
    the store. Going back to an older version is allowed here: whether a server follows is its own
    decision (``--allow-rollback``). Returns (pointer URL, pack URL)."""
    if not pointer or "/" in pointer or pointer.endswith(C.PACK_SUFFIX) or pointer == INDEX_FILE:
        raise PrecompileError(f"--pointer {pointer!r}: a plain object name in the model's folder (such as current or canary)")
    folder = url.rstrip("/")
    index = read_index(folder)
    entry = index["versions"].get(str(version))
    if entry is None:
        published = ", ".join(sorted(index["versions"], key=int)) or "none"
        raise PrecompileError(f"{folder}: no version {version} published (published: {published}); push it first")
    pack_url = f"{folder}/{entry['file']}"
    fs, path = filesystem(pack_url)
    stat(fs, path, pack_url)  # the pack is there: a MissingObjectError names it otherwise
    pointer_url = f"{folder}/{pointer}"
    fs, path = filesystem(pointer_url)
    data = f"{entry['file']}\n".encode()
    retried(pointer_url, "write the pointer", lambda: fs.pipe_file(path, data))
    if _resolve_pointer(pointer_url).target != pack_url:  # read back through the watcher's own path
        raise PrecompileError(f"{pointer_url}: the store does not hand back the pointer just written")
    return pointer_url, pack_url


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
