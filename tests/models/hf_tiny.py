"""Tiny transformers models for the init and doctor tests: real architectures, small configs."""

from __future__ import annotations

import time

import torch
import transformers as T


def bert(max_positions: int = 64) -> torch.nn.Module:
    """An encoder with a position table of ``max_positions`` rows and a token-type table of 2."""
    torch.manual_seed(0)
    config = T.BertConfig(
        vocab_size=100,
        hidden_size=32,
        num_hidden_layers=1,
        num_attention_heads=2,
        intermediate_size=37,
        max_position_embeddings=max_positions,
    )
    return T.BertModel(config)


def gpt2(positions: int = 64) -> torch.nn.Module:
    """A decoder returning a ModelOutput with a cache in it; positions come from arange(seq)."""
    torch.manual_seed(0)
    config = T.GPT2Config(
        vocab_size=100, n_embd=32, n_layer=1, n_head=2, n_positions=positions, bos_token_id=0, eos_token_id=0
    )
    return T.GPT2Model(config)


def vit(image_size: int = 32) -> torch.nn.Module:
    """A vision model whose code fixes the image size from its config."""
    torch.manual_seed(0)
    config = T.ViTConfig(
        image_size=image_size,
        patch_size=8,
        hidden_size=32,
        num_hidden_layers=1,
        num_attention_heads=2,
        intermediate_size=37,
    )
    return T.ViTModel(config)


class Branchy(torch.nn.Module):
    """Branches on a tensor's values: torch.export cannot trace it for every input."""

    def __init__(self) -> None:
        super().__init__()
        self.proj = torch.nn.Linear(8, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.sum() > 0:
            return self.proj(x)
        return -self.proj(x)


def branchy() -> torch.nn.Module:
    return Branchy()


class SmallTable(torch.nn.Module):
    """Token ids index a table of 5 rows; no range is declared, so samples in [0, 9] go past it."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = torch.nn.Embedding(5, 4)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.embed(ids).sum(-1)


def small_table() -> torch.nn.Module:
    return SmallTable()


class SlowToTrace(torch.nn.Module):
    """Eager is instant; tracing takes a minute (a stand-in for an export that searches for long)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if torch.compiler.is_exporting():
            time.sleep(60)
        return x * 2


def slow_to_trace() -> torch.nn.Module:
    return SlowToTrace()


def efficientnet() -> torch.nn.Module:
    """EfficientNet's blocks (depthwise convs, squeeze-and-excite) 8 channels wide. Its pooler is
    transformers' ``AvgPool2d(hidden_dim, ceil_mode=True)``: a 64×64 window over at most 12×12."""
    torch.manual_seed(0)
    config = T.EfficientNetConfig(
        width_coefficient=0.05,
        hidden_dim=64,
        num_labels=3,
        initializer_range=0.4,
        depthwise_padding=[],
        in_channels=[32, 16],
        out_channels=[16, 24],
        kernel_sizes=[3, 5],
        strides=[2, 2],
        num_block_repeats=[1, 1],
        expand_ratios=[1, 6],
    )
    model = T.EfficientNetForImageClassification(config)
    for m in model.modules():  # transformers draws BatchNorm weights ~ N(0, 0.02): outputs near 0 match anything
        if isinstance(m, torch.nn.BatchNorm2d):
            m.reset_parameters()
    return model.eval()


def segformer() -> torch.nn.Module:
    """Segformer's two first stages (overlapping patch embeddings, attention over a strided-conv
    reduction of the tokens, Mix-FFN's depthwise conv) and its decode head, 8 and 16 channels wide."""
    torch.manual_seed(0)
    config = T.SegformerConfig(
        num_encoder_blocks=2,
        depths=[1, 1],
        sr_ratios=[8, 4],
        hidden_sizes=[8, 16],
        patch_sizes=[7, 3],
        strides=[4, 2],
        num_attention_heads=[1, 1],
        mlp_ratios=[2, 2],
        decoder_hidden_size=16,
        num_labels=3,
        initializer_range=0.2,  # outputs of about 1, so that a wrong kernel shows
    )
    return T.SegformerForSemanticSegmentation(config).eval()
