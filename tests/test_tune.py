"""Options chosen by measurement: every variant compiled under each candidate, timed on its traffic,
the fastest that matches eager kept; frozen (oneDNN-prepacked) variants carry their own weights."""

from __future__ import annotations

import io
import json
from dataclasses import replace

import pytest
import torch
from click.testing import CliRunner
from rich.console import Console

import loader
from precompile.cli import main
from precompile.errors import CheckError, ProfileError
from precompile.pipeline import build
from precompile.profile import load_profile
from precompile.progress import Progress, RichProgress
from precompile.stages.resolve import resolve_model
from precompile.stages.tune import Trial, choose, first_call_cost, fresh_shapes
from precompile.traffic import serving_shapes
from precompile.units import VariantPlan

from .conftest import CLASSIFIER_PROFILE, builds, write_profile

TUNED = CLASSIFIER_PROFILE.replace("name: tiny-classifier", "name: tiny-tuned").replace(
    "check: {random_shapes: 6}",
    """distribution:
  shapes: [{batch: 1, seq: 16, count: 80}, {batch: 4, seq: 40, count: 20}]
plan: {max_specialized: 0}
check: {random_shapes: 1}
compile:
  tune: {candidates: [{}, {freezing: true}]}""",
)


class Recorded(Progress):
    """What the build reports, as (kind, name, detail) rows."""

    def __init__(self) -> None:
        self.rows: list[tuple[str, str, str]] = []

    def done(self, name: str, detail: str, seconds: float) -> None:
        self.rows.append(("done", name, detail))

    def note(self, text: str) -> None:
        self.rows.append(("note", "", text))


@pytest.fixture(scope="module")
@builds
def tuned_build(tmp_path_factory):
    folder = tmp_path_factory.mktemp("tuned")
    progress = Recorded()
    return build(write_profile(folder, TUNED), folder / "artifact", jobs=2, progress=progress), progress


@pytest.fixture(scope="module")
def tuned(tuned_build):
    return tuned_build[0]


def test_each_candidate_has_its_own_label(tuned_build):
    _, progress = tuned_build
    units = [detail for kind, name, detail in progress.rows if kind == "done" and name == "variant"]
    assert sorted(units) == [
        "dynamic batch∈[1,8] seq∈[2,48] (candidate 0: defaults)",
        "dynamic batch∈[1,8] seq∈[2,48] (candidate 1: freezing=True)",
    ]
    (timed,) = [text for kind, _, text in progress.rows if kind == "note" and text.startswith("dynamic: ")]
    assert "0:defaults: " in timed and "1:freezing=True: " in timed


def test_the_build_output_shows_details_as_written():
    """rich reads "[candidate 1]" as markup: the CLI's lines escape what they show."""
    progress = RichProgress()
    progress.console = Console(file=io.StringIO(), highlight=False, width=200)
    progress.done("variant", "dynamic batch∈[1,8] [candidate 1]", 1.0)
    assert "dynamic batch∈[1,8] [candidate 1]" in progress.console.file.getvalue()


def test_every_candidate_is_timed_and_the_fastest_that_matches_is_kept(tuned):
    trials = tuned.manifest.check.tuning
    assert [(t["variant"], t["candidate"]) for t in trials] == [("dynamic", 0), ("dynamic", 1)]
    assert [t["options"] for t in trials] == [{}, {"freezing": True}]
    assert all(t["ms"] > 0 and t["max_abs_error"] < 1e-4 and t["compile_s"] > 0 for t in trials)
    assert all(t["first_ratio"] > 0 for t in trials)  # a dynamic variant's first call at a new shape, timed
    (kept,) = [t for t in trials if t["kept"]]
    # The fastest, unless its first call at a new shape costs over 1.5× the fastest steady call
    # and the other's does not (the rule itself: test_choose_keeps_the_fastest_candidate_...).
    recorded = [
        Trial(t["variant"], t["candidate"], t["options"], ms=t["ms"], first_ratio=t["first_ratio"]) for t in trials
    ]
    assert kept["candidate"] == choose(recorded, first_call=1.5).candidate
    assert sorted(p.name for p in (tuned.path / "variants").iterdir()) == ["dynamic.pt2"]  # the loser is gone


