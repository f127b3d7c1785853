"""Convolutions that never need a per-shape oneDNN primitive: 1×1 ones as matrix products, depthwise
ones as loops Inductor generates.

oneDNN has no shape-agnostic convolution on CPU: it creates (JIT-compiles) a primitive the first time
it meets each input shape in each thread, about 0.2 ms of CPU per convolution, so the first call at
an image size the warm-up never ran costs 1.3–2.5× the steady call (52 primitives a call for
MobileNetV2). These kinds of convolution need no such primitive:

- **1×1**, no padding, groups or dilation (any stride): a matrix product over the channels,
  ``[N·H·W, C] @ [C, K]`` on a channels-last activation, written as a ``bmm`` of one batch so that
  freezing's linear pattern (which would hand it to oneDNN's inner product, again one primitive per
  size) leaves it to MKL's GEMM, which has no per-shape code. A batch norm that is the convolution's
  only reader is folded into the weight and bias in the graph (freezing folds the constants).
- **depthwise** k×k (one filter per channel): a sum of k² shifted, strided slices of the padded input
  times the filter's taps, one pointwise kernel Inductor generates (the pad is a masked load).
- **stem**: a dense k×k convolution over few input channels (at most ``STEM_TAPS`` values per
  output: an image's 3-channel 3×3 stem): an im2col of the C·k² windows, then the 1×1 route's
  matrix product.
- **dense** k×k (``dense_as_gemm``, opt-in): any such convolution as an im2col written pixel by pixel
  (each tap's channels one contiguous copy) and the same product; slower than oneDNN's steady and
  first calls on ResNet-18 (``bench/results/conv_routes.md``), there for a convnet that must run
  without oneDNN (standalone).

    done = route(ep.graph_module)      # [("conv1x1_as_gemm", "conv2d_1"), ("depthwise_as_loops", "conv2d_2"), ...]

All are exact up to the order of the additions (eager's convolution sums in another order).
Other dense k×k convolutions stay oneDNN's: their primitives are created at load for the shapes
the warm-up runs (``loader.warmup``).
"""

from __future__ import annotations

import operator
from typing import Any

import torch
import torch._refs

aten = torch.ops.aten

# conv2d.padding: a string padding ("valid", "same"), as transformers' EfficientNet writes all 81 of its.
CONV2DS = (aten.conv2d.default, aten.conv2d.padding, aten.convolution.default)
KEPT_META = ("stack_trace", "nn_module_stack")


class _Builder:
    """Adds nodes before ``anchor``, each with its value computed from its inputs' values."""

    def __init__(self, graph: torch.fx.Graph, anchor: torch.fx.Node):
        self.graph, self.anchor = graph, anchor

    def __call__(self, target: Any, *args: Any) -> torch.fx.Node:
        with self.graph.inserting_before(self.anchor):
            node = self.graph.call_function(target, args)
        vals = [a.meta["val"] if isinstance(a, torch.fx.Node) else a for a in args]
        vals = [[v.meta["val"] if isinstance(v, torch.fx.Node) else v for v in a] if isinstance(a, list) else a
                for a in vals]  # fmt: skip
        # constant_pad_nd's C++ kernel reads the sizes as ints (fixing each at its hint): its Python
        # reference keeps them symbolic, run in the program's fake mode.
        if target is aten.constant_pad_nd.default:
            with torch._guards.detect_fake_mode(vals[0]):
                node.meta["val"] = torch._refs.constant_pad_nd(*vals)
        else:
            node.meta["val"] = target(*vals)
        node.meta.update({k: v for k, v in self.anchor.meta.items() if k in KEPT_META})
        return node


