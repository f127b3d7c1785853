"""Convnets Inductor compiles badly or not at all (precompile.passes.convnets): tiny transformers vision
models built through the whole pipeline, and the graph rewrites and failure message on their own."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest
import torch
import torch._inductor
from torch import nn

import loader
from precompile.options import unit_options, with_kind_defaults
from precompile.passes import convnets, prepack
from precompile.pipeline import build

from .conftest import builds, write_profile
from .models import hf_tiny, tiny
from .test_doctor import profile

# Graph rewrites on exported convnets, oneDNN's layouts probed, artifacts compiled: seconds a test.
pytestmark = pytest.mark.integration

# A static batch: the point of these builds is the dynamic height and width, and a dynamic batch
# besides adds to Inductor's symbolic work at every size (about 15 s on Segformer).
IMAGES = """
    name: {name}
    model: {{factory: "hf_tiny:{name}", outputs: [logits]}}
    inputs: {{pixel_values: {{shape: [{batch}, 3, height, width], dtype: float32}}}}
    dims: {{height: {{min: {lo}, max: {hi}}}, width: {{min: {lo}, max: {hi}}}}}
    check: {{random_shapes: 1}}
"""


def generated_code(artifact: Path) -> str:
    """The C++ Inductor wrote for every variant (AOTInductor packages keep their sources)."""
    out = []
    for package in (artifact / "variants").glob("*.pt2"):
        with zipfile.ZipFile(package) as z:
            out += [z.read(n).decode() for n in z.namelist() if n.endswith(".cpp")]
    return "\n".join(out)


def matches_eager(artifact: Path, model: nn.Module, shape: tuple[int, ...]) -> None:
    x = torch.randn(shape, generator=torch.Generator().manual_seed(5))
    with torch.no_grad():
        want = model(pixel_values=x).logits
    got = loader.load(artifact)(x)
    got = got["logits"] if isinstance(got, dict) else got
    assert want.abs().max() > 0.1  # a model whose outputs vanish would match any compiled code
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-5)


def test_efficientnet_pools_with_a_mean_over_any_image_size(tmp_path):
    result = build(profile(tmp_path, IMAGES.format(name="efficientnet", batch=2, lo=32, hi=96)), tmp_path / "artifact")
    artifact = result.path
    # No compile section: a convnet is frozen by default (its weights packed, inside its package).
    assert [v.embedded_constants for v in result.manifest.variants] == [True]
    kernels = set(re.findall(r"void\s+(cpp_fused_\w+)\(", generated_code(artifact)))
    assert kernels and not [k for k in kernels if "avg_pool2d" in k]  # no loop over the 64×64 window
    assert [k for k in kernels if "mean" in k]
    # The stride-2 depthwise convolutions' pads are their own padding: only the dense stem's is a copy.
    assert len([k for k in kernels if "pad" in k]) == 1, kernels
    # Squeeze-and-excite's convolutions over the pooled pixel run as dense layers (beside the classifier's).
    assert generated_code(artifact).count("aoti_torch_cpu__linear_pointwise(") > 1
    matches_eager(artifact, hf_tiny.efficientnet(), (2, 3, 41, 77))


def test_segformer_builds_with_dynamic_height_and_width(tmp_path):
    # One image a call: the failure was the dynamic height and width (a view's strides summed from
    # floor divisions).
    artifact = build(
        profile(tmp_path, IMAGES.format(name="segformer", batch=1, lo=64, hi=128)), tmp_path / "artifact"
    ).path
    matches_eager(artifact, hf_tiny.segformer(), (1, 3, 127, 65))


# --- the rewrites and the message on their own ---------------------------------------------------


class Pools(nn.Module):
    def __init__(self):
        super().__init__()
        self.whole = nn.AvgPool2d(64, ceil_mode=True)  # covers every input up to 64×64
        self.local = nn.AvgPool2d(2)

    def forward(self, x):
        return self.whole(x).mean((-2, -1)) + self.local(x).mean((-2, -1))


def line_of(code: str) -> int:
    """This file's line number of ``code`` (the model line a message must name)."""
    return next(i for i, line in enumerate(Path(__file__).read_text().splitlines(), 1) if line.strip() == code)


def export(model: nn.Module, x: torch.Tensor, dims: dict[int, torch.export.Dim] | None) -> torch.export.ExportedProgram:
    with torch.no_grad():
        return torch.export.export(model.eval(), (x,), dynamic_shapes=(dims,) if dims else None)


def test_only_a_window_covering_every_input_becomes_a_mean():
    height = torch.export.Dim("height", min=4, max=64)
    ep = export(Pools(), torch.randn(2, 3, 10, 12), {2: height})
    done = convnets.rewrite(ep)
    code = "return self.whole(x).mean((-2, -1)) + self.local(x).mean((-2, -1))"
    where = f"test_convnets.py:{line_of(code)} in forward: {code}"
    assert [(r.kind, r.where) for r in done] == [("global_avg_pool", where)]
    targets = [n.target for n in ep.graph.nodes if n.op == "call_function"]
    assert targets.count(torch.ops.aten.avg_pool2d.default) == 1  # the 2×2 pool stays
    x = torch.randn(2, 3, 37, 12)
    torch.testing.assert_close(ep.module()(x), Pools()(x))