def test_the_tuned_artifact_serves_the_winner_and_matches_eager(tuned):
    model = loader.load(tuned.path)
    eager = resolve_model(load_profile(tuned.path.parent / "profile.yaml"))
    ids, mask = torch.randint(0, 50, (3, 20)), torch.ones(3, 20, dtype=torch.bool)
    (variant,) = model.variants
    kept = [t for t in tuned.manifest.check.tuning if t["kept"]][0]
    assert variant.embedded_constants == kept["options"].get("freezing", False)
    with torch.no_grad():
        torch.testing.assert_close(model(ids, mask), eager(ids, mask), atol=1e-5, rtol=1e-5)


def test_inspect_shows_the_candidates(tuned):
    out = CliRunner().invoke(main, ["inspect", str(tuned.path)], catch_exceptions=False).output
    assert "tuning" in out and "freezing=True" in out


@pytest.mark.integration
def test_a_frozen_variant_carries_its_own_prepacked_weights(tmp_path):
    text = TUNED.replace("  tune: {candidates: [{}, {freezing: true}]}", "  inductor: {freezing: true}")
    result = build(write_profile(tmp_path, text), tmp_path / "artifact", jobs=1)
    (variant,) = result.manifest.variants
    assert variant.embedded_constants and variant.constants == ()
    manifest = json.loads((result.path / "manifest.json").read_text())
    assert manifest["variants"][0]["embedded_constants"] is True
    eager = resolve_model(load_profile(tmp_path / "profile.yaml"))
    ids, mask = torch.randint(0, 50, (2, 9)), torch.ones(2, 9, dtype=torch.bool)
    with torch.no_grad():
        torch.testing.assert_close(loader.load(result.path)(ids, mask), eager(ids, mask), atol=1e-5, rtol=1e-5)


def test_serving_shapes_are_the_hottest_inside_the_variant_weighted_by_traffic():
    vp = VariantPlan("dynamic-0", "dynamic", {"batch": (1, 8), "seq": (2, 16)}, {"batch": 2, "seq": 8})
    dist = {(1, 16): 60, (2, 8): 30, (4, 40): 500, (8, 16): 10, (1, 2): 0}
    shapes = serving_shapes(vp, dist, ("batch", "seq"), top=2)
    assert shapes == [({"batch": 1, "seq": 16}, 60 / 90), ({"batch": 2, "seq": 8}, 30 / 90)]
    assert serving_shapes(vp, {}, ("batch", "seq")) == [({"batch": 2, "seq": 8}, 1.0)]


def test_choose_skips_failed_candidates_and_says_why_when_none_is_left():
    trials = [
        Trial("v", 0, {}, ms=2.0),
        Trial("v", 1, {"freezing": True}, ms=1.0),
        Trial("v", 2, {"x": 1}, error="boom"),
    ]
    best = choose(trials)
    assert best.candidate == 1 and best.kept and best == replace(trials[1], kept=True) and not trials[0].kept
    with pytest.raises(CheckError, match="no tuning candidate compiled and matched eager.*boom"):
        choose([Trial("v", 0, {}, error="boom")])


def test_choose_keeps_the_fastest_candidate_whose_first_call_stays_within_the_bound():
    # oneDNN's: the fastest steady call, its first call at a new shape 2.5× that; a routed one: 1.2×
    # as slow, its first call 1.1× its own steady call, so 1.32× the fastest steady call.
    onednn = Trial("v", 0, {"freezing": True}, ms=10.0, first_ratio=2.5)
    routed = Trial("v", 1, {"conv_routes": ["conv1x1_as_gemm"]}, ms=12.0, first_ratio=1.1)
    loops = Trial("v", 2, {"conv_routes": ["conv1x1_as_gemm", "depthwise_as_loops"]}, ms=18.0, first_ratio=1.0)
    assert first_call_cost(routed, 10.0) == pytest.approx(1.32)
    assert choose([onednn, routed, loops], first_call=1.5).candidate == 1
    assert choose([onednn, routed, loops], first_call=None).candidate == 0  # steady speed alone
    assert choose([onednn, routed, loops], first_call=3.0).candidate == 0  # every one within: the fastest
    # None within the bound: the fastest all the same (the build notes each candidate's first call).
    assert choose([onednn, replace(routed, first_ratio=1.5)], first_call=1.5).candidate == 0
    # A candidate whose first call was not measured (a static variant's) counts as within it.
    assert choose([replace(onednn, first_ratio=None), routed], first_call=1.5).candidate == 0


