"""Which shapes a load's warm-up runs on a variant: its hint, then, for a dynamic variant, the largest
shape its ranges hold (every dim at its max), so that a later first call at any shape finds its
buffers already mapped.

What a first call at a shape no call met pays over the steady call at that shape (``bench.firstcall``;
one thread, CPU time, ``perf`` samples and ``ONEDNN_VERBOSE`` counts of the five artifacts of
``bench.vision``, 8 to 20 unseen shapes each):

- oneDNN creating a primitive for each convolution at that shape: its descriptor (the brgemm
  convolution's cost model over blockings) and then the JIT of its kernels, about as much of each;
- page faults: buffers larger than any met before come as fresh pages from the kernel (glibc's heap,
  or tcmalloc, keeps memory it was given; a larger size still asks for more), and their first touch
  makes the convolutions themselves slower.

oneDNN (3.12 in torch 2.13) keys each primitive on the exact shape and keeps its brgemm kernels per
primitive (``brgemm_containers``: the global kernel storage is compiled out), so warming other
shapes leaves an unseen one's creation as it was: ResNet-50 created 195 primitives over 8 unseen
shapes cold, 194 after warming the largest shape and 166 after warming 64 random ones (only layers
deep enough for two image sizes to meet in one size). Memory is what a warm-up can give: after one
call at the largest shape the allocator holds buffers of every size a call can need: 10 first calls
at unseen shapes fault 30× less for ResNet-50 on glibc (16× on tcmalloc), 4× (17×) for MobileNetV2,
3× (16×) for EfficientNet-B0, 1.2 to 4× for RegNet-Y and Segformer (glibc maps buffers over 32 MB
afresh on every call; the README's "The loader" has the table); and their convolutions run about as
fast as in the steady call.

``warmup_shapes`` (``loader.load``): ``"auto"`` (the default) warms the largest shape when its
estimated time (the hint's warm-up call scaled by the number of elements) fits ``BUDGET_SECONDS``;
``"range"`` always does; ``"hint"`` runs the hint only (as before).
"""

from __future__ import annotations

import math

from .manifest import Variant

WARMUP_SHAPES = ("auto", "hint", "range")
DEFAULT_WARMUP_SHAPES = "auto"
# "auto" warms a variant's largest shape only when its estimated call takes at most this long: a
# load's cost stays bounded whatever the ranges (a text model of batch 64 × 512 tokens, say).
BUDGET_SECONDS = 2.0


def check_warmup_shapes(mode: str) -> None:
    if mode not in WARMUP_SHAPES:
        raise ValueError(f"warmup_shapes={mode!r}: expected one of {', '.join(WARMUP_SHAPES)}")


def largest(variant: Variant) -> dict[str, int] | None:
    """Every dim of a dynamic variant at its range's max; None for a static variant, or where that
    is the hint itself (nothing more to warm)."""
    if variant.kind != "dynamic":
        return None
    sizes = {d: r.max for d, r in variant.dims.items()}
    return None if sizes == dict(variant.hint) else sizes


def estimate_seconds(variant: Variant, sizes: dict[str, int], hint_seconds: float) -> float:
    """A call at ``sizes`` estimated from the hint's: its time scaled by the product of the dims (the
    elements of every input grow with it)."""
    return hint_seconds * math.prod(sizes.values()) / max(1, math.prod(variant.hint.values()))


def after_hint(
    variant: Variant, mode: str, hint_seconds: float, *, budget: float = BUDGET_SECONDS
) -> list[dict[str, int]]:
    """The shapes to warm after the hint, which took ``hint_seconds``: the largest shape, or none
    (``"hint"``; a static variant; ``"auto"`` when its estimate exceeds ``budget``)."""
    check_warmup_shapes(mode)
    big = largest(variant)
    if big is None or mode == "hint":
        return []
    if mode == "auto" and estimate_seconds(variant, big, hint_seconds) > budget:
        return []
    return [big]
