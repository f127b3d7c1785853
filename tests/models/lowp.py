"""Small real models for the precision tests: Linear layers (int8 dynamic, bf16) and convolutions
(int8 static, calibrated)."""

import torch


class Encoder(torch.nn.Module):
    """Token embeddings, a residual MLP block and mean pooling over the unmasked tokens."""

    def __init__(self, vocab: int = 50, width: int = 64):
        super().__init__()
        torch.manual_seed(0)
        self.emb = torch.nn.Embedding(vocab, width)
        self.up = torch.nn.Linear(width, 4 * width)
        self.down = torch.nn.Linear(4 * width, width)
        self.head = torch.nn.Linear(width, 8)

    def forward(self, ids, mask):
        x = self.emb(ids)
        x = x + self.down(torch.relu(self.up(x)))
        m = mask.unsqueeze(-1).to(x.dtype)
        pooled = (x * m).sum(1) / m.sum(1).clamp(min=1)
        return self.head(pooled), ids.sum(1)


class ConvNet(torch.nn.Module):
    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.c1 = torch.nn.Conv2d(3, 16, 3, padding=1)
        self.bn = torch.nn.BatchNorm2d(16)
        self.c2 = torch.nn.Conv2d(16, 32, 3, padding=1, stride=2)
        self.fc = torch.nn.Linear(32, 10)

    def forward(self, x):
        x = torch.relu(self.bn(self.c1(x)))
        x = torch.relu(self.c2(x))
        return self.fc(x.mean((2, 3)))


def encoder(vocab: int = 50, width: int = 64):
    return Encoder(vocab, width).eval()


def convnet():
    return ConvNet().eval()


class OutlierNet(torch.nn.Module):
    """A conv net with one quantization-sensitive layer: c1's first output channel is 5000× the others,
    so c2's input, quantized per tensor to uint8, keeps almost nothing of the other 15 channels. c2
    barely reads that channel (its weights there are 1e-4×), so in fp32 the outlier goes no further:
    int8 with c2 alone in fp32 is as accurate as the plain conv net's, with every layer int8 it is not."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.c1 = torch.nn.Conv2d(3, 16, 3, padding=1)
        self.c2 = torch.nn.Conv2d(16, 32, 3, padding=1)
        self.c3 = torch.nn.Conv2d(32, 32, 3, padding=1, stride=2)
        self.fc = torch.nn.Linear(32, 10)
        with torch.no_grad():
            self.c1.weight[0] *= 5000.0
            self.c1.bias[0] = 5000.0
            self.c2.weight[:, 0] *= 1e-4

    def forward(self, x):
        x = torch.relu(self.c1(x))
        x = torch.relu(self.c2(x))
        x = torch.relu(self.c3(x))
        return self.fc(x.mean((2, 3)))


def outlier():
    return OutlierNet().eval()


class Pointwise(torch.nn.Module):
    """A conv net with 1×1 convolutions after it, small images at the last ones: Inductor packs a
    dynamic int8 convolution's weight for no input size, which for c3 is in a blocking oneDNN wants
    at none of the sizes, and for c4 and the shortcut at some (they want two over the range); the
    residual addition is fused into one of the two (``qconv2d_pointwise.binary``). Its stem is
    ConvNet's (a convolution, batch norm, ReLU), so one int8 build serves the calibration test too."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.c1 = torch.nn.Conv2d(3, 16, 3, padding=1)
        self.bn = torch.nn.BatchNorm2d(16)
        self.c2 = torch.nn.Conv2d(16, 32, 3, padding=1, stride=3)
        self.c3 = torch.nn.Conv2d(32, 256, 1)
        self.c4 = torch.nn.Conv2d(256, 1024, 1)
        self.shortcut = torch.nn.Conv2d(256, 1024, 1)
        self.fc = torch.nn.Linear(1024, 10)

    def forward(self, x):
        x = torch.relu(self.bn(self.c1(x)))
        x = torch.relu(self.c2(x))
        x = torch.relu(self.c3(x))
        x = torch.relu(self.c4(x) + self.shortcut(x))
        return self.fc(x.mean((2, 3)))


def pointwise():
    return Pointwise().eval()
