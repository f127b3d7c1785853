"""No change to a served artifact's files may crash the process or change what it computes.

A weights file truncated while memory-mapped used to kill the process with SIGBUS (exit 135) at the
next call, and one rewritten in place changed the weights under the running model. The cases run in
a subprocess (all in one; each alone again if that one dies), so a regression fails the test instead
of killing pytest.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

import loader
from loader.stores.pack import read_head
from precompile.ship.pack import pack

SERVE_THEN_CHANGE = textwrap.dedent(
    """
    import os, shutil, sys, torch
    import loader

    args = sys.argv[1:]
    for folder, change in zip(args[::2], args[1::2]):  # each case on its own copy, in turn
        model = loader.load(folder)
        ids = torch.arange(16).reshape(2, 8) % 50
        mask = torch.ones(2, 8, dtype=torch.bool)
        before = model(ids, mask)
        weights = os.path.join(folder, "weights.safetensors")
        code = [os.path.join(folder, "variants", n) for n in os.listdir(os.path.join(folder, "variants"))]
        size = os.path.getsize(weights)
        if change == "truncate":
            os.truncate(weights, 0)
        elif change == "cp-over":  # cp opens the existing file with O_TRUNC, then writes
            with open(weights, "wb") as f:
                f.write(os.urandom(size))
        elif change == "rsync-inplace":  # same size, new bytes, written where the old ones were
            with open(weights, "r+b") as f:
                f.write(b"\\xff" * size)
        elif change == "code":
            for path in code:
                with open(path, "r+b") as f:
                    f.write(os.urandom(os.path.getsize(path)))
                os.truncate(path, 10)
        after = model(ids, mask)
        print(change, "unchanged" if torch.equal(before, after) else "CHANGED", flush=True)
    """
)


CHANGES = ["truncate", "cp-over", "rsync-inplace", "code"]


def serve_then_change(*pairs: str) -> subprocess.CompletedProcess:
    """SERVE_THEN_CHANGE on (folder, change) pairs, in one child process."""
    return subprocess.run(
        [sys.executable, "-c", SERVE_THEN_CHANGE, *pairs],
        capture_output=True,
        text=True,
        timeout=120 * len(pairs) // 2,
        cwd=Path(__file__).parent.parent,
    )


@pytest.fixture(scope="module")
def changed(classifier_artifact, tmp_path_factory) -> dict[str, str]:
    """Every change, each to a copy of its own, in one child process (one start of Python and torch,
    not four): what each case printed, or nothing if the child died."""
    folder = tmp_path_factory.mktemp("mapped")
    pairs = [p for c in CHANGES for p in (str(shutil.copytree(classifier_artifact, folder / c)), c)]
    result = serve_then_change(*pairs)
    if result.returncode != 0:  # it died: every case runs again alone (below), as each did before
        return {}
    return dict(line.split(" ", 1) for line in result.stdout.strip().splitlines()[-len(CHANGES) :])


@pytest.mark.parametrize("change", CHANGES)
def test_changing_a_served_folders_files_in_place_neither_crashes_nor_changes_results(
    changed, classifier_artifact, tmp_path, change
):
    if change not in changed:  # the shared child died: this case alone, in a child of its own
        folder = shutil.copytree(classifier_artifact, tmp_path / "served")
        result = serve_then_change(str(folder), change)
        assert result.returncode == 0, f"exit {result.returncode} (-7 or 135: SIGBUS)\n{result.stderr[-2000:]}"
        changed = {change: result.stdout.strip().splitlines()[-1].split(" ", 1)[1]}
    assert changed[change] == "unchanged"


def test_a_folders_weights_are_a_private_copy_hashed_as_read(classifier_artifact, tmp_path, monkeypatch):
    import loader.artifact

    hashed = []
    real = loader.artifact.sha256_file
    monkeypatch.setattr(loader.artifact, "sha256_file", lambda p, *a: hashed.append(Path(p).name) or real(p, *a))
    folder = shutil.copytree(classifier_artifact, tmp_path / "a")
    model = loader.load(folder)
    assert "weights.safetensors" not in hashed  # hashed once, by the read that fills the copy
    weights = folder / "weights.safetensors"
    tensors = model._weights.tensors
    kept = {name: t.clone() for name, t in tensors.items()}
    weights.write_bytes(bytes(weights.stat().st_size))
    assert all(tensors[name].equal(t) for name, t in kept.items())


def test_weights_changed_after_the_manifest_was_written_are_refused_on_read(classifier_artifact, tmp_path):
    folder = shutil.copytree(classifier_artifact, tmp_path / "a")
    weights = folder / "weights.safetensors"
    data = bytearray(weights.read_bytes())
    data[-1] ^= 1
    weights.write_bytes(bytes(data))
    with pytest.raises(loader.ArtifactError, match="weights.safetensors does not match its sha256"):
        loader.load(folder)
    assert loader.load(folder, verify=False)  # sizes only, as asked


def test_a_pack_is_served_from_a_read_only_cache_entry_it_maps(classifier_artifact, tmp_path):
    packed = pack(classifier_artifact, tmp_path / "a.tar.zst")
    model = loader.load(packed, cache_dir=tmp_path / "cache")
    entry = tmp_path / "cache" / "artifacts" / read_head(packed).digest
    assert model.path == entry
    assert (entry / "weights.safetensors").stat().st_mode & 0o222 == 0
    maps = Path(f"/proc/{os.getpid()}/maps")
    if maps.exists():
        assert str(entry / "weights.safetensors") in maps.read_text()


def test_a_manifest_naming_a_weights_file_of_another_size_is_refused_before_reading(classifier_artifact, tmp_path):
    folder = shutil.copytree(classifier_artifact, tmp_path / "a")
    manifest = json.loads((folder / "manifest.json").read_text())
    manifest["files"]["weights.safetensors"]["size"] += 1
    (folder / "manifest.json").write_text(json.dumps(manifest))
    with pytest.raises(loader.ArtifactError, match="weights.safetensors is .* bytes, the manifest says"):
        loader.load(folder)
