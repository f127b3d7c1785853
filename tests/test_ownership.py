"""The cache and the version state must be this user's alone, as ssh treats ~/.ssh.

With a shared PRECOMPILE_CACHE, another local user could plant ``artifacts/<digest>`` (the digest is
public, in the pack) with changed weights or code and a ``.verified`` record matching them, and a
trusted load would run it without hashing. Every folder, entry, file and record another user owns,
or that group or others can write, is refused, with the chmod/chown that fixes it. The tests run as
root, so ``os.chown(path, OTHER, -1)`` plays the other user.
"""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import pytest

import loader
from loader.errors import InsecurePathError
from loader.fs import make_writable
from loader.stores.pack import read_head
from precompile.ship.pack import pack
from precompile.ship.sign import sign

OTHER = 12345  # a uid that is not ours


@pytest.fixture(scope="module")
def packed(classifier_artifact, tmp_path_factory) -> Path:
    return pack(classifier_artifact, tmp_path_factory.mktemp("pack") / "classifier.tar.zst")


@pytest.fixture
def cache(packed, tmp_path) -> Path:
    """A cache holding the pack's entry, installed by a load (closed: the tests change the entry's
    files, which a model still warming up in its background opener reads)."""
    loader.load(packed, cache_dir=tmp_path / "cache").close()
    return tmp_path / "cache"


def entry_of(cache: Path, packed: Path) -> Path:
    return cache / "artifacts" / read_head(packed).digest


def needs_root():
    if os.geteuid() != 0:
        pytest.skip("playing another user with chown needs root")


@pytest.mark.parametrize("folder", ["", "artifacts", "locks", "tmp"])
def test_a_cache_folder_group_or_others_can_write_is_refused(packed, cache, folder):
    path = cache / folder if folder else cache
    path.chmod(0o777)
    with pytest.raises(InsecurePathError, match=f"writable by group or others .*`chmod go-w {path}`"):
        loader.load(packed, cache_dir=cache)
    path.chmod(0o755)
    assert loader.load(packed, cache_dir=cache)


def test_a_cache_root_another_user_owns_is_refused(packed, cache):
    needs_root()
    os.chown(cache, OTHER, -1)
    with pytest.raises(
        InsecurePathError, match=f"owned by uid {OTHER}, not by this user .*`chown -R 0 {cache}`.*PRECOMPILE_CACHE"
    ):
        loader.load(packed, cache_dir=cache)


def test_an_empty_cache_folder_prepared_by_another_user_is_refused(packed, tmp_path):
    needs_root()
    root = tmp_path / "shared-cache"
    root.mkdir(mode=0o755)
    os.chown(root, OTHER, -1)
    with pytest.raises(InsecurePathError, match="owned by uid 12345"):
        loader.load(packed, cache_dir=root)


def plant(cache: Path, packed: Path, *, record_owner: int | None = None, record_mode: int = 0o644) -> Path:
    """Change the entry's weights (same size) and forge a .verified record that matches them."""
    entry = entry_of(cache, packed)
    make_writable(entry)
    weights = entry / "weights.safetensors"
    weights.chmod(0o644)
    data = bytearray(weights.read_bytes())
    data[-4:] = b"\x00\x00\xc8\x42"  # the last float becomes 100.0
    weights.write_bytes(bytes(data))
    weights.chmod(0o444)
    record = cache / "artifacts" / f"{entry.name}.verified"
    files = json.loads(record.read_text())["files"]
    st = weights.stat()
    files["weights.safetensors"] = [st.st_size, st.st_mtime_ns, st.st_ctime_ns, st.st_ino]
    record.write_text(json.dumps({"digest": entry.name, "files": files}))
    record.chmod(record_mode)
    if record_owner is not None:
        os.chown(record, record_owner, -1)
    return entry


