"""Artifacts are written for readers other than their builder (a CI user builds, a service user
serves): folders and files get the modes the umask gives new ones, 0755/0644 under the usual 022,
not the 0700/0600 of temporary folders and safetensors files; `umask 077` keeps them private.
(The cache of unpacked packs stays read-only and its own user's: tests/test_cache.py, test_ownership.py.)"""

from __future__ import annotations

import os
import stat
import tempfile
from pathlib import Path

import pytest

from precompile.write import publish


def modes(root: Path) -> dict[str, int]:
    out = {".": stat.S_IMODE(root.stat().st_mode)}
    for path in root.rglob("*"):
        out[path.relative_to(root).as_posix()] = stat.S_IMODE(path.stat().st_mode)
    return out


def umask() -> int:
    mask = os.umask(0o022)
    os.umask(mask)
    return mask


def test_a_built_artifact_is_readable_by_other_users(classifier_artifact):
    mask = umask()
    found = modes(classifier_artifact)
    assert "weights.safetensors" in found and "variants" in found
    for rel, mode in found.items():
        expected = 0o777 & ~mask if (classifier_artifact / rel).is_dir() else 0o666 & ~mask
        assert mode == expected, f"{rel}: {oct(mode)}"
    if mask == 0o022:
        assert found["."] == 0o755 and found["weights.safetensors"] == 0o644


@pytest.mark.parametrize("mask, folder, file", [(0o022, 0o755, 0o644), (0o002, 0o775, 0o664), (0o077, 0o700, 0o600)])
def test_publish_gives_the_modes_the_umask_allows(tmp_path, mask, folder, file):
    staging = Path(tempfile.mkdtemp(dir=tmp_path))  # 0700, as the build's staging folder
    (staging / "variants").mkdir(mode=0o700)
    (staging / "variants" / "v.pt2").write_bytes(b"x")
    fd = os.open(staging / "weights.safetensors", os.O_WRONLY | os.O_CREAT, 0o600)
    os.close(fd)
    old = os.umask(mask)
    try:
        publish(staging, tmp_path / "artifact")
    finally:
        os.umask(old)
    assert modes(tmp_path / "artifact") == {
        ".": folder,
        "variants": folder,
        "variants/v.pt2": file,
        "weights.safetensors": file,
    }
