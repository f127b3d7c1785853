"""Variants opened on demand (``load(..., open=...)``, ``loader.opening``), both loaders: the first
variant before ``load()`` returns, the others later, each verified before it runs, the same results
as opening them all at once; and a package read once, hashed as its library is copied out of it."""

from __future__ import annotations

import io
import shutil
import zipfile
from pathlib import Path

import numpy as np
import pytest
import torch

import loader
import loader.native.package
from loader import ArtifactError
from loader.native.package import extract_library, read_package

from .test_native import TAGGER_CALLS, tagger_inputs

LOADERS = {"native": loader.load_native, "torch": loader.load}


def call(model, kind: str, batch: int, seq: int):
    ids, mask = tagger_inputs(batch, seq, seed=batch * 100 + seq)
    if kind == "torch":
        ids, mask = torch.from_numpy(ids), torch.from_numpy(mask)
    (tags, pooled), variant = model.call_detailed(ids, mask)
    return np.asarray(tags), np.asarray(pooled), variant


@pytest.fixture(scope="module")
def eager(tagger_build):
    return {kind: load(tagger_build.path, open="eager") for kind, load in LOADERS.items()}


@pytest.mark.parametrize("kind", LOADERS)
def test_a_lazy_load_opens_one_variant_and_the_others_at_their_first_call(tagger_build, eager, kind):
    model = LOADERS[kind](tagger_build.path, open="lazy")
    ids = [v.id for v in model.variants]
    assert [model.is_open(v) for v in ids] == [True, False, False, False]
    assert set(model.stats()["variants"]) == set(ids)  # every variant counted from the start
    for batch, seq in TAGGER_CALLS:
        tags, pooled, variant = call(model, kind, batch, seq)
        want_tags, want_pooled, want_variant = call(eager[kind], kind, batch, seq)
        assert variant == want_variant
        assert np.array_equal(tags, want_tags) and np.array_equal(pooled, want_pooled), (batch, seq)
    assert all(model.is_open(v) for v in ids)
    assert model.stats()["calls"] == len(TAGGER_CALLS)


@pytest.mark.parametrize("kind", LOADERS)
def test_a_background_load_opens_the_rest_in_a_thread_and_calls_wait_for_them(tagger_build, eager, kind):
    model = LOADERS[kind](tagger_build.path)  # the default
    assert model.opening is not None and model.is_open(model.variants[0].id)
    tags, pooled, _ = call(model, kind, 8, 32)  # dynamic-1: waits for it if the thread has not got there yet
    want_tags, want_pooled, _ = call(eager[kind], kind, 8, 32)
    assert np.array_equal(tags, want_tags) and np.array_equal(pooled, want_pooled)
    assert model.wait_opened(120)
    assert all(model.is_open(v.id) for v in model.variants)
    assert model.stats()["calls"] == 1  # the thread's warm-up calls are not counted


