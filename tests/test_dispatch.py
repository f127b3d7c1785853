"""A planned multi-variant artifact: calls land on the expected variant, policies agree with eager,
weights are shared, and stats feed the next build's distribution."""

from __future__ import annotations

import json
import os

import pytest
import torch

import loader
from loader import GuardError
from precompile.profile import load_profile
from precompile.traffic import read_distribution

from .conftest import write_profile
from .models.tiny import tagger


@pytest.fixture(scope="module")
def model(tagger_build):
    return loader.load(tagger_build.path)


@pytest.fixture(scope="module")
def eager():
    return tagger().eval()


def inputs(batch, seq, real=None, seed=0):
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, 50, (batch, seq), generator=g)
    mask = torch.ones(batch, seq, dtype=torch.bool)
    return ids, mask


def test_artifact_holds_the_planned_variants(tagger_build, model):
    assert [(v.id, v.kind) for v in model.variants] == [
        ("static-0", "static"),
        ("static-1", "static"),
        ("dynamic-0", "dynamic"),
        ("dynamic-1", "dynamic"),
    ]
    manifest = json.loads((tagger_build.path / "manifest.json").read_text())
    assert manifest["variants"][0]["dims"] == {"batch": [1, 1], "seq": [16, 16]}
    assert manifest["variants"][3]["hint"] == {"batch": 4, "seq": 24}
    assert manifest["policy"] == {"batch": "split", "seq": "pad"}


def test_weights_are_stored_once_for_all_variants(tagger_build):
    files = json.loads((tagger_build.path / "manifest.json").read_text())["files"]
    weights = files["weights.safetensors"]["size"]
    params = sum(p.numel() * 4 for p in tagger().parameters())
    assert weights < params * 1.1 + 4096  # one copy, not four
    code = sum(v["size"] for k, v in files.items() if k.startswith("variants/"))
    total = sum(os.path.getsize(tagger_build.path / k) for k in files)
    assert total == weights + code + files["references.safetensors"]["size"]


@pytest.mark.parametrize(
    "batch, seq, variant",
    [
        (1, 16, "static-0"),
        (2, 8, "static-1"),
        (3, 10, "dynamic-0"),
        (2, 16, "dynamic-0"),
        (1, 17, "dynamic-1"),
        (8, 32, "dynamic-1"),
    ],
)
def test_calls_land_on_the_expected_variant(model, eager, batch, seq, variant):
    ids, mask = inputs(batch, seq)
    (tokens, pooled), used = model.call_detailed(ids, mask)
    assert used == variant and model.select(ids, mask).id == variant
    want_tokens, want_pooled = eager(ids, mask)
    torch.testing.assert_close(tokens, want_tokens.detach())
    torch.testing.assert_close(pooled, want_pooled.detach())


def test_select_answers_with_the_policys_plan_for_a_call_it_serves(model):
    ids, mask = inputs(19, 12, seed=1)
    plan = model.select(ids, mask)
    assert plan.id == model.call_detailed(ids, mask)[1] == "dynamic-0"
    assert plan.policies == (("batch", "split"),)
    assert [(sizes, v.id) for sizes, v in plan.pieces] == [({"batch": b, "seq": 12}, "dynamic-0") for b in (7, 6, 6)]
    ids, mask = inputs(2, 3)
    plan = model.select(ids, mask)
    assert plan.policies == (("seq", "pad"),) and [s for s, _ in plan.pieces] == [{"batch": 2, "seq": 4}]
    assert plan.id == model.call_detailed(ids, mask)[1]
    with pytest.raises(GuardError, match="its policy is pad, which only serves sizes below 4"):
        model.select(*inputs(1, 33))  # what the call itself raises


def test_split_policy_cuts_batch_and_concatenates(model, eager):
    ids, mask = inputs(19, 12, seed=1)
    (tokens, pooled), used = model.call_detailed(ids, mask)
    assert used == "dynamic-0"  # pieces of 7, 6, 6
    assert tokens.shape == (19, 12, 3) and pooled.shape == (19, 3)
    want_tokens, want_pooled = eager(ids, mask)
    torch.testing.assert_close(tokens, want_tokens.detach())
    torch.testing.assert_close(pooled, want_pooled.detach())


def test_pad_policy_pads_seq_and_slices_outputs_back(model, eager):
    ids, mask = inputs(3, 2, seed=2)
    (tokens, pooled), used = model.call_detailed(ids, mask)
    assert used == "dynamic-0" and tokens.shape == (3, 2, 3)
    want_tokens, want_pooled = eager(ids, mask)
    torch.testing.assert_close(tokens, want_tokens.detach())
    torch.testing.assert_close(pooled, want_pooled.detach())  # mask padded with 0: the mean ignores the padding


def test_split_and_pad_together(model, eager):
    ids, mask = inputs(12, 3, seed=3)
    tokens, pooled = model(ids, mask)
    want_tokens, want_pooled = eager(ids, mask)
    torch.testing.assert_close(tokens, want_tokens.detach())
    torch.testing.assert_close(pooled, want_pooled.detach())


def test_pad_cannot_serve_sizes_above_the_range(model):
    with pytest.raises(GuardError, match=r"dim 'seq' is 40, above the built range \[4, 32\]; its policy is pad"):
        model(*inputs(1, 40))


def test_stats_count_calls_per_variant_and_shapes(tagger_build, tmp_path):
    model = loader.load(tagger_build.path)
    for batch, seq in [(1, 16), (1, 16), (3, 10), (19, 12)]:
        model(*inputs(batch, seq))
    stats = model.stats()
    assert stats["calls"] == 4
    assert stats["variants"]["static-0"]["calls"] == 2
    # the split call (19 = 7 + 6 + 6) is one call on dynamic-0 and three runs of its code
    assert stats["variants"]["dynamic-0"]["calls"] == 1 + 1
    assert stats["variants"]["dynamic-0"]["pieces"] == 1 + 3
    assert stats["shapes"][0] == {"dims": {"batch": 1, "seq": 16}, "count": 2}
    assert {"dims": {"batch": 19, "seq": 12}, "count": 1} in stats["shapes"]

    # The histogram is what a profile's distribution.file reads: the next build sees this traffic.
    (tmp_path / "traffic.jsonl").write_text("".join(json.dumps(s) + "\n" for s in stats["shapes"]))
    profile = write_profile(
        tmp_path,
        """
        name: next
        model: {factory: "tiny:tagger"}
        inputs:
          ids:  {shape: [batch, seq], dtype: int64}
          mask: {shape: [batch, seq], dtype: bool}
        dims: {batch: {min: 1, max: 8}, seq: {min: 4, max: 32}}
        distribution: {file: traffic.jsonl}
    """,
    )
    assert read_distribution(load_profile(profile)) == {(1, 16): 2, (3, 10): 1, (19, 12): 1}


def test_references_are_stored_for_every_variant(tagger_build):
    check = json.loads((tagger_build.path / "manifest.json").read_text())["check"]
    assert [r["variant"] for r in check["references"]] == ["static-0", "static-1", "dynamic-0", "dynamic-1"]
    assert check["references"][2]["dims"] == {"batch": 1, "seq": 4}


def test_plan_traffic_shares_are_recorded(tagger_build):
    traffic = tagger_build.plan.to_dict()["traffic"]
    assert traffic["static"]["count"] == 800
    assert traffic["total"] == 950
    assert traffic["out_of_range_by_policy"]["pad"] == {"count": 20, "share": round(20 / 950, 6)}
    assert traffic["out_of_range_by_policy"]["split"] == {"count": 30, "share": round(30 / 950, 6)}
