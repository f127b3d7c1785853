"""Inductor fails to lower a convolution whose input is a view with sum-of-FloorDiv strides (torch 2.13).

Segformer's pattern: a strided patch-embedding conv, tokens [b, h*w, c] through LayerNorms, then
`x.transpose(1, 2).reshape(b, c, h, w)` into another conv, with dynamic height and width. Lowering
that conv checks the view's stride order (ir.Layout.is_stride_ordered -> guard_or_false(Eq(l % r, 0)));
sympy turns `l % r` into an expression with a negative power, and value-range analysis raises
ValueRangeError: Invalid ranges [0:-1] (ValueRanges.pow_by_natural clamps the exponent's range to
[0, oo] and gets an empty one). Copying the view first into another layout compiles and matches eager
(`.clone()` alone does not help: Inductor's remove_noop_ops drops a clone with its input's strides).

    python inductor-segformer-dynamic.py            # fails: LoweringException: ValueRangeError
    python inductor-segformer-dynamic.py --clone    # the workaround: compiles and matches eager
"""

import sys

import torch
from torch import nn


class PatchThenReduce(nn.Module):
    def __init__(self, clone: bool = False):
        super().__init__()
        self.clone = clone
        self.patch = nn.Conv2d(3, 8, 7, stride=4, padding=3)  # h = (height - 1) // 4 + 1
        self.norm1 = nn.LayerNorm(8)
        self.norm2 = nn.LayerNorm(8)
        self.reduce = nn.Conv2d(8, 8, 8, stride=8)

    def forward(self, x):
        x = self.patch(x)
        b, c, h, w = x.shape
        tokens = self.norm2(self.norm1(x.flatten(2).transpose(1, 2)))  # [b, h*w, c]
        image = tokens.transpose(1, 2).reshape(b, c, h, w)
        return self.reduce(image.clone(memory_format=torch.contiguous_format) if self.clone else image)


torch.manual_seed(0)
model = PatchThenReduce(clone="--clone" in sys.argv).eval()
x = torch.randn(2, 3, 200, 210)
dims = {
    0: torch.export.Dim("batch", min=1, max=4),
    2: torch.export.Dim("height", min=96, max=256),
    3: torch.export.Dim("width", min=96, max=256),
}
with torch.no_grad():
    ep = torch.export.export(model, (x,), dynamic_shapes=(dims,))
    path = torch._inductor.aoti_compile_and_package(ep)
    compiled = torch._inductor.aoti_load_package(path)
    for shape in [(1, 3, 96, 96), (3, 3, 97, 255), (4, 3, 256, 256)]:
        t = torch.randn(shape)
        torch.testing.assert_close(compiled(t), model(t))
print(f"torch {torch.__version__}: compiled, matches eager at 3 shapes")
