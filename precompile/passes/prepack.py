"""Convolution weights packed for oneDNN at build time, for dynamic image sizes too.

Inductor's freezing (torch 2.13, ``fx_passes/mkldnn_fusion.py``, the weight-pack pass) turns each
CPU convolution into ``mkldnn._convolution_pointwise`` and packs its weight into oneDNN's blocked
layout (``mkldnn._reorder_convolution_weight``) only when the input size is static; with a symbolic
size it keeps the plain weight ("we need to pack weight in runtime"), and every call then re-lays out
every weight of the network (about 100 MB a call for ResNet-50 in fp32).

A weight packed for one size does not serve every size as it is: ideep asks oneDNN, at each call, for
the weight format the kernel for that call's shape wants, and reorders a packed weight that differs.
For one ISA that format is often the same across sizes, and often not: oneDNN 3.12's brgemm kernels
block ResNet-50's weights by the image size for 20 of its 53 convolutions, and a packed weight in the
wrong blocking is reordered per call by oneDNN's generic ``simple:any`` reorder, ~10 ms for a
1024×256 weight, far slower than the plain weight's jitted one (ResNet-50 fp32 at 1×96², every
weight packed for 2×157²: 914 ms a call on a busy host, against 34 ms eager).

``PrepackConvolutions`` is an Inductor ``post_grad_custom_pre_pass`` (it runs after freezing, before
the fusions): each such convolution whose weight is a frozen constant gets that weight packed for the
variant's hint shape (the sizes the program was exported with), as a new constant, when oneDNN asks
for the same format at the range's corners, its middle and the hint:

    configs["post_grad_custom_pre_pass"] = PrepackConvolutions()   # stages.compile, when freezing

Left as they are (plain weights, reordered per call by oneDNN's jitted reorder):

- a convolution whose format varies over those sizes (above);
- a convolution reading a single channel: with dynamic sizes Inductor gives its output the layout of
  a contiguous input (``mkldnn_ir._prepare_convolution_fusion_create``, PR #121400), and a one-channel
  input is contiguous and channels-last at once, and a packed weight makes oneDNN write channels-last:
  Inductor would describe the packed kernel's output wrongly;
- transposed convolutions: the freezing pass does not convert them with dynamic sizes at all (their
  lowering needs static sizes), so they stay ``aten.convolution`` with plain weights.
"""

from __future__ import annotations

import ctypes
from itertools import product
from operator import attrgetter
from typing import Any

import torch
from torch._inductor.constant_folding import replace_node_with_constant
from torch._inductor.custom_graph_pass import CustomGraphPass, get_hash_for_files
from torch.fx.experimental.symbolic_shapes import has_free_symbols, optimization_hint

CONVOLUTION = torch.ops.mkldnn._convolution_pointwise.default


class PrepackConvolutions(CustomGraphPass):
    """Pack the frozen weight of every dynamic-size convolution for the hint shape (module docstring)."""

    def __call__(self, graph: torch.fx.Graph) -> None:
        gm = graph.owning_module
        for node in list(graph.nodes):
            if node.op == "call_function" and node.target is CONVOLUTION:
                if _left_because(gm, node) is None:
                    _pack(gm, node)

    def uuid(self) -> Any:
        return get_hash_for_files((__file__,))  # Inductor's cache keys on this: a change here recompiles


def _left_because(gm: torch.fx.GraphModule, node: torch.fx.Node) -> str | None:
    """Why ``node``'s weight stays as it is, or None when it gets packed."""
    x, weight = node.args[0], node.args[1]
    val = x.meta.get("val") if isinstance(x, torch.fx.Node) else None
    if not isinstance(val, torch.Tensor) or not has_free_symbols(val.shape):
        return "static"  # packed by Inductor already
    if not isinstance(weight, torch.fx.Node) or weight.op != "get_attr":
        return "not a constant"
    w = attrgetter(weight.target)(gm)
    if not isinstance(w, torch.Tensor) or w.is_mkldnn or w.device.type != "cpu":
        return "not a constant"
    groups = node.args[6]
    if w.size(1) * groups == 1:
        return "one input channel"
    if len({_layout(_reorder(w, node, size)) for size in _probe_sizes(val.shape)}) > 1:
        return "format varies with the size"
    return None


def _probe_sizes(shape: Any) -> list[list[int]]:
    """The convolution's input sizes when the graph's inputs are at the hint, at each corner of their
    ranges (every symbol at its least or greatest) and in the middle of them."""
    exprs = [s.node.expr if isinstance(s, torch.SymInt) else s for s in shape]
    env = next(s.node.shape_env for s in shape if isinstance(s, torch.SymInt))
    symbols = sorted({f for e in exprs if hasattr(e, "free_symbols") for f in e.free_symbols}, key=str)
    # A dim declared from 1 has the range [2, max] in the graph (torch.export specializes 0 and 1): probe 1 too.
    ranges = [_ends(env.var_to_range[f]) for f in symbols]
    points = [[optimization_hint(s) for s in shape]]
    for corner in [*product(*ranges), tuple((r[0] + r[-1]) // 2 for r in ranges)]:
        values = dict(zip(symbols, corner))
        points.append([int(e.xreplace(values)) if hasattr(e, "xreplace") else int(e) for e in exprs])
    return [list(p) for p in dict.fromkeys(tuple(p) for p in points)]


def _ends(r: Any) -> tuple[int, ...]:
    """A range's ends to probe; a dim without a maximum is probed at its least value (and the hint)."""
    lo = int(r.lower)  # a size's least value is always known (0, 1 or 2 unless declared)
    hi = (int(r.upper),) if r.upper.is_finite else ()
    return ((1,) if lo == 2 else ()) + (lo, *hi)


def _reorder(w: torch.Tensor, node: torch.fx.Node, size: list[int]) -> torch.Tensor:
    """``w`` packed the way oneDNN wants it for an input of ``size``: the call Inductor's own pass
    makes for a static size (``mkldnn_fusion.pack_conv_weight``), private to torch."""
    _, _, _, padding, stride, dilation, groups = node.args[:7]
    return torch.ops.mkldnn._reorder_convolution_weight(w, padding, stride, dilation, groups, size)


def _layout(packed: torch.Tensor) -> bytes:
    """A packed tensor's bytes as oneDNN laid them out: equal for two packings of one weight exactly
    when their formats agree (oneDNN's serialized descriptor also holds shape-dependent fields that
    ideep does not compare: a bf16 weight packed for 28² serves 16² and 48² without a reorder)."""
    return ctypes.string_at(torch.ops.mkldnn.data_ptr(packed), torch.ops.mkldnn._nbytes(packed))


def _pack(gm: torch.fx.GraphModule, node: torch.fx.Node) -> None:
    x, weight, _, padding, stride, dilation, groups = node.args[:7]
    hint = [optimization_hint(s) for s in x.meta["val"].shape]
    packed = _reorder(attrgetter(weight.target)(gm), node, hint)
    # The helper freezing turns a folded value into a frozen constant with (private to Inductor).
    graph = gm.graph
    with graph.inserting_before(node):
        pack = graph.call_function(
            torch.ops.mkldnn._reorder_convolution_weight.default, (weight, padding, stride, dilation, groups, hint)
        )
    pack.meta.update(weight.meta)
    node.replace_input_with(weight, pack)
    replace_node_with_constant(gm, pack, packed)
    if not weight.users:
        graph.erase_node(weight)
