"""Build: the compiled artifact agrees with eager, and failures leave nothing behind."""

from __future__ import annotations

import json
import re
import shutil
from pathlib import Path

import pytest
import torch
from click.testing import CliRunner

import loader
from precompile.cli import main
from precompile.errors import CheckError, ExportError, PrecompileError
from precompile.pipeline import build
from precompile.profile import load_profile
from precompile.samples import make_inputs
from precompile.stages.resolve import resolve_model

from .conftest import CLASSIFIER_PROFILE, write_profile


def test_manifest_describes_the_artifact(classifier_artifact):
    manifest = json.loads((classifier_artifact / "manifest.json").read_text())
    assert manifest["format"] == "precompile-artifact" and manifest["format_version"] == 1
    assert manifest["name"] == "tiny-classifier"
    assert manifest["torch_version"] == torch.__version__
    assert manifest["target"]["device"] == "cpu"
    assert manifest["target"]["cpu_capability"] == torch.backends.cpu.get_cpu_capability()
    assert [i["name"] for i in manifest["inputs"]] == ["ids", "mask"]
    assert manifest["dims"] == {"batch": {"min": 1, "max": 8}, "seq": {"min": 2, "max": 48}}
    assert set(manifest["files"]) == {"weights.safetensors", "variants/dynamic.pt2", "references.safetensors"}
    assert manifest["check"]["shapes"] >= 10


def test_weights_are_stored_once_outside_the_compiled_code(classifier_artifact, classifier_profile):
    eager = resolve_model(load_profile(classifier_profile))
    embed = eager.embed.weight.detach().numpy().tobytes()
    package = (classifier_artifact / "variants" / "dynamic.pt2").read_bytes()
    weights = (classifier_artifact / "weights.safetensors").read_bytes()
    assert embed[:256] not in package
    assert embed in weights
    assert "embed.weight" in json.loads((classifier_artifact / "manifest.json").read_text())["constants"]


def test_compiled_matches_eager_on_random_shapes_and_range_ends(classifier_artifact, classifier_profile):
    loaded = load_profile(classifier_profile)
    eager = resolve_model(loaded)
    model = loader.load(classifier_artifact)
    shapes = [(1, 2), (8, 48), (1, 48), (8, 2)] + [
        (int(b), int(s))
        for b, s in zip(
            torch.randint(1, 9, (8,), generator=torch.Generator().manual_seed(3)),
            torch.randint(2, 49, (8,), generator=torch.Generator().manual_seed(4)),
        )
    ]
    assert len(shapes) >= 10
    for batch, seq in shapes:
        ids, mask = make_inputs(loaded.profile, {"batch": batch, "seq": seq}, seed=batch * 100 + seq)
        with torch.no_grad():
            want = eager(ids, mask)
        got = model(ids, mask)
        assert got.shape == (batch, 3)
        torch.testing.assert_close(got, want, atol=1e-4, rtol=1e-4)
        torch.testing.assert_close(model(ids=ids, mask=mask), got)


def test_dict_and_tuple_outputs_keep_their_structure(structured_artifact):
    torch.manual_seed(1)
    from tests.models.tiny import Structured

    eager = Structured().eval()
    model = loader.load(structured_artifact)
    x = torch.randn(5, 8)
    got = model(x)
    want = eager(x)
    assert set(got) == {"hidden", "pair"} and isinstance(got["pair"], tuple) and len(got["pair"]) == 2
    torch.testing.assert_close(got["hidden"], want["hidden"].detach())
    torch.testing.assert_close(got["pair"][0], want["pair"][0].detach())
    torch.testing.assert_close(got["pair"][1], want["pair"][1].detach())


def test_check_failure_leaves_previous_artifact_untouched(tmp_path, structured_artifact):
    target = tmp_path / "artifact"
    shutil.copytree(structured_artifact, target)
    before = {p.name: p.read_bytes() for p in target.rglob("*") if p.is_file()}
    profile = write_profile(
        tmp_path,
        """
        name: noisy
        model: {factory: "tiny:noisy"}
        inputs: {x: {shape: [batch, 8], dtype: float32}}
        dims: {batch: {min: 1, max: 4}}
    """,
    )
    with pytest.raises(CheckError, match="compiled differs from eager beyond tolerance"):
        build(profile, target)
    assert {p.name: p.read_bytes() for p in target.rglob("*") if p.is_file()} == before
    assert [p.name for p in tmp_path.iterdir() if "staging" in p.name] == []


