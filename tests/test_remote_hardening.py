"""A damaged or hostile store (issue 20, items 6-9): its index is parsed strictly, a refused deploy
changes nothing, a hostile object is refused after its first bytes, and a fresh file:// store works.
Against the real S3-compatible server of tests/test_remote.py (`rclone serve s3` on loopback), or a
file:// folder."""

from __future__ import annotations

import json
import os

import pytest
from click.testing import CliRunner

import loader
from loader import ArtifactError
from loader.stores import remote
from precompile.cli import main
from precompile.ship.remote import promote, push

from .test_remote import STORE, cache_state, downloads, s3, store_env  # noqa: F401  (fixtures)

pytest.importorskip("s3fs")

NAME = "tiny-classifier"
MODEL = f"{STORE}/{NAME}"
INDEX = f"{MODEL}/index.json"


def put(url: str, data: bytes) -> None:
    """Write an object through the store's API (rclone does not see files written behind its back)."""
    fs, path = remote.filesystem(url)
    fs.pipe_file(path, data)


def store_bytes(url: str) -> dict[str, bytes]:
    """Every object under ``url`` and its bytes."""
    fs, path = remote.filesystem(url)
    return {p: fs.cat_file(p) for p in sorted(fs.find(path))}


def run(*args: str):
    return CliRunner().invoke(main, list(args), catch_exceptions=False)


@pytest.fixture
def published(s3, classifier_pack) -> dict:
    """Version 1 pushed and promoted; returns the index as push wrote it."""
    push(classifier_pack, STORE)
    promote(MODEL, 1)
    fs, path = remote.filesystem(INDEX)
    return json.loads(fs.cat_file(path))


# --- 6: the index is untrusted input -----------------------------------------------------------

CORRUPTIONS = {
    "a version key that is not a number": (
        lambda index: {**index, "versions": {"latest": index["versions"]["1"]}},
        'versions."latest": the key is not a version number (a positive integer, as push writes)',
    ),
    "an entry that is a string": (
        lambda index: {**index, "versions": {"1": "1.tar.zst"}},
        'versions."1": expected an object, got a string',
    ),
    "an entry without sha256": (
        lambda index: {**index, "versions": {"1": {k: v for k, v in index["versions"]["1"].items() if k != "sha256"}}},
        "versions.\"1\": missing key(s) ['sha256']",
    ),
    "an entry that is a list": (
        lambda index: {**index, "versions": {"1": list(index["versions"]["1"].values())}},
        'versions."1": expected an object, got a list',
    ),
    "a file outside the model's folder": (
        lambda index: {**index, "versions": {"1": {**index["versions"]["1"], "file": "../other-model/1.tar.zst"}}},
        "versions.\"1\".file: '../other-model/1.tar.zst': version 1 is published as 1.tar.zst in the model's folder",
    ),
    "versions that are a list": (
        lambda index: {**index, "versions": []},
        "versions: expected an object of version numbers",
    ),
    "not JSON": (
        None,
        "not an index `precompile push` wrote (not valid JSON: Expecting value: line 1 column 1 (char 0))",
    ),
}

COMMANDS = {
    "pull": lambda tmp_path: ["pull", MODEL, "-o", str(tmp_path / "pulled.tar.zst")],
    "ls": lambda tmp_path: ["ls", STORE],
    "ls of the model": lambda tmp_path: ["ls", MODEL],
    "promote": lambda tmp_path: ["promote", MODEL, "--version", "1"],
}


@pytest.mark.parametrize("command", COMMANDS)
@pytest.mark.parametrize("corruption", CORRUPTIONS)
def test_a_damaged_index_is_one_clear_line_naming_the_store_and_key(published, tmp_path, corruption, command):
    damage, message = CORRUPTIONS[corruption]
    put(INDEX, b"<html>oops" if damage is None else json.dumps(damage(published)).encode())
    before = store_bytes(MODEL)
    result = run(*COMMANDS[command](tmp_path))
    assert (result.exit_code, result.output) == (1, f"Error: {INDEX}: {message}\n")
    assert store_bytes(MODEL) == before and not (tmp_path / "pulled.tar.zst").exists()


