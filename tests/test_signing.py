"""Signatures, expiry and rollback: load(..., trusted_keys=..., refuse_rollback=...) and the CLI around them."""

from __future__ import annotations

import base64
import json
import shutil
import stat
from pathlib import Path

import pytest
from click.testing import CliRunner
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey

import loader
from loader import ArtifactError, LoaderError, UntrustedArtifactError
from loader.source import open_artifact
from loader.stores.pack import read_head
from precompile.cli import main
from precompile.errors import PrecompileError
from precompile.ship.pack import pack
from precompile.ship.sign import keygen, sign


def invoke(*args: str):
    return CliRunner().invoke(main, list(args), catch_exceptions=False)


def copy(src: Path, dst: Path, **manifest_changes) -> Path:
    shutil.copytree(src, dst)
    if manifest_changes:
        manifest = json.loads((dst / "manifest.json").read_text())
        manifest.update(manifest_changes)
        (dst / "manifest.json").write_text(json.dumps(manifest, indent=2))
    return dst


@pytest.fixture(scope="module")
def signed(classifier_artifact, signing_keys, tmp_path_factory) -> Path:
    folder = copy(classifier_artifact, tmp_path_factory.mktemp("signed") / "artifact")
    sign(folder, signing_keys[0])
    return folder


@pytest.fixture(scope="module")
def other_keys(tmp_path_factory) -> tuple[Path, Path]:
    private, public, _ = keygen(tmp_path_factory.mktemp("other") / "other")
    return private, public


def test_keygen_cli_writes_a_secret_key_and_a_public_key(tmp_path):
    result = invoke("keygen", "-o", str(tmp_path / "ci"))
    assert result.exit_code == 0
    assert stat.S_IMODE((tmp_path / "ci.key").stat().st_mode) == 0o600
    assert (tmp_path / "ci.pub").read_text().startswith("-----BEGIN PUBLIC KEY-----")
    assert "key id" in result.output
    again = CliRunner().invoke(main, ["keygen", "-o", str(tmp_path / "ci")])
    assert again.exit_code == 1 and "exists; refusing to overwrite a key" in again.output


def test_a_signed_artifact_loads_with_its_key(signed, signing_keys):
    opened = open_artifact(signed, trusted_keys=[signing_keys[1]])
    assert opened.signed_by is not None
    assert loader.load(signed, trusted_keys=[signing_keys[1]]).name == "tiny-classifier"


def test_trusted_keys_may_be_paths_text_or_key_objects(signed, signing_keys):
    from cryptography.hazmat.primitives import serialization

    pem = signing_keys[1].read_text()
    key = serialization.load_pem_public_key(pem.encode())
    openssh = key.public_bytes(serialization.Encoding.OpenSSH, serialization.PublicFormat.OpenSSH).decode()
    for trusted in (str(signing_keys[1]), signing_keys[1], pem, pem.encode(), key, openssh):
        assert open_artifact(signed, trusted_keys=[trusted]).signed_by


def test_an_unsigned_artifact_is_refused(classifier_artifact, signing_keys):
    with pytest.raises(
        UntrustedArtifactError,
        match=r"not signed, and this loader only accepts artifacts signed by key\(s\) [0-9a-f]{16}",
    ):
        loader.load(classifier_artifact, trusted_keys=[signing_keys[1]])


def test_a_signature_by_another_key_is_refused(signed, other_keys):
    with pytest.raises(UntrustedArtifactError, match=r"signed by key [0-9a-f]{16}, which is not trusted here"):
        loader.load(signed, trusted_keys=[other_keys[1]])


def test_any_of_several_trusted_keys_will_do(signed, signing_keys, other_keys):
    assert open_artifact(signed, trusted_keys=[other_keys[1], signing_keys[1]]).signed_by


