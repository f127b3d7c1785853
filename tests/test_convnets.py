"""Convnets Inductor compiles badly or not at all (precompile.passes.convnets): tiny transformers vision
models built through the whole pipeline, and the graph rewrites and failure message on their own."""

from __future__ import annotations

import re
import zipfile
from pathlib import Path

import pytest
import torch
import torch._inductor
from torch import nn

import loader
from precompile.options import unit_options, with_kind_defaults
from precompile.passes import convnets
from precompile.pipeline import build

from .models import hf_tiny, tiny
from .test_doctor import profile

# Graph rewrites on exported convnets, artifacts compiled: seconds a test (the prepacking half is
# tests/test_prepack.py).
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
