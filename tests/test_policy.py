"""pad and split on an output that follows a dim on several axes (attention scores [batch, seq, seq]),
and the build running every policy past its range against eager."""

from __future__ import annotations

import pytest
import torch

import loader
from loader import GuardError
from precompile.compare import CheckReport
from precompile.errors import ProfileError
from precompile.pipeline import build
from precompile.profile import load_profile
from precompile.stages.check import Staged, check_policies, check_policy_outputs, policy_sizes

from .conftest import TAGGER_PROFILE, builds, write_profile
from .models.tiny import scores, tagger
from .test_loader import copy_with_manifest

SCORES_PROFILE = """
name: tiny-scores
model: {factory: "tiny:scores"}
inputs:
  ids: {shape: [batch, seq], dtype: int64, range: [0, 49]}
dims:
  batch: {min: 1, max: 4}
  seq:   {min: 4, max: 12}
outputs:
  - {shape: [batch, seq, seq]}
policy:
  out_of_range: {batch: split, seq: pad}
check: {random_shapes: 2}
"""


@pytest.fixture(scope="module")
@builds
def scores_build(tmp_path_factory):
    """One dynamic variant of the scores model; batch split, seq padded."""
    folder = tmp_path_factory.mktemp("scores")
    return build(write_profile(folder, SCORES_PROFILE), folder / "artifact")


@pytest.fixture(scope="module")
def model(scores_build):
    return loader.load(scores_build.path)


def ids(batch: int, seq: int, seed: int = 0) -> torch.Tensor:
    return torch.randint(0, 50, (batch, seq), generator=torch.Generator().manual_seed(seed))


def eager(x: torch.Tensor) -> torch.Tensor:
    with torch.no_grad():
        return scores().eval()(x)


# --- the loader ----------------------------------------------------------------------------------


def test_pad_cuts_every_output_axis_that_follows_the_dim(model):
    x = ids(2, 3)
    out, variant = model.call_detailed(x)
    assert out.shape == (2, 3, 3) and variant == "dynamic"
    torch.testing.assert_close(out, eager(x))


@pytest.mark.parametrize("batch", [5, 6, 9], ids=["uneven", "even", "three-pieces"])
def test_split_concatenates_along_the_axis_that_follows_the_dim(model, batch):
    x = ids(batch, 7, seed=batch)
    out = model(x)
    assert out.shape == (batch, 7, 7)
    torch.testing.assert_close(out, eager(x))


def test_split_and_pad_together(model):
    x = ids(6, 2, seed=1)
    torch.testing.assert_close(model(x), eager(x))


def test_a_split_that_cannot_be_undone_is_refused_and_in_range_calls_still_serve(scores_build, tmp_path):
    """An artifact (from an older build, or edited) that splits seq with seq on two output axes."""
    path = copy_with_manifest(scores_build.path, tmp_path / "a", lambda m: m["policy"].update(seq="split"))
    bad = loader.load(path)
    with pytest.raises(
        GuardError, match=r"its policy is split, which this artifact cannot undo: output 0 follows 'seq' on axes 1, 2"
    ) as info:
        bad(ids(2, 13))
    assert info.value.reason == "policy"
    x = ids(2, 12)
    torch.testing.assert_close(bad(x), eager(x))


def test_split_counts_once_as_a_call_and_each_piece_as_a_piece(scores_build):
    model = loader.load(scores_build.path)
    model(ids(9, 5))  # 3 + 3 + 3
    model(ids(2, 5))
    stats = model.stats()
    assert stats["calls"] == 2
    assert stats["variants"]["dynamic"]["calls"] == 2 and stats["variants"]["dynamic"]["pieces"] == 4
    assert sum(s["count"] for s in stats["shapes"]) == 2


# --- the build -----------------------------------------------------------------------------------


def test_the_build_runs_each_policy_past_its_range_against_eager(scores_build):
    checked = [s for s in scores_build.check.per_shape if "(" in s.variant]
    assert {(s.variant, tuple(s.dims.items())) for s in checked} >= {
        ("dynamic (batch: split)", (("batch", 5), ("seq", 7))),
        ("dynamic (batch: split)", (("batch", 9), ("seq", 7))),
        ("dynamic (seq: pad)", (("batch", 2), ("seq", 3))),
        ("dynamic (seq: pad)", (("batch", 2), ("seq", 1))),
    }


def test_the_build_refuses_to_split_a_dim_an_output_follows_twice(tmp_path):
    profile = write_profile(tmp_path, SCORES_PROFILE.replace("seq: pad", "seq: split"))
    with pytest.raises(ProfileError) as info:
        build(profile, tmp_path / "out")  # refused before anything compiles
    assert info.value.problems == [
        (
            "policy.out_of_range.seq",
            "split cannot be undone: output 0 follows 'seq' on axes 1, 2; pieces can be concatenated back only "
            "along exactly one axis of every output; use pad or error for 'seq'",
        )
    ]
    assert not (tmp_path / "out").exists()


def test_check_policy_outputs_accepts_one_axis_per_output(tmp_path):
    check_policy_outputs(load_profile(write_profile(tmp_path, SCORES_PROFILE)))


def test_a_policy_that_changes_the_results_is_a_profile_error(tagger_build, tmp_path):
    """The tagger's masked mean ignores padding only while the mask pads with 0; padding with 1
    counts the padded tokens in."""
    profile = write_profile(tmp_path / "p", TAGGER_PROFILE.replace("pad_value: {mask: 0}", "pad_value: {mask: 1}"))
    path = copy_with_manifest(tagger_build.path, tmp_path / "a", lambda m: m["pad_value"].update(mask=1.0))
    loaded = load_profile(profile)
    with pytest.raises(ProfileError) as info:
        check_policies(loaded, tagger().eval(), Staged(path, target="cpu", lower_precisions=False), CheckReport())
    [(place, message)] = info.value.problems
    assert place == "policy.out_of_range.seq"
    assert message.startswith("pad changes the results (variant dynamic-0 (seq: pad), batch=")
    assert "use error for 'seq', or a pad_value that leaves the results unchanged" in message


def test_policy_sizes_lie_past_the_range():
    assert policy_sizes(4, 12, "pad") == [1, 3]
    assert policy_sizes(1, 8, "pad") == []  # nothing below 1 to pad
    assert policy_sizes(1, 4, "split") == [5, 9]
    assert policy_sizes(8, 10, "split") == [20]  # 11 and 21 cannot split into pieces of at least 8
