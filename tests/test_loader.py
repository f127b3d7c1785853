"""The runtime: guards refuse every bad call with a GuardError, artifacts are validated, nothing compiles."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import loader
from loader import ArtifactError, GuardError, IncompatibleArtifactError

ROOT = Path(__file__).resolve().parent.parent


@pytest.fixture(scope="module")
def model(classifier_artifact):
    return loader.load(classifier_artifact)


def inputs(batch=2, seq=10):
    return torch.randint(0, 50, (batch, seq)), torch.ones(batch, seq, dtype=torch.bool)


def test_guard_error_is_a_value_error():
    assert issubclass(GuardError, ValueError)


@pytest.mark.parametrize(
    "call, message",
    [
        (lambda m, i, k: m(i), "missing input(s): mask (inputs: ids, mask)"),
        (lambda m, i, k: m(i, k, i), "expected at most 2 inputs (ids, mask), got 3 positional"),
        (lambda m, i, k: m(i, masks=k), "unknown input 'masks' (inputs: ids, mask)"),
        (lambda m, i, k: m(i, k, ids=i), "input 'ids' given twice, by position and by name"),
        (lambda m, i, k: m(i.tolist(), k), "input 'ids': expected a torch.Tensor, got list"),
        (lambda m, i, k: m(i.int(), k), "input 'ids': dtype is int32, the artifact needs int64"),
        (lambda m, i, k: m(i.to("meta"), k), "input 'ids': a meta tensor has no data to compute on"),
        (lambda m, i, k: m(i[0], k), "input 'ids': has 1 dimensions (10,), the artifact needs 2 (shape [batch, seq])"),
        (
            lambda m, i, k: m(i[:, :1], k[:, :1]),
            "input 'ids': dim 'seq' (axis 1) is 1, outside the built range [2, 48]",
        ),
        (
            lambda m, i, k: m(torch.zeros(2, 49, dtype=torch.int64), k),
            "input 'ids': dim 'seq' (axis 1) is 49, outside the built range [2, 48]",
        ),
        (
            lambda m, i, k: m(torch.zeros(9, 10, dtype=torch.int64), k),
            "input 'ids': dim 'batch' (axis 0) is 9, outside the built range [1, 8]",
        ),
        (
            lambda m, i, k: m(i, k[:, :9]),
            "input 'mask': dim 'seq' (axis 1) is 9, but another input has seq=10; inputs sharing a dim must agree",
        ),
        (lambda m, i, k: m(torch.zeros(10, 2, dtype=torch.int64).t(), k), "input 'ids': tensor is not contiguous"),
    ],
    ids=[
        "missing",
        "too-many",
        "unknown-kw",
        "twice",
        "not-tensor",
        "dtype",
        "meta",
        "rank",
        "below-min",
        "above-max",
        "batch-above-max",
        "shared-dim",
        "non-contiguous",
    ],
)
def test_every_guard_raises_guard_error(model, call, message):
    ids, mask = inputs()
    with pytest.raises(GuardError) as info:
        call(model, ids, mask)
    assert message in str(info.value)


def test_static_size_guard(structured_artifact):
    model = loader.load(structured_artifact)
    with pytest.raises(
        GuardError, match=r"input 'x': axis 1 is 7, the artifact needs exactly 8 \(shape \[batch, 8\]\)"
    ):
        model(torch.zeros(2, 7))


def test_model_lists_variants_and_selects_one(model):
    assert [v.id for v in model.variants] == ["dynamic"]
    assert model.select(*inputs()).id == "dynamic"
    assert model.input_names == ("ids", "mask")


def test_missing_artifact():
    with pytest.raises(ArtifactError, match="no such artifact"):
        loader.load("/nonexistent/artifact")


def test_folder_without_manifest(tmp_path):
    with pytest.raises(ArtifactError, match="no manifest.json; this folder is not a precompile artifact"):
        loader.load(tmp_path)


def copy_with_manifest(src: Path, dst: Path, edit) -> Path:
    shutil.copytree(src, dst)
    manifest = json.loads((dst / "manifest.json").read_text())
    edit(manifest)
    (dst / "manifest.json").write_text(json.dumps(manifest))
    return dst


def test_unknown_format_is_refused(tmp_path, classifier_artifact):
    path = copy_with_manifest(classifier_artifact, tmp_path / "a", lambda m: m.update(format="something-else"))
    with pytest.raises(
        ArtifactError, match="format: not 'precompile-artifact': this is not a precompile artifact's manifest"
    ):
        loader.load(path)


def test_newer_format_version_is_refused(tmp_path, classifier_artifact):
    path = copy_with_manifest(classifier_artifact, tmp_path / "a", lambda m: m.update(format_version=2))
    with pytest.raises(ArtifactError, match="version 2 is not supported by this loader"):
        loader.load(path)


def test_manifest_with_wrong_types_names_the_key(tmp_path, classifier_artifact):
    path = copy_with_manifest(classifier_artifact, tmp_path / "a", lambda m: m["dims"]["seq"].update(max="48"))
    with pytest.raises(ArtifactError, match=r"dims\.seq\[1\]: expected an integer, got a string"):
        loader.load(path)


def test_artifact_for_another_torch_is_incompatible(tmp_path, classifier_artifact):
    path = copy_with_manifest(classifier_artifact, tmp_path / "a", lambda m: m.update(torch_version="1.13.1"))
    with pytest.raises(IncompatibleArtifactError, match="torch: built with 1.13.1"):
        loader.load(path)


def test_changed_weights_are_detected(tmp_path, classifier_artifact):
    path = tmp_path / "a"
    shutil.copytree(classifier_artifact, path)
    data = bytearray((path / "weights.safetensors").read_bytes())
    data[-5] ^= 0x40
    (path / "weights.safetensors").write_bytes(bytes(data))
    with pytest.raises(ArtifactError, match="weights.safetensors does not match its sha256"):
        loader.load(path)


def test_truncated_file_is_detected(tmp_path, classifier_artifact):
    path = tmp_path / "a"
    shutil.copytree(classifier_artifact, path)
    package = path / "variants" / "dynamic.pt2"
    package.write_bytes(package.read_bytes()[:1000])
    with pytest.raises(ArtifactError, match=r"variants/dynamic.pt2 is 1000 bytes, the manifest says \d+"):
        loader.load(path)


ISOLATION = r"""
import sys, time, json
import torch
import loader
model = loader.load(sys.argv[1])
ids = torch.randint(0, 50, (4, 24)); mask = torch.ones(4, 24, dtype=torch.bool)
start = time.perf_counter(); model(ids, mask); first = time.perf_counter() - start
steady = []
for _ in range(20):
    start = time.perf_counter(); model(ids, mask); steady.append(time.perf_counter() - start)