@pytest.mark.parametrize("kind", LOADERS)
def test_a_variant_whose_package_changed_after_the_load_never_runs(tagger_build, kind, tmp_path):
    path = tmp_path / "a"
    shutil.copytree(tagger_build.path, path)
    model = LOADERS[kind](path, open="lazy")
    last = model.variants[-1]
    package = path / last.file
    data = bytearray(package.read_bytes())
    data[len(data) // 2] ^= 1  # inside the compiled library
    package.write_bytes(bytes(data))
    for _ in range(2):  # refused for good, the same way each time
        with pytest.raises(ArtifactError, match=f"{last.file} does not match its sha256"):
            call(model, kind, 8, 32)
    assert call(model, kind, 1, 16)[2] == model.variants[0].id  # the others serve on


@pytest.mark.parametrize("kind", LOADERS)
def test_a_folder_removed_before_its_last_variant_opens_still_serves_it(tagger_build, eager, kind, tmp_path):
    """Deploying by rename then deleting the old folder: what was loaded is what serves, all of it."""
    path = tmp_path / "current"
    shutil.copytree(tagger_build.path, path)
    model = LOADERS[kind](path, open="lazy")
    shutil.rmtree(path)
    tags, pooled, variant = call(model, kind, 8, 32)
    want_tags, want_pooled, want_variant = call(eager[kind], kind, 8, 32)
    assert variant == want_variant == model.variants[-1].id
    assert np.array_equal(tags, want_tags) and np.array_equal(pooled, want_pooled)


@pytest.mark.parametrize("kind", LOADERS)
def test_a_package_not_opened_is_not_read(tagger_build, kind, tmp_path):
    path = tmp_path / "a"
    shutil.copytree(tagger_build.path, path)
    last = loader.parse_manifest((path / "manifest.json").read_bytes()).variants[-1]
    data = bytearray((path / last.file).read_bytes())
    data[len(data) // 2] ^= 1
    (path / last.file).write_bytes(bytes(data))
    model = LOADERS[kind](path, open="lazy")  # loads: that package's turn has not come
    assert call(model, kind, 1, 16)[2] == model.variants[0].id
    with pytest.raises(ArtifactError, match="does not match its sha256"):
        LOADERS[kind](path, open="eager")


@pytest.mark.parametrize("kind", LOADERS)
def test_close_waits_for_the_background_warm_up_it_interrupts_and_stops_the_opener(tagger_build, kind, monkeypatch):
    """A model closed while its opener thread runs a variant's warm-up (compiled code on the model's
    containers) frees them only once that warm-up is done, and the opener opens nothing after it."""
    import threading
    import time

    from loader.dispatch import ServedModel

    inside, steps = threading.Event(), []
    warm = ServedModel.warm_variant

    def slow_warm(self, variant_id, **options):
        if not threading.current_thread().name.startswith("open-variants:"):
            return warm(self, variant_id, **options)  # load()'s own warm-up of the first variant
        steps.append(("start", variant_id))
        inside.set()
        time.sleep(0.5)  # the close() below arrives in here
        warm(self, variant_id, **options)
        steps.append(("end", variant_id))

    monkeypatch.setattr(ServedModel, "warm_variant", slow_warm)
    model = LOADERS[kind](tagger_build.path)
    assert inside.wait(60)
    model.close()
    assert steps[-1][0] == "end"  # close() came back after the warm-up it interrupted, not during it
    assert not model.opening.is_alive()
    assert len(steps) == 2  # one warm-up, none after the close
    assert [model.is_open(v.id) for v in model.variants].count(True) == 2  # the first, and the one warmed


def test_an_unknown_open_mode_is_refused(tagger_build):
    with pytest.raises(ValueError, match="open='soon': expected one of eager, background, lazy"):
        loader.load_native(tagger_build.path, open="soon")


def test_a_closed_model_opens_nothing_more(tagger_build):
    model = loader.load_native(tagger_build.path, open="lazy")
    model.close()
    with pytest.raises(ArtifactError, match="the model was closed"):
        call(model, "native", 8, 32)


# --- one pass over a package -----------------------------------------------------------------------


def test_the_library_is_copied_out_whole_and_hashed_in_the_same_pass(tagger_build):
    v = loader.parse_manifest((tagger_build.path / "manifest.json").read_bytes()).variants[0]
    entry = loader.parse_manifest((tagger_build.path / "manifest.json").read_bytes()).files[v.file]
    package = read_package(tagger_build.path / v.file)
    out = io.BytesIO()
    assert extract_library(package, out, size=entry.size, sha256=entry.sha256) is False  # no proxy calls
    with zipfile.ZipFile(tagger_build.path / v.file) as z:
        assert out.getvalue() == z.read(package.library)
    with pytest.raises(ArtifactError, match="does not match its sha256"):
        extract_library(package, io.BytesIO(), sha256="0" * 64)


def test_a_deflated_library_is_inflated_as_it_is_copied(tagger_build, tmp_path):
    v = loader.parse_manifest((tagger_build.path / "manifest.json").read_bytes()).variants[0]
    original = tagger_build.path / v.file
    deflated = tmp_path / "deflated.pt2"
    with zipfile.ZipFile(original) as src, zipfile.ZipFile(deflated, "w", zipfile.ZIP_DEFLATED) as dst:
        for info in src.infolist():
            dst.writestr(info.filename, src.read(info))
    package = read_package(deflated)
    out = io.BytesIO()
    extract_library(package, out)
    with zipfile.ZipFile(original) as z:
        assert out.getvalue() == z.read(package.library)


def test_a_package_changed_between_the_look_at_its_directory_and_the_read_is_refused(
    tagger_build, tmp_path, monkeypatch
):
    """Where the library lies is read first; if the zip directory that said so is not the one then
    hashed and copied (rewritten meanwhile, in place), nothing is trusted."""
    v = loader.parse_manifest((tagger_build.path / "manifest.json").read_bytes()).variants[0]
    copy = tmp_path / "p.pt2"
    shutil.copy(tagger_build.path / v.file, copy)
    real = loader.native.package._locate

    def then_rewrite(f, package, total):
        found = real(f, package, total)
        data = bytearray(copy.read_bytes())
        data[-30] ^= 1  # in the central directory, after it was read
        with open(copy, "r+b") as g:
            g.write(bytes(data))
        return found

    monkeypatch.setattr(loader.native.package, "_locate", then_rewrite)
    with pytest.raises(ArtifactError, match="changed while it was being read"):
        extract_library(read_package(copy), io.BytesIO())


# --- a frozen variant's constants kept once ---------------------------------------------------------

BLOB = r"""
#include <stddef.h>
/* As AOTInductor links a package's constants: a large read-only blob in .lrodata. */
__attribute__((section(".lrodata"), aligned(4096))) const unsigned char blob[8 << 20] = {1, 2, 3};
size_t sum(void) { size_t s = 0; for (size_t i = 0; i < sizeof blob; i += 4096) s += blob[i] + 1; return s; }
"""


def resident_kb(library: Path) -> int:
    """Resident kB of ``library``'s mappings in this process (/proc/self/smaps)."""
    total, mine = 0, False
    for line in Path("/proc/self/smaps").read_text().splitlines():
        fields = line.split()
        if "-" in fields[0] and len(fields) >= 5 and ":" in fields[3]:  # a mapping's header line
            mine = len(fields) == 6 and fields[5] == str(library)
        elif mine and fields[0] == "Rss:":
            total += int(fields[1])
    return total


def test_the_library_pages_a_frozen_variant_copied_its_constants_from_are_given_back(tmp_path):
    import ctypes
    import subprocess

    from loader.pages import ConstantsRelease, constants_section

    source, library = tmp_path / "blob.c", (tmp_path / "blob.so").resolve()
    source.write_text(BLOB)
    subprocess.run(["cc", "-shared", "-fPIC", "-O1", "-o", str(library), str(source)], check=True)
    assert constants_section(library)[1] >= 8 << 20
    lib = ctypes.CDLL(str(library))
    lib.sum.restype = ctypes.c_size_t
    pages = (8 << 20) // 4096
    assert lib.sum() == pages + 1  # reads every page of the blob: now resident
    before = resident_kb(library)
    assert before >= 8 << 10
    released = ConstantsRelease(library)
    with released:
        pass
    assert resident_kb(library) <= before - (8 << 10) + 8  # the blob's pages are no longer this process's
    assert lib.sum() == pages + 1  # and read again, they are what they were
