"""Convolution weights packed for oneDNN at build time, for dynamic image sizes too.

Inductor's freezing (torch 2.13, ``fx_passes/mkldnn_fusion.py``, the weight-pack pass) turns each
CPU convolution into ``mkldnn._convolution_pointwise`` and packs its weight into oneDNN's blocked
layout (``mkldnn._reorder_convolution_weight``) only when the input size is static; with a symbolic
size it keeps the plain weight ("we need to pack weight in runtime"), and every call then re-lays out
every weight of the network (about 100 MB a call for ResNet-50 in fp32).

A weight packed for one size does not serve every size as it is: ideep asks oneDNN, at each call, for
the weight format the kernel for that call's shape wants, and reorders a packed weight that differs.
For one ISA that format is often the same across sizes, and often not: oneDNN 3.12's brgemm kernels
pick the output-channel blocking (``Acdb48a`` or ``Acdb64a`` in fp32 on AVX-512) by a cost model
over the batch, the image size and the thread count, for 25 of ResNet-50's 53 convolutions over
batch 1-4 and 96-256² (19 of MobileNetV2's 52), and a packed weight in the wrong blocking is
reordered per call by oneDNN's generic ``simple:any`` reorder, ~10 ms for a 1024×256 weight, far
slower than the plain weight's jitted one (ResNet-50 fp32 at 1×96², every weight packed for 2×157²:
914 ms a call on a busy host, against 34 ms eager).

That choice is not monotone in any size (ResNet-50's 128×128 3×3 stride-2 convolution wants the
other blocking only at 28² with a batch of 2-4; a 512×128 1×1 one flips back and forth along the
image side), so no split of a range into a few variants makes every convolution's layout agree:
cut into 16 sub-ranges (each batch × height and width halves), 5-19 of ResNet-50's convolutions
still vary within one (MobileNetV2: 7-15), and each frozen variant carries its own weights (~100 MB
for ResNet-50) and compile. The planner therefore does not split for layouts; the convolutions that
vary keep a plain weight. The layouts are the build host's: those found constant at 2 threads were
the same at 1 (ResNet-50); a serving host with many more threads than the build's may want others.

``PrepackConvolutions`` is an Inductor ``post_grad_custom_pre_pass`` (it runs after freezing, before
the fusions): each such convolution whose weight is a frozen constant gets that weight packed for the
variant's hint shape (the sizes the program was exported with), as a new constant, when oneDNN asks
for the same format at every size the convolution's input takes over the variant's ranges (all of
them up to ``MAX_PROBES``, evenly spread past it):

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
from collections.abc import Callable, Iterable, Iterator
from itertools import product
from math import prod
from operator import attrgetter
from typing import Any

import sympy
import torch
from torch._inductor.constant_folding import replace_node_with_constant
from torch._inductor.custom_graph_pass import CustomGraphPass, get_hash_for_files
from torch.fx.experimental.symbolic_shapes import has_free_symbols, optimization_hint

CONVOLUTION = torch.ops.mkldnn._convolution_pointwise.default
# Input sizes probed per convolution at most (about 0.5 ms each on a busy 2-core host): ResNet-50's
# stage-one convolutions take 4 × 41 × 41 sizes over batch 1-4 and 96-256² images, all probed.
MAX_PROBES = 8192


class PrepackConvolutions(CustomGraphPass):
    """Pack the frozen weight of every dynamic-size convolution for the hint shape (module docstring)."""

    def __call__(self, graph: torch.fx.Graph) -> None:
        gm = graph.owning_module
        seen: dict[tuple[Any, ...], bool] = {}  # a network's repeated blocks ask the same question
        for node in list(graph.nodes):
            if node.op == "call_function" and node.target is CONVOLUTION:
                if _left_because(gm, node, seen) is None:
                    _pack(gm, node)

    def uuid(self) -> Any:
        return get_hash_for_files((__file__,))  # Inductor's cache keys on this: a change here recompiles


def _left_because(gm: torch.fx.GraphModule, node: torch.fx.Node, seen: dict[tuple[Any, ...], bool]) -> str | None:
    """Why ``node``'s weight stays as it is, or None when it gets packed. ``seen``: whether the format
    varies, per convolution already probed in this graph (the layout depends on the weight's shape
    and dtype, the convolution's arguments and the input's sizes, never on the weight's values)."""
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
    key = (tuple(w.shape), w.dtype, *map(str, node.args[3:7]), *(str(s) for s in val.shape))
    if key not in seen:
        seen[key] = varies(lambda size: _reorder(w, node, size), probe_sizes(val.shape))
    if seen[key]:
        return "format varies with the size"
    return None


def varies(pack: Callable[[list[int]], torch.Tensor], sizes: Iterable[list[int]]) -> bool:
    """Whether ``pack`` lays a weight out differently for any of ``sizes`` (stops at the first that
    differs from the first size's)."""
    first = None
    for size in sizes:
        bytes_ = layout(pack(size))
        if first is None:
            first = bytes_
        elif bytes_ != first:
            return True
    return False


def probe_sizes(shape: Any) -> Iterator[list[int]]:
    """The convolution's input sizes to ask oneDNN about: the hint first, then every size the input
    takes over the ranges of the graph's inputs (each dim is a function of its own symbols: its
    distinct values, times the other dims'), spread evenly over them past ``MAX_PROBES``. Corners
    and a middle are not enough: oneDNN picks ResNet-50's 128×128 3×3 stride-2 blocking by a cost
    model that wants another layout only at 28² with a batch of 2 to 4 (module docstring)."""
    exprs = [s.node.expr if isinstance(s, torch.SymInt) else sympy.Integer(s) for s in shape]
    env = next(s.node.shape_env for s in shape if isinstance(s, torch.SymInt))
    yield [optimization_hint(s) for s in shape]
    groups: list[tuple[list[int], list[tuple[int, ...]]]] = []  # (dims, their distinct values) per symbol set
    for symbols in _symbol_sets(exprs):
        dims = [i for i, e in enumerate(exprs) if e.free_symbols and e.free_symbols <= symbols]
        ordered = sorted(symbols, key=str)
        values = _within_budget([_values(env.var_to_range[f]) for f in ordered])  # a dim of several symbols
        seen = {
            tuple(int(exprs[i].xreplace(dict(zip(ordered, point)))) for i in dims): None for point in product(*values)
        }
        groups.append((dims, list(seen)))
    groups = [(dims, v) for (dims, _), v in zip(groups, _within_budget([v for _, v in groups]))]
    for combination in product(*(v for _, v in groups)):
        size = [int(e) if not e.free_symbols else 0 for e in exprs]
        for (dims, _), values in zip(groups, combination):
            for i, n in zip(dims, values):
                size[i] = n
        yield size


def _symbol_sets(exprs: list[Any]) -> list[set[Any]]:
    """The free symbols of ``exprs``, grouped so that no dim's symbols straddle two groups."""
    sets: list[set[Any]] = []
    for e in exprs:
        joined = set(e.free_symbols)
        for s in [s for s in sets if s & joined]:
            joined |= s
            sets.remove(s)
        if joined:
            sets.append(joined)
    return sets


def _values(r: Any) -> list[int]:
    """A symbol's values to probe: all of its range; one without a maximum at its least value (and
    the hint). A dim declared from 1 has the range [2, max] in the graph (torch.export specializes 0
    and 1): 1 too."""
    lo = int(r.lower)  # a size's least value is always known (0, 1 or 2 unless declared)
    start = 1 if lo == 2 else lo
    return list(range(start, int(r.upper) + 1)) if r.upper.is_finite else [start, lo]


def _within_budget(lists: list[list[Any]]) -> list[list[Any]]:
    """``lists``, the longest halved (evenly spread, its ends kept) until their product of lengths,
    the sizes they make, is at most ``MAX_PROBES``."""
    lists = list(lists)
    while prod(len(v) for v in lists) > MAX_PROBES:
        k = max(range(len(lists)), key=lambda j: len(lists[j]))
        lists[k] = _spread(lists[k], (len(lists[k]) + 1) // 2)
    return lists


def _spread(values: list[Any], k: int) -> list[Any]:
    """``k`` of ``values`` evenly spread, the first and last among them."""
    if len(values) <= k:
        return values
    return [values[round(i * (len(values) - 1) / (k - 1))] for i in range(k)]


def _reorder(w: torch.Tensor, node: torch.fx.Node, size: list[int]) -> torch.Tensor:
    """``w`` packed the way oneDNN wants it for an input of ``size``: the call Inductor's own pass
    makes for a static size (``mkldnn_fusion.pack_conv_weight``), private to torch."""
    _, _, _, padding, stride, dilation, groups = node.args[:7]
    return torch.ops.mkldnn._reorder_convolution_weight(w, padding, stride, dilation, groups, size)


def layout(packed: torch.Tensor) -> bytes:
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
