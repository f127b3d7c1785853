"""Dynamic convolutions run on weights packed at build time (precompile.passes.prepack): the gray net
(every kind of convolution, fp32 and bf16) and the layout nets built through the whole pipeline, run in
fresh processes under oneDNN's verbose log, and the probe of the sizes a range takes on its own.
Split from tests/test_convnets.py so that the two halves go to both xdist workers."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import threading
import zipfile
from pathlib import Path

import pytest
import torch
from torch import nn

import loader
from precompile.passes import prepack
from precompile.pipeline import build

from .conftest import builds, write_profile
from .models import tiny
from .test_convnets import export, generated_code

# Artifacts compiled and run in child processes, oneDNN's layouts probed: seconds a test.
pytestmark = pytest.mark.integration

# --- dynamic convolutions run on weights packed at build time (precompile.passes.prepack) -------------

GRAY = """
    name: gray
    model: {factory: "tiny:gray_net"}
    inputs: {x: {shape: [batch, 1, height, width], dtype: float32}}
    dims: {batch: {min: 1, max: 2}, height: {min: 24, max: 48}, width: {min: 24, max: 48}}
    plan: {max_specialized: 0}
    compile: {inductor: {freezing: true}}
    precision: [fp32, bf16]
    accuracy: {metric: cosine, threshold: 0.99, min_speedup: 0}
    check: {random_shapes: 1}
"""

# Loads the artifact in a fresh process under ONEDNN_VERBOSE and calls it twice at each shape, between
# markers; saves the outputs for the test to compare with eager.
CALLS = """
import json, sys, torch, loader
path, precision, shapes, out = sys.argv[1], sys.argv[2], json.loads(sys.argv[3]), sys.argv[4]
model = loader.load(path, precision=precision)
got = []
for shape in shapes:
    x = torch.randn(shape, generator=torch.Generator().manual_seed(sum(shape)))
    for call in range(2):
        print(f"=== {shape} {call}", flush=True)
        y = model(x)
    got.append(y)
print("=== end", flush=True)
torch.save(got, out)
"""


@pytest.fixture(scope="module")
@builds
def gray(tmp_path_factory):
    folder = tmp_path_factory.mktemp("gray")
    return build(write_profile(folder, GRAY), folder / "artifact")


def convolution_weights(package: Path) -> dict[str, tuple[str, bool]]:
    """Each ``mkldnn._convolution_pointwise`` weight of the package's generated code: how oneDNN's
    verbose log writes its dims (``OxIxHxW``, grouped ``GxO/GxI/GxHxW``), and whether it is a packed
    (opaque oneDNN) constant."""
    with zipfile.ZipFile(package) as z:
        (code,) = [z.read(n).decode() for n in z.namelist() if n.endswith(".wrapper.cpp")]
    info: dict[str, dict[str, str]] = {}
    for i, field, value in re.findall(r"constants_info_\[(\d+)\]\.(name|shape|layout) = (.*);", code):
        info.setdefault(i, {})[field] = value
    constants = {v["name"].strip('"'): v for v in info.values()}
    # Inside a layout branch (a subgraph), a constant reaches the call as a local handle assigned from it,
    # through one handle per level where branches nest (an AMX host's bf16 build nests them).
    aliases = dict((local, const) for const, local in re.findall(r"assign_tensors_out\((\w+), &(\w+)_handle\)", code))

    def constant(name: str) -> str:
        while name in aliases and name not in constants:
            name = aliases[name]
        return name

    out = {}
    for weight, groups in re.findall(
        r"aoti_torch_cpu_mkldnn__convolution_pointwise\(\w+, (\w+),(?:[^;]*?\.cbegin\(\), \d+,){3} (\d+)L", code
    ):
        weight = constant(weight)
        o, i, h, w = (int(n) for n in re.findall(r"\d+", constants[weight]["shape"]))
        g = int(groups)
        dims = f"{o}x{i}x{h}x{w}" if g == 1 else f"{g}x{o // g}x{i}x{h}x{w}"
        out[weight] = (dims, "layout__mkldnn" in constants[weight]["layout"])
    return out


def onednn_calls(artifact: Path, precision: str, shapes: list[list[int]], tmp_path: Path):
    """Per (shape, call): the dims of every reorder oneDNN ran; and the outputs, one per shape."""
    lines, outputs = onednn_reorder_lines(artifact, precision, shapes, tmp_path)
    return {call: [line.split(",")[-2] for line in found] for call, found in lines.items()}, outputs


def onednn_reorder_lines(artifact: Path, precision: str, shapes: list[list[int]], tmp_path: Path):
    """Per (shape, call): oneDNN's verbose line of every reorder it ran; and the outputs, one per shape."""
    env = {**os.environ, "ONEDNN_VERBOSE": "1", "OMP_WAIT_POLICY": "PASSIVE"}
    out = tmp_path / f"{precision}.pt"
    run = subprocess.run(
        [sys.executable, "-c", CALLS, str(artifact), precision, json.dumps(shapes), str(out)],
        env=env, capture_output=True, text=True, check=True,
    )  # fmt: skip
    reorders, current = {}, None
    for line in run.stdout.splitlines():
        if line.startswith("=== "):
            current = line[4:]
            reorders[current] = []
        elif current and line.startswith("onednn_verbose") and ",exec,cpu,reorder," in line:
            reorders[current].append(line)
    return reorders, torch.load(out)


