"""The local cache: packs unpacked once, atomically, shared by processes, re-hashed only when changed."""

from __future__ import annotations

import multiprocessing
import os
import signal
import stat
import time
from pathlib import Path

import pytest
from click.testing import CliRunner

import loader
import loader.artifact
import loader.stores.cache
import loader.stores.pack
from loader import constants as C
from loader.source import open_artifact
from loader.stores.cache import Cache, default_root
from loader.stores.pack import read_head
from precompile.cli import main


def cache_files(root: Path) -> list[str]:
    return sorted(p.relative_to(root).as_posix() for p in root.rglob("*"))


def test_first_load_installs_a_read_only_entry_named_by_the_manifest_digest(classifier_pack, tmp_path):
    root = tmp_path / "cache"
    opened = open_artifact(classifier_pack, cache_dir=root)
    digest = read_head(classifier_pack).digest
    assert opened.unpacked and opened.root == root / "artifacts" / digest
    assert (root / "CACHEDIR.TAG").read_text().startswith("Signature: 8a477f597d28d172789f06886806bc55\n")
    assert stat.S_IMODE(opened.root.stat().st_mode) == 0o555
    assert stat.S_IMODE((opened.root / "weights.safetensors").stat().st_mode) == 0o444
    assert (root / "artifacts" / f"{digest}.verified").is_file()
    assert list((root / "tmp").iterdir()) == []


def test_second_load_reads_the_cache_without_hashing(classifier_pack, tmp_path, monkeypatch):
    root = tmp_path / "cache"
    loader.load(classifier_pack, cache_dir=root)
    hashed = []
    real = loader.artifact.sha256_file
    monkeypatch.setattr(loader.artifact, "sha256_file", lambda p: hashed.append(p) or real(p))
    monkeypatch.setattr(loader.stores.cache, "unpack", lambda *a: pytest.fail("unpacked twice"))
    model = loader.load(classifier_pack, cache_dir=root)
    assert hashed == []
    assert model.path.parent == root / "artifacts"


def test_second_load_costs_about_what_loading_the_folder_costs(classifier_artifact, classifier_pack, tmp_path):
    root = tmp_path / "cache"
    loader.load(classifier_pack, cache_dir=root)

    def median(path, **kw):
        times = []
        for _ in range(5):
            start = time.perf_counter()
            loader.load(path, **kw)
            times.append(time.perf_counter() - start)
        return sorted(times)[2]

    folder, packed = median(classifier_artifact), median(classifier_pack, cache_dir=root)
    assert packed < 1.5 * folder + 0.02, (packed, folder)


def test_a_changed_file_in_an_entry_is_hashed_caught_and_unpacked_again(classifier_pack, tmp_path):
    root = tmp_path / "cache"
    entry = open_artifact(classifier_pack, cache_dir=root).root
    weights = entry / "weights.safetensors"
    good = weights.read_bytes()
    os.chmod(weights, 0o644)
    weights.write_bytes(good[:-1] + bytes([good[-1] ^ 1]))
    opened = open_artifact(classifier_pack, cache_dir=root)
    assert opened.unpacked
    assert weights.read_bytes() == good


def test_a_file_rewritten_with_its_size_and_mtime_put_back_is_still_caught(classifier_pack, tmp_path):
    """The record is checked by lstat alone; what a writer cannot put back is the ctime."""
    root = tmp_path / "cache"
    entry = open_artifact(classifier_pack, cache_dir=root).root
    weights = entry / "weights.safetensors"
    good, before = weights.read_bytes(), os.lstat(weights)
    os.chmod(weights, 0o644)
    weights.write_bytes(good[:-1] + bytes([good[-1] ^ 1]))  # same size
    os.chmod(weights, 0o444)
    os.utime(weights, ns=(before.st_atime_ns, before.st_mtime_ns))  # same mtime and mode
    after = os.lstat(weights)
    assert (after.st_size, after.st_mtime_ns, after.st_ino) == (before.st_size, before.st_mtime_ns, before.st_ino)
    opened = open_artifact(classifier_pack, cache_dir=root)
    assert opened.unpacked  # hashed, refused, unpacked again
    assert weights.read_bytes() == good
    model = loader.load_native(classifier_pack, cache_dir=root)
    assert model.path == entry


def test_a_touched_file_is_hashed_once_then_trusted_again(classifier_pack, tmp_path, monkeypatch):
    root = tmp_path / "cache"
    entry = open_artifact(classifier_pack, cache_dir=root).root
    os.utime(entry / "weights.safetensors")  # same content, new mtime and ctime
    hashed = []
    real = loader.artifact.sha256_file
    monkeypatch.setattr(loader.artifact, "sha256_file", lambda p: hashed.append(Path(p).name) or real(p))
    assert not open_artifact(classifier_pack, cache_dir=root).unpacked
    assert hashed == ["weights.safetensors"]
    open_artifact(classifier_pack, cache_dir=root)
    assert hashed == ["weights.safetensors"]


def _open_in_child(pack: str, root: str, barrier, results) -> None:
    barrier.wait()
    _, unpacked = Cache(root).open(read_head(pack))
    results.put(unpacked)


