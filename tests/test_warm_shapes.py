"""A dynamic variant's hottest traffic shapes (the profile's plan.warm_shapes, the manifest's warm) are
run by the load's warm-up, so that a first call at one of them creates no oneDNN primitive; an unseen
shape, or the hint-only warm-up, still creates every convolution's."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from precompile.cli.inspect import describe
from precompile.pipeline import build

from .conftest import write_profile

# The gray net served mostly at 1×32², then at two other shapes the dynamic variant warms at load
# (plan.warm_shapes), hottest first.
GRAY_TRAFFIC = """
    name: gray-traffic
    model: {factory: "tiny:gray_net"}
    inputs: {x: {shape: [batch, 1, height, width], dtype: float32}}
    dims: {batch: {min: 1, max: 2}, height: {min: 24, max: 48}, width: {min: 24, max: 48}}
    distribution:
      shapes:
        - {batch: 1, height: 32, width: 32, count: 50}
        - {batch: 2, height: 40, width: 24, count: 20}
        - {batch: 1, height: 28, width: 44, count: 10}
    plan: {max_specialized: 0}
    check: {random_shapes: 1}
"""

# Loads the artifact in a fresh process (warm-up as argv[2] says) under oneDNN's verbose log of
# primitive creations, prints what the load warmed, then makes one first call at each shape of argv[3].
FIRST_AT = """
import json, sys, torch, loader
path, mode, shapes = sys.argv[1], sys.argv[2], json.loads(sys.argv[3])
model = loader.load(path, open="eager", warmup_shapes=mode)
print("=== warmed " + json.dumps(model.warmed), flush=True)
for shape in shapes:
    print(f"=== {shape}", flush=True)
    model(torch.randn(shape))
print("=== end", flush=True)
"""


@pytest.mark.integration
def test_the_load_warms_a_dynamic_variant_on_its_traffic_s_hottest_shapes(tmp_path, build_cache):
    """A first call at a shape the build's traffic held (after the hint) creates no oneDNN primitive:
    the load's warm-up ran it (loader.warmup); at a shape the traffic did not hold, or with the hint's
    warm-up alone, it creates every convolution's."""
    built = build(write_profile(tmp_path, GRAY_TRAFFIC), tmp_path / "artifact", cache=build_cache)
    art, (v,) = built.path, built.manifest.variants
    # export moved the planned hint 1×32² off batch 1 and off width == height: the planned one is warmed
    assert v.hint == {"batch": 2, "height": 32, "width": 33}
    hot = (
        {"batch": 1, "height": 32, "width": 32},
        {"batch": 2, "height": 40, "width": 24},
        {"batch": 1, "height": 28, "width": 44},
    )
    assert v.warm == hot
    assert "warms at load 3 shape(s) of its traffic: 1×32×32, 2×40×24, 1×28×44" in describe(built.manifest)
    env = {**os.environ, "ONEDNN_VERBOSE": "profile_create", "OMP_WAIT_POLICY": "PASSIVE"}
    shapes = [[1, 1, 32, 32], [2, 1, 40, 24], [1, 1, 28, 44], [1, 1, 44, 30]]  # the traffic's shapes, one unseen
    created, warmed = {}, {}
    for mode in ("auto", "hint"):
        run = subprocess.run(
            [sys.executable, "-c", FIRST_AT, str(art), mode, json.dumps(shapes)],
            env=env, capture_output=True, text=True, check=True,
        )  # fmt: skip
        warmed[mode] = json.loads(run.stdout.split("=== warmed ", 1)[1].split("\n", 1)[0])[v.id]
        parts = run.stdout.split("=== ")[2:-1]  # one per shape, after the warmed line
        created[mode] = [p.count(",create:cache_miss,") for p in parts]
    big = {"batch": 2, "height": 48, "width": 48}
    assert warmed["auto"] == [v.hint, big, *v.warm] and warmed["hint"] == [v.hint]
    assert created["auto"][:3] == [0, 0, 0] and created["auto"][3] >= 5  # the gray net's 5 pointwise convolutions
    assert all(n >= 5 for n in created["hint"])

    from bench import firstcall  # the bench sets the traffic's shapes apart from unseen ones

    rows = firstcall.measure([art], shapes=2, repeat=2, warmups=("auto",))
    assert [(r["shape"], r["dims"]) for r in rows][2:] == [("traffic", s) for s in hot[:2]]
    assert all(r["dims"] not in hot for r in rows[:2]) and [r["shape"] for r in rows[:2]] == ["unseen"] * 2
    said = firstcall.per_artifact(rows)
    assert [s["kind"] for s in said.values()] == ["unseen", "traffic"]
    assert "(median of 2 traffic shapes)" in firstcall.summary(rows)
