"""The planner is a pure function of the profile and its traffic: hand-made distributions in, variants out."""

from __future__ import annotations

import json

import pytest
from click.testing import CliRunner

from precompile.cli import main
from precompile.errors import ProfileError
from precompile.profile import load_profile
from precompile.stages.plan import plan_variants
from precompile.traffic import read_distribution

from .conftest import write_profile

BASE = """
name: planned
model: {factory: "tiny:classifier"}
inputs:
  ids:  {shape: [batch, seq], dtype: int64}
  mask: {shape: [batch, seq], dtype: bool}
dims:
  batch: {min: 1, max: 16}
  seq:   {min: 8, max: 512}
"""


def plan_for(tmp_path, extra: str = "", files: dict[str, str] | None = None):
    for name, text in (files or {}).items():
        (tmp_path / name).write_text(text)
    loaded = load_profile(write_profile(tmp_path, BASE + extra))
    return plan_variants(loaded.profile, read_distribution(loaded))


SHAPES = """
distribution:
  shapes:
    - {batch: 1, seq: 128, count: 4000}
    - {batch: 8, seq: 64, count: 1500}
    - {batch: 2, seq: 256, count: 300}
    - {batch: 4, seq: 32, count: 200}
"""


def test_static_variants_go_to_the_hottest_shapes_until_coverage(tmp_path):
    plan = plan_for(tmp_path, SHAPES + "plan: {coverage: 0.8, max_specialized: 4}\n")
    statics = [v for v in plan.variants if v.kind == "static"]
    # 4000/6000 = 0.67 < 0.8, so a second one is added; 5500/6000 = 0.92 ≥ 0.8 stops.
    assert [v.hint for v in statics] == [{"batch": 1, "seq": 128}, {"batch": 8, "seq": 64}]
    assert plan.static_count == 5500 and plan.total == 6000


def test_max_specialized_caps_static_variants(tmp_path):
    plan = plan_for(tmp_path, SHAPES + "plan: {coverage: 1.0, max_specialized: 1}\n")
    assert [v.id for v in plan.variants] == ["static-0", "dynamic"]


def test_dynamic_variants_always_cover_every_range(tmp_path):
    plan = plan_for(tmp_path, SHAPES + "plan: {ranges: {seq: [128, 512]}}\n")
    dynamic = [v for v in plan.variants if v.kind == "dynamic"]
    assert [v.ranges for v in dynamic] == [
        {"batch": (1, 16), "seq": (8, 128)},
        {"batch": (1, 16), "seq": (129, 512)},
    ]


def test_dynamic_hint_is_the_hottest_shape_it_serves(tmp_path):
    plan = plan_for(tmp_path, SHAPES + "plan: {ranges: {seq: [128]}, max_specialized: 1}\n")
    low, high = [v for v in plan.variants if v.kind == "dynamic"]
    assert low.hint == {"batch": 8, "seq": 64}  # (1, 128) is hotter but has its own static variant
    assert high.hint == {"batch": 2, "seq": 256}
    assert low.count == 1700 and high.count == 300


def test_no_traffic_means_one_dynamic_variant(tmp_path):
    plan = plan_for(tmp_path)
    assert [(v.id, v.kind, v.ranges) for v in plan.variants] == [
        ("dynamic", "dynamic", {"batch": (1, 16), "seq": (8, 512)})
    ]


def test_out_of_range_traffic_is_reported_with_policy(tmp_path):
    extra = """
distribution:
  shapes:
    - {batch: 1, seq: 128, count: 90}
    - {batch: 32, seq: 128, count: 6}
    - {batch: 1, seq: 600, count: 4}
outputs: [{shape: [batch, 2]}]
policy: {out_of_range: {batch: split}}
"""
    plan = plan_for(tmp_path, extra)
    assert plan.by_policy == {"split": 6}
    assert plan.rejected_count == 4
    assert plan.out_of_range == (({"batch": 32, "seq": 128}, 6), ({"batch": 1, "seq": 600}, 4))
    assert plan.to_dict()["traffic"]["rejected"] == {"count": 4, "share": 0.04}


def test_distribution_file_and_shapes_are_merged(tmp_path):
    lines = "\n".join(json.dumps({"dims": {"batch": 1, "seq": 128}, "count": 5}) for _ in range(3))
    plan = plan_for(
        tmp_path,
        "distribution:\n  file: traffic.jsonl\n  shapes: [{batch: 1, seq: 128, count: 1}]\n",
        {"traffic.jsonl": lines + "\n"},
    )
    assert plan.total == 16 and plan.variants[0].hint == {"batch": 1, "seq": 128}