def test_a_window_smaller_than_some_input_stays_a_pool():
    height = torch.export.Dim("height", min=4, max=64)
    ep = export(Pools(), torch.randn(2, 3, 10, 80), {2: height})  # 80 columns: two windows across
    assert convnets.rewrite(ep) == []


class TokensToImage(nn.Module):
    """Segformer's pattern: patch embeddings, tokens [b, h*w, c] through LayerNorms, back to an image."""

    def __init__(self):
        super().__init__()
        self.patch = nn.Conv2d(3, 8, 7, stride=4, padding=3)
        self.norms = nn.Sequential(nn.LayerNorm(8), nn.LayerNorm(8))
        self.reduce = nn.Conv2d(8, 8, 8, stride=8)

    def forward(self, x):
        x = self.patch(x)
        b, c, h, w = x.shape
        image = self.norms(x.flatten(2).transpose(1, 2)).transpose(1, 2).reshape(b, c, h, w)
        return self.reduce(image)


IMAGE_DIMS = {0: torch.export.Dim("batch", min=1, max=4), 2: torch.export.Dim("height", min=96, max=256),
              3: torch.export.Dim("width", min=96, max=256)}  # fmt: skip


def test_a_convolution_reads_a_copy_of_a_view_with_dynamic_sizes_only():
    dynamic = export(TokensToImage(), torch.randn(2, 3, 200, 210), IMAGE_DIMS)
    at = f"test_convnets.py:{line_of('return self.reduce(image)')} in forward: return self.reduce(image)"
    assert [(r.kind, r.where) for r in convnets.rewrite(dynamic)] == [("copy_conv_input", at)]
    convs = [n for n in dynamic.graph.nodes if n.target is torch.ops.aten.conv2d.default]
    assert [c.args[0].target for c in convs] == ["x", torch.ops.aten.clone.default]
    static = export(TokensToImage(), torch.randn(2, 3, 200, 210), None)
    assert convnets.rewrite(static) == []


def test_a_lowering_failure_names_the_model_line_and_the_dims(tmp_path):
    ep = export(TokensToImage(), torch.randn(2, 3, 200, 210), IMAGE_DIMS)
    try:  # Inductor itself, without the rewrite that avoids its failure
        torch._inductor.aoti_compile_and_package(ep, package_path=str(tmp_path / "model.pt2"))
    except Exception as e:
        message = convnets.explain_failure(e, ep, [["batch", 3, "height", "width"]])
    else:
        raise AssertionError("Inductor compiled the pattern: torch has fixed the bug; retire the rewrite")
    assert message is not None and "\n" not in message
    at = f"test_convnets.py:{line_of('return self.reduce(image)')} in forward: return self.reduce(image)"
    assert f"cannot compile aten.convolution at {at} for dynamic height and width" in message
    assert "sizes [batch, 8, (((height - 1)//4)) + 1, (((width - 1)//4)) + 1] are floor divisions" in message
    assert "ValueRangeError: Invalid ranges [0:-1]" in message
    assert message.endswith("declare height and width as static sizes in the profile (one variant per size)")


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
    # Inside a layout branch (a subgraph), a constant reaches the call as a local handle assigned from it.
    aliases = dict((local, const) for const, local in re.findall(r"assign_tensors_out\((\w+), &(\w+)_handle\)", code))
    out = {}
    for weight, groups in re.findall(
        r"aoti_torch_cpu_mkldnn__convolution_pointwise\(\w+, (\w+),(?:[^;]*?\.cbegin\(\), \d+,){3} (\d+)L", code
    ):
        weight = aliases.get(weight, weight)
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
model = loader.load(sys.argv[1], precision="fp32")  # warms this thread up
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


class PatchedEncoder(nn.Module):
    """ViT's shape: one convolution cuts the image into patches, dense layers do the rest."""

    def __init__(self):
        super().__init__()
        self.patch = nn.Conv2d(3, 8, 4, stride=4)
        self.layers = nn.Sequential(nn.Linear(8, 8), nn.ReLU(), nn.Linear(8, 8))

    def forward(self, x):
        return self.layers(self.patch(x).flatten(2).transpose(1, 2))


def test_a_convnet_compiles_frozen_unless_its_profile_says_otherwise():
    x = torch.randn(2, 1, 32, 32)
    assert convnets.model_kind(export(tiny.gray_net(), x, None)) == "convnet"
    assert convnets.model_kind(export(PatchedEncoder(), x.expand(2, 3, 32, 32), None)) == "other"
    assert with_kind_defaults(unit_options({}), "convnet")["freezing"] is True
    assert "freezing" not in with_kind_defaults(unit_options({}), "other")
    assert with_kind_defaults(unit_options({"freezing": False}), "convnet")["freezing"] is False
    assert with_kind_defaults(unit_options({}, isa="x86-64-v3"), "convnet")["freezing"] is False  # portable: unfrozen


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