def test_a_file_changed_after_signing_is_refused(signed, signing_keys, tmp_path):
    folder = copy(signed, tmp_path / "a")
    weights = folder / "weights.safetensors"
    data = bytearray(weights.read_bytes())
    data[-1] ^= 0x10
    weights.write_bytes(bytes(data))
    with pytest.raises(ArtifactError, match="weights.safetensors does not match its sha256"):
        loader.load(folder, trusted_keys=[signing_keys[1]])


def test_a_manifest_changed_after_signing_is_refused(signed, signing_keys, tmp_path):
    folder = copy(signed, tmp_path / "a", version=99)
    with pytest.raises(UntrustedArtifactError, match="signature.json was made for another manifest"):
        loader.load(folder, trusted_keys=[signing_keys[1]])


def test_a_forged_signature_is_refused(signed, signing_keys, tmp_path):
    """The attacker edits the manifest and the digest the signature names, but cannot sign."""
    from loader.artifact import manifest_digest

    folder = copy(signed, tmp_path / "a", version=99)
    signature = json.loads((folder / "signature.json").read_text())
    signature["manifest_sha256"] = manifest_digest((folder / "manifest.json").read_bytes())
    (folder / "signature.json").write_text(json.dumps(signature))
    with pytest.raises(UntrustedArtifactError, match="the signature does not verify with key"):
        loader.load(folder, trusted_keys=[signing_keys[1]])


def test_a_signature_copied_from_another_artifact_is_refused(signed, classifier_artifact, signing_keys, tmp_path):
    folder = copy(classifier_artifact, tmp_path / "a", version=2)
    shutil.copy(signed / "signature.json", folder / "signature.json")
    with pytest.raises(UntrustedArtifactError, match="was made for another manifest"):
        loader.load(folder, trusted_keys=[signing_keys[1]])


@pytest.mark.parametrize(
    "edit, message",
    [
        (lambda s: s.pop("algorithm"), "expected an object with exactly the keys"),
        (lambda s: s.update(algorithm="rsa"), "algorithm 'rsa' is not supported"),
        (lambda s: s.update(format_version=2), "is not one this loader reads"),
        (lambda s: s.update(key_id="ABC"), "key_id: expected 64 lowercase hex digits"),
        (lambda s: s.update(signature="not base64!"), "signature: expected the base64 of 64 bytes"),
        (lambda s: s.update(signature=base64.b64encode(b"x" * 63).decode()), "expected the base64 of 64 bytes"),
        (lambda s: s.update(signature=12), "expected the base64 of 64 bytes"),
    ],
    ids=["missing-key", "algorithm", "format-version", "key-id", "not-base64", "short", "not-a-string"],
)
def test_a_malformed_signature_file_is_refused_by_name(signed, signing_keys, tmp_path, edit, message):
    folder = copy(signed, tmp_path / "a")
    signature = json.loads((folder / "signature.json").read_text())
    edit(signature)
    (folder / "signature.json").write_text(json.dumps(signature))
    with pytest.raises(UntrustedArtifactError, match=message):
        loader.load(folder, trusted_keys=[signing_keys[1]])


def test_bad_trusted_keys_are_the_callers_error(signed, signing_keys, tmp_path):
    with pytest.raises(LoaderError, match="trusted_keys is empty"):
        loader.load(signed, trusted_keys=[])
    with pytest.raises(LoaderError, match="got a single one"):
        loader.load(signed, trusted_keys=str(signing_keys[1]))
    with pytest.raises(LoaderError, match=r"trusted_keys\[0\]: .*release.key: not a PEM or OpenSSH public key"):
        loader.load(signed, trusted_keys=[signing_keys[0]])
    with pytest.raises(LoaderError, match="verify=False skips the sha256 checks a signature relies on"):
        loader.load(signed, trusted_keys=[signing_keys[1]], verify=False)