def test_bad_distribution_lines_are_named(tmp_path):
    with pytest.raises(ProfileError) as info:
        plan_for(
            tmp_path, "distribution: {file: t.jsonl}\n", {"t.jsonl": '{"dims": {"batch": 1}, "count": 2}\nnot json\n'}
        )
    ((place, message),) = info.value.problems
    assert place == "distribution.file"
    assert message.endswith("t.jsonl:1: dims ['batch'] are not the profile's ['batch', 'seq']")


def test_a_dynamic_variant_is_warmed_on_the_hottest_shapes_it_serves_after_its_hint(tmp_path):
    shapes = [(1, 128, 4000), (8, 64, 1500), (2, 256, 300), (4, 32, 200), (3, 32, 200), (16, 512, 5), (5, 9, 1)]
    traffic = "distribution:\n  shapes:\n" + "".join(
        f"    - {{batch: {b}, seq: {s}, count: {c}}}\n" for b, s, c in shapes
    )
    plan = plan_for(tmp_path / "a", traffic + "plan: {max_specialized: 1, coverage: 1.0, warm_shapes: 3}\n")
    (dynamic,) = [v for v in plan.variants if v.kind == "dynamic"]
    # static-0 serves 1×128; the dynamic variant's hint is the next hottest, its warm shapes that and
    # the two after it, the tie at 200 going to the smaller batch
    assert dynamic.hint == {"batch": 8, "seq": 64}
    assert dynamic.warm == ({"batch": 8, "seq": 64}, {"batch": 2, "seq": 256}, {"batch": 3, "seq": 32})
    assert all(v.warm == () for v in plan.variants if v.kind == "static")
    everything = plan_for(tmp_path / "b", traffic + "plan: {max_specialized: 1, coverage: 1.0}\n")
    assert len(next(v for v in everything.variants if v.kind == "dynamic").warm) == 6  # default 8: all it serves
    none = plan_for(tmp_path / "c", traffic + "plan: {max_specialized: 1, coverage: 1.0, warm_shapes: 0}\n")
    assert next(v for v in none.variants if v.kind == "dynamic").warm == ()


def test_warm_shapes_out_of_bounds_is_refused(tmp_path):
    with pytest.raises(ProfileError) as info:
        plan_for(tmp_path, "plan: {warm_shapes: 65}\n")
    assert [place for place, _ in info.value.problems] == ["plan.warm_shapes"]


def test_plan_is_deterministic(tmp_path):
    ties = "distribution:\n  shapes:\n" + "".join(f"    - {{batch: {b}, seq: 64, count: 10}}\n" for b in (4, 2, 3, 1))
    first = plan_for(tmp_path / "a", ties + "plan: {max_specialized: 2, coverage: 1.0}\n")
    second = plan_for(tmp_path / "b", ties + "plan: {max_specialized: 2, coverage: 1.0}\n")
    assert first == second
    assert [v.hint["batch"] for v in first.variants if v.kind == "static"] == [1, 2]


def test_pad_or_split_without_outputs_is_refused(tmp_path):
    with pytest.raises(ProfileError) as info:
        plan_for(tmp_path, "policy: {out_of_range: {seq: pad}}\n")
    assert (
        "policy.out_of_range.seq",
        "pad needs `outputs:` to declare which output axes follow 'seq'",
    ) in info.value.problems


def test_split_needs_every_output_to_follow_the_dim(tmp_path):
    with pytest.raises(ProfileError) as info:
        plan_for(tmp_path, "outputs: [{shape: [batch, 2]}]\npolicy: {out_of_range: {seq: split}}\n")
    assert info.value.problems == [
        ("policy.out_of_range.seq", "split needs every output to follow 'seq'; outputs[0] has shape ['batch', 2]")
    ]


def test_cli_plan_prints_table_and_json(tmp_path):
    path = write_profile(tmp_path, BASE + SHAPES)
    text = CliRunner().invoke(main, ["plan", str(path)], catch_exceptions=False)
    assert text.exit_code == 0
    assert "static-0     static   batch=1 seq=128" in text.output
    assert "traffic: static 91.7%, dynamic 8.3%" in text.output
    data = json.loads(CliRunner().invoke(main, ["plan", str(path), "--json"], catch_exceptions=False).output)
    assert data["traffic"]["total"] == 6000
    assert [v["id"] for v in data["variants"]] == ["static-0", "static-1", "dynamic"]
