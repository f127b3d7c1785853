"""``precompile pack``: an artifact folder as one .tar.zst file (the format is ``loader.stores.pack``'s),
written atomically; a signed artifact's signature must belong to its manifest."""

from __future__ import annotations

import os
import tempfile
from pathlib import Path

from loader import constants as C
from loader.artifact import manifest_digest, read_manifest_with_bytes, read_signature
from loader.stores.pack import write_pack
from loader.trust import parse_signature

from ..errors import PrecompileError


def default_pack_path(artifact: Path) -> Path:
    return artifact.with_name(artifact.name + C.PACK_SUFFIX)


def pack(
    artifact: str | os.PathLike, output: str | os.PathLike | None = None, *, level: int = 3, threads: int = 0
) -> Path:
    """Write the artifact folder as one pack file (default: ``<folder>.tar.zst`` beside it).

    Every file is checked against the manifest as it is packed, and a signature, if present, must
    belong to this manifest: a pack is never made of a corrupt or stale artifact.
    """
    artifact = Path(artifact)
    if not artifact.is_dir():
        raise PrecompileError(f"{artifact}: not an artifact folder (pack takes the folder `precompile build` wrote)")
    _, manifest_bytes = read_manifest_with_bytes(artifact)
    _check_signature_belongs(artifact, manifest_bytes)
    target = Path(output) if output is not None else default_pack_path(artifact)
    with atomic_output(target) as out:
        write_pack(artifact, out, level=level, threads=threads)
    return target


def _check_signature_belongs(artifact: Path, manifest_bytes: bytes) -> None:
    data = read_signature(artifact)
    if data is None:
        return
    sig = parse_signature(data, str(artifact / C.SIGNATURE_FILE))
    if sig.manifest_sha256 != manifest_digest(manifest_bytes):
        raise PrecompileError(
            f"{artifact / C.SIGNATURE_FILE}: made for another manifest (the artifact changed after signing); "
            f"sign it again with `precompile sign {artifact} --key KEY`"
        )


class atomic_output:
    """Write a file beside ``target`` and rename it into place only when the writing succeeded."""

    def __init__(self, target: Path):
        self.target = target

    def __enter__(self):
        if self.target.is_dir():
            raise PrecompileError(f"{self.target}: is a folder; give a file name for the output")
        try:
            self.target.parent.mkdir(parents=True, exist_ok=True)
            fd, self.tmp = tempfile.mkstemp(prefix=f".{self.target.name}.", dir=self.target.parent)
        except OSError as e:
            raise PrecompileError(f"{self.target}: cannot write ({e.strerror})") from None
        self.file = os.fdopen(fd, "wb")
        return self.file

    def __exit__(self, exc_type, exc, tb):
        try:
            if exc_type is None:
                self.file.flush()
                os.fsync(self.file.fileno())
            self.file.close()
            if exc_type is None:
                os.chmod(self.tmp, 0o644)
                os.replace(self.tmp, self.target)
        finally:
            if os.path.exists(self.tmp):
                os.unlink(self.tmp)
        return False