def test_signing_a_pack_puts_the_signature_inside(classifier_pack, signing_keys, other_keys, tmp_path):
    packed = tmp_path / "a.tar.zst"
    shutil.copy(classifier_pack, packed)
    result = invoke("sign", str(packed), "--key", str(signing_keys[0]))
    assert result.exit_code == 0 and "signed with key" in result.output
    assert read_head(packed).signature is not None
    model = loader.load(packed, trusted_keys=[signing_keys[1]], cache_dir=tmp_path / "cache")
    assert model.name == "tiny-classifier"
    sign(packed, other_keys[0])  # re-signing replaces the signature
    with pytest.raises(UntrustedArtifactError, match="which is not trusted here"):
        loader.load(packed, trusted_keys=[signing_keys[1]], cache_dir=tmp_path / "cache")


def test_a_signature_survives_reformatting_the_manifest(signed, signing_keys, tmp_path):
    folder = copy(signed, tmp_path / "a")
    manifest = json.loads((folder / "manifest.json").read_text())
    (folder / "manifest.json").write_text(json.dumps(dict(reversed(list(manifest.items())))))
    assert open_artifact(folder, trusted_keys=[signing_keys[1]]).signed_by


def test_a_signature_does_not_depend_on_fields_the_file_leaves_out(classifier_artifact, signing_keys, tmp_path):
    """An artifact written before a manifest field existed keeps a valid signature under a loader that
    knows the field: the signature covers the file's JSON, not this loader's idea of a manifest."""
    manifest = json.loads((classifier_artifact / "manifest.json").read_text())
    optional = [
        k for k in ("check", "version", "expires", "policy", "pad_value", "output_dims", "cuda") if k in manifest
    ]
    folder = copy(classifier_artifact, tmp_path / "a")
    (folder / "manifest.json").write_text(json.dumps({k: v for k, v in manifest.items() if k not in optional}))
    sign(folder, signing_keys[0])
    assert open_artifact(folder, trusted_keys=[signing_keys[1]]).signed_by


def test_signing_a_pack_another_tool_recompressed(classifier_pack, signing_keys, tmp_path):
    import io

    import zstandard

    tar = (
        zstandard.ZstdDecompressor()
        .stream_reader(io.BytesIO(classifier_pack.read_bytes()), read_across_frames=True)
        .read()
    )
    packed = tmp_path / "one-frame.tar.zst"
    packed.write_bytes(zstandard.ZstdCompressor(level=9, write_checksum=True).compress(tar))
    sign(packed, signing_keys[0])
    assert open_artifact(packed, trusted_keys=[signing_keys[1]], cache_dir=tmp_path / "cache").signed_by


def test_a_signed_folder_packs_to_the_same_bytes_as_a_signed_pack(signed, classifier_pack, signing_keys, tmp_path):
    packed = tmp_path / "a.tar.zst"
    shutil.copy(classifier_pack, packed)
    sign(packed, signing_keys[0])
    assert pack(signed, tmp_path / "b.tar.zst").read_bytes() == packed.read_bytes()


def test_sign_refuses_a_public_key_and_a_corrupt_artifact(classifier_artifact, signing_keys, tmp_path):
    with pytest.raises(PrecompileError, match="a public key; signing needs the private one"):
        sign(classifier_artifact, signing_keys[1])
    folder = copy(classifier_artifact, tmp_path / "a")
    (folder / "weights.safetensors").write_bytes(b"\0" * (folder / "weights.safetensors").stat().st_size)
    with pytest.raises(ArtifactError, match="does not match its sha256"):
        sign(folder, signing_keys[0])
    assert not (folder / "signature.json").exists()


def test_sign_accepts_an_openssh_private_key(classifier_artifact, tmp_path):
    from cryptography.hazmat.primitives import serialization

    key = Ed25519PrivateKey.generate()
    (tmp_path / "id_ed25519").write_bytes(
        key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.OpenSSH, serialization.NoEncryption())
    )
    folder = copy(classifier_artifact, tmp_path / "a")
    sign(folder, tmp_path / "id_ed25519")
    assert open_artifact(folder, trusted_keys=[key.public_key()]).signed_by


# --- expiry and rollback -----------------------------------------------------------------------


