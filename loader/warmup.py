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

Some primitives are keyed by one dim alone: a linear layer after a global pooling (a convnet's
classifier, EfficientNet-B0's 15 squeeze-and-excite products) makes oneDNN create an inner product for
each batch size, whatever the image's. A variant whose convolutions take no primitive (the routes of
a first-calls variant, ``Variant.first_calls_of``) paid only those at a new shape of an unmet batch:
EfficientNet-B0's at 3×116×155, 22.9 ms against 16.4 steady, and nothing at a new image size of a
batch met before. So a first-calls variant's warm-up also runs each value of a short range (at most
``SHORT_RANGE`` values: a batch of 1-4), with every other dim at its min, where no shape before it
had that value: EfficientNet-B0's first calls at 8 new shapes then cost 1.34-1.39× the steady call
(median), 1.58-1.72× at worst, and no primitive is created in them. Not on other variants: their
convolutions create primitives at each new image size anyway, and on oneDNN's the two calls at
96² created theirs too (0.03-0.08 s more of the load, for 3 ms of inner products).

``warmup_shapes`` (``loader.load``): ``"auto"`` (the default) warms, after the hint, a first-calls
variant's short ranges' values while their estimates' sum fits ``BUDGET_SECONDS``, then the largest
shape when its estimated time (the hint's warm-up call scaled by the number of elements) fits
``BUDGET_SECONDS``, then the ``warm`` shapes, hottest first, while their estimates' sum fits
``BUDGET_SECONDS``; ``"range"`` warms all of them, whatever the time; ``"hint"`` runs the hint only.
"""

from __future__ import annotations

import math

from .manifest import Variant

WARMUP_SHAPES = ("auto", "hint", "range")
DEFAULT_WARMUP_SHAPES = "auto"
# "auto" warms a variant's largest shape only when its estimated call takes at most this long: a
# load's cost stays bounded whatever the ranges (a text model of batch 64 × 512 tokens, say).
BUDGET_SECONDS = 2.0
# A dim whose range holds at most this many values is warmed at each of them (``short_range_shapes``).
SHORT_RANGE = 8


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
    variant's hottest traffic shapes (``variant.warm``, hottest first), with, before them, each value
    of its short ranges they do not meet (``short_range_shapes``), or none (``"hint"``; a static
    variant). With ``"auto"``, the largest shape when its estimate fits ``budget``, and the traffic
    shapes, and the short ranges', while the sum of their estimates does (a budget of its own each:
    the largest shape's is spent on memory every shape uses, the traffic's on the shapes the build
    saw most)."""
    check_warmup_shapes(mode)
    if variant.kind != "dynamic" or mode == "hint":
        return []
    big = largest(variant)
    shapes = [] if big is None or (mode == "auto" and estimate_seconds(variant, big, hint_seconds) > budget) else [big]
    shapes += _within(variant, [dict(s) for s in variant.warm if s != big], mode, hint_seconds, budget)
    short = short_range_shapes(variant, [dict(variant.hint), *shapes])
    # Before the largest: small calls after it let glibc hand back the heap's top, and the first calls
    # at new sizes fault their buffers in again (EfficientNet-B0: 60-160 faults a first call, 1,100 so).
    return _within(variant, short, mode, hint_seconds, budget) + shapes


def _within(
    variant: Variant, shapes: list[dict[str, int]], mode: str, hint_seconds: float, budget: float
) -> list[dict[str, int]]:
    """``shapes`` in order while the sum of their estimates fits ``budget`` (all of them unless ``"auto"``)."""
    spent, out = 0.0, []
    for sizes in shapes:
        spent += estimate_seconds(variant, sizes, hint_seconds)
        if mode == "auto" and spent > budget:
            break
        out.append(sizes)
    return out


def short_range_shapes(variant: Variant, before: list[dict[str, int]]) -> list[dict[str, int]]:
    """For each dim of a dynamic first-calls variant (``Variant.first_calls_of``) whose range holds at
    most ``SHORT_RANGE`` values, each value no shape of ``before`` has, with every other dim at its
    min (the cheapest call that has it). None for another variant."""
    if variant.kind != "dynamic" or variant.first_calls_of is None:
        return []
    low = {d: r.min for d, r in variant.dims.items()}
    shapes: list[dict[str, int]] = []
    for d, r in variant.dims.items():
        if r.max - r.min + 1 > SHORT_RANGE:
            continue
        met = {s[d] for s in [*before, *shapes]}
        shapes += [{**low, d: value} for value in range(r.min, r.max + 1) if value not in met]
    return shapes
