"""[Inductor][CPU] a zero pad before a convolution is a copy of the whole activation (EfficientNet's
stride-2 depthwise blocks): standalone repro, torch only, about a minute on 2 cores.

    python inductor-pad-before-conv.py

transformers' EfficientNet pads each stride-2 depthwise convolution's input by hand
(``nn.ZeroPad2d((0, 1, 0, 1))`` for a 3×3 kernel) and convolves it with ``padding="valid"``.
Inductor (freezing on, as for a frozen CPU model) compiles the pad as a kernel of its own that writes
a padded copy of the activation, then hands it to oneDNN. oneDNN takes asymmetric padding natively
(``padding_l``/``padding_r``), and even through aten's symmetric ``padding`` the same values come out
of the convolution with the pad's larger side as padding and a zero row and column added to the
kernel on the other side: no copy.
"""

from __future__ import annotations

import re
import time

import torch
import torch._inductor.config as inductor_config
import torch.nn.functional as F
from torch import nn


class PadThenDepthwise(nn.Module):
    """1×1 expansion, the hand-written pad, a stride-2 depthwise 3×3, as in EfficientNet's blocks."""

    def __init__(self, channels: int = 96) -> None:
        super().__init__()
        self.expand = nn.Conv2d(24, channels, 1)
        self.depthwise = nn.Conv2d(channels, channels, 3, stride=2, groups=channels)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.depthwise(F.pad(F.silu(self.expand(x)), (0, 1, 0, 1)))


class Folded(nn.Module):
    """The same values: padding 1 and a 4×4 kernel whose first row and column are zero."""

    def __init__(self, padded: PadThenDepthwise) -> None:
        super().__init__()
        self.expand = padded.expand
        weight = F.pad(padded.depthwise.weight.detach(), (1, 0, 1, 0))
        self.depthwise = nn.Conv2d(weight.shape[0], weight.shape[0], 4, stride=2, padding=1, groups=weight.shape[0])
        self.depthwise.weight.data.copy_(weight)
        self.depthwise.bias.data.copy_(padded.depthwise.bias.detach())

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.depthwise(F.silu(self.expand(x)))


def median_ms(fn, x: torch.Tensor, n: int = 50) -> float:
    for _ in range(5):
        fn(x)
    times = []
    for _ in range(n):
        start = time.perf_counter()
        fn(x)
        times.append((time.perf_counter() - start) * 1000)
    return sorted(times)[n // 2]


def main() -> None:
    torch.manual_seed(0)
    inductor_config.freezing = True
    padded = PadThenDepthwise().eval()
    folded = Folded(padded).eval()
    shapes = [(4, 24, 72, 63), (2, 24, 80, 79), (3, 24, 48, 48)]
    with torch.no_grad():
        for shape in shapes:  # odd and even sizes: the pad's extra column is read at some only
            x = torch.randn(shape).to(memory_format=torch.channels_last)
            torch.testing.assert_close(folded(x), padded(x), rtol=1e-5, atol=1e-5)
        from torch._inductor.utils import run_and_get_code

        compiled = {}
        for name, model in (("pad + valid conv", padded), ("folded", folded)):
            compiled[name] = torch.compile(model, dynamic=True)
            x = torch.randn(shapes[0]).to(memory_format=torch.channels_last)
            _, code = run_and_get_code(compiled[name], x)
            names = sorted(set(re.findall(r"(cpp_fused_\w+) = async_compile", "\n".join(code))))
            print(f"{name:18} Inductor kernels: {', '.join(names) or 'none'}")
        print(f"torch {torch.__version__}, {torch.get_num_threads()} threads, channels-last input, dynamic shapes")
        for shape in shapes:
            x = torch.randn(shape).to(memory_format=torch.channels_last)
            cells = "  ".join(f"{name} {median_ms(fn, x):7.3f} ms" for name, fn in compiled.items())
            print(f"  {'x'.join(map(str, shape)):12} {cells}")


if __name__ == "__main__":
    main()