def test_fresh_shapes_lie_inside_the_ranges_and_never_repeat_one_seen():
    vp = VariantPlan("dynamic", "dynamic", {"batch": (1, 2), "h": (5, 6)}, {"batch": 1, "h": 5})
    seen = {(1, 5)}
    shapes = fresh_shapes(vp, seen, 2, seed=0) + fresh_shapes(vp, seen, 2, seed=1)
    keys = [(s["batch"], s["h"]) for s in shapes]
    assert len(keys) == len(set(keys)) == 3 and (1, 5) not in keys  # 4 shapes in all, one seen before
    assert seen == {(1, 5), (1, 6), (2, 5), (2, 6)}


@pytest.mark.parametrize(
    "tune, message",
    [
        ("{preset: fastest}", "compile.tune.preset: unknown preset 'fastest' (presets: cpu, cpu-max, convnet)"),
        ("{max_seconds: 10}", "compile.tune: give a preset or at least one candidate"),
        ("{candidates: [{freezin: true}]}", "compile.tune.candidates[0].freezin: unknown Inductor option"),
    ],
)
def test_bad_tune_sections_are_profile_errors(tmp_path, tune, message):
    text = TUNED.replace("{candidates: [{}, {freezing: true}]}", tune)
    with pytest.raises(
        ProfileError, match=message.replace("(", r"\(").replace(")", r"\)").replace("[", r"\[").replace("]", r"\]")
    ):
        load_profile(write_profile(tmp_path, text))


def test_a_preset_expands_over_compile_inductor(tmp_path):
    text = TUNED.replace(
        "  tune: {candidates: [{}, {freezing: true}]}", "  inductor: {freezing: true}\n  tune: {preset: cpu}"
    )
    spec = load_profile(write_profile(tmp_path, text)).profile.compile
    assert spec.candidates() == [{"freezing": True}]  # {} and {freezing: true} merge to the same set


def test_plan_shows_the_candidates(tmp_path):
    path = write_profile(tmp_path, TUNED)
    out = CliRunner().invoke(main, ["plan", str(path)], catch_exceptions=False).output
    assert "tuning: each variant compiled 2 ways" in out and "candidate 1: freezing=True" in out
    data = json.loads(CliRunner().invoke(main, ["plan", str(path), "--json"], catch_exceptions=False).output)
    assert data["compile_candidates"] == [{}, {"freezing": True}]


def test_where_the_fastest_s_first_call_is_over_the_bound_another_serves_its_first_calls():
    from precompile.stages.tune import Trial, first_calls_twin

    onednn = Trial("dynamic", 0, {}, ms=1.0, first_ratio=2.5)  # fastest, its first call 2.5x
    routed = Trial("dynamic", 1, {"conv_routes": ["conv1x1_as_gemm"]}, ms=1.2, first_ratio=1.1)
    primary, twin = first_calls_twin([onednn, routed], 1.5)
    assert (primary.candidate, primary.kept, primary.first_calls) == (0, True, False)
    assert (twin.candidate, twin.kept, twin.first_calls) == (1, False, True)
    # Over the bound too (1.6x the fastest's steady call), but cheaper than oneDNN's own first call.
    slower = replace(routed, ms=1.6, first_ratio=1.0)
    assert first_calls_twin([onednn, slower], 1.5)[1].candidate == 1
    # No cheaper first call elsewhere, the fastest within the bound, or no bound: the fastest alone.
    assert first_calls_twin([onednn, replace(routed, ms=3.0, first_ratio=1.0)], 1.5) is None
    assert first_calls_twin([replace(onednn, first_ratio=1.2), routed], 1.5) is None
    assert first_calls_twin([onednn, routed], None) is None
    # No first call measured (a static variant): no twin.
    assert first_calls_twin([replace(onednn, first_ratio=None), routed], 1.5) is None
    # Cheaper, but by less than the share a second variant must save (FIRST_CALLS_GAIN of 2.5x: 2.0x).
    assert first_calls_twin([onednn, replace(routed, first_ratio=1.75)], 1.5) is None  # 2.1x
    assert first_calls_twin([onednn, replace(routed, first_ratio=1.65)], 1.5)[1].candidate == 1  # 1.98x