def test_a_one_pixel_convolution_becomes_a_dense_layer_and_computes_the_same():
    dims = {0: torch.export.Dim("batch", min=1, max=4), 2: torch.export.Dim("height", min=8, max=64),
            3: torch.export.Dim("width", min=8, max=64)}  # fmt: skip
    model = tiny.excite_net()
    ep = export(model, torch.randn(2, 3, 20, 24), dims)
    done = convnets.rewrite(ep)
    assert sorted(r.kind for r in done) == ["pixel_conv_as_linear"] * 2  # squeeze-excite's two, not the others
    targets = [n.target for n in ep.graph.nodes if n.op == "call_function"]
    assert targets.count(torch.ops.aten.linear.default) == 2
    assert sum(t in convnets.CONVOLUTIONS or getattr(t, "overloadpacket", None) in convnets.CONVOLUTIONS
               for t in targets) == 3  # fmt: skip
    for shape in ((1, 3, 8, 8), (3, 3, 37, 64)):
        x = torch.randn(shape)
        with torch.no_grad():
            torch.testing.assert_close(ep.module()(x), model(x), rtol=1e-5, atol=1e-5)


def test_a_convolution_over_more_than_one_pixel_stays_a_convolution():
    dims = {0: torch.export.Dim("batch", min=1, max=4), 2: torch.export.Dim("height", min=1, max=8),
            3: torch.export.Dim("width", min=1, max=8)}  # fmt: skip
    ep = export(nn.Conv2d(4, 6, 1).eval(), torch.randn(2, 4, 3, 3), dims)  # one pixel at some sizes only
    assert convnets.rewrite(ep) == []


class Padded(nn.Module):
    """EfficientNet's pads (transformers: ``nn.ZeroPad2d(correct_pad(k))`` before a "valid" stride-2
    depthwise convolution, and ``(0, 1, 0, 1)`` before the dense stem), and a symmetric one."""

    def __init__(self):
        super().__init__()
        self.stem_pad, self.stem = nn.ZeroPad2d((0, 1, 0, 1)), nn.Conv2d(3, 8, 3, 2, padding="valid")
        self.pad3, self.dw3 = nn.ZeroPad2d((0, 1, 0, 1)), nn.Conv2d(8, 8, 3, 2, padding="valid", groups=8)
        self.pad5, self.dw5 = nn.ZeroPad2d((1, 2, 1, 2)), nn.Conv2d(8, 8, 5, 2, padding="valid", groups=8, bias=False)
        self.wide, self.dw = nn.ZeroPad2d((2, 1, 0, 0)), nn.Conv2d(8, 8, 3, 1, padding=1, groups=8)
        self.same, self.dense = nn.ZeroPad2d(1), nn.Conv2d(8, 4, 3)

    def forward(self, x):
        x = self.stem(self.stem_pad(x))
        x = self.dw5(self.pad5(self.dw3(self.pad3(x)))) + 1
        return self.dense(self.same(self.dw(self.wide(x))))


def test_a_zero_pad_before_a_convolution_becomes_its_padding_and_computes_the_same():
    """Pads of the depthwise convolutions, asymmetric or not, and the symmetric one go into the
    convolutions (the asymmetric by a kernel with zero taps); the dense stem's asymmetric pad stays."""
    dims = {0: torch.export.Dim("batch", min=1, max=4), 2: torch.export.Dim("height", min=16, max=64),
            3: torch.export.Dim("width", min=16, max=64)}  # fmt: skip
    model = Padded().eval()
    ep = export(model, torch.randn(2, 3, 32, 40), dims)
    done = convnets.rewrite(ep)
    assert [r.kind for r in done] == ["pad_into_conv"] * 4
    assert [r.where.split(" in ")[0] for r in done] == [f"test_convnets.py:{line_of(code)}" for code in (
        "x = self.dw5(self.pad5(self.dw3(self.pad3(x)))) + 1",) * 2 + (
        "return self.dense(self.same(self.dw(self.wide(x))))",) * 2]  # fmt: skip
    pads = [n for n in ep.graph.nodes if n.op == "call_function" and n.target is torch.ops.aten.pad.default]
    assert [n.args[1] for n in pads] == [[0, 1, 0, 1]]  # the stem's
    for shape in ((1, 3, 16, 16), (3, 3, 37, 64), (2, 3, 33, 18), (4, 3, 64, 63)):  # odd and even sizes
        x = torch.randn(shape)
        with torch.no_grad():
            torch.testing.assert_close(ep.module()(x), model(x), rtol=1e-5, atol=1e-5)