def test_dynamic_convolutions_reorder_no_packed_weight_at_any_shape(gray, tmp_path):
    model = tiny.gray_net()
    (hint,) = [[v.hint[d] if isinstance(d, str) else d for d in ("batch", 1, "height", "width")]
               for v in gray.manifest.variants if v.id == "dynamic"]  # fmt: skip
    shapes = [[1, 1, 24, 24], [2, 1, 48, 48], hint, [2, 1, 31, 45], [1, 1, 48, 25]]
    variants = {v.precision: v.id for v in gray.manifest.variants}
    assert "fp32" in variants
    for precision, vid in variants.items():
        weights = convolution_weights(gray.path / "variants" / f"{vid}.pt2")
        twins = [d for d, p in weights.values() if p] and {d for d, p in weights.values() if p} & {
            d for d, p in weights.values() if not p
        }
        if twins:  # a layout branch: a packed weight and its plain twin, so the log cannot tell their reorders apart
            pytest.skip(f"{vid}: this host's build keeps layout branches (packed and plain {sorted(twins)})")
        packed = {dims for dims, is_packed in weights.values() if is_packed}
        plain = {dims for dims, is_packed in weights.values() if not is_packed}
        assert len(weights) == 5  # every convolution but the transposed one runs as _convolution_pointwise
        assert packed and "16x1x3x3" in plain  # the one-channel stem stays plain
        reorders, outputs = onednn_calls(gray.path, precision, shapes, tmp_path)
        assert len(reorders) == 2 * len(shapes) + 1
        for call, dims in reorders.items():
            assert not packed & set(dims), (precision, call, dims)
            if call != "end":
                assert "16x1x3x3" in dims  # a plain weight is reordered at every call: the log is read right
        for shape, got in zip(shapes, outputs):
            x = torch.randn(shape, generator=torch.Generator().manual_seed(sum(shape)))
            with torch.no_grad():
                want = model(x)
            assert want.abs().max() > 0.1
            tolerance = {"fp32": 1e-5, "bf16": 5e-2}[precision] * want.abs().max().item()
            torch.testing.assert_close(got, want, rtol=0, atol=tolerance)


WARM_THREADS = """
import sys, threading, loader
model = loader.load(sys.argv[1], precision="fp32")  # warms this thread up (its hint; the rest behind it)
model.wait_opened()
for where in ("main", "main", "new thread"):
    print(f"=== {where}", flush=True)
    if where == "main":
        model.warm_thread()
    else:
        thread = threading.Thread(target=model.warm_thread)
        thread.start()
        thread.join()
print("=== end", flush=True)
"""


def test_warm_thread_warms_each_thread_once(gray):
    env = {**os.environ, "ONEDNN_VERBOSE": "1", "OMP_WAIT_POLICY": "PASSIVE"}
    run = subprocess.run([sys.executable, "-c", WARM_THREADS, str(gray.path)], env=env, capture_output=True, text=True)
    assert run.returncode == 0, run.stderr
    ran, current = {}, None
    for line in run.stdout.splitlines():
        if line.startswith("=== "):
            current = line[4:]
            ran.setdefault(current, 0)
        elif current and ",exec,cpu,convolution," in line:
            ran[current] += 1
    assert ran["main"] == 0  # load() warmed the main thread up: nothing runs again
    # the fp32 variant's five convolutions, once at its hint and once at its largest shape (loader.warmup)
    assert ran["new thread"] == 10


