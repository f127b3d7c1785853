"""Convolutional models that torch 2.13's Inductor compiles into pathological code, or not at all.

Four rewrites of the exported graph, each exact (eager computes the same values either way), applied
to every package just before AOTInductor compiles it, and a translation of the lowering failure the
last one avoids, should it show up elsewhere:

    done = rewrite(ep)                      # [Rewrite("global_avg_pool", ...), Rewrite("pad_into_conv", ...)]
    model_kind(ep)                          # "convnet": what options.KIND_DEFAULTS compiles it with
    message = explain_failure(e, ep, [["batch", 3, "height", "width"]])   # None if not a lowering failure

- **A global average pool written as a huge pooling window.** transformers' EfficientNet (and ALIGN)
  pool with ``nn.AvgPool2d(1280, ceil_mode=True)`` over a 7×7 map. Inductor lowers ``avg_pool2d`` with
  stride == kernel as a sum over the whole kernel window, whatever the input's extent: 1280×1280 masked
  steps per channel, which made EfficientNet-B0 17-39× slower than eager (eager clips the window to the
  input), static or dynamic sizes alike. Where the window provably covers the whole input, the pool is a
  ``mean`` over the two spatial axes. docs/upstream/inductor-efficientnet-dynamic.md
- **A convolution over a single pixel.** Squeeze-and-excite blocks (EfficientNet, RegNet-Y) pool the
  map to N×C×1×1 and run two 1×1 convolutions on it. oneDNN runs such a convolution on blocked
  activations: EfficientNet-B0's ten reduce convolutions (``jit_1x1``) each cost three reorders per
  call (the pooled input and the result to and from ``nChw16c``, and the weight), 30 of its 123 oneDNN
  primitives at 1×96², each with its fixed cost. Where the input is provably one pixel, a 1×1
  convolution with no padding, stride or groups is the dense layer it is: ``linear`` on the channels
  (Inductor packs its weight for the batch hint), the two unit axes put back after.
- **A zero pad before a convolution.** transformers' EfficientNet pads each stride-2 depthwise
  convolution's input by hand (``nn.ZeroPad2d(correct_pad(k))``: one pixel more on the right and
  bottom) and convolves it "valid". Inductor copies the whole activation into a padded buffer for
  oneDNN, a kernel that took 12% of EfficientNet-B0's call at 4×143×126. The pad is the
  convolution's own padding, ``max(left, right)`` per axis; where the two sides differ, the kernel
  gets zero taps on the side with less (every window then starts where it did, over the same
  values). Taps are added to depthwise convolutions only, whose extra multiply-adds cost less than
  the copy; a dense convolution keeps an asymmetric pad.
- **A convolution reading a view whose strides are sums of floor divisions.** Segformer turns tokens
  back into an image with ``x.transpose(1, 2).reshape(b, c, h, w)`` where ``h = (height - 1) // 4 + 1``;
  the view's strides hold ``h * w`` expanded into a sum, and Inductor's stride-order check on them
  (``Layout.is_stride_ordered``) asks for a bound of an expression sympy has turned into a fraction:
  ``ValueRangeError: Invalid ranges [0:-1]`` and no package. With dynamic sizes, such a view is copied
  (``clone``) before the convolution: Inductor gives the copy the layout the convolution wants (it fuses
  with the op that produced the data) and never compares the view's strides. docs/upstream/inductor-segformer-dynamic.md
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any

import torch
from torch.export import ExportedProgram
from torch.fx.experimental.symbolic_shapes import statically_known_true

from ..analysis.shapes import dim_symbols, user_line
from . import conv_routes

aten = torch.ops.aten

# Every convolution an exported graph can hold; Inductor lowers them all through one lowering.
CONVOLUTIONS = {
    aten.convolution, aten._convolution, aten.conv1d, aten.conv2d, aten.conv3d,
    aten.conv_transpose1d, aten.conv_transpose2d, aten.conv_transpose3d,
}  # fmt: skip

# Dense layers and matrix products, against which convolutions are counted (``model_kind``).
PRODUCTS = {aten.linear, aten.addmm, aten.mm, aten.bmm, aten.matmul, aten.baddbmm}

# The 2-d convolutions a single-pixel one, or one after a pad, is looked for among (``conv2d.padding``:
# transformers' EfficientNet writes ``padding="same"``, which for a 1×1 kernel is no padding, and
# ``padding="valid"`` after its own pads).
CONV2DS = (aten.conv2d.default, aten.conv2d.padding, aten.convolution.default)

UPSTREAM_SEGFORMER = "docs/upstream/inductor-segformer-dynamic.md"

# What a replacement node keeps of the node it replaces: its value (shape, dtype) and where it came from.
KEPT_META = ("val", "tensor_meta", "stack_trace", "nn_module_stack")


@dataclass(frozen=True)
class Rewrite:
    """One change to the graph: what (``global_avg_pool``, ``pixel_conv_as_linear``, ``pad_into_conv``
    or ``copy_conv_input``) and where in the model."""

    kind: str
    node: str  # the graph node rewritten
    where: str  # ``file.py:461 in __init__``-style line of the model's code, or ""


def model_kind(ep: ExportedProgram) -> str:
    """``"convnet"`` where the graph holds more convolutions than dense layers and matrix products
    (ResNet, MobileNet, EfficientNet, RegNet), else ``"other"`` (transformers, ViT and Segformer
    among them): the kind ``options.KIND_DEFAULTS`` names."""
    counts = {"conv": 0, "product": 0}
    for node in ep.graph.nodes:
        packet = getattr(node.target, "overloadpacket", None)
        if packet in CONVOLUTIONS:
            counts["conv"] += 1
        elif packet in PRODUCTS:
            counts["product"] += 1
    return "convnet" if counts["conv"] > counts["product"] else "other"


def rewrite(ep: ExportedProgram, routes: tuple[str, ...] = ()) -> list[Rewrite]:
    """Apply the rewrites to ``ep``'s graph in place, and the convolution ``routes`` asked for
    (``precompile.passes.conv_routes``, before the copies: a routed convolution's output is such a
    view); what was changed, in graph order."""
    gm = ep.graph_module
    done = _global_avg_pools(gm) + _pixel_convs_as_linear(gm)
    # Routed before a zero pad becomes a convolution's padding: a routed depthwise convolution reads
    # its padded input from one buffer it writes anyway, so the pad costs it nothing, and the pad
    # folded in would give it zero taps (4×4 for a 3×3) it would multiply by and a weight computed
    # in the graph, which the routes leave to oneDNN (EfficientNet-B0's four stride-2 ones).
    done += [Rewrite(kind, name, "") for kind, name in conv_routes.route(gm, routes)]
    done += _pads_into_convs(gm) + _copy_conv_inputs(gm)
    if done:
        gm.graph.lint()
        gm.recompile()
    return done


def _global_avg_pools(gm: torch.fx.GraphModule) -> list[Rewrite]:
    done = []
    for node in list(gm.graph.nodes):
        if node.op != "call_function" or node.target is not aten.avg_pool2d.default or not _covers_input(gm, node):
            continue
        with gm.graph.inserting_before(node):
            mean = gm.graph.call_function(aten.mean.dim, (node.args[0], [-2, -1], True))
        mean.meta.update({k: v for k, v in node.meta.items() if k in KEPT_META})
        node.replace_all_uses_with(mean)
        gm.graph.erase_node(node)
        done.append(Rewrite("global_avg_pool", node.name, _model_line(node.meta.get("stack_trace"))))
    return done


def _covers_input(gm: torch.fx.GraphModule, node: torch.fx.Node) -> bool:
    """Whether this ``avg_pool2d`` is a mean over the spatial axes for every size the graph serves:
    no padding, no divisor override, one output position, and a window at least the input's extent
    (eager then divides by the input's extent: the window is clipped to it)."""
    bound = node.normalized_arguments(gm, normalize_to_only_use_kwargs=True)
    x, out = node.args[0].meta.get("val"), node.meta.get("val")
    if bound is None or not isinstance(x, torch.Tensor) or not isinstance(out, torch.Tensor):
        return False
    kw = bound.kwargs
    kernel = list(kw["kernel_size"]) * (2 if len(kw["kernel_size"]) == 1 else 1)
    padding = kw.get("padding", 0)
    padding = list(padding) if isinstance(padding, (list, tuple)) else [padding]
    if kw.get("divisor_override") is not None or any(p != 0 for p in padding):
        return False
    return all(statically_known_true(size == 1) for size in out.shape[-2:]) and all(
        statically_known_true(size <= k) for size, k in zip(x.shape[-2:], kernel)
    )


def _pixel_convs_as_linear(gm: torch.fx.GraphModule) -> list[Rewrite]:
    done = []
    for node in list(gm.graph.nodes):
        if node.op != "call_function" or node.target not in CONV2DS:
            continue
        parts = _pixel_conv(gm, node)
        if parts is None:
            continue
        x, weight, bias = parts
        out, w = weight.meta["val"].shape[:2]
        graph = gm.graph
        with graph.inserting_before(node):
            flat = graph.call_function(aten.squeeze.dims, (x, [2, 3]))
            matrix = graph.call_function(aten.view.default, (weight, [out, w]))
            dense = graph.call_function(aten.linear.default, (flat, matrix, bias))
            image = graph.call_function(
                aten.unsqueeze.default, (graph.call_function(aten.unsqueeze.default, (dense, -1)), -1)
            )
        vals = {flat: aten.squeeze.dims(x.meta["val"], [2, 3]), matrix: weight.meta["val"].view(out, w)}
        vals[dense] = aten.linear.default(vals[flat], vals[matrix], bias.meta["val"] if bias is not None else None)
        vals[image.args[0]] = vals[dense].unsqueeze(-1)
        vals[image] = vals[image.args[0]].unsqueeze(-1)
        for new, val in vals.items():
            new.meta.update({k: v for k, v in node.meta.items() if k in KEPT_META and k not in ("val", "tensor_meta")})
            new.meta["val"] = val
        node.replace_all_uses_with(image)
        graph.erase_node(node)
        done.append(Rewrite("pixel_conv_as_linear", node.name, _model_line(node.meta.get("stack_trace"))))
    return done


def _pixel_conv(gm: torch.fx.GraphModule, node: torch.fx.Node) -> tuple[Any, Any, Any] | None:
    """``(input, weight, bias)`` of a 2-d convolution that is a dense layer over the channels: a 1×1
    kernel, no padding, stride, dilation or groups, not transposed, a weight that is the model's own
    tensor, and an input of one pixel at every size the graph serves; else None."""
    bound = node.normalized_arguments(gm, normalize_to_only_use_kwargs=True)
    if bound is None:
        return None
    kw = bound.kwargs
    x, weight, bias = kw["input"], kw["weight"], kw.get("bias")
    vals = [getattr(n, "meta", {}).get("val") for n in (x, weight)]
    if not all(isinstance(v, torch.Tensor) and v.dim() == 4 for v in vals):
        return None
    xv, wv = vals
    if weight.op not in ("placeholder", "get_attr"):
        return None  # a quantized weight (dequantized in the graph): Inductor's int8 patterns want the conv
    if kw.get("transposed", False) or kw.get("groups", 1) != 1 or tuple(wv.shape[2:]) != (1, 1):
        return None
    ones = [list(kw.get(k, d)) if isinstance(kw.get(k, d), (list, tuple)) else [kw.get(k, d)] for k, d in
            (("stride", 1), ("dilation", 1))]  # fmt: skip
    padding = kw.get("padding", 0)
    padding = list(padding) if isinstance(padding, (list, tuple)) else [padding]
    if any(p not in (0, "valid", "same") for p in padding) or any(v != 1 for part in ones for v in part):
        return None
    if not all(statically_known_true(size == 1) for size in xv.shape[2:]):
        return None
    return x, weight, bias


def _pads_into_convs(gm: torch.fx.GraphModule) -> list[Rewrite]:
    done = []
    graph = gm.graph
    for node in list(graph.nodes):
        if node.op != "call_function" or node.target not in CONV2DS:
            continue
        parts = _padded_conv(gm, node)
        if parts is None:
            continue
        pad, kw, padding, extend = parts
        with graph.inserting_before(node):
            weight = kw["weight"]
            if any(extend):
                weight = graph.call_function(aten.constant_pad_nd.default, (weight, extend, 0.0))
                weight.meta.update(val=aten.constant_pad_nd.default(kw["weight"].meta["val"], extend, 0.0))
            conv = graph.call_function(
                aten.conv2d.default,
                (pad.args[0], weight, kw.get("bias"), list(kw["stride"]), padding, [1, 1], kw["groups"]),
            )
        conv.meta.update({k: v for k, v in node.meta.items() if k in KEPT_META})
        node.replace_all_uses_with(conv)
        graph.erase_node(node)
        if not pad.users:
            graph.erase_node(pad)
        done.append(Rewrite("pad_into_conv", node.name, _model_line(pad.meta.get("stack_trace"))))
    return done


def _padded_conv(
    gm: torch.fx.GraphModule, node: torch.fx.Node
) -> tuple[Any, dict[str, Any], list[int], list[int]] | None:
    """For a 2-d convolution whose input is that of a zero pad with fixed amounts: the pad node, the
    convolution's arguments, the padding the convolution takes in the pad's place, and how its kernel
    is to be extended (``constant_pad_nd``'s amounts, last axis first); else None.

    A pad of ``(L, R)`` before a stride-``s`` window is the convolution's own padding ``max(L, R)``
    with ``|R - L|`` zero taps added to the kernel on the side with less padding: every window then
    starts where it did, over the same values, and there are as many. Only depthwise convolutions
    get taps added (their extra multiply-adds cost less than the copy saved; a dense one's do not)."""
    bound = node.normalized_arguments(gm, normalize_to_only_use_kwargs=True)
    if bound is None:
        return None
    kw = dict(bound.kwargs)
    pad, weight = kw["input"], kw["weight"]
    if not isinstance(pad, torch.fx.Node) or pad.op != "call_function" or weight.op not in ("placeholder", "get_attr"):
        return None
    amounts = _zero_pad(pad)
    xv, wv = (getattr(n, "meta", {}).get("val") for n in (pad.args[0], weight))
    if amounts is None or not all(isinstance(v, torch.Tensor) and v.dim() == 4 for v in (xv, wv)):
        return None
    if kw.get("transposed", False) or any(p for p in kw.get("output_padding", [0, 0])):
        return None
    stride, dilation = (list(kw.get(k, 1)) if isinstance(kw.get(k, 1), (list, tuple)) else [kw.get(k, 1)] * 2
                        for k in ("stride", "dilation"))  # fmt: skip
    padding = kw.get("padding", 0)
    padding = [0, 0] if padding == "valid" else list(padding) if isinstance(padding, (list, tuple)) else [padding] * 2
    if len(stride) == 1:
        stride = stride * 2
    if len(padding) == 1:
        padding = padding * 2
    if any(d != 1 for d in dilation) or not all(isinstance(p, int) for p in padding):
        return None
    kw.update(stride=stride, groups=kw.get("groups", 1))
    depthwise = wv.shape[1] == 1 and kw["groups"] > 1
    extend: list[int] = []  # constant_pad_nd's order: width's (before, after), then height's
    merged = [0, 0]
    for axis, (before, after) in ((1, amounts[0:2]), (0, amounts[2:4])):
        left, right = before + padding[axis], after + padding[axis]
        if left != right and not depthwise:
            return None
        merged[axis] = max(left, right)
        extend += [right - left, 0] if right > left else [0, left - right]
    return pad, kw, merged, extend


def _zero_pad(node: torch.fx.Node) -> list[int] | None:
    """The amounts ``(left, right, top, bottom)`` of a constant zero pad of the last two axes by
    fixed, non-negative sizes; else None."""
    if node.target is aten.pad.default:
        mode = node.kwargs.get("mode", node.args[2] if len(node.args) > 2 else "constant")
        value = node.kwargs.get("value", node.args[3] if len(node.args) > 3 else None)
        if mode != "constant":
            return None
    elif node.target is aten.constant_pad_nd.default:
        value = node.kwargs.get("value", node.args[2] if len(node.args) > 2 else 0)
    else:
        return None
    amounts = list(node.args[1])
    if value not in (None, 0, 0.0) or len(amounts) != 4 or not all(isinstance(a, int) and a >= 0 for a in amounts):
        return None
    return amounts


def _copy_conv_inputs(gm: torch.fx.GraphModule) -> list[Rewrite]:
    done, copies = [], {}
    for node in list(gm.graph.nodes):
        if node.op != "call_function" or getattr(node.target, "overloadpacket", None) not in CONVOLUTIONS:
            continue
        src = node.args[0]
        if not _dynamic_view(src):
            continue
        if src not in copies:
            val = src.meta["val"]
            # Another memory format than the view's: a clone with its input's strides is a no-op that
            # Inductor removes (post_grad.remove_noop_ops). The convolution still picks the layout.
            layout = torch.contiguous_format
            if _known_contiguous(val):
                layout = {4: torch.channels_last, 5: torch.channels_last_3d}.get(val.dim(), layout)
            with gm.graph.inserting_after(src):
                copies[src] = gm.graph.call_function(aten.clone.default, (src,), {"memory_format": layout})
            copies[src].meta.update(val=val.clone(memory_format=layout), stack_trace=src.meta.get("stack_trace"))
        node.replace_input_with(src, copies[src])
        done.append(Rewrite("copy_conv_input", node.name, _model_line(node.meta.get("stack_trace"))))
    return done


def _dynamic_view(node: Any) -> bool:
    """A view (it shares its producer's memory and strides) with a symbolic size. ``contiguous`` is
    no view in this sense: what it returns is laid out densely by construction."""
    if not isinstance(node, torch.fx.Node) or node.op != "call_function":
        return False
    target, val = node.target, node.meta.get("val")
    return (
        isinstance(target, torch._ops.OpOverload)  # OpOverload.is_view: the schema says the output aliases an input
        and target.is_view
        and target.overloadpacket is not aten.contiguous
        and isinstance(val, torch.Tensor)
        and any(isinstance(s, torch.SymInt) for s in val.shape)
    )


def _known_contiguous(val: torch.Tensor) -> bool:
    """Whether ``val``'s strides are provably row-major, asking the sizes' ranges only (``is_contiguous()``
    would add guards to the exported program's shape environment)."""
    expected: Any = 1
    for size, stride in reversed(list(zip(val.shape, val.stride()))):
        if not statically_known_true(size == 1) and not statically_known_true(stride == expected):
            return False
        expected = expected * size
    return True


# --- the failure, in the profile's words -------------------------------------------------------------


def explain_failure(e: BaseException, ep: ExportedProgram, shapes: list[list[Any]]) -> str | None:
    """One line for an Inductor lowering failure: the op, the model's line, the dims its input's sizes
    depend on (``shapes``: the profile's input shapes, ``[batch, 3, height, width]``) and what to do;
    None when ``e`` is no lowering failure (the caller then quotes torch)."""
    text = str(e)
    failure = re.search(r"LoweringException: (\w+): (.*)", text)
    if failure is None:
        return None
    target = re.search(r"^\s*target: (\S+)", text, re.M)
    op = target.group(1).removesuffix(".default") if target else "an op"
    names = {str(symbol): dim for symbol, dim in dim_symbols(ep, shapes).items()}
    # The input's IR (args[0]); a view's own layout comes last, after the buffer it views.
    first = re.search(r"args\[0\]:(.*?)(?:args\[1\]:|Found from|$)", text, re.S)
    size = re.findall(r"size=\[([^\]]*)\]", first.group(1)) if first else []
    sizes = _in_dims(size[-1], names) if size else ""
    divided = " ".join(part for part in _entries(sizes) if "//" in part)  # the dims floor divisions hold
    involved = [d for d in dict.fromkeys(names.values()) if re.search(rf"\b{re.escape(d)}\b", divided)]
    line = _model_line(text.split("Found from", 1)[1] if "Found from" in text else "")
    at = f" at {line}" if line else ""
    said = f"{failure.group(1)}: {failure.group(2).strip()}"
    if failure.group(1) == "ValueRangeError" and involved:
        dims = " and ".join(involved)
        return (
            f"Inductor (torch {torch.__version__}) cannot compile {op}{at} for dynamic {dims}: its input's "
            f"sizes [{sizes}] are floor divisions of them, on which its range analysis fails ({said}; "
            f"{UPSTREAM_SEGFORMER}); declare {dims} as static sizes in the profile (one variant per size)"
        )
    shown = f" (input sizes [{sizes}])" if sizes else ""
    return f"Inductor (torch {torch.__version__}) cannot compile {op}{at}{shown}: {said}"


def _entries(sizes: str) -> list[str]:
    """``a, (b + 1)//4, c`` → its top-level entries (commas inside brackets do not split)."""
    out, depth, start = [], 0, 0
    for i, ch in enumerate(sizes):
        depth += {"(": 1, "[": 1, ")": -1, "]": -1}.get(ch, 0)
        if ch == "," and depth == 0:
            out.append(sizes[start:i].strip())
            start = i + 1
    return out + [sizes[start:].strip()]


def _in_dims(sizes: str, names: dict[str, str]) -> str:
    """Inductor's size expressions with its symbols (``s53``) replaced by the profile's dim names."""
    return re.sub(r"\bs\d+\b", lambda m: names.get(m.group(0), m.group(0)), sizes)


def _model_line(stack: str | None) -> str:
    """The innermost frame of a Python stack text outside torch: ``modeling_x.py:216 in forward: <code>``."""
    frames = re.findall(r'File "([^"]+)", line (\d+), in (\S+)\n\s*(.*)', stack or "")
    stack = [{"filename": i, "line": int(n), "name": name, "loc": code} for i, (_, n, name, code) in enumerate(frames)]
    return user_line(stack, {i: path for i, (path, *_) in enumerate(frames)})
