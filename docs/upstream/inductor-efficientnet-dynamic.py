"""Inductor lowers avg_pool2d over the whole kernel window, not the input's extent (torch 2.13, CPU).

transformers' EfficientNet pools with nn.AvgPool2d(1280, ceil_mode=True) on a 7x7 map (a global
average pool written as a huge window). Eager clips the window to the input; Inductor's lowering
(torch/_inductor/lowering.py, _avg_poolnd) emits a masked sum over all 1280x1280 window positions
per output element, with static and dynamic sizes alike. Runs in ~30 s on 2 cores:

    python inductor-efficientnet-dynamic.py
"""

import time

import torch


class Pool(torch.nn.Module):
    def __init__(self, kernel: int = 1280):
        super().__init__()
        self.pool = torch.nn.AvgPool2d(kernel, ceil_mode=True)

    def forward(self, x):
        return self.pool(x)


def ms(fn, x, n=3):
    fn(x)
    t = time.perf_counter()
    for _ in range(n):
        fn(x)
    return (time.perf_counter() - t) / n * 1e3


torch.manual_seed(0)
x = torch.randn(1, 64, 7, 7)
pool = Pool().eval()
with torch.no_grad():
    compiled = torch.compile(pool, dynamic=False)
    torch.testing.assert_close(compiled(x), pool(x))
    dynamic = torch.compile(Pool().eval(), dynamic=True)
    torch.testing.assert_close(dynamic(x), pool(x))
    workaround = torch.compile(lambda t: t.mean((-2, -1), keepdim=True), dynamic=False)
    torch.testing.assert_close(workaround(x), pool(x))
    print(f"torch {torch.__version__}: AvgPool2d(1280, ceil_mode=True) on {tuple(x.shape)}")
    print(f"  eager               {ms(pool, x):8.3f} ms")
    print(
        f"  torch.compile       {ms(compiled, x):8.3f} ms   (a masked loop over 1280*1280 window positions per channel)"
    )
    print(f"  ... dynamic=True    {ms(dynamic, x):8.3f} ms")
    print(f"  compiled x.mean()   {ms(workaround, x):8.3f} ms   (the same values)")