def _conv_args(gm: torch.fx.GraphModule, node: torch.fx.Node) -> dict[str, Any] | None:
    """A 2-d, not transposed convolution's arguments, its stride, padding and dilation as pairs of
    ints (a string padding as the pair it means: "valid" none, "same" half the dilated kernel where
    that is the same on both sides); None for anything else (an uneven "same", a 1-d or 3-d one)."""
    if node.op != "call_function" or node.target not in CONV2DS:
        return None
    bound = node.normalized_arguments(gm, normalize_to_only_use_kwargs=True)
    if bound is None:
        return None
    kw = dict(bound.kwargs)
    if kw.get("transposed", False):
        return None
    padding = kw.get("padding", 0)
    for key, default in (("stride", 1), ("padding", 0), ("dilation", 1)):
        value = kw.get(key, default)
        if key == "padding" and isinstance(value, str):
            continue
        value = list(value) if isinstance(value, (list, tuple)) else [value]
        if len(value) == 1:
            value = value * 2
        if not all(isinstance(v, int) for v in value):
            return None
        kw[key] = value
    kw["groups"] = kw.get("groups", 1)
    vals = [getattr(kw[k], "meta", {}).get("val") for k in ("input", "weight")]
    if not all(isinstance(v, torch.Tensor) and v.dim() == 4 and v.dtype == torch.float32 for v in vals):
        return None
    if isinstance(padding, str):
        reach = [d * (k - 1) for d, k in zip(kw["dilation"], vals[1].shape[2:])]  # the dilated kernel's extent - 1
        if padding == "valid":
            kw["padding"] = [0, 0]
        elif padding == "same" and all(r % 2 == 0 for r in reach):  # torch allows "same" at stride 1 only
            kw["padding"] = [r // 2 for r in reach]
        else:
            return None
    if kw["weight"].op not in ("placeholder", "get_attr"):
        return None  # a quantized weight (dequantized in the graph): Inductor's int8 patterns want the conv
    return kw


BATCH_NORMS = (aten.batch_norm.default, aten._native_batch_norm_legit_no_training.default)


def _folded_norm(node: torch.fx.Node) -> tuple[torch.fx.Node, list[Any]] | None:
    """The inference batch norm that is ``node``'s only reader and its ``(weight, bias, mean, var,
    eps)`` (weight and bias may be None), its parameters the model's own tensors; else None."""
    if len(node.users) != 1:
        return None
    norm = next(iter(node.users))
    if norm.op != "call_function" or norm.target not in BATCH_NORMS or norm.args[0] is not node:
        return None
    if norm.target is aten.batch_norm.default:
        _, weight, bias, mean, var, training, _, eps, *_ = norm.args
        if training:
            return None
    else:
        _, weight, bias, mean, var, _, eps = norm.args
        if any(u.target is not operator.getitem or u.args[1] != 0 for u in norm.users):
            return None
    params = [p for p in (weight, bias, mean, var) if p is not None]
    if mean is None or var is None or not all(isinstance(p, torch.fx.Node) and p.op in ("placeholder", "get_attr")
                                              for p in params):  # fmt: skip
        return None
    return norm, [weight, bias, mean, var, eps]


def _scale_and_shift(b: _Builder, conv_bias: Any, norm: list[Any] | None) -> tuple[Any, Any]:
    """The per-channel scale the weight is multiplied by and the shift added after (None: none)."""
    if norm is None:
        return None, conv_bias
    weight, bias, mean, var, eps = norm
    scale = b(aten.rsqrt.default, b(aten.add.Tensor, var, eps))
    if weight is not None:
        scale = b(aten.mul.Tensor, scale, weight)
    centred = b(aten.neg.default, mean) if conv_bias is None else b(aten.sub.Tensor, conv_bias, mean)
    shift = b(aten.mul.Tensor, centred, scale)
    if bias is not None:
        shift = b(aten.add.Tensor, shift, bias)
    return scale, shift


def _replace(gm: torch.fx.GraphModule, conv: torch.fx.Node, norm: torch.fx.Node | None, out: torch.fx.Node) -> None:
    graph = gm.graph
    if norm is None:
        conv.replace_all_uses_with(out)
    elif norm.target is aten.batch_norm.default:
        norm.replace_all_uses_with(out)
    else:
        for user in list(norm.users):  # getitem 0 of _native_batch_norm_legit_no_training
            user.replace_all_uses_with(out)
            graph.erase_node(user)
    if norm is not None:
        graph.erase_node(norm)
    graph.erase_node(conv)


def _gemm_conv(gm: torch.fx.GraphModule, node: torch.fx.Node, kw: dict[str, Any]) -> bool:
    """A 1×1 convolution with no padding, groups or dilation as ``bmm`` over the channels."""
    x, weight = kw["input"], kw["weight"]
    wv = weight.meta["val"]
    k, c = wv.shape[:2]
    if tuple(wv.shape[2:]) != (1, 1) or kw["groups"] != 1 or any(kw["padding"]) or kw["dilation"] != [1, 1]:
        return False
    folded = _folded_norm(node)
    b = _Builder(gm.graph, node)
    scale, shift = _scale_and_shift(b, kw.get("bias"), folded[1] if folded else None)
    matrix = b(aten.view.default, weight, [k, c])
    if scale is not None:
        matrix = b(aten.mul.Tensor, matrix, b(aten.unsqueeze.default, scale, 1))
    for axis, step in ((2, kw["stride"][0]), (3, kw["stride"][1])):
        if step != 1:
            x = b(aten.slice.Tensor, x, axis, 0, None, step)
    _replace(gm, node, folded[0] if folded else None, _times_matrix(b, x, matrix, shift))
    return True


def _times_matrix(b: _Builder, x: torch.fx.Node, matrix: torch.fx.Node, shift: Any) -> torch.fx.Node:
    """Each pixel's channels of ``x`` ([N, C, H, W]) times ``matrix`` ([K, C]) plus ``shift``: [N, K, H, W],
    channels-last."""
    k, c = matrix.meta["val"].shape
    # The rows read from a channels-last buffer: their [N·H·W, C] matrix is then a view of it. Left
    # to Inductor, the reshape copied each row out of x's strided slice, its index split by
    # divisions by the product of the dynamic sizes: twice the steady call (tests' model: 1.42 / 5.91
    # / 6.45 / 3.39 -> 0.71 / 2.78 / 2.68 / 1.52 ms) and a third of the compile in sympy (47 -> 34 s).
    x = _realized_channels_last(b, x, c)
    n, h, w = (b(aten.sym_size.int, x, axis) for axis in (0, 2, 3))
    # One batch of N·H·W rows: the weight stays a constant of fixed size (an expand to the batch
    # would be folded at the batch's hint).
    rows = b(aten.reshape.default, b(aten.permute.default, x, [0, 2, 3, 1]), [1, -1, c])
    cols = b(aten.unsqueeze.default, b(aten.t.default, matrix), 0)
    out = b(aten.bmm.default, rows, cols)
    if shift is not None:
        out = b(aten.add.Tensor, out, shift)
    return b(aten.permute.default, b(aten.reshape.default, out, [n, h, w, k]), [0, 3, 1, 2])


def _loop_conv(gm: torch.fx.GraphModule, node: torch.fx.Node, kw: dict[str, Any]) -> bool:
    """A depthwise convolution (one filter per channel, no dilation) as a sum of shifted slices."""
    wv, xv = kw["weight"].meta["val"], kw["input"].meta["val"]
    channels = wv.shape[0]
    if wv.shape[1] != 1 or kw["groups"] != channels or xv.shape[1] != channels or kw["dilation"] != [1, 1]:
        return False
    _shifted_slices(gm, node, kw)
    return True


# A dense convolution is routed by ``stem_as_loops`` when it reads at most this many input values per
# output (input channels × kernel taps): an image's stem (3 channels, 3×3: 27), not a 7×7 one (147) or
# any convolution between hidden layers (``dense_as_gemm`` routes those).
STEM_TAPS = 32


def _stem_conv(gm: torch.fx.GraphModule, node: torch.fx.Node, kw: dict[str, Any]) -> bool:
    """A dense convolution over few input channels (an image's stem) as ``_im2col_conv``. MobileNetV2's
    stem, standalone, one thread, 3×3×116×155: 20.8 ms a call against 22.1–22.4 ms as a sum of
    shifted slices per input channel, which Inductor vectorised along the width with stride-6 gathers
    (a stride-2 layer, channels-last)."""
    _, channels, kh, kwd = kw["weight"].meta["val"].shape
    if channels * kh * kwd > STEM_TAPS:
        return False
    return _im2col_conv(gm, node, kw, taps_first=False)


def _dense_conv(gm: torch.fx.GraphModule, node: torch.fx.Node, kw: dict[str, Any]) -> bool:
    """Any dense k×k convolution (no groups or dilation) as ``_im2col_conv``, its columns tap by tap:
    a hidden layer's input is channels-last, so each tap's C channels are one contiguous copy."""
    return _im2col_conv(gm, node, kw, taps_first=True)


def _im2col_conv(gm: torch.fx.GraphModule, node: torch.fx.Node, kw: dict[str, Any], *, taps_first: bool) -> bool:
    """A dense k×k convolution, no groups or dilation, as an im2col (the k² shifted, strided windows
    of the padded input stacked: [N, C·k², H', W'], channel by channel as the weight orders them, or
    ``taps_first``: [N, k²·C, H', W']) times the weight as a matrix in the same order: the 1×1 route's
    product."""
    x, weight = kw["input"], kw["weight"]
    out_channels, channels, kh, kwd = weight.meta["val"].shape
    if kw["groups"] != 1 or kw["dilation"] != [1, 1] or (kh, kwd) == (1, 1):
        return False
    (sh, sw), (ph, pw) = kw["stride"], kw["padding"]
    folded = _folded_norm(node)
    b = _Builder(gm.graph, node)
    scale, shift = _scale_and_shift(b, kw.get("bias"), folded[1] if folded else None)
    if taps_first:  # [K, kh, kw, C], copied by reshape: freezing folds the copy
        weight = b(aten.permute.default, weight, [0, 2, 3, 1])
    matrix = b(aten.reshape.default, weight, [out_channels, channels * kh * kwd])
    if scale is not None:
        matrix = b(aten.mul.Tensor, matrix, b(aten.unsqueeze.default, scale, 1))
    padded = b(aten.constant_pad_nd.default, x, [pw, pw, ph, ph], 0.0) if ph or pw else x
    if taps_first:  # read k² times: written once, as the depthwise route writes its input
        padded = _realized_channels_last(b, padded, channels)
    windows = []
    for i in range(kh):
        rows = b(aten.slice.Tensor, padded, 2, i, i + 1 - kh or None, sh)
        for j in range(kwd):
            windows.append(b(aten.slice.Tensor, rows, 3, j, j + 1 - kwd or None, sw))
    if taps_first:  # stacked pixel by pixel: [N, H', W', k², C], each tap's C channels one contiguous copy
        pixels = [b(aten.permute.default, w, [0, 2, 3, 1]) for w in windows]
        flat = b(aten.flatten.using_ints, b(aten.stack.default, pixels, 3), 3, 4)
        patches = b(aten.permute.default, flat, [0, 3, 1, 2])  # [N, k²·C, H', W'], channels-last
    else:
        patches = b(aten.flatten.using_ints, b(aten.stack.default, windows, 2), 1, 2)
    _replace(gm, node, folded[0] if folded else None, _times_matrix(b, patches, matrix, shift))
    return True


def _shifted_slices(gm: torch.fx.GraphModule, node: torch.fx.Node, kw: dict[str, Any]) -> None:
    """Replace the depthwise convolution ``node`` by a sum over its taps of a shifted, strided slice
    of the padded input times the tap's filter."""
    x, weight = kw["input"], kw["weight"]
    out_channels, channels, kh, kwd = weight.meta["val"].shape
    (sh, sw), (ph, pw) = kw["stride"], kw["padding"]
    folded = _folded_norm(node)
    b = _Builder(gm.graph, node)
    scale, shift = _scale_and_shift(b, kw.get("bias"), folded[1] if folded else None)
    if scale is not None:
        weight = b(aten.mul.Tensor, weight, b(aten.view.default, scale, [out_channels, 1, 1, 1]))
    # Tap (i, j) reads the padded input from (i, j) on, every step-th pixel, up to k - 1 - i short of
    # its end: as many windows as the convolution has, at any size, with no arithmetic on the sizes.
    padded = b(aten.constant_pad_nd.default, x, [pw, pw, ph, ph], 0.0) if ph or pw else x
    padded = _realized_channels_last(b, padded, x.meta["val"].shape[1])
    # The taps tap-major, each a contiguous row over the output channels (freezing folds the copy): a
    # tap read from the [K, C, k, k] weight itself would be a gather with stride C·k² in the vectorised loop.
    rows_of_taps = b(aten.view.default, weight, [out_channels, channels * kh * kwd])
    taps = b(aten.contiguous.default, b(aten.permute.default, rows_of_taps, [1, 0]))
    taps = _one_buffer(b, taps)
    total = None
    for i in range(kh):
        rows = b(aten.slice.Tensor, padded, 2, i, i + 1 - kh or None, sh)
        for j in range(kwd):
            window = b(aten.slice.Tensor, rows, 3, j, j + 1 - kwd or None, sw)
            tap = b(aten.view.default, b(aten.select.int, taps, 0, i * kwd + j), [1, out_channels, 1, 1])
            term = b(aten.mul.Tensor, window, tap)
            total = term if total is None else b(aten.add.Tensor, total, term)
    if shift is not None:
        total = b(aten.add.Tensor, total, b(aten.view.default, shift, [1, out_channels, 1, 1]))
    _replace(gm, node, folded[0] if folded else None, total)


def _one_buffer(b: _Builder, taps: torch.fx.Node) -> torch.fx.Node:
    """``taps`` ([k², K], contiguous) kept one constant that every tap reads at its own offset:
    freezing's constant folding would otherwise fold each tap's ``select`` into a constant of its own,
    and the loop then holds k² pointers, most of them spilled to the stack and reloaded for every
    vector (the op that keeps it is left unfolded: ``_keep_unfolded``)."""
    import torch._inductor.inductor_prims  # noqa: F401 -- registers prims.inductor_force_stride_order

    _keep_unfolded()
    return b(torch.ops.prims.inductor_force_stride_order.default, taps, [taps.meta["val"].shape[1], 1])


def _keep_unfolded() -> None:
    """Inductor's constant folding (freezing) leaves ``prims.inductor_force_stride_order`` alone in
    this process: the routes pass constants through it to keep them one buffer (``_one_buffer``);
    nothing else gives it a constant."""
    from torch._inductor import constant_folding

    op = torch.ops.prims.inductor_force_stride_order.default
    if op not in constant_folding._dont_constant_fold:
        constant_folding.add_dont_constant_fold(op)


def _realized_channels_last(b: _Builder, x: torch.fx.Node, channels: int) -> torch.fx.Node:
    """``x`` written once to a channels-last buffer: each of the k² taps then reads it with a plain
    load, instead of recomputing ``x``'s producer (its pad's bounds checks, the previous layer's
    epilogue) k² times in the loop (Inductor inlines a pointwise producer into each reader)."""
    import torch._inductor.inductor_prims  # noqa: F401 -- registers prims.inductor_force_stride_order

    h, w = (b(aten.sym_size.int, x, axis) for axis in (2, 3))
    row = b(operator.mul, w, channels)
    strides = [b(operator.mul, h, row), 1, row, channels]
    return b(torch.ops.prims.inductor_force_stride_order.default, x, strides)


ROUTES = {
    "conv1x1_as_gemm": _gemm_conv,
    "depthwise_as_loops": _loop_conv,
    "stem_as_loops": _stem_conv,
    "dense_as_gemm": _dense_conv,
}


def route(gm: torch.fx.GraphModule, kinds: tuple[str, ...] = tuple(ROUTES)) -> list[tuple[str, str]]:
    """Rewrite the convolutions of ``kinds`` in place; ``(kind, node)`` for each rewritten."""
    done = []
    for node in list(gm.graph.nodes):
        kw = _conv_args(gm, node)
        if kw is None:
            continue
        for kind in kinds:
            if ROUTES[kind](gm, node, kw):
                done.append((kind, node.name))
                break
    if done:
        gm.graph.eliminate_dead_code()
        gm.graph.lint()
        gm.recompile()
    return done
