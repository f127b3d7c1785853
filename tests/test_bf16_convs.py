"""bf16 convolutions with dynamic sizes reorder no weight at any call (precompile.passes.prepack).

At the sizes where oneDNN wants one weight format with one thread and another with two (small
images, batch 1: the last stages of a ResNet), a packed weight cannot serve both, and the pass ran
those sizes on the plain weight, re-laid at every call (bf16 ResNet-50 at 1×103×87: three weights
of 1-2 MB a call). A 1×1 convolution now runs there as a linear layer on a weight packed for
oneDNN's matmul, whose format depends on neither size nor thread count.
"""

from __future__ import annotations

import torch

from precompile.passes import prepack
from precompile.pipeline import build

from .conftest import write_profile
from .models import tiny
from .test_convnets import generated_code, onednn_reorder_lines

# LayoutNet's 1×1 expansion (128 to 512 channels) over the small images where the thread counts
# disagree on its bf16 weight's format (on a 2-core AVX-512 host: 4×3 at batch 1, 4×4 at batch 2).
SMALL = """
    name: small-images
    model: {factory: "tiny:layout_net"}
    inputs: {x: {shape: [batch, 3, height, width], dtype: float32}}
    dims: {batch: {min: 1, max: 2}, height: {min: 2, max: 8}, width: {min: 2, max: 8}}
    plan: {max_specialized: 0}
    precision: [bf16]
    accuracy: {metric: cosine, threshold: 0.99, min_speedup: 0}
    check: {random_shapes: 1}
"""


def expand_weight_formats(size: list[int]) -> prepack.Layouts:
    """How oneDNN lays LayoutNet's bf16 expansion weight out for an input of ``size``, per thread count."""
    w = tiny.layout_net().expand.weight.detach().to(torch.bfloat16)

    def pack(s: list[int]) -> torch.Tensor:
        return torch.ops.mkldnn._reorder_convolution_weight(w, [0, 0], [1, 1], [1, 1], 1, s)

    return prepack.group_by_layout(pack, [size], prepack.probe_threads())


def test_a_bf16_pointwise_convolution_reorders_no_weight_where_thread_counts_want_different_formats(tmp_path):
    mixed = [1, 3, 4, 3]
    assert expand_weight_formats([1, 128, 4, 3]).mixed  # the premise: no one packed weight serves this size
    built = build(write_profile(tmp_path, SMALL), tmp_path / "artifact")
    (variant,) = [v for v in built.manifest.variants if v.precision == "bf16"]
    code = generated_code(built.path)
    assert "_layout_branch" in code and "aoti_torch_cpu__linear_pointwise(" in code  # a branch runs a linear layer
    hint = [variant.hint[d] if isinstance(d, str) else d for d in ("batch", 3, "height", "width")]
    shapes = [mixed, [1, 3, 2, 2], [2, 3, 8, 8], hint, [2, 3, 4, 4], [1, 3, 2, 5]]
    reorders, outputs = onednn_reorder_lines(built.path, "bf16", shapes, tmp_path)
    assert len(reorders) == 2 * len(shapes) + 1  # the log is read right: a marker per call
    for call, lines in reorders.items():
        assert not [line for line in lines if line.split(",")[-2].endswith("x1x1")], (call, lines)
    model = tiny.layout_net()
    for shape, got in zip(shapes, outputs):
        x = torch.randn(shape, generator=torch.Generator().manual_seed(sum(shape)))
        with torch.no_grad():
            want = model(x)
        assert want.abs().max() > 0.1
        assert torch.nn.functional.cosine_similarity(got.flatten(1), want.flatten(1)).min() > 0.99, shape