def test_export_failure_names_dim_and_leaves_nothing(tmp_path):
    profile = write_profile(
        tmp_path,
        """
        name: specializes
        model: {factory: "tiny:specializes"}
        inputs: {x: {shape: [batch, seq], dtype: float32}}
        dims: {batch: {min: 1, max: 4}, seq: {min: 2, max: 32, hint: 16}}
    """,
    )
    with pytest.raises(ExportError) as info:
        build(profile, tmp_path / "out")
    text = str(info.value)
    assert "dims involved: seq [2, 32]" in text
    assert "what to change:" in text and "dims.seq" in text
    assert not (tmp_path / "out").exists()
    assert [p.name for p in tmp_path.iterdir() if "staging" in p.name] == []


@pytest.mark.integration
def test_a_guard_that_holds_for_part_of_a_range_gives_the_split_points_that_export(tmp_path):
    """torch.export's "not all values of height ... satisfy the generated guard": the error names the
    sizes the model's code treats apart and the plan.ranges split that gives them a variant of their
    own; with that split, every planned variant exports."""
    from precompile.stages.plan import make_plan
    from precompile.tracing import export_model

    text = """
        name: strided
        model: {factory: "tiny:strided_image"}
        inputs: {x: {shape: [batch, 3, height, 13], dtype: float32}}
        dims: {batch: {min: 1, max: 2}, height: {min: 3, max: 24}}
    """
    result = CliRunner().invoke(
        main, ["build", str(write_profile(tmp_path, text)), "-o", str(tmp_path / "out")], catch_exceptions=False
    )
    assert result.exit_code == 1 and "Traceback" not in result.output
    assert "the model's code takes another path for dims.height at 3-4 than at 5-24" in result.output
    assert "`plan: {ranges: {height: [4]}}`" in result.output and "or narrow dims.height to [5, 24]" in result.output
    assert not (tmp_path / "out").exists()

    loaded = load_profile(write_profile(tmp_path, text.rstrip() + "\n        plan: {ranges: {height: [4]}}\n"))
    model = resolve_model(loaded)
    variants = make_plan(loaded).variants
    assert sorted(v.ranges["height"] for v in variants) == [(3, 4), (5, 24)]
    for v in variants:  # each part exports: the advice was right
        export_model(model, loaded.profile, v.ranges, v.hint)


def test_a_violated_guard_is_read_as_integer_arithmetic_only():
    from precompile.tracing import explain_export_failure

    def said(guard: str, lo: int = 1, hi: int = 20, source: str = "L['x'].size()[1]") -> str:
        text = f"  - Not all values of seq = {source} in the specified range {lo} <= seq <= {hi} satisfy the generated guard {guard}."
        return explain_export_failure(RuntimeError(text), {"seq": (lo, hi)}, {"seq": 8})

    # holds in two runs: the split points are every place it changes, and no single narrower range is offered
    both = said("Ne(Mod(L['x'].size()[1], 8), 0) and L['x'].size()[1] != 16")
    assert "at 8, 16 than at 1-7, 9-15, 17-20" in both and "{ranges: {seq: [7, 8, 15, 16]}}" in both
    assert "narrow" not in both
    # a guard over two sizes, a float or an attribute is not evaluated: torch's words alone
    for guard in ("L['x'].size()[1] != L['x'].size()[0]", "L['x'].size()[1] * 0.5 > 2", "L['x'].size()[1].real > 2"):
        assert "split the range" not in said(guard)
        assert "change the model so torch.export can trace it" in said(guard)


@pytest.mark.integration
def test_an_attention_mask_sampled_as_ones_builds_and_serves_padded_calls(tmp_path):
    """``range`` is what every call may hold, ``sample.range`` what the build's samples hold: a mask
    sampled as ones still serves a padded call (zeros), and refuses a value past its valid range."""
    masked = "mask: {shape: [batch, seq], dtype: int64, range: [0, 1], sample: {range: [1, 1]}}"
    profile = write_profile(tmp_path, CLASSIFIER_PROFILE.replace("mask: {shape: [batch, seq], dtype: bool}", masked))
    model = loader.load(build(profile, tmp_path / "out").path)
    ids, mask = torch.randint(0, 50, (2, 9)), torch.ones(2, 9, dtype=torch.int64)
    mask[1, 5:] = 0  # the second call is padded
    torch.testing.assert_close(model(ids, mask), resolve_model(load_profile(profile))(ids, mask))
    with pytest.raises(loader.GuardError, match="outside the valid range"):
        model(ids, mask * 2)