def test_the_sizes_of_the_range_are_grouped_by_the_layout_onednn_wants_for_them():
    # oneDNN's cost model picks this convolution's blocking by size and thread count: on a 2-core
    # AVX-512 host it wants another layout only at 28² with a batch of 2 to 4, which the range's
    # corners and middle miss. The pass probes every size the input takes.
    conv = nn.Conv2d(128, 128, 3, stride=2, padding=1)
    dims = {0: torch.export.Dim("batch", min=1, max=4), 2: torch.export.Dim("height", min=24, max=40),
            3: torch.export.Dim("width", min=24, max=40)}  # fmt: skip
    ep = export(conv, torch.randn(2, 128, 32, 32), dims)
    (x,) = [n for n in ep.graph.nodes if n.op == "placeholder" and n.name == ep.graph_signature.user_inputs[0]]
    probed = [tuple(size) for size in prepack.probe_sizes(x.meta["val"].shape)]
    every = {(n, 128, h, w) for n in range(1, 5) for h in range(24, 41) for w in range(24, 41)}
    assert probed[0] == (2, 128, 32, 32) and set(probed) == every  # the hint first, then every size

    def pack(size: list[int]) -> torch.Tensor:
        return torch.ops.mkldnn._reorder_convolution_weight(conv.weight.detach(), [1, 1], [2, 2], [1, 1], 1, size)

    groups, mixed = prepack.group_by_layout(pack, [list(p) for p in probed])  # at this process's thread count
    assert not mixed
    assert groups[0][0] == [2, 128, 32, 32]  # the hint's layout first
    assert sorted(tuple(size) for group in groups for size in group) == sorted(probed)
    layouts = [prepack.layout(pack(group[0])) for group in groups]
    assert len(set(layouts)) == len(groups)
    for group, want in zip(groups, layouts):
        assert all(prepack.layout(pack(size)) == want for size in group[:: max(1, len(group) // 50)])


def test_the_probe_asks_from_several_threads_and_finds_what_one_thread_finds(monkeypatch):
    """``group_by_layout`` asks oneDNN from ``probe_workers()`` threads at once, each at the thread
    count probed (OpenMP's per-thread setting): the same groups, in the same order, as one thread
    asking alone, at each count; the calling thread's count is as it was."""
    conv = nn.Conv2d(256, 512, 1, stride=2)  # two blockings over these sizes on a 2-core AVX-512 host
    sizes = [[b, 256, h, h + 3] for b in (1, 2, 4) for h in range(8, 200)]
    askers = set()

    def pack(size: list[int]) -> torch.Tensor:
        askers.add(threading.current_thread().name)
        return torch.ops.mkldnn._reorder_convolution_weight(conv.weight.detach(), [0, 0], [2, 2], [1, 1], 1, size)

    before = torch.get_num_threads()
    found = {}
    for workers in (1, 3):
        askers.clear()
        monkeypatch.setattr(prepack, "probe_workers", lambda: workers)
        found[workers] = prepack.group_by_layout(pack, sizes, [1, 2])
        assert len(askers) == workers
    assert found[3] == found[1]
    assert sorted([*(size for group in found[3].groups for size in group), *found[3].mixed]) == sorted(sizes)
    assert torch.get_num_threads() == before


@pytest.mark.parametrize("thread_counts_agree", [True, False])
def test_a_static_convolution_s_weight_serves_every_thread_count_a_call_runs_at(monkeypatch, thread_counts_agree):
    """Inductor packs a static convolution's weight for the compiling process's thread count; where
    oneDNN wants another blocking at one thread (two calls at once), it re-laid the weight at every
    such call with its reference reorder (ResNet-50's static variant: 6.2 calls/s on one thread
    against 36.8 on two). The pass keeps a packed weight where the thread counts agree, the plain
    one where they do not; either computes what the packed one did."""
    conv = nn.Conv2d(128, 128, 3, stride=2, padding=1).requires_grad_(False)
    args = ([1, 1], [2, 2], [1, 1], 1)
    x = torch.randn(1, 128, 32, 32)
    packed = torch.ops.mkldnn._reorder_convolution_weight(conv.weight, *args, list(x.shape))
    gm = torch.fx.GraphModule(nn.Module(), torch.fx.Graph())
    gm.register_buffer("w", packed)
    gm.register_buffer("b", conv.bias)
    graph = gm.graph
    inp, w, b = graph.placeholder("x"), graph.get_attr("w"), graph.get_attr("b")
    inp.meta["val"] = x
    out = graph.call_function(prepack.CONVOLUTION, (inp, w, b, *args, "none", [], ""))
    graph.output(out)
    gm.recompile()
    before = gm(x)
    probed = []

    def layouts(pack, sizes, threads=(), settle=False):
        probed.append((list(sizes), list(threads)))
        sizes = list(sizes)
        return prepack.Layouts([sizes], []) if thread_counts_agree else prepack.Layouts([], sizes)

    monkeypatch.setattr(prepack, "group_by_layout", layouts)
    monkeypatch.setattr(prepack, "probe_threads", lambda: [1, 2])
    prepack.PrepackConvolutions()(graph)
    gm.recompile()
    assert probed == [([[1, 128, 32, 32]], [1, 2])]  # the static size, at one thread and at the host's count
    (weight,) = [n for n in graph.nodes if n.op == "get_attr" and n.users and n is not b]
    value = getattr(gm, weight.target)
    assert value.is_mkldnn == thread_counts_agree
    if not thread_counts_agree:
        assert torch.equal(value, conv.weight)  # the plain weight: oneDNN's jitted reorder per call
    torch.testing.assert_close(gm(x), before)


LAYOUTS = """
    name: layouts
    model: {factory: "tiny:layout_net"}
    inputs: {x: {shape: [batch, 3, height, width], dtype: float32}}
    dims: {batch: {min: 1, max: 4}, height: {min: 8, max: 40}, width: {min: 8, max: 40}}
    plan: {max_specialized: 0}
    precision: [fp32]
    accuracy: {metric: cosine, threshold: 0.99, min_speedup: 0}
    check: {random_shapes: 1}
"""


def test_a_weight_oneDNN_lays_out_differently_across_the_range_is_packed_per_layout_and_never_reordered(tmp_path):
    model = tiny.layout_net()

    def pack_for(conv: nn.Conv2d, size: list[int]) -> torch.Tensor:
        w = conv.weight.detach()
        return torch.ops.mkldnn._reorder_convolution_weight(w, conv.padding, conv.stride, [1, 1], 1, size)

    sizes = [[n, 128, h, w] for n in range(1, 5) for h in range(8, 41, 4) for w in range(8, 41, 4)]
    assert (
        len(prepack.group_by_layout(lambda s: pack_for(model.expand, s), sizes).groups) > 1
    )  # the premise: one packed weight cannot serve it all
    built = build(write_profile(tmp_path, LAYOUTS), tmp_path / "artifact")
    (variant,) = built.manifest.variants
    with zipfile.ZipFile(built.path / "variants" / f"{variant.id}.pt2") as z:
        (code,) = [z.read(n).decode() for n in z.namelist() if n.endswith(".wrapper.cpp")]
    assert "_layout_branch" in code  # the layout is chosen per call (torch.cond, inlined as an if)
    assert "aoti_torch_cpu_mkldnn__convolution_pointwise_binary(" in code  # the addition and ReLU fused in a branch
    hint = [variant.hint[d] if isinstance(d, str) else d for d in ("batch", 3, "height", "width")]
    shapes = [[1, 3, 8, 8], [4, 3, 40, 40], hint, [3, 3, 17, 33], [2, 3, 28, 28], [1, 3, 40, 9], [4, 3, 9, 38]]
    reorders, outputs = onednn_reorder_lines(built.path, "fp32", shapes, tmp_path)
    assert len(reorders) == 2 * len(shapes) + 1
    for shape in shapes:
        # where one thread and this host's count want different layouts, the plain weight serves (and
        # is re-laid by the jitted reorder); everywhere else no weight is re-laid
        mixed = {
            "x".join(map(str, conv.weight.shape))
            for conv, size in (
                (model.stem, shape),
                (model.expand, [shape[0], 128, *shape[2:]]),
                (model.head, [shape[0], 512, *shape[2:]]),
            )  # fmt: skip
            if prepack.group_by_layout(lambda s: pack_for(conv, s), [size], prepack.probe_threads()).mixed
        }
        for call in range(2):
            lines = reorders[f"{shape} {call}"]
            sources = {next(f for f in line.split(",") if f.startswith("src:")).split(":")[4] for line in lines}
            assert sources <= {"abcd"}, lines  # from a plain weight only, never a packed one
            assert {line.split(",")[-2] for line in lines} == mixed, (shape, call, lines)
    for shape, got in zip(shapes, outputs):
        x = torch.randn(shape, generator=torch.Generator().manual_seed(sum(shape)))
        with torch.no_grad():
            want = model(x)
        torch.testing.assert_close(got, want, rtol=0, atol=1e-5 * want.abs().max().item())


def test_a_relu6_and_a_silu_after_a_convolution_laid_out_per_call_are_fused_into_its_branches(tmp_path):
    """Inductor fuses such activations into the convolution (oneDNN's post-ops) only where it can see
    them: after a per-call layout choice they ran as a pass of their own over the activation (15 a
    call on MobileNetV2), unless the choice's branches fuse them."""
    profile = write_profile(tmp_path, LAYOUTS.replace("layout_net", "activated_layout_net"))
    built = build(profile, tmp_path / "artifact")
    code = generated_code(built.path)
    assert "_layout_branch" in code  # the premise: the expansions' layouts are chosen per call
    kernels = set(re.findall(r"void\s+(cpp_fused_\w+)\(", code))
    assert not [k for k in kernels if "hardtanh" in k or "silu" in k or "clamp" in k], kernels
    assert '"hardtanh"' in code and '"swish"' in code  # oneDNN's post-ops, in the branches
    model, artifact = tiny.activated_layout_net(), loader.load(built.path)
    for shape in ([1, 3, 8, 8], [4, 3, 40, 40], [3, 3, 17, 33], [2, 3, 28, 28]):
        x = torch.randn(shape, generator=torch.Generator().manual_seed(sum(shape)))
        with torch.no_grad():
            want = model(x)
        torch.testing.assert_close(artifact(x), want, rtol=0, atol=1e-5 * want.abs().max().item())


def test_the_first_call_bench_sets_each_unseen_shape_against_its_steady_call(gray):
    from bench import firstcall

    rows = firstcall.measure([gray.path], shapes=2, repeat=3)  # a fresh process per warm-up mode, as a server loads
    dynamic = {v.id: v for v in gray.manifest.variants if v.kind == "dynamic"}
    assert rows and all("failed" not in r for r in rows)
    assert {r["warmup"] for r in rows} == set(firstcall.WARMUPS) == {"hint", "auto"}
    by_mode = {m: [(r["variant"], r["dims"]) for r in rows if r["warmup"] == m] for m in firstcall.WARMUPS}
    assert by_mode["hint"] == by_mode["auto"]  # the same shapes, with and without the largest shape's warm-up
    assert {vid for vid, _ in by_mode["hint"]} <= set(dynamic) and len(by_mode["hint"]) == 2 * len(
        {vid for vid, _ in by_mode["hint"]}
    )
    for r in rows:  # shapes no warm-up met
        assert r["dims"] not in r["warmed"] and r["ratio"] == pytest.approx(r["first_ms"] / r["steady_ms"])
        assert len(r["warmed"]) == (1 if r["warmup"] == "hint" else 2)
    said = firstcall.per_artifact(rows)
    assert len(said) == 2
    for name, s in said.items():
        mine = [r for r in rows if f"[warm-up: {r['warmup']}]" in name]
        assert s["shapes"] == len(mine) and s["worst"] == max(r["ratio"] for r in mine)
        assert s["first_faults"] == sum(r["first_faults"] for r in mine)
        assert name in firstcall.summary(rows) and f"{s['worst']:.2f}×" in firstcall.summary(rows)


# Loads the artifact in a fresh process (warm-up as argv[2] says, or the default) under oneDNN's verbose
# log of primitive creations, then calls it once at the largest shape its ranges hold.
FIRST_AT_LARGEST = """
import sys, torch, loader
path, mode = sys.argv[1], sys.argv[2]
model = loader.load(path, open="eager") if mode == "default" else loader.load(path, open="eager", warmup_shapes=mode)
(v,) = [v for v in model.variants if v.kind == "dynamic" and v.precision == "fp32"]
shape = [v.dims[d].max if isinstance(d, str) else d for d in model.manifest.inputs[0].shape]
print("=== first", flush=True)
model.run_variant(v.id, torch.randn(shape))
print("=== end", flush=True)
"""


def test_after_the_default_warm_up_a_call_at_the_range_s_largest_shape_creates_no_onednn_primitive(gray):
    """Its buffers were allocated and touched at load (loader.warmup); with the hint alone the first
    such call creates every convolution's primitive then."""
    env = {**os.environ, "ONEDNN_VERBOSE": "profile_create", "OMP_WAIT_POLICY": "PASSIVE"}
    created = {}
    for mode in ("default", "hint"):
        run = subprocess.run(
            [sys.executable, "-c", FIRST_AT_LARGEST, str(gray.path), mode],
            env=env, capture_output=True, text=True, check=True,
        )  # fmt: skip
        first = run.stdout.split("=== first\n", 1)[1].split("=== end", 1)[0]
        created[mode] = first.count(",create:cache_miss,")
    assert created["default"] == 0 and created["hint"] >= 5  # the gray net's 5 pointwise convolutions