def test_push_refuses_to_extend_a_damaged_index(published, classifier_versions):
    put(INDEX, json.dumps({**published, "versions": {"latest": published["versions"]["1"]}}).encode())
    before = store_bytes(MODEL)
    result = run("push", str(classifier_versions[1]), STORE)
    assert result.exit_code == 1 and result.output.startswith(f'Error: {INDEX}: versions."latest"')
    assert store_bytes(MODEL) == before  # version 2 was not uploaded either


def test_an_index_in_the_wrong_folder_is_refused(published):
    put(INDEX, json.dumps({**published, "name": "other-model"}).encode())
    result = run("ls", MODEL)
    assert (result.exit_code, result.output) == (
        1,
        f"Error: {INDEX}: name: 'other-model', but the index is in the folder of '{NAME}'\n",
    )


# --- 7: a refused deploy changes nothing ------------------------------------------------------


def test_a_promote_refused_for_a_file_outside_the_folder_leaves_the_store_as_it_was(published, classifier_pack):
    put(f"{STORE}/other-model/1.tar.zst", classifier_pack.read_bytes())
    put(
        INDEX,
        json.dumps(
            {**published, "versions": {"1": {**published["versions"]["1"], "file": "../other-model/1.tar.zst"}}}
        ).encode(),
    )
    before = store_bytes(STORE)
    result = run("promote", MODEL, "--version", "1")
    assert result.exit_code == 1 and "version 1 is published as 1.tar.zst in the model's folder" in result.output
    assert store_bytes(STORE) == before
    assert remote.resolve_pointer(f"{MODEL}/current").target == f"{MODEL}/1.tar.zst"


def test_a_promote_of_a_pack_that_is_not_the_one_indexed_leaves_the_store_as_it_was(published, classifier_pack):
    pack_url = f"{MODEL}/1.tar.zst"
    put(f"{MODEL}/current", b"")  # a pointer someone emptied: even that is kept as it was
    put(pack_url, bytes(classifier_pack.stat().st_size))  # the right size, not a pack
    before = store_bytes(MODEL)
    result = run("promote", MODEL, "--version", "1")
    assert (result.exit_code, result.output) == (
        1,
        f"Error: {pack_url}: not a pack (it does not start with a zstandard frame); pass an artifact folder or a file "
        "written by `precompile pack`\n",
    )
    assert store_bytes(MODEL) == before


def test_a_promote_of_a_pack_of_another_size_is_refused_first(published, classifier_pack):
    pack_url = f"{MODEL}/1.tar.zst"
    put(pack_url, classifier_pack.read_bytes() + b"\0" * 512)
    before = store_bytes(MODEL)
    result = run("promote", MODEL, "--version", "1")
    size = classifier_pack.stat().st_size
    assert (result.exit_code, result.output) == (
        1,
        f"Error: {pack_url}: {size + 512} bytes in the store, index.json records {size}; push it again or fix the index\n",
    )
    assert store_bytes(MODEL) == before


# --- 8: a hostile object costs one small read --------------------------------------------------


@pytest.fixture
def written(monkeypatch) -> list[int]:
    """The bytes each download hands to its writer (what reaches the cache's tmp/)."""
    counts: list[int] = []
    real = remote.download

    def spy(fs, path, url, write, size):
        counts.append(0)

        def counted(chunk: bytes):
            counts[-1] += len(chunk)
            return write(chunk)

        return real(fs, path, url, counted, size)

    monkeypatch.setattr(remote, "download", spy)
    return counts


JUNK = 24 << 20


def test_an_unsigned_pack_followed_by_junk_is_refused_after_its_head(s3, classifier_pack, signing_keys, written):
    url = f"{STORE}/hostile/1.tar.zst"
    fs, path = remote.filesystem(url)
    fs.pipe_file(path, classifier_pack.read_bytes() + os.urandom(JUNK))
    with pytest.raises(loader.UntrustedArtifactError) as caught:
        loader.load(url, trusted_keys=[signing_keys[1]])
    assert str(caught.value).startswith(f"{url}: ")
    assert len(written) == 1 and written[0] <= remote.FIRST_CHUNK  # one small read of the 24 MiB
    assert cache_state(s3.root.parent) == ([], [])


