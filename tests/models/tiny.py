"""Tiny real models for the test suite (each compiles in seconds)."""

from __future__ import annotations

import torch
from torch import nn


class Classifier(nn.Module):
    """Two inputs sharing batch and seq; returns one tensor."""

    def __init__(self, vocab: int = 50, width: int = 16):
        super().__init__()
        self.embed = nn.Embedding(vocab, width)
        self.mix = nn.Linear(width, width)
        self.head = nn.Linear(width, 3)

    def forward(self, ids: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        x = torch.tanh(self.mix(self.embed(ids)))
        m = mask.unsqueeze(-1).to(x.dtype)
        return self.head((x * m).sum(1) / m.sum(1).clamp(min=1.0))


class Structured(nn.Module):
    """One float input with a static axis; returns a dict holding a tensor and a tuple."""

    def __init__(self):
        super().__init__()
        self.a = nn.Linear(8, 4)
        self.b = nn.Linear(8, 2)

    def forward(self, x: torch.Tensor):
        h = self.a(x)
        return {"hidden": h, "pair": (self.b(x).softmax(-1), h.sum(-1))}


class Noisy(nn.Module):
    """Compiled and eager outputs differ (fresh noise each call): the check stage must refuse it."""

    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(8, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.lin(x) + torch.rand_like(x)


class DataDependent(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(8, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.sum() > 0:
            return self.lin(x)
        return -x


class Specializes(nn.Module):
    """Works only when seq is 16: torch.export pins the dim to that size."""

    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(16, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.lin(x.reshape(x.shape[0], 16))


def classifier(**kwargs) -> nn.Module:
    torch.manual_seed(0)
    return Classifier(**kwargs)


def structured() -> nn.Module:
    torch.manual_seed(1)
    return Structured()


def noisy() -> nn.Module:
    return Noisy()


def data_dependent() -> nn.Module:
    return DataDependent()


def specializes() -> nn.Module:
    return Specializes()


def broken() -> nn.Module:
    raise RuntimeError("factory exploded")


def not_a_module():
    return 42


class Tagger(nn.Module):
    """Per-token logits [batch, seq, 3] and a masked mean [batch, 3]: padding seq with mask=False
    leaves both unchanged on the real tokens, and every output follows batch."""

    def __init__(self, vocab: int = 50, width: int = 16):
        super().__init__()
        self.embed = nn.Embedding(vocab, width)
        self.mix = nn.Linear(width, width)
        self.head = nn.Linear(width, 3)

    def forward(self, ids: torch.Tensor, mask: torch.Tensor):
        tokens = self.head(torch.tanh(self.mix(self.embed(ids))))
        m = mask.unsqueeze(-1).to(tokens.dtype)
        return tokens, (tokens * m).sum(1) / m.sum(1).clamp(min=1.0)


def tagger() -> nn.Module:
    torch.manual_seed(2)
    return Tagger()


class Scores(nn.Module):
    """Attention scores ``[batch, seq, seq]`` (q·kᵀ of token embeddings, no softmax): padding seq adds
    rows and columns and leaves the real ones unchanged, so pad is exact once both seq axes are cut
    back; splitting seq would lose every score across pieces; splitting batch is exact."""

    def __init__(self, vocab: int = 50, width: int = 8):
        super().__init__()
        self.embed = nn.Embedding(vocab, width)
        self.q = nn.Linear(width, width)
        self.k = nn.Linear(width, width)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        x = self.embed(ids)
        return self.q(x) @ self.k(x).transpose(1, 2)


def scores() -> nn.Module:
    torch.manual_seed(3)
    return Scores()


class DiesInWorker(nn.Module):
    """Kills its own process with SIGKILL when run inside a build's compile worker (as the
    out-of-memory killer would); runs normally in the process that started the build."""

    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(8, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        import multiprocessing
        import os
        import signal

        if multiprocessing.parent_process() is not None:
            os.kill(os.getpid(), signal.SIGKILL)
        return self.lin(x)


def dies_in_worker() -> nn.Module:
    return DiesInWorker()


class FailsOrHangsInWorker(nn.Module):
    """Inside a build's compile worker, fails at once where its batch is static and sleeps for a
    minute where it is dynamic (a compile that is still running when the build fails); runs normally
    in the process that started the build."""

    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(8, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        import multiprocessing
        import time

        if multiprocessing.parent_process() is not None:
            if isinstance(x.shape[0], int):
                raise ValueError("this variant fails in its compile worker")
            time.sleep(60)
        return self.lin(x)


def fails_or_hangs_in_worker() -> nn.Module:
    return FailsOrHangsInWorker()


class Encoder(nn.Module):
    """A tiny transformer-like encoder: token embeddings, one masked self-attention layer (keys whose
    mask is False get no weight), a feed-forward block, and a masked mean. Padding seq with mask False
    leaves the real tokens' states and the pooled vector unchanged."""

    def __init__(self, vocab: int = 50, width: int = 16):
        super().__init__()
        self.embed = nn.Embedding(vocab, width)
        self.qkv = nn.Linear(width, 3 * width)
        self.norm1 = nn.LayerNorm(width)
        self.ffn = nn.Sequential(nn.Linear(width, 2 * width), nn.GELU(), nn.Linear(2 * width, width))
        self.norm2 = nn.LayerNorm(width)

    def forward(self, ids: torch.Tensor, mask: torch.Tensor):
        x = self.embed(ids)
        q, k, v = self.qkv(x).chunk(3, dim=-1)
        scores = (q @ k.transpose(1, 2)) / (x.shape[-1] ** 0.5)
        scores = scores.masked_fill(~mask.unsqueeze(1), -1e9)
        x = self.norm1(x + scores.softmax(-1) @ v)
        x = self.norm2(x + self.ffn(x))
        m = mask.unsqueeze(-1).to(x.dtype)
        return x, (x * m).sum(1) / m.sum(1).clamp(min=1.0)


def encoder() -> nn.Module:
    torch.manual_seed(4)
    return Encoder()


class LengthMean(nn.Module):
    """Averages over every position, masked or not: padding seq changes the mean (divides by the
    padded length), so a batching section that pads seq must be refused."""

    def __init__(self, vocab: int = 50, width: int = 8):
        super().__init__()
        self.embed = nn.Embedding(vocab, width)
        self.head = nn.Linear(width, 3)

    def forward(self, ids: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        x = self.embed(ids) * mask.unsqueeze(-1).to(torch.float32)
        return self.head(x.mean(1))


def length_mean() -> nn.Module:
    torch.manual_seed(5)
    return LengthMean()


class BatchCentered(nn.Module):
    """Subtracts the mean over the batch: a row's output depends on its batch-mates."""

    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(8, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.lin(x)
        return h - h.mean(0, keepdim=True)


def batch_centered() -> nn.Module:
    torch.manual_seed(6)
    return BatchCentered()


class GrayNet(nn.Module):
    """A convnet over one-channel images with each kind of convolution: a one-channel stem, strided,
    depthwise, grouped, 1×1, and a transposed convolution (the prepacking tests)."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.stem = nn.Conv2d(1, 16, 3, padding=1)
        self.down = nn.Conv2d(16, 32, 3, stride=2, padding=1)
        self.depthwise = nn.Conv2d(32, 32, 3, padding=1, groups=32)
        self.grouped = nn.Conv2d(32, 32, 3, padding=1, groups=4)
        self.up = nn.ConvTranspose2d(32, 8, 2, stride=2)
        self.head = nn.Conv2d(8, 4, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = torch.relu(self.depthwise(torch.relu(self.down(self.stem(x)))))
        return self.head(torch.relu(self.up(self.grouped(y))))


def gray_net() -> nn.Module:
    return GrayNet().eval()


class LayoutNet(nn.Module):
    """A convnet whose 1×1 expansion oneDNN packs in two layouts over batch 1-4 and 8-40² images (on an
    AVX-512 host: ``Acdb64a`` at some sizes, ``Acdb48a``/``Acdb32a`` at others), each followed by
    what Inductor fuses into a convolution: a ReLU, an addition and a ReLU (the prepacking tests)."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.stem = nn.Conv2d(3, 128, 3, padding=1)
        self.expand = nn.Conv2d(128, 512, 1)
        self.skip = nn.Conv2d(128, 512, 1, bias=False)
        self.head = nn.Conv2d(512, 8, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = torch.relu(self.stem(x))
        return self.head(torch.relu(self.expand(h) + self.skip(h)))


def layout_net() -> nn.Module:
    return LayoutNet().eval()


class ExciteNet(nn.Module):
    """A depthwise block with squeeze-and-excite, as MobileNetV3 and EfficientNet have: the pooled
    map's two 1×1 convolutions run on one pixel (the single-pixel rewrite's tests)."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(7)
        self.stem = nn.Conv2d(3, 16, 3, stride=2, padding=1)
        self.depthwise = nn.Conv2d(16, 16, 3, padding=1, groups=16)
        self.reduce = nn.Conv2d(16, 4, 1)
        self.expand = nn.Conv2d(4, 16, 1)
        self.project = nn.Conv2d(16, 8, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = nn.functional.silu(self.depthwise(nn.functional.silu(self.stem(x))))
        scale = torch.sigmoid(self.expand(nn.functional.silu(self.reduce(y.mean((2, 3), keepdim=True)))))
        return self.project(y * scale)


def excite_net() -> nn.Module:
    return ExciteNet().eval()


class ActivatedLayoutNet(nn.Module):
    """LayoutNet's 1×1 expansion twice, one followed by a ReLU6 (MobileNet's), the other by a SiLU
    (EfficientNet's): activations the per-call layout choice fuses into its branches."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.stem = nn.Conv2d(3, 128, 3, padding=1)
        self.expand = nn.Conv2d(128, 512, 1)
        self.other = nn.Conv2d(128, 512, 1)
        self.head = nn.Conv2d(512, 8, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = torch.relu(self.stem(x))
        return self.head(nn.functional.relu6(self.expand(h)) * nn.functional.silu(self.other(h)))


def activated_layout_net() -> nn.Module:
    return ActivatedLayoutNet().eval()


class StridedImage(nn.Module):
    """Two stride-2 convolutions, then the feature map flattened: at 4 pixels a side or fewer the
    map is one pixel, which torch.export traces apart (a size of 1), so a range from 4 up fails to
    export as one dynamic variant and builds as two (``plan.ranges``)."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.a = nn.Conv2d(3, 4, 3, stride=2, padding=1)
        self.b = nn.Conv2d(4, 4, 3, stride=2, padding=1)
        self.norm = nn.BatchNorm2d(4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.norm(self.b(self.a(x))).flatten(1)


def strided_image() -> nn.Module:
    return StridedImage().eval()
