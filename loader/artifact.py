"""Reading an artifact folder: its manifest and the integrity of the files it lists."""

from __future__ import annotations

import hashlib
import json
import os
import re
import stat
from collections.abc import Collection
from pathlib import Path

from . import constants as C
from .errors import ArtifactError
from .manifest import Manifest, parse_manifest

_URL_RE = re.compile(r"^[a-zA-Z][a-zA-Z0-9+.-]*://")


def is_url(path: object) -> bool:
    """True for ``scheme://...`` strings (fsspec URLs, ``oci://`` references); paths on disk are never
    URLs. Here, not in ``loader.stores.remote``, so that the core tells a URL from a path without it."""
    return isinstance(path, str) and bool(_URL_RE.match(path))


def read_manifest(root: str | os.PathLike) -> Manifest:
    """Parse ``root/manifest.json``; ArtifactError if the folder is not an artifact."""
    return read_manifest_with_bytes(root)[0]


def read_manifest_with_bytes(root: str | os.PathLike) -> tuple[Manifest, bytes]:
    """The parsed manifest and the bytes it was parsed from (what signatures and digests cover)."""
    root = Path(root)
    if not root.exists():
        raise ArtifactError(f"{root}: no such artifact (build one with `precompile build PROFILE -o {root}`)")
    if not root.is_dir():
        raise ArtifactError(f"{root}: not an artifact folder")
    path = root / C.MANIFEST_FILE
    try:
        with open(path, "rb") as f:
            data = f.read(C.MAX_MANIFEST_BYTES + 1)
    except FileNotFoundError:
        raise ArtifactError(f"{root}: no {C.MANIFEST_FILE}; this folder is not a precompile artifact") from None
    except OSError as e:
        raise ArtifactError(f"{path}: cannot read ({e.strerror})") from None
    return parse_manifest(data, source=str(path)), data


def canonical_manifest(manifest: bytes | Manifest) -> bytes:
    """The bytes that identify a manifest: what signatures cover and what names its cache entry.

    From the manifest's bytes (as signatures and the cache use it): the JSON document written again
    with sorted keys and no whitespace. Formatting does not matter, and the result does not depend on
    this loader's ``Manifest`` class, so a newer loader whose manifests have more fields computes the
    same bytes for an old file and its signatures stay valid. Pass only bytes ``parse_manifest``
    accepted. From a parsed ``Manifest``: the same, for a manifest this version of precompile wrote.
    """
    try:
        document = manifest.to_dict() if isinstance(manifest, Manifest) else json.loads(manifest)
        text = json.dumps(document, sort_keys=True, separators=(",", ":"), ensure_ascii=True)
    except (ValueError, RecursionError) as e:
        raise ArtifactError(f"{C.MANIFEST_FILE}: cannot be put in canonical form ({e})") from None
    return text.encode("ascii")


def manifest_digest(manifest: bytes | Manifest) -> str:
    """sha256 of the canonical manifest: one artifact's identity (its files are pinned by sha256)."""
    return hashlib.sha256(canonical_manifest(manifest)).hexdigest()


def read_signature(root: str | os.PathLike) -> bytes | None:
    """The raw bytes of ``root/signature.json``, or None when the artifact is not signed."""
    path = Path(root) / C.SIGNATURE_FILE
    try:
        with open(path, "rb") as f:
            data = f.read(C.MAX_SIGNATURE_BYTES + 1)
    except FileNotFoundError:
        return None
    except OSError as e:
        raise ArtifactError(f"{path}: cannot read ({e.strerror})") from None
    if len(data) > C.MAX_SIGNATURE_BYTES:
        raise ArtifactError(f"{path}: larger than the {C.MAX_SIGNATURE_BYTES} bytes a signature may take")
    return data


def sha256_file(path: str | os.PathLike, chunk: int = 1 << 20) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while block := f.read(chunk):
            h.update(block)
    return h.hexdigest()


def verify_files(
    root: str | os.PathLike,
    manifest: Manifest,
    *,
    hashes: bool = True,
    known: dict[str, list[int]] | None = None,
    hashed_on_read: Collection[str] = (),
) -> dict[str, list[int]]:
    """Check that every listed file exists as a regular file with the listed size (and sha256).

    ``known`` maps a file to the identity (size, mtime_ns, ctime_ns, inode, device) it had when it was
    last hashed; a file that still has it is not hashed again (any write, chmod or rename moves its
    ctime, which only the clock's owner can set back; inode and device tell a replaced file).
    ``hashed_on_read`` names files the caller hashes as it reads them (``read_private``, a variant's
    package as it is opened): their sizes are checked here, their hashes there. Returns every file's
    identity now, for the caller to remember.
    """
    root = Path(root)
    identities = {}
    for rel, entry in manifest.files.items():
        path = root / rel
        try:
            st = os.lstat(path)
        except FileNotFoundError:
            raise ArtifactError(f"{root}: {rel} is listed in the manifest but missing") from None
        except OSError as e:
            raise ArtifactError(f"{root}: {rel}: cannot read ({e.strerror})") from None
        if not stat.S_ISREG(st.st_mode):
            raise ArtifactError(f"{root}: {rel} is not a regular file")
        if st.st_size != entry.size:
            raise ArtifactError(f"{root}: {rel} is {st.st_size} bytes, the manifest says {entry.size}")
        identity = [st.st_size, st.st_mtime_ns, st.st_ctime_ns, st.st_ino, st.st_dev]
        unchanged = (known is not None and known.get(rel) == identity) or rel in hashed_on_read
        if hashes and not unchanged:
            try:
                digest = sha256_file(path)
            except OSError as e:
                raise ArtifactError(f"{root}: {rel}: cannot read ({e.strerror})") from None
            if digest != entry.sha256:
                raise ArtifactError(f"{root}: {rel} does not match its sha256 in the manifest (changed or corrupt)")
        identities[rel] = identity
    return identities


class HeldFile:
    """A file of the artifact opened now and read later (a variant opened on demand): renaming or
    deleting it, or its folder, in between changes nothing (deploying by ``mv new current`` and
    removing the old folder is safe); rewriting it in place is caught by its hash when it is read.
    ``path`` reads the very file held (``/proc/self/fd/N``, a fresh read position each time)."""

    def __init__(self, path: str | os.PathLike):
        self.name = str(path)  # for messages
        try:
            self._fd: int | None = os.open(
                path, os.O_RDONLY | getattr(os, "O_NOFOLLOW", 0) | getattr(os, "O_CLOEXEC", 0)
            )
        except OSError as e:
            raise ArtifactError(f"{path}: cannot read ({e.strerror})") from None
        proc = f"/proc/self/fd/{self._fd}"
        self.path = proc if os.path.exists(proc) else self.name  # elsewhere: the name, as before

    def close(self) -> None:
        fd, self._fd = self._fd, None
        if fd is not None:
            os.close(fd)

    def __del__(self) -> None:
        self.close()