def test_a_first_call_figure_is_the_median_over_its_shapes(tmp_path, monkeypatch):
    """``first_call`` on a fake runner and clock: the first call at each fresh shape costs 3x, 1.2x,
    1.4x and 2x the steady one there; the figure is their median (1.7x), not the worst shape's."""
    from types import SimpleNamespace

    from precompile.stages import tune

    profile = load_profile(write_profile(tmp_path, CLASSIFIER_PROFILE)).profile
    vp = VariantPlan("dynamic", "dynamic", {"batch": (1, 8), "seq": (2, 48)}, {"batch": 1, "seq": 8})
    clock, met = [0.0], set()
    first_cost = {3: 3.0, 5: 1.2, 7: 1.4, 9: 2.0}  # by seq: ms of the first call; 1 ms each after

    def run(ids, *rest):
        shape = tuple(ids.shape)
        clock[0] += 1e-3 * (first_cost.get(shape[1], 1.0) if shape not in met else 1.0)
        met.add(shape)

    monkeypatch.setattr(tune, "time", SimpleNamespace(perf_counter=lambda: clock[0]))
    monkeypatch.setattr(tune, "time_calls", lambda fn, seconds: [(fn(), 1.0)[1]])
    shapes = [{"batch": 2, "seq": seq} for seq in first_cost]
    assert tune.first_call(run, profile, vp, shapes) == pytest.approx(1.7)
    assert tune.first_call(run, profile, vp, []) is None


@pytest.mark.parametrize("first_calls", [True, False])
def test_compile_tune_first_calls_says_whether_a_second_variant_is_kept(tmp_path, first_calls):
    """tune_variants on three fake packages with fixed figures (oneDNN's fastest, its first call 3x):
    with first_calls, the fastest as the variant and the cheapest first call beside it as <id>-first;
    without, one package, the fastest within the bound (``choose``), the others deleted."""
    from types import SimpleNamespace

    from precompile.stages.tune import tune_variants
    from precompile.units import CompiledPackage, CompiledUnit, CompiledUnits, VariantPlan

    vp = VariantPlan("dynamic", "dynamic", {"batch": (1, 32)}, {"batch": 2})  # fresh shapes for each candidate
    (tmp_path / "variants").mkdir()
    units = []
    for k in range(3):
        path = tmp_path / "variants" / f"dynamic-{k}.pt2"
        path.write_bytes(b"package %d" % k)
        units.append(CompiledUnit(vp, CompiledPackage(path, {}, {}), 1.0, candidate=k))
    figures = {0: (1.0, 3.0), 1: (1.2, 1.1), 2: (1.4, 1.0)}  # candidate: (steady ms, first ÷ steady)
    result = tune_variants(
        SimpleNamespace(dims={"batch": None}, check=SimpleNamespace(seed=0)),
        None,
        [vp],
        CompiledUnits(tuple(units)),
        [{}, {"conv_routes": ["conv1x1_as_gemm"]}, {"conv_routes": ["conv1x1_as_gemm", "depthwise_as_loops"]}],
        {},
        open_runner=lambda package, device: package.path.read_bytes(),
        measure_unit=lambda run, unit, shapes: (figures[unit.candidate][0], 0.0),
        measure_first=lambda run, unit, fresh: figures[unit.candidate][1],
        first_call_bound=1.5,
        first_calls=first_calls,
    )
    kept = [(u.variant.id, u.variant.first_calls_of, u.package.path.read_bytes()) for u in result.kept]
    if first_calls:
        assert kept == [("dynamic", None, b"package 0"), ("dynamic-first", "dynamic", b"package 1")]
    else:
        assert kept == [("dynamic", None, b"package 1")]
    assert sorted(p.name for p in (tmp_path / "variants").iterdir()) == sorted(
        ["dynamic.pt2", "dynamic-first.pt2"] if first_calls else ["dynamic.pt2"]
    )


def test_each_candidate_gets_fresh_shapes_of_its_own_where_the_ranges_hold_few():
    """A batch of 1-8 with the hint and a served shape seen holds 6 fresh sizes: 3 candidates get 2
    each (4 would leave the third none, and a candidate without a figure counts as within the bound)."""
    from precompile.stages.tune import FIRST_CALL_SHAPES, fresh_per_candidate

    small = VariantPlan("dynamic", "dynamic", {"batch": (1, 8)}, {"batch": 3})
    assert fresh_per_candidate(small, 2, 3) == 2 and fresh_per_candidate(small, 2, 1) == FIRST_CALL_SHAPES
    pair = VariantPlan("d", "dynamic", {"b": (1, 2)}, {"b": 1})
    assert fresh_per_candidate(pair, 1, 3) == 1  # one size left for three: at least one
    images = VariantPlan("dynamic", "dynamic", {"batch": (1, 4), "height": (96, 256)}, {"batch": 2, "height": 157})
    assert fresh_per_candidate(images, 4, 3) == FIRST_CALL_SHAPES
    seen = {(3,), (5,)}
    drawn = [fresh_shapes(small, seen, fresh_per_candidate(small, 2, 3), seed=k) for k in range(3)]
    assert [len(d) for d in drawn] == [2, 2, 2]
