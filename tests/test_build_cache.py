"""The build cache (precompile.build_cache): a compile made before is copied, not made again; what
changes the compiled code misses it; a damaged entry is not used; a bad folder is one line.

Every build here but the session classifier's (conftest.classifier_build, which fills the cache)
runs with AOTInductor replaced by a function that fails: a build that passes copied its variant, and
one that fails with that function's message tried to compile. No test compiles anything."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import textwrap

import pytest
import torch
import torch._inductor
from click.testing import CliRunner

import loader
import precompile
from precompile.build_cache import ENV
from precompile.cli import main
from precompile.errors import PrecompileError

from .conftest import CLASSIFIER_PROFILE, write_profile

NOT_CACHED = "compiled: the build cache had no entry"


@pytest.fixture
def no_compiling(monkeypatch):
    def compile_refused(*args, **kwargs):
        raise RuntimeError(NOT_CACHED)

    monkeypatch.setattr(torch._inductor, "aoti_compile_and_package", compile_refused)


def test_the_same_model_built_again_elsewhere_is_copied_from_the_cache(
    classifier_build, build_cache, tmp_path, no_compiling
):
    """Another folder, another copy of the model's file, through the CLI: the variant comes from
    the cache, byte for byte the classifier's, and serves what it serves."""
    profile = write_profile(tmp_path / "again", CLASSIFIER_PROFILE)
    out = tmp_path / "artifact"
    result = CliRunner().invoke(main, ["build", str(profile), "-o", str(out), "--cache", str(build_cache)])
    assert result.exit_code == 0, result.output
    assert "(from the build cache)" in result.output
    first = classifier_build[1].path
    (variant,) = (first / "variants").iterdir()
    assert (out / "variants" / variant.name).read_bytes() == variant.read_bytes()
    ids = torch.randint(0, 50, (3, 17))
    mask = torch.ones(3, 17, dtype=torch.bool)
    assert torch.equal(loader.load(out)(ids, mask), loader.load(first)(ids, mask))


@pytest.mark.parametrize(
    "change",
    [
        ("kwargs: {vocab: 50, width: 16}", "kwargs: {vocab: 50, width: 24}"),  # other weights and shapes
        ("seq:   {min: 2, max: 48}", "seq:   {min: 2, max: 40}"),  # another range
        ("check: {random_shapes: 6}", "check: {random_shapes: 6}\ncompile: {inductor: {freezing: true}}"),  # an option
    ],
    ids=["weights", "range", "option"],
)
def test_what_changes_the_compiled_code_compiles_again(classifier_build, build_cache, tmp_path, no_compiling, change):
    text = textwrap.dedent(CLASSIFIER_PROFILE).replace(*change)
    assert text != textwrap.dedent(CLASSIFIER_PROFILE)
    with pytest.raises(PrecompileError, match=NOT_CACHED):
        precompile.build(write_profile(tmp_path, text), tmp_path / "artifact", cache=build_cache)


def test_a_damaged_entry_is_not_used_and_is_removed(classifier_build, build_cache, tmp_path, no_compiling):
    cache = tmp_path / "cache"
    shutil.copytree(build_cache, cache)
    (variant,) = (classifier_build[1].path / "variants").iterdir()
    (entry,) = [p.parent for p in cache.rglob("variant.pt2") if p.read_bytes() == variant.read_bytes()]
    package = entry / "variant.pt2"
    package.write_bytes(package.read_bytes()[:-100])  # cut short, as a full disk would leave it
    with pytest.raises(PrecompileError, match=NOT_CACHED):
        precompile.build(write_profile(tmp_path, CLASSIFIER_PROFILE), tmp_path / "artifact", cache=cache)
    assert not entry.exists()


def test_a_cache_that_is_not_a_folder_is_one_line_naming_it(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)  # the default output, artifacts/<name>, would be here
    profile = write_profile(tmp_path, CLASSIFIER_PROFILE)
    (tmp_path / "file").write_text("not a folder")
    result = CliRunner().invoke(main, ["build", str(profile), "--cache", str(tmp_path / "file")])
    assert result.exit_code == 1
    assert (
        result.output.strip()
        == f"Error: the build cache {tmp_path / 'file'} is a file, not a folder: give a folder for the cache, or unset it"
    )
    monkeypatch.setenv(ENV, str(tmp_path / "file"))
    result = CliRunner().invoke(main, ["build", str(profile)])
    assert result.exit_code == 1 and f"(from ${ENV})" in result.output
    assert "Traceback" not in result.output and not (tmp_path / "artifacts").exists()


@pytest.mark.integration
def test_two_builds_of_one_model_at_once_compile_it_once(tmp_path):
    """Two processes, one empty cache: one compiles while the other waits on the key's lock, then
    copies the entry the first wrote."""
    profile = write_profile(tmp_path, CLASSIFIER_PROFILE)
    env = {**os.environ, "OMP_WAIT_POLICY": "PASSIVE", ENV: str(tmp_path / "cache")}
    builds = [
        subprocess.Popen(
            [sys.executable, "-m", "precompile", "build", str(profile), "-o", str(tmp_path / f"out{i}")],
            env=env,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
        )
        for i in range(2)
    ]
    outputs = [b.communicate(timeout=300)[0] for b in builds]
    assert [b.returncode for b in builds] == [0, 0], outputs
    assert sorted("(from the build cache)" in out for out in outputs) == [False, True], outputs
    assert len(list((tmp_path / "cache").rglob("record.json"))) == 1


@pytest.mark.parametrize("value", [0, 7])
def test_a_model_with_a_zero_dim_buffer_has_a_key_that_follows_its_value(value):
    """BatchNorm's ``num_batches_tracked`` is a 0-dim int64: its bytes are hashed like any weight's
    (it once crashed the build with "self.dim() cannot be 0 to view Long as Byte")."""
    from precompile.build_cache import compile_key

    def key(tracked: int) -> str | None:
        torch.manual_seed(0)
        model = torch.nn.Sequential(torch.nn.Conv2d(3, 4, 3), torch.nn.BatchNorm2d(4)).eval()
        model[1].num_batches_tracked.fill_(tracked)
        ep = torch.export.export(model, (torch.randn(1, 3, 8, 8),))
        return compile_key(ep, {}, {"device": "cpu"})

    assert key(value) is not None
    assert key(value) == key(value)
    assert key(value) != key(value + 1)


def test_a_key_that_fails_to_compute_compiles_the_variant_with_a_warning(monkeypatch):
    """The cache only saves time: an error while hashing (a tensor type it does not know) leaves the
    variant uncached, said in a warning, instead of failing the build."""
    from precompile import build_cache

    def broken(value):
        raise RuntimeError("no bytes to hash")

    monkeypatch.setattr(build_cache, "_tensor_digest", broken)
    ep = torch.export.export(torch.nn.Linear(2, 2), (torch.randn(1, 2),))
    with pytest.warns(UserWarning, match=r"build cache is not used .*RuntimeError: no bytes to hash"):
        assert build_cache.compile_key(ep, {}, {"device": "cpu"}) is None
