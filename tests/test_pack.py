"""Packs: one file per artifact, read back exactly, written only from a sound artifact."""

from __future__ import annotations

import io
import json
import os
import shutil
import subprocess
import sys
import tarfile
from pathlib import Path

import pytest
import torch
import zstandard
from click.testing import CliRunner

import loader
from loader import ArtifactError
from loader import constants as C
from loader.stores.pack import read_head, read_partial_head, unpack, verify_pack, walk_frames
from precompile.cli import main
from precompile.errors import PrecompileError
from precompile.ship.pack import pack

ROOT = Path(__file__).resolve().parent.parent


def invoke(*args: str, env: dict | None = None):
    return CliRunner().invoke(main, list(args), catch_exceptions=False, env=env)


def test_loading_a_pack_gives_the_same_model_as_the_folder(classifier_artifact, classifier_pack, tmp_path):
    folder_model = loader.load(classifier_artifact)
    packed_model = loader.load(classifier_pack, cache_dir=tmp_path / "cache")
    ids, mask = torch.randint(0, 50, (3, 17)), torch.ones(3, 17, dtype=torch.bool)
    assert torch.equal(packed_model(ids, mask), folder_model(ids, mask))
    assert packed_model.manifest == folder_model.manifest


def test_pack_is_a_plain_tar_stream_with_the_manifest_first(classifier_artifact, classifier_pack):
    data = (
        zstandard.ZstdDecompressor()
        .stream_reader(io.BytesIO(classifier_pack.read_bytes()), read_across_frames=True)
        .read()
    )
    with tarfile.open(fileobj=io.BytesIO(data)) as tar:
        members = tar.getmembers()
    names = [m.name for m in members]
    manifest = loader.parse_manifest((classifier_artifact / "manifest.json").read_bytes())
    assert names == ["manifest.json"] + sorted(manifest.files)
    assert all(m.isreg() and m.mode == 0o644 and m.mtime == 0 and m.uid == 0 for m in members)


def test_head_is_a_frame_of_its_own(classifier_pack):
    with open(classifier_pack, "rb") as f:
        frames = walk_frames(f, classifier_pack)
    head = read_head(classifier_pack)
    assert len(frames) == 2
    assert frames[0].content_size == C.TAR_BLOCK + len(head.manifest_bytes) + (-len(head.manifest_bytes) % C.TAR_BLOCK)
    assert sum(f.size for f in frames) == classifier_pack.stat().st_size


def test_packing_twice_gives_the_same_bytes(classifier_artifact, classifier_pack, tmp_path):
    again = pack(classifier_artifact, tmp_path / "again.tar.zst")
    assert again.read_bytes() == classifier_pack.read_bytes()


def test_unpack_restores_every_file(classifier_artifact, classifier_pack, tmp_path):
    head = unpack(classifier_pack, tmp_path)
    assert head.signature is None
    for rel in list(head.manifest.files) + ["manifest.json"]:
        assert (tmp_path / rel).read_bytes() == (classifier_artifact / rel).read_bytes()


def test_extra_files_in_the_folder_are_not_packed(classifier_artifact, tmp_path):
    folder = tmp_path / "a"
    shutil.copytree(classifier_artifact, folder)
    (folder / "notes.txt").write_text("not part of the artifact")
    head = verify_pack(pack(folder, tmp_path / "a.tar.zst"))
    assert "notes.txt" not in head.manifest.files


def test_a_corrupt_artifact_is_never_packed(classifier_artifact, tmp_path):
    folder = tmp_path / "a"
    shutil.copytree(classifier_artifact, folder)
    weights = folder / "weights.safetensors"
    data = bytearray(weights.read_bytes())
    data[-3] ^= 1
    weights.write_bytes(bytes(data))
    with pytest.raises(ArtifactError, match="weights.safetensors does not match its sha256"):
        pack(folder, tmp_path / "a.tar.zst")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["a"]  # no pack, no temporary file


def test_pack_refuses_a_signature_of_another_manifest(classifier_artifact, signing_keys, tmp_path):
    from precompile.ship.sign import sign

    folder = tmp_path / "a"
    shutil.copytree(classifier_artifact, folder)
    sign(folder, signing_keys[0])
    manifest = json.loads((folder / "manifest.json").read_text())
    manifest["version"] = 7
    (folder / "manifest.json").write_text(json.dumps(manifest))
    with pytest.raises(PrecompileError, match="signature.json: made for another manifest .* sign it again"):
        pack(folder, tmp_path / "a.tar.zst")


def test_pack_cli_writes_beside_the_folder_by_default(classifier_artifact, tmp_path):
    folder = tmp_path / "text-classifier"
    shutil.copytree(classifier_artifact, folder)
    result = invoke("pack", str(folder))
    assert result.exit_code == 0, result.output
    assert result.output.startswith(f"{folder}.tar.zst (")
    verify_pack(Path(f"{folder}.tar.zst"))


def test_pack_cli_on_a_missing_folder_is_a_clean_error(tmp_path):
    result = invoke("pack", str(tmp_path / "nope"))
    assert result.exit_code == 1
    assert "not an artifact folder" in result.output and "Traceback" not in result.output


ISOLATION = r"""
import sys, json
import loader
heavy = lambda: sorted({m.split(".")[0] for m in sys.modules} & {"zstandard", "cryptography"})
loader.load(sys.argv[1])
folder = heavy()
loader.load(sys.argv[2], cache_dir=sys.argv[3])
print(json.dumps({"folder": folder, "pack": heavy()}))
"""


def test_zstandard_and_cryptography_load_only_when_needed(classifier_artifact, classifier_pack, tmp_path):
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    out = subprocess.run(
        [sys.executable, "-c", ISOLATION, str(classifier_artifact), str(classifier_pack), str(tmp_path / "cache")],
        capture_output=True,
        text=True,
        cwd=ROOT,
        env=env,
        check=True,
    )
    report = json.loads(out.stdout.strip().splitlines()[-1])
    assert report == {"folder": [], "pack": ["zstandard"]}


def test_a_partial_head_is_none_until_the_manifest_and_signature_have_arrived(classifier_pack, tmp_path):
    data = classifier_pack.read_bytes()
    whole = read_head(classifier_pack)
    first = walk_frames(open(classifier_pack, "rb"), classifier_pack)[0].size  # the head's own frame
    partial = tmp_path / "partial.tar.zst"
    seen = []
    for cut in (0, 3, 100, first // 2, first - 1, first + (1 << 17) + 32, len(data)):  # + the next frame's first block
        partial.write_bytes(data[:cut])
        head = read_partial_head(partial)
        seen.append(
            head is not None
            and (head.manifest_bytes, head.signature, head.digest)
            == (whole.manifest_bytes, whole.signature, whole.digest)
        )
    assert seen == [False] * 5 + [True, True]


def test_a_partial_head_refuses_bytes_that_are_no_pack_at_once(tmp_path):
    junk = tmp_path / "junk.tar.zst"
    junk.write_bytes(os.urandom(1 << 16))
    with pytest.raises(ArtifactError, match="not a pack"):
        read_partial_head(junk)
    junk.write_bytes(
        zstandard.ZstdCompressor(write_checksum=True).compress(b"not a tar header" * 64) + os.urandom(1 << 16)
    )
    with pytest.raises(ArtifactError, match="header checksum does not match"):
        read_partial_head(junk)