def test_a_pack_followed_by_more_junk_than_its_manifest_accounts_for_is_refused_after_its_head(
    s3, classifier_pack, written
):
    url = f"{STORE}/appended/1.tar.zst"
    put(url, classifier_pack.read_bytes() + bytes(JUNK))
    with pytest.raises(
        ArtifactError,
        match=rf"^{url}: {classifier_pack.stat().st_size + JUNK} bytes, more than the \d+ a pack of its manifest can take \(bytes appended\?\)$",
    ):
        loader.load(url)  # no trust policy: the head is admitted, its size is not
    assert len(written) == 1 and written[0] <= remote.FIRST_CHUNK
    assert cache_state(s3.root.parent) == ([], [])


def test_junk_that_is_not_a_pack_is_refused_after_its_first_read(s3, written):
    url = f"{STORE}/junk/1.tar.zst"
    put(url, b"\x28\xb5\x2f\xfd" + os.urandom(JUNK))  # a zstandard magic number, then noise
    with pytest.raises(ArtifactError, match=f"^{url}: "):
        loader.load(url)
    assert len(written) == 1 and written[0] <= remote.FIRST_CHUNK
    assert cache_state(s3.root.parent) == ([], [])


def test_max_bytes_refuses_a_larger_object_before_downloading(s3, classifier_pack, downloads):
    pushed = push(classifier_pack, STORE)
    size = classifier_pack.stat().st_size
    with pytest.raises(ArtifactError) as caught:
        loader.load(pushed.url, max_bytes=size - 1)
    assert (
        str(caught.value)
        == f"{pushed.url}: the store's object is {size} bytes, more than max_bytes={size - 1}; refusing to download it"
    )
    assert downloads == [] and cache_state(s3.root.parent) == ([], [])
    assert loader.load(pushed.url, max_bytes=size).manifest.version == pushed.version
    with pytest.raises(loader.LoaderError, match=r"^max_bytes='1 GB': expected a positive number of bytes$"):
        loader.load(pushed.url, max_bytes="1 GB")


def test_an_object_larger_than_its_index_records_is_not_downloaded(s3, classifier_pack, downloads):
    pushed = push(classifier_pack, STORE)
    size = classifier_pack.stat().st_size
    put(pushed.url, classifier_pack.read_bytes() + bytes(JUNK))  # replaced behind the index's back
    with pytest.raises(ArtifactError) as caught:
        loader.load(pushed.url)
    assert str(caught.value) == (
        f"{pushed.url}: the store's object is {size + JUNK} bytes, its index.json records {size}; refusing to download it"
    )
    assert downloads == [] and cache_state(s3.root.parent) == ([], [])


def test_a_load_refuses_a_pack_whose_sha256_is_not_the_indexed_one(s3, classifier_pack):
    pushed = push(classifier_pack, STORE)
    data = bytearray(classifier_pack.read_bytes())
    data[-1] ^= 0xFF  # same size, other bytes
    put(pushed.url, bytes(data))
    with pytest.raises(ArtifactError) as caught:
        loader.load(pushed.url)
    assert (
        str(caught.value) == f"{pushed.url}: its sha256 is not the one in index.json (changed in the store, or corrupt)"
    )
    assert cache_state(s3.root.parent) == ([], [])


# --- 9: a fresh file:// store ---------------------------------------------------------------------


def test_a_fresh_file_store_takes_push_promote_pull_ls_and_load(store_env, classifier_pack, tmp_path):
    store = f"file://{tmp_path}/fresh-store"
    assert run("ls", store).output == f"{store}: nothing published\n"
    pushed = run("push", str(classifier_pack), store)
    assert pushed.exit_code == 0, pushed.output
    assert pushed.output.startswith(f"{store}/{NAME}/1.tar.zst (")
    listed = run("ls", store)
    assert (
        listed.exit_code == 0
        and listed.output.splitlines()[0] == NAME
        and listed.output.splitlines()[1].startswith("  v1 ")
    )
    promoted = run("promote", f"{store}/{NAME}", "--version", "1")
    assert (promoted.exit_code, promoted.output) == (0, f"{store}/{NAME}/current -> {store}/{NAME}/1.tar.zst\n")
    pulled = run("pull", f"{store}/{NAME}", "-o", str(tmp_path / "pulled.tar.zst"))
    assert pulled.exit_code == 0, pulled.output
    assert (tmp_path / "pulled.tar.zst").read_bytes() == classifier_pack.read_bytes()
    target = remote.resolve_pointer(f"{store}/{NAME}/current").target
    assert loader.load(target).manifest.version == 1
