"""The load's warm-up beyond the hint (loader.warmup): a dynamic variant is also run on the largest
shape its ranges hold, so that a first call at any shape finds its buffers mapped; bounded by an
estimate of that call's time; the same outputs after it."""

from __future__ import annotations

import dataclasses

import pytest
import torch

import loader
from loader.warmup import BUDGET_SECONDS, after_hint, estimate_seconds, largest, short_range_shapes


def inputs(batch: int, seq: int, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    return torch.randint(0, 50, (batch, seq), generator=gen), torch.ones(batch, seq, dtype=torch.bool)


def test_a_dynamic_variant_warms_its_largest_shape_after_its_hint(tagger_build):
    """(tagger_build: 2 static variants, 2 dynamic ones over seq [4,16] and [17,32], batch [1,8].)"""
    model = loader.load(tagger_build.path, open="eager", warmup_shapes="range")
    for v in model.variants:
        if v.kind == "static":
            assert model.warmed[v.id] == [v.hint]
            continue
        hint, big = model.warmed[v.id]
        assert hint == v.hint and big == {d: r.max for d, r in v.dims.items()}
        # inside the variant's ranges, through its guards: dispatch sends such a call to it
        assert model.select(*model.example_inputs(v, big)).id == v.id


def test_by_default_a_small_variant_warms_its_largest_shape_too(tagger_build):
    model = loader.load(tagger_build.path, open="eager")
    assert model.warmup_shapes == "auto"  # tiny calls: the largest shape's estimate fits the budget
    assert all(len(model.warmed[v.id]) == (2 if v.kind == "dynamic" else 1) for v in model.variants)


def test_hint_warms_the_hint_alone(tagger_build):
    model = loader.load(tagger_build.path, open="eager", warmup_shapes="hint")
    assert model.warmed == {v.id: [v.hint] for v in model.variants}


def test_the_background_opener_warms_the_same_shapes(tagger_build):
    model = loader.load(tagger_build.path, warmup_shapes="range")  # open="background": the first before returning
    assert model.wait_opened(60)
    eager = loader.load(tagger_build.path, open="eager", warmup_shapes="range")
    assert model.warmed == eager.warmed


def test_the_background_mode_returns_after_the_hint_and_warms_the_rest_behind_it(tagger_build, monkeypatch):
    import threading

    import loader.opening

    release = threading.Event()
    monkeypatch.setattr(loader.opening, "lower_priority", lambda: release.wait(60))  # the thread holds here
    model = loader.load(tagger_build.path, warmup_shapes="range")  # open="background", the default
    first = next(iter(model.warmed))
    assert model.warmed == {first: [model.variants[0].hint]}  # load() ran the first variant's hint alone
    assert not model.wait_opened(0.05)
    release.set()
    assert model.wait_opened(60)
    assert model.warmed == loader.load(tagger_build.path, open="eager", warmup_shapes="range").warmed


def test_warming_the_largest_shape_changes_no_output(tagger_build):
    cold = loader.load(tagger_build.path, open="eager", warmup=False)
    warm = loader.load(tagger_build.path, open="eager", warmup_shapes="range")
    for batch, seq in [(8, 16), (8, 32), (3, 11), (5, 29), (1, 4)]:
        args = inputs(batch, seq, seed=batch * seq)
        for got, want in zip(warm(*args), cold(*args)):
            assert torch.equal(got, want)


def test_auto_warms_the_largest_shape_only_within_its_time_budget(tagger_build):
    (v, *_) = [v for v in tagger_build.manifest.variants if v.kind == "dynamic"]
    big = largest(v)
    growth = estimate_seconds(v, big, 1.0)  # the largest call's estimate per second of the hint's
    assert growth > 1
    fits, over = 0.9 * BUDGET_SECONDS / growth, 1.1 * BUDGET_SECONDS / growth
    assert after_hint(v, "auto", fits) == [big]
    assert after_hint(v, "auto", over) == []
    assert after_hint(v, "auto", 0.5, budget=0.5 * growth) == [big]  # the budget is inclusive
    assert after_hint(v, "range", over) == [big]  # "range" has no budget
    assert after_hint(v, "hint", 0.0) == []


def test_a_static_variant_or_one_whose_hint_is_its_largest_has_nothing_more_to_warm(tagger_build):
    static, dynamic = (next(v for v in tagger_build.manifest.variants if v.kind == k) for k in ("static", "dynamic"))
    assert largest(static) is None and after_hint(static, "range", 0.0) == []
    at_max = dataclasses.replace(dynamic, hint={d: r.max for d, r in dynamic.dims.items()})
    assert largest(at_max) is None and after_hint(at_max, "range", 0.0) == []


@pytest.mark.parametrize("load", [loader.load, loader.load_native])
def test_an_unknown_warmup_shapes_is_refused_before_anything_is_opened(tagger_build, load):
    with pytest.raises(ValueError, match=r"warmup_shapes='all': expected one of auto, hint, range"):
        load(tagger_build.path / "no-such-folder", warmup_shapes="all")


def test_load_native_warms_the_same_shapes(tagger_build):
    native = loader.load_native(tagger_build.path, open="eager", warmup_shapes="range")
    torch_model = loader.load(tagger_build.path, open="eager", warmup_shapes="range")
    assert native.warmed == torch_model.warmed


def test_auto_warms_the_traffic_s_shapes_hottest_first_within_a_budget_of_their_own(tagger_build):
    (v, *_) = [v for v in tagger_build.manifest.variants if v.kind == "dynamic"]
    big = largest(v)
    small, mid, other = ({"batch": b, "seq": s} for b, s in ((1, v.dims["seq"].min), (4, v.dims["seq"].max), (2, 6)))
    v = dataclasses.replace(v, warm=(small, big, mid, other))  # big is warmed once, as the largest shape
    per_element = 1.0 / estimate_seconds(v, {d: 1 for d in v.hint}, 1.0)  # hint seconds that make one element 1 s
    cost = {name: estimate_seconds(v, s, per_element) for name, s in (("small", small), ("mid", mid), ("other", other))}
    # a budget the largest shape is over, that the first two traffic shapes fit and the third does not
    budget = cost["small"] + cost["mid"] + 0.5 * cost["other"]
    assert estimate_seconds(v, big, per_element) > budget
    assert after_hint(v, "auto", per_element, budget=budget) == [small, mid]
    assert after_hint(v, "range", per_element, budget=budget) == [big, small, mid, other]
    assert after_hint(v, "hint", per_element) == []


def test_a_first_calls_variant_warms_each_value_of_a_short_range_before_the_largest_shape(tagger_build):
    """A linear layer after a pooling makes oneDNN create a primitive per batch size, whatever the rest
    of the shape: a first-calls variant (one whose convolutions create none) is warmed at each batch
    its hint and other shapes do not have, at the smallest sizes of the other dims, before its
    largest shape (whose buffers the allocator should hold last). batch [1,8] is short; seq is not."""
    (v, *_) = [v for v in tagger_build.manifest.variants if v.kind == "dynamic"]
    v = dataclasses.replace(v, warm=())
    twin = dataclasses.replace(v, id=f"{v.id}-first", first_calls_of=v.id)
    big, low = largest(twin), v.dims["seq"].min
    batches = [b for b in range(1, 9) if b not in (v.hint["batch"], big["batch"])]
    short = [{"batch": b, "seq": low} for b in batches]
    assert len(short) >= 6 and after_hint(twin, "range", 0.0) == [*short, big]
    assert after_hint(v, "range", 0.0) == [big]  # not on a variant whose convolutions create theirs
    # "auto": the short range's calls within a budget of their own, as many as fit
    cost = [estimate_seconds(twin, s, 1.0) for s in short]
    budget = cost[0] + cost[1] + 0.5 * cost[2]  # the largest shape is over it
    assert estimate_seconds(twin, big, 1.0) > budget
    assert after_hint(twin, "auto", 1.0, budget=budget) == short[:2]
    assert after_hint(twin, "hint", 0.0) == []


def test_a_short_range_met_by_the_shapes_before_adds_nothing(tagger_build):
    (v, *_) = [v for v in tagger_build.manifest.variants if v.kind == "dynamic"]
    twin = dataclasses.replace(v, first_calls_of=v.id, warm=())
    every = [{"batch": b, "seq": v.dims["seq"].max} for b in range(1, 9)]
    assert short_range_shapes(twin, every) == []
    assert short_range_shapes(dataclasses.replace(twin, kind="static"), []) == []