def test_a_planted_entry_with_a_forged_record_of_another_user_is_refused(packed, signing_keys, tmp_path):
    needs_root()
    signed = Path(shutil.copy(packed, tmp_path / "signed.tar.zst"))
    sign(signed, signing_keys[0])
    cache = tmp_path / "cache"
    loader.load(signed, cache_dir=cache, trusted_keys=[signing_keys[1]]).close()  # closed before plant()
    plant(cache, signed, record_owner=OTHER)
    with pytest.raises(InsecurePathError, match="a precompile cache record is owned by uid 12345"):
        loader.load(signed, cache_dir=cache, trusted_keys=[signing_keys[1]])


def test_a_record_others_can_write_is_refused(packed, cache):
    plant(cache, packed, record_mode=0o666)
    with pytest.raises(
        InsecurePathError, match=r"\.verified: a precompile cache record is writable by group or others"
    ):
        loader.load(packed, cache_dir=cache)


def test_an_entry_another_user_owns_is_refused(packed, cache):
    needs_root()
    entry = entry_of(cache, packed)
    os.chown(entry, OTHER, -1)
    with pytest.raises(
        InsecurePathError, match="a precompile cache entry is owned by uid 12345.*precompile cache clear"
    ):
        loader.load(packed, cache_dir=cache)


def test_a_file_in_an_entry_another_user_owns_is_refused(packed, cache):
    needs_root()
    variant = next((entry_of(cache, packed) / "variants").iterdir())
    os.chown(variant, OTHER, -1)
    with pytest.raises(InsecurePathError, match=f"{variant}: a file of a precompile cache entry is owned by uid 12345"):
        loader.load(packed, cache_dir=cache)


def test_an_entry_that_is_a_link_is_refused(packed, cache, tmp_path):
    entry = entry_of(cache, packed)
    elsewhere = tmp_path / "elsewhere"
    shutil.copytree(entry, elsewhere)
    make_writable(cache / "artifacts")
    shutil.rmtree(entry)
    entry.symlink_to(elsewhere)
    with pytest.raises(InsecurePathError, match="a precompile cache entry is a symbolic link"):
        loader.load(packed, cache_dir=cache)


def test_folders_are_created_private_whatever_the_umask(packed, tmp_path):
    old = os.umask(0o002)
    try:
        loader.load(packed, cache_dir=tmp_path / "cache", refuse_rollback=True, state_dir=tmp_path / "state")
        loader.load(packed, cache_dir=tmp_path / "cache", refuse_rollback=True, state_dir=tmp_path / "state")
    finally:
        os.umask(old)
    for folder in ("cache", "cache/artifacts", "cache/locks", "cache/tmp", "state", "state/versions"):
        assert (tmp_path / folder).stat().st_mode & 0o777 == 0o755, folder


def test_a_state_folder_others_can_write_is_refused(classifier_artifact, tmp_path):
    state = tmp_path / "state"
    state.mkdir(mode=0o777)
    state.chmod(0o777)
    with pytest.raises(
        InsecurePathError,
        match=f"the precompile state folder is writable by group or others .*`chmod go-w {state}`.*PRECOMPILE_STATE",
    ):
        loader.load(classifier_artifact, refuse_rollback=True, state_dir=state)


def test_a_version_record_another_user_owns_is_refused(classifier_artifact, tmp_path):
    needs_root()
    state = tmp_path / "state"
    loader.load(classifier_artifact, refuse_rollback=True, state_dir=state)
    record = state / "versions" / "tiny-classifier.json"
    os.chown(record, OTHER, -1)
    with pytest.raises(InsecurePathError, match=f"{record}: a version record is owned by uid 12345"):
        loader.load(classifier_artifact, refuse_rollback=True, state_dir=state)


def test_root_owned_folders_are_trusted_like_ssh_does(packed, cache, monkeypatch):
    import loader.fs

    monkeypatch.setattr(loader.fs, "current_uid", lambda: OTHER)  # we are someone else; the cache is root's
    assert loader.load(packed, cache_dir=cache)