banned = ("precompile", "click", "yaml", "pydantic", "torch._inductor", "safetensors")
print(json.dumps({
    "imported": sorted(m for m in sys.modules if m.split(".")[0] in banned or m.startswith("torch._inductor")),
    "first": first, "steady": sorted(steady)[10],
}))
"""


def test_loader_imports_nothing_heavy_and_never_compiles(classifier_artifact):
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    out = subprocess.run(
        [sys.executable, "-c", ISOLATION, str(classifier_artifact)],
        capture_output=True,
        text=True,
        cwd=ROOT,
        env=env,
        check=True,
    )
    report = json.loads(out.stdout.strip().splitlines()[-1])
    assert report["imported"] == []
    # A compile would cost seconds; the first call is allowed a few steady-state calls' worth of warm-up.
    assert report["first"] < 10 * report["steady"] + 0.05, report


def test_load_warms_every_variant_unless_told_not_to(tagger_build, monkeypatch):
    """warmup() runs (for real) inside load() by default, once, in the calling thread (with every
    variant opened first, open="eager"; the other modes warm the rest as they open them)."""
    import threading

    real = loader.CompiledModel.warmup
    runs = []

    def watched(self, **options):
        runs.append(threading.get_ident())
        variants_run = []
        original = self.run_variant
        self.run_variant = lambda vid, *a: (variants_run.append(vid), original(vid, *a))[1]
        try:
            real(self, **options)
        finally:
            del self.run_variant
        runs.append(tuple(variants_run))

    monkeypatch.setattr(loader.CompiledModel, "warmup", watched)
    model = loader.load(tagger_build.path, open="eager")
    # each variant once per shape its warm-up ran: the hint, and a dynamic one's largest (loader.warmup)
    assert runs == [threading.get_ident(), tuple(v.id for v in model.variants for _ in model.warmed[v.id])]
    assert model.stats()["calls"] == 0  # warm-up calls are not traffic
    loader.load(tagger_build.path, warmup=False)
    assert len(runs) == 2
