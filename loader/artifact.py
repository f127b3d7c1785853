"""Reading an artifact folder: its manifest and the integrity of the files it lists."""

from __future__ import annotations

import hashlib
import os
from pathlib import Path

from . import constants as C
from .errors import ArtifactError
from .manifest import Manifest, parse_manifest


def read_manifest(root: str | os.PathLike) -> Manifest:
    """Parse ``root/manifest.json``; ArtifactError if the folder is not an artifact."""
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
    return parse_manifest(data, source=str(path))


def sha256_file(path: str | os.PathLike, chunk: int = 1 << 20) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while block := f.read(chunk):
            h.update(block)
    return h.hexdigest()


def verify_files(root: str | os.PathLike, manifest: Manifest, *, hashes: bool = True) -> None:
    """Check that every listed file exists as a regular file with the listed size (and sha256)."""
    root = Path(root)
    for rel, entry in manifest.files.items():
        path = root / rel
        try:
            st = os.lstat(path)
        except FileNotFoundError:
            raise ArtifactError(f"{root}: {rel} is listed in the manifest but missing") from None
        except OSError as e:
            raise ArtifactError(f"{root}: {rel}: cannot read ({e.strerror})") from None
        if not os.path.isfile(path) or os.path.islink(path):
            raise ArtifactError(f"{root}: {rel} is not a regular file")
        if st.st_size != entry.size:
            raise ArtifactError(f"{root}: {rel} is {st.st_size} bytes, the manifest says {entry.size}")
        if hashes and sha256_file(path) != entry.sha256:
            raise ArtifactError(f"{root}: {rel} does not match its sha256 in the manifest (changed or corrupt)")
