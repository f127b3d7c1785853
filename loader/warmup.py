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
afresh on every call; docs/loader.md has the table); and their convolutions run about as
fast as in the steady call.

What a warm-up can give the shapes themselves is their primitives: a dynamic variant's ``warm``
shapes (the hottest of the build's traffic it serves after its hint, the profile's
``plan.warm_shapes``) are run too, so that their first calls in serving find oneDNN's primitives
created (``bench.firstcall`` reports both kinds of shape).

``warmup_shapes`` (``loader.load``): ``"auto"`` (the default) warms the largest shape when its
estimated time (the hint's warm-up call scaled by the number of elements) fits ``BUDGET_SECONDS``,
then the ``warm`` shapes, hottest first, while their estimates' sum fits ``BUDGET_SECONDS``;
``"range"`` warms all of them, whatever the time; ``"hint"`` runs the hint only (as before).
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
    """The shapes to warm after the hint, which took ``hint_seconds``: the largest shape, then the
    variant's hottest traffic shapes (``variant.warm``, hottest first), or none (``"hint"``; a static
    variant). With ``"auto"``, the largest shape when its estimate fits ``budget``, and the traffic
    shapes while the sum of their estimates does (a budget of its own: the largest shape's is spent
    on memory every shape uses, theirs on the shapes the build saw most)."""
    check_warmup_shapes(mode)
    if variant.kind != "dynamic" or mode == "hint":
        return []
    big = largest(variant)
    shapes = [] if big is None or (mode == "auto" and estimate_seconds(variant, big, hint_seconds) > budget) else [big]
    spent = 0.0
    for sizes in variant.warm:
        if sizes == big:
            continue
        spent += estimate_seconds(variant, sizes, hint_seconds)
        if mode == "auto" and spent > budget:
            break
        shapes.append(dict(sizes))
    return shapes