def test_an_expired_artifact_is_refused(classifier_artifact, tmp_path):
    folder = copy(classifier_artifact, tmp_path / "a", expires="2020-01-01T00:00:00+00:00")
    with pytest.raises(UntrustedArtifactError, match="tiny-classifier version 1 expired at 2020-01-01T00:00:00"):
        loader.load(folder)


def test_an_artifact_not_yet_expired_loads(classifier_artifact, tmp_path):
    folder = copy(classifier_artifact, tmp_path / "a", expires="2999-01-01T00:00:00+00:00")
    assert loader.load(folder).manifest.expires == "2999-01-01T00:00:00+00:00"


def test_min_version(classifier_artifact, tmp_path):
    folder = copy(classifier_artifact, tmp_path / "a", version=3)
    assert loader.load(folder, min_version=3).manifest.version == 3
    with pytest.raises(UntrustedArtifactError, match="is version 3, older than the minimum 4 asked for"):
        loader.load(folder, min_version=4)


def test_a_rollback_is_refused_once_a_newer_version_was_loaded(classifier_artifact, tmp_path):
    v1 = copy(classifier_artifact, tmp_path / "v1", version=1)
    v2 = copy(classifier_artifact, tmp_path / "v2", version=2)
    state = tmp_path / "state"
    loader.load(v1, refuse_rollback=True, state_dir=state)
    loader.load(v2, refuse_rollback=True, state_dir=state)
    with pytest.raises(
        UntrustedArtifactError, match=r"version 1 is older than version 2, already loaded on this host \(a rollback\)"
    ):
        loader.load(v1, refuse_rollback=True, state_dir=state)
    assert loader.load(v1, state_dir=state).manifest.version == 1  # only when asked
    loader.load(v2, refuse_rollback=True, state_dir=state)  # the same release again is fine
    assert json.loads((state / "versions" / "tiny-classifier.json").read_text())["version"] == 2


def test_other_content_under_a_version_already_seen_is_refused(classifier_artifact, tmp_path):
    first = copy(classifier_artifact, tmp_path / "a", version=5)
    second = copy(classifier_artifact, tmp_path / "b", version=5, created="2030-01-01T00:00:00+00:00")
    loader.load(first, refuse_rollback=True, state_dir=tmp_path / "state")
    with pytest.raises(UntrustedArtifactError, match="version 5 was already loaded on this host with other content"):
        loader.load(second, refuse_rollback=True, state_dir=tmp_path / "state")


def test_refused_or_unchecked_loads_record_nothing(classifier_artifact, tmp_path):
    state = tmp_path / "state"
    loader.load(copy(classifier_artifact, tmp_path / "v9", version=9), state_dir=state)
    bad = copy(classifier_artifact, tmp_path / "v8", version=8, torch_version="1.0.0")
    with pytest.raises(ArtifactError):
        loader.load(bad, refuse_rollback=True, state_dir=state)
    assert not list(state.glob("versions/*.json"))


def test_a_damaged_version_record_fails_closed(classifier_artifact, tmp_path):
    record = tmp_path / "state" / "versions" / "tiny-classifier.json"
    record.parent.mkdir(parents=True)
    record.write_text("{not json")
    with pytest.raises(LoaderError, match="unreadable version record .* delete it to reset"):
        loader.load(classifier_artifact, refuse_rollback=True, state_dir=tmp_path / "state")


def test_the_version_state_defaults_outside_the_cache(tmp_path, monkeypatch):
    from loader.trust import default_state_root

    monkeypatch.setenv("HOME", str(tmp_path))
    monkeypatch.delenv("XDG_STATE_HOME", raising=False)
    monkeypatch.delenv("PRECOMPILE_STATE", raising=False)
    assert default_state_root() == tmp_path / ".local" / "state" / "precompile"
    monkeypatch.setenv("PRECOMPILE_STATE", str(tmp_path / "s"))
    assert default_state_root() == tmp_path / "s"
