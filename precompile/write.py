"""Stage 5, write: lay out an artifact in a staging folder beside the target, then move it into place.

Nothing appears at the target path until the artifact is complete and checked; a failed build
removes its staging folder and leaves any previous artifact at the target untouched.
"""

from __future__ import annotations

import os
import shutil
import tempfile
from pathlib import Path

import torch
from safetensors.torch import save_file

from loader import constants as C
from loader.artifact import sha256_file
from loader.fs import open_to_readers
from loader.manifest import ConstantSpec, FileEntry

from .errors import PrecompileError


def staging_folder(target: Path, *, marker: str = C.MANIFEST_FILE, what: str = "a precompile artifact") -> Path:
    """A new empty folder on the target's file system, so the final rename is atomic. A non-empty
    ``target`` without ``marker`` (not ``what`` this writes) is refused, never replaced."""
    target.parent.mkdir(parents=True, exist_ok=True)
    if target.exists() and not (target / marker).is_file() and any(target.iterdir()):
        raise PrecompileError(f"{target}: exists and is not {what}; refusing to replace it (choose another -o)")
    return Path(tempfile.mkdtemp(prefix=f".{target.name}.staging-", dir=target.parent))


def write_weights(folder: Path, constants: dict[str, torch.Tensor]) -> dict[str, ConstantSpec]:
    save_file({k: v.contiguous() for k, v in constants.items()}, str(folder / C.WEIGHTS_FILE))
    return {k: ConstantSpec(str(v.dtype).removeprefix("torch."), tuple(v.shape)) for k, v in sorted(constants.items())}


def file_entries(folder: Path) -> dict[str, FileEntry]:
    """Size and sha256 of every file under ``folder`` except the manifest, by relative path."""
    out = {}
    for path in sorted(folder.rglob("*")):
        if path.is_file() and path.name != C.MANIFEST_FILE:
            rel = path.relative_to(folder).as_posix()
            out[rel] = FileEntry(path.stat().st_size, sha256_file(path))
    return out


def write_manifest(folder: Path, text: str) -> None:
    path = folder / C.MANIFEST_FILE
    with open(path, "w", encoding="utf-8") as f:
        f.write(text)
        f.flush()
        os.fsync(f.fileno())


def publish(staging: Path, target: Path) -> None:
    """Move the finished staging folder to ``target``, replacing an older artifact there."""
    open_to_readers(staging)  # 0755/0644 under umask 022: built by CI, served by another user
    for path in staging.rglob("*"):
        if path.is_file():
            with open(path, "rb") as f:
                os.fsync(f.fileno())
    old = None
    if target.exists():
        old = Path(tempfile.mkdtemp(prefix=f".{target.name}.old-", dir=target.parent))
        os.rmdir(old)
        os.rename(target, old)
    os.rename(staging, target)
    if old is not None:
        shutil.rmtree(old, ignore_errors=True)
    _fsync_dir(target.parent)


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