def test_data_dependent_control_flow_is_explained(tmp_path):
    profile = write_profile(
        tmp_path,
        """
        name: branchy
        model: {factory: "tiny:data_dependent"}
        inputs: {x: {shape: [batch, 8], dtype: float32}}
        dims: {batch: {min: 1, max: 4}}
    """,
    )
    result = CliRunner().invoke(main, ["build", str(profile), "-o", str(tmp_path / "out")], catch_exceptions=False)
    assert result.exit_code == 1
    assert "torch.export failed" in result.output
    assert "data-dependent control flow" in result.output
    assert "Traceback" not in result.output
    # The advice comes first and alone: torch's partial graph goes to the log file the message names.
    assert "def forward" not in result.output
    log = re.search(r"all of it in (\S+?)\):", result.output).group(1)
    assert "def forward" in Path(log).read_text()


def test_refuses_to_replace_a_folder_that_is_not_an_artifact(tmp_path):
    target = tmp_path / "precious"
    target.mkdir()
    (target / "notes.txt").write_text("keep me")
    profile = write_profile(
        tmp_path,
        """
        name: x
        model: {factory: "tiny:structured"}
        inputs: {x: {shape: [batch, 8], dtype: float32}}
        dims: {batch: {min: 1, max: 4}}
    """,
    )
    result = CliRunner().invoke(main, ["build", str(profile), "-o", str(target)], catch_exceptions=False)
    assert result.exit_code == 1 and "is not a precompile artifact; refusing to replace it" in result.output
    assert (target / "notes.txt").read_text() == "keep me"


@pytest.mark.integration
def test_measure_drops_static_variants_that_do_not_pay(tmp_path):
    profile = write_profile(
        tmp_path,
        """
        name: measured
        model: {factory: "tiny:structured"}
        inputs: {x: {shape: [batch, 8], dtype: float32}}
        dims: {batch: {min: 1, max: 16}}
        distribution: {shapes: [{batch: 4, count: 10}]}
        plan: {measure: true, min_speedup: 1000.0}
        check: {random_shapes: 1}
    """,
    )
    result = build(profile, tmp_path / "out", jobs=1)
    (entry,) = result.measured
    assert entry.variant == "static-0" and entry.against == "dynamic" and not entry.kept
    assert entry.static_ms > 0 and entry.dynamic_ms > 0
    manifest = json.loads((tmp_path / "out" / "manifest.json").read_text())
    assert [v["id"] for v in manifest["variants"]] == ["dynamic"]
    assert (
        "variants/static-0.pt2" not in manifest["files"]
        and not (tmp_path / "out" / "variants" / "static-0.pt2").exists()
    )
    assert manifest["check"]["measure"][0]["speedup"] == entry.speedup
    assert loader.load(tmp_path / "out")(torch.ones(4, 8))["hidden"].shape == (4, 4)


def worker_profile(folder: Path, factory: str) -> Path:
    """Two variants (static batch 4, dynamic 1-8) of a tiny:FACTORY model that behaves apart in a compile worker."""
    text = f"""
name: {factory.replace("_", "-")}
model: {{factory: "tiny:{factory}"}}
inputs:
  x: {{shape: [batch, 8], dtype: float32}}
dims:
  batch: {{min: 1, max: 8}}
distribution: {{shapes: [{{batch: 4, count: 9}}]}}
check: {{random_shapes: 1}}
"""
    return write_profile(folder, text)


@pytest.mark.integration
def test_a_compile_worker_killed_by_a_signal_has_its_variant_compiled_again_in_the_build_process(tmp_path):
    """The model SIGKILLs any compile worker that runs it (as the out-of-memory killer would) and runs
    normally in the build's own process: each variant is compiled again there, with the fault handler on."""
    from precompile.progress import Progress

    notes = []

    class Record(Progress):
        def note(self, text):
            notes.append(text)

    result = build(worker_profile(tmp_path, "dies_in_worker"), tmp_path / "out", jobs=2, progress=Record())
    again = [n for n in notes if "compiling it again in the build process" in n]
    assert len(again) == len(result.manifest.variants) == 2
    assert all("its compile worker process died without an error (killed by a signal" in n for n in again)
    assert loader.load(tmp_path / "out")(torch.ones(4, 8)).shape == (4, 4)


@pytest.mark.integration
def test_a_failed_build_stops_the_compile_workers_still_running(tmp_path):
    """One variant fails in its compile worker while the other's worker is still compiling (it sleeps
    a minute there): the build fails with the first one's error and leaves no worker running behind it."""
    import multiprocessing

    earlier = set(multiprocessing.active_children())
    with pytest.raises(PrecompileError, match="this variant fails in its compile worker"):
        build(worker_profile(tmp_path, "fails_or_hangs_in_worker"), tmp_path / "out", jobs=2)
    assert [p for p in multiprocessing.active_children() if p not in earlier] == []
    assert not (tmp_path / "out").exists()  # nothing half-written