def test_processes_loading_the_same_pack_at_once_unpack_it_once(classifier_pack, tmp_path, monkeypatch):
    real = loader.stores.cache.unpack

    def slow_unpack(*args):
        time.sleep(0.3)  # widen the window in which a second process could start unpacking too
        return real(*args)

    monkeypatch.setattr(loader.stores.cache, "unpack", slow_unpack)
    ctx = multiprocessing.get_context("fork")
    barrier, results = ctx.Barrier(4), ctx.Queue()
    procs = [
        ctx.Process(target=_open_in_child, args=(str(classifier_pack), str(tmp_path), barrier, results))
        for _ in range(4)
    ]
    for p in procs:
        p.start()
    for p in procs:
        p.join(60)
    assert [p.exitcode for p in procs] == [0, 0, 0, 0]
    assert sorted(results.get(timeout=5) for _ in procs) == [False, False, False, True]
    assert list((tmp_path / "tmp").iterdir()) == []


def _die_mid_unpack(pack: str, root: str) -> None:
    real = loader.stores.pack._TarReader.copy_data
    calls = []

    def copy_then_die(self, *args):
        calls.append(1)
        if len(calls) == 2:
            os.kill(os.getpid(), signal.SIGKILL)
        return real(self, *args)

    loader.stores.pack._TarReader.copy_data = copy_then_die
    Cache(root).open(read_head(pack))


def test_a_process_killed_mid_unpack_leaves_nothing_a_later_load_trusts(classifier_pack, tmp_path):
    child = multiprocessing.get_context("fork").Process(
        target=_die_mid_unpack, args=(str(classifier_pack), str(tmp_path))
    )
    child.start()
    child.join(60)
    assert child.exitcode == -signal.SIGKILL
    leftovers = list((tmp_path / "tmp").iterdir())
    assert len(leftovers) == 1 and not list((tmp_path / "artifacts").iterdir())
    opened = open_artifact(classifier_pack, cache_dir=tmp_path)
    assert opened.unpacked
    assert list((tmp_path / "tmp").iterdir()) == []  # the dead process's folder is gone


def test_verify_false_checks_sizes_only(classifier_pack, tmp_path, monkeypatch):
    open_artifact(classifier_pack, cache_dir=tmp_path)
    monkeypatch.setattr(loader.artifact, "sha256_file", lambda p: pytest.fail("hashed"))
    assert not open_artifact(classifier_pack, cache_dir=tmp_path, verify=False).unpacked


def test_default_root_follows_precompile_cache_then_xdg_then_home(tmp_path, monkeypatch):
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    monkeypatch.delenv("XDG_CACHE_HOME", raising=False)
    monkeypatch.delenv(C.CACHE_ENV, raising=False)
    assert default_root() == tmp_path / "home" / ".cache" / "precompile"
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    assert default_root() == tmp_path / "xdg" / "precompile"
    monkeypatch.setenv(C.CACHE_ENV, str(tmp_path / "mine"))
    assert default_root() == tmp_path / "mine"


def test_cache_ls_and_clear(classifier_pack, tmp_path):
    env = {C.CACHE_ENV: str(tmp_path / "cache")}
    runner = CliRunner()
    assert runner.invoke(main, ["cache", "ls"], env=env).output == f"{tmp_path / 'cache'}: 0 artifact(s), 0 B\n"
    loader.load(classifier_pack, cache_dir=tmp_path / "cache")
    result = runner.invoke(main, ["cache", "ls"], env=env, catch_exceptions=False)
    assert result.exit_code == 0
    digest = read_head(classifier_pack).digest
    assert "1 artifact(s)" in result.output and "tiny-classifier" in result.output and digest[:16] in result.output
    result = runner.invoke(main, ["cache", "clear"], env=env, catch_exceptions=False)
    assert result.exit_code == 0 and "removed 1 artifact(s)" in result.output
    assert [f for f in cache_files(tmp_path / "cache") if not f.startswith("locks/")] == [
        "CACHEDIR.TAG",
        "artifacts",
        "locks",
        "tmp",
    ]
    assert loader.load(classifier_pack, cache_dir=tmp_path / "cache").path.is_dir()  # and it fills again


def test_install_repair_and_clear_need_no_root_powers(classifier_pack, tmp_path, monkeypatch):
    """Tests often run as root, who may move a read-only folder; nobody else may (its `..` entry
    changes). Emulate the rule, so that the cache is tested as an ordinary user would run it."""
    real = os.rename

    def rename(src, dst):
        moving = os.path.isdir(src) and os.path.dirname(os.path.abspath(src)) != os.path.dirname(os.path.abspath(dst))
        if moving and not os.stat(src).st_mode & stat.S_IWUSR:
            raise PermissionError(13, "Permission denied", src)
        return real(src, dst)

    monkeypatch.setattr(os, "rename", rename)
    entry = open_artifact(classifier_pack, cache_dir=tmp_path).root
    assert stat.S_IMODE(entry.stat().st_mode) == 0o555
    os.chmod(entry / "weights.safetensors", 0o644)
    with open(entry / "weights.safetensors", "r+b") as f:
        f.write(b"\xff")
    assert open_artifact(classifier_pack, cache_dir=tmp_path).unpacked  # discarded and unpacked again
    assert Cache(tmp_path).clear()[0] == 1
