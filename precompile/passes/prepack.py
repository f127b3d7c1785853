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

Why the format moves (oneDNN's ``cpu/x64/jit_brgemm_conv_utils.cpp``, ``init_conf``): the brgemm
convolution tries output-channel blocks of 64, 48, 32 and 16 and keeps the one whose ``est_eff()``
is highest, an estimate over the batch, the output's height and width, the thread count (``nthr``)
and the cache sizes; ``pick_tags`` then derives the weight format from that block (``Ohwi64o``,
``Ohwi48o``, ...), and a weight given in another format makes the kernel refuse the problem
(``init_tag``: unimplemented), so no setting makes one format serve every size. The choice is not
monotone in any size (ResNet-50's 128×128 3×3 stride-2 convolution wants the other blocking only at
28² with a batch of 2-4; a 512×128 1×1 one flips back and forth along the image side), so no split
of a range into a few variants makes every convolution's layout agree (cut into 16 sub-ranges, 5-19
of ResNet-50's convolutions still vary within one).

So a convolution whose format varies over its range gets one packed copy of its weight per format
that occurs (two or three), and the compiled program picks one per call: ``torch.cond`` on a 0-d
bool read from a build-time table indexed by the convolution's input sizes, which AOTInductor
inlines as an ``if`` on one byte (``_pick_per_call``). The copies cost their bytes in the package
(ResNet-50 fp32: docs/compile-options.md). The formats are the build host's, probed at one thread and at its
own count (``probe_threads``: the loader gives a call between the two); at the sizes where those
want different formats the branch runs on the plain weight (re-laid per call by the jitted reorder,
as before this pass), never on a packed one in the wrong blocking; an int8 convolution, which takes
no plain weight, runs there on the copy packed for its own count (a lone call's: ``settle``). A serving host with more threads
than the build's may want others at some sizes (then oneDNN reorders there). The probes are asked from
as many threads at once as the compile has CPUs (``probe_workers``): a 3-convolution model's build
spent 4.7 s of its 18 s in them on one thread, 3.1 s on two.

A static convolution's weight Inductor packs itself, for the thread count of the process that
compiles it; where oneDNN wants another blocking at one thread, each of two calls at once re-laid
it with the reference reorder (transformers' ResNet-50, static at 1×3×128²: 6.5 calls/s on one thread
against 43.2 on two; served unbatched to 16 clients, 14.6 requests/s). The pass probes it at the
static size and ``probe_threads()``: the weight stays packed where they agree (repacked if
Inductor's differs), and goes back to plain where they do not (``_settle_static``): 25.5 calls/s on
one thread, 43.8 on two, 53.6 requests/s served.

``PrepackConvolutions`` is an Inductor ``post_grad_custom_pre_pass`` (it runs after freezing, before
the fusions): each such convolution whose weight is a frozen constant gets that weight packed for
each format oneDNN asks for over the sizes the convolution's input takes over the variant's ranges
(all of them up to ``MAX_PROBES``, evenly spread past it); a single format needs no choice:

    configs["post_grad_custom_pre_pass"] = PrepackConvolutions()   # stages.compile, when freezing

The int8 convolutions (PT2E's x86 quantizer, ``onednn.qconv_pointwise`` and
``qconv2d_pointwise.binary``) are packed by Inductor's freezing itself (``fx_passes/quantization.py``,
``qconv_weight_prepack``: ``onednn.qconv_prepack(..., x_shape)``), but with ``x_shape=None`` when
the input's size is symbolic, and ideep then packs for a made-up input: the blocking oneDNN's brgemm
wants at no real size for most 1×1 convolutions (38 of ResNet-50's 53 over batch 1-4 and 96-256²,
probed), which oneDNN re-lays per call (``simple:any`` for a 1024×256 weight: ~5-10 ms a call). This
pass probes them the same way, with ``qconv_prepack`` and the input's sizes (in the probes the format
depended on neither the input's scale nor its zero point; a zero point other than 0 is probed apart,
as oneDNN compensates for it in the weight), repacks the weight (read back plain from Inductor's
copy) for the hint where one format serves the range, and chooses per call where several do (the
binary one, a residual addition fused in, on a copy of its addend: it writes the addend in place,
which a ``torch.cond`` branch may not do).

Left as they are (plain weights, reordered per call by oneDNN's jitted reorder):

- a convolution whose format varies and whose input is not channels-last (the model's own image,
  Segformer's reshaped sequences): a branch describes the output by the input's layout as FX
  records it, and Inductor may lay such an input out otherwise (Segformer's build failed its check
  with the choice made there);
- a convolution reading a single channel: with dynamic sizes Inductor gives its output the layout of
  a contiguous input (``mkldnn_ir._prepare_convolution_fusion_create``, PR #121400), and a one-channel
  input is contiguous and channels-last at once, and a packed weight makes oneDNN write channels-last:
  Inductor would describe the packed kernel's output wrongly;
- transposed convolutions: the freezing pass does not convert them with dynamic sizes at all (their
  lowering needs static sizes), so they stay ``aten.convolution`` with plain weights.
"""

from __future__ import annotations

import ctypes
import operator
from collections.abc import Callable, Iterable, Iterator
from concurrent.futures import ThreadPoolExecutor
from itertools import product
from math import prod
from operator import attrgetter
from typing import Any, NamedTuple

import sympy
import torch
from torch._inductor.constant_folding import replace_node_with_constant
from torch._inductor.custom_graph_pass import CustomGraphPass, get_hash_for_files
from torch.fx.experimental.symbolic_shapes import guard_or_false, guard_or_true, has_free_symbols, optimization_hint

aten = torch.ops.aten
CONVOLUTION = torch.ops.mkldnn._convolution_pointwise.default
# Inductor's int8 convolutions (PT2E x86 quantizer), their weights packed by its freezing pass.
QUANTIZED = (
    torch.ops.onednn.qconv_pointwise.default,
    torch.ops.onednn.qconv2d_pointwise.default,
    torch.ops.onednn.qconv2d_pointwise.binary,
)
# The overloads a cond's branch calls them through, the input's scale and zero point as tensors
# (``_quantized_call``); the binary one on a copy of its addend (``_binary_on_copy``).
TENSOR_SCALES = {
    torch.ops.onednn.qconv_pointwise.default: torch.ops.onednn.qconv_pointwise.tensor,
    torch.ops.onednn.qconv2d_pointwise.default: torch.ops.onednn.qconv2d_pointwise.tensor,
    torch.ops.onednn.qconv2d_pointwise.binary: torch.ops.onednn.qconv2d_pointwise.binary_tensor,
}
# Input sizes probed per convolution at most (about 0.5 ms each on a busy 2-core host): ResNet-50's
# stage-one convolutions take 4 × 41 × 41 sizes over batch 1-4 and 96-256² images, all probed.
MAX_PROBES = 8192
# Sizes below which one thread asks oneDNN alone: a thread costs more than it saves on a few queries.
PROBES_PER_WORKER = 64


class PrepackConvolutions(CustomGraphPass):
    """Pack the frozen weight of every dynamic-size convolution, once per format oneDNN wants over the
    range, and choose among the copies per call where there are several; settle the weights Inductor
    packed for static sizes at every thread count (module docstring)."""

    def __call__(self, graph: torch.fx.Graph) -> None:
        gm = graph.owning_module
        seen: dict[tuple[Any, ...], Layouts] = {}  # a network's repeated blocks ask the same question
        for node in list(graph.nodes):
            if node.op == "call_function" and (node.target is CONVOLUTION or node.target in QUANTIZED):
                if _packed_static(gm, node):
                    _settle_static(gm, node, seen)
                    continue
                found = _formats(gm, node, seen)
                if len(found.groups) == 1 and not found.mixed:
                    _pack(gm, node)
                elif found.groups and len(found.groups) + bool(found.mixed) > 1 and _choosable(node, found):
                    _pick_per_call(gm, node, found)

    def uuid(self) -> Any:
        return get_hash_for_files((__file__,))  # Inductor's cache keys on this: a change here recompiles


def _formats(gm: torch.fx.GraphModule, node: torch.fx.Node, seen: dict[tuple[Any, ...], Layouts]) -> Layouts:
    """The input sizes of ``node`` by the weight format oneDNN wants for them (``Layouts``; one group
    and nothing mixed: one packed weight serves them all); none when the weight stays as it is
    (static: Inductor packed it; not a frozen constant; one input channel, module docstring).
    ``seen``: the layouts per convolution already probed in this graph (the format depends on the
    weight's shape and dtype, the convolution's arguments and the input's sizes, never on the
    weight's values)."""
    x, weight = node.args[0], _argument(node, "weight")
    val = x.meta.get("val") if isinstance(x, torch.fx.Node) else None
    if not isinstance(val, torch.Tensor) or not has_free_symbols(val.shape):
        return NONE  # packed by Inductor already
    if not isinstance(weight, torch.fx.Node) or weight.op != "get_attr":
        return NONE
    w = _plain_weight(gm, node)
    if w is None:
        return NONE
    stride, padding, dilation, groups = (_argument(node, a) for a in ("stride", "padding", "dilation", "groups"))
    if w.size(1) * groups == 1:
        return NONE
    key = (node.target, tuple(w.shape), w.dtype, *map(str, (padding, stride, dilation, groups)))
    key += (*(str(s) for s in val.shape), node.target is not CONVOLUTION and node.args[2] != 0)
    if key not in seen:
        seen[key] = group_by_layout(
            lambda size: _reorder(w, gm, node, size),
            probe_sizes(val.shape),
            probe_threads(),
            settle=node.target is not CONVOLUTION,
        )
    return seen[key]


def _packed_static(gm: torch.fx.GraphModule, node: torch.fx.Node) -> bool:
    """Whether ``node`` is an fp32 convolution of a static input size whose weight Inductor's freezing
    packed (for the thread count of the process that compiled it)."""
    x, weight = node.args[0], _argument(node, "weight")
    val = x.meta.get("val") if isinstance(x, torch.fx.Node) else None
    if node.target is not CONVOLUTION or not isinstance(val, torch.Tensor) or has_free_symbols(val.shape):
        return False
    if not isinstance(weight, torch.fx.Node) or weight.op != "get_attr":
        return False
    w = attrgetter(weight.target)(gm)
    return isinstance(w, torch.Tensor) and w.is_mkldnn and w.device.type == "cpu"


def _settle_static(gm: torch.fx.GraphModule, node: torch.fx.Node, seen: dict[tuple[Any, ...], Layouts]) -> None:
    """A static convolution's weight as every thread count a call runs at can use it. Inductor packs
    it for the compiling process's count, and oneDNN may want another blocking at one thread (each
    of two calls at once, execution instances): then it re-lays the weight at every such call with
    its reference reorder (transformers' ResNet-50 at 1×3×128², a static variant: 6.2 calls/s on one
    thread against 36.8 on two). Probed at ``probe_threads()``: where they agree, the weight packed
    for that format (Inductor's, unless it differs); where they do not, the plain weight, which
    oneDNN re-lays per call with its jitted reorder, as the dynamic variants' mixed sizes do."""
    weight = _argument(node, "weight")
    packed = attrgetter(weight.target)(gm)
    plain = packed.to_dense()
    size = [int(s) for s in node.args[0].meta["val"].shape]
    arguments = tuple(str(_argument(node, a)) for a in ("stride", "padding", "dilation", "groups"))
    key = ("static", tuple(plain.shape), plain.dtype, *arguments, *size)
    if key not in seen:
        seen[key] = group_by_layout(lambda s: _reorder(plain, gm, node, s), [size], probe_threads())
    if seen[key].mixed:
        value = plain
    else:
        value = _reorder(plain, gm, node, size)
        if layout(value) == layout(packed):
            return  # Inductor's is the one every count wants
    node.replace_input_with(weight, _constant(gm, node, value, weight.meta.get("val")))
    if not weight.users:
        gm.graph.erase_node(weight)


def _argument(node: torch.fx.Node, name: str) -> Any:
    """``node``'s argument ``name`` (the weight: ``weight`` of the fp32 op, ``qw`` of the int8 ones)."""
    if node.target is CONVOLUTION:
        return node.args[{"weight": 1, "padding": 3, "stride": 4, "dilation": 5, "groups": 6}[name]]
    names = [a.name for a in node.target._schema.arguments]
    return node.args[names.index("qw" if name == "weight" else name)]


def _plain_weight(gm: torch.fx.GraphModule, node: torch.fx.Node) -> torch.Tensor | None:
    """The frozen weight of ``node`` in its plain layout: the fp32 op's as it is (None if oneDNN's
    already); the int8 ops' from the copy Inductor packed for no size (its pass passes no input
    size when it is symbolic, and ideep then packs for a made-up one, module docstring), unless
    its input's scale and zero point are tensors (then it stays as it is)."""
    w = attrgetter(_argument(node, "weight").target)(gm)
    if not isinstance(w, torch.Tensor) or w.device.type != "cpu":
        return None
    if node.target is CONVOLUTION:
        return None if w.is_mkldnn else w
    scales = _argument(node, "w_scale")
    if not (w.is_mkldnn and isinstance(scales, torch.fx.Node) and scales.op == "get_attr"):
        return None
    if isinstance(node.args[1], torch.fx.Node) or isinstance(node.args[2], torch.fx.Node):
        return None
    return w.to_dense()


class Layouts(NamedTuple):
    """A convolution's input sizes by the weight format oneDNN wants for them: ``groups``, one per
    format, in the order first met (the hint's first), at every thread count probed alike; ``mixed``:
    the sizes where the thread counts want different formats (a packed weight would be re-laid
    blocked to blocked, oneDNN's slow ``simple:any`` reorder, at one of them: they run on the plain
    weight, re-laid by the jitted reorder)."""

    groups: list[list[list[int]]]
    mixed: list[list[int]]


NONE = Layouts([], [])


def group_by_layout(
    pack: Callable[[list[int]], torch.Tensor],
    sizes: Iterable[list[int]],
    threads: Iterable[int] = (),
    *,
    settle: bool = False,
) -> Layouts:
    """``sizes`` grouped by how ``pack`` lays a weight out for them at each of ``threads`` (OpenMP
    thread counts, as oneDNN's choice depends on them; none: the current count only). ``settle``:
    a size the thread counts disagree on joins the group of the format the most threads want (a
    lone call's), nothing is left mixed: for the int8 convolutions, whose op takes no plain weight,
    so that a mixed size's only other weight is Inductor's copy packed for no size, which oneDNN
    re-lays at every call at any thread count (on an AMX Xeon at 2 threads, a 1024×256 1×1 int8
    convolution at 1×3×16² images: ``AcdB64a4b`` to ``AcdB32a4b`` per call); settled, it is re-laid
    only in calls run on fewer threads."""
    sizes = list(sizes)
    threads = list(threads)
    before = torch.get_num_threads()
    keys: list[tuple[bytes, ...]] = [() for _ in sizes]
    try:
        for t in threads or [before]:
            keys = [(*key, found) for key, found in zip(keys, _probe(pack, sizes, t))]
    finally:
        torch.set_num_threads(before)  # the OpenMP count of this thread, and MKL's, which is the process's
    groups: dict[bytes, list[list[int]]] = {}
    mixed = []
    for key, size in zip(keys, sizes):
        if len(set(key)) == 1 or settle:
            groups.setdefault(key[-1], []).append(size)
        else:
            mixed.append(size)
    return Layouts(list(groups.values()), mixed)


def _probe(pack: Callable[[list[int]], torch.Tensor], sizes: list[list[int]], threads: int) -> list[bytes]:
    """``layout(pack(size))`` for each of ``sizes`` as oneDNN lays it out for a call on ``threads``
    OpenMP threads, asked from ``probe_workers()`` threads at once, each over its own share of the
    sizes. oneDNN reads the count from the asking thread (OpenMP's per-thread setting, which
    ``torch.set_num_threads`` sets), and its queries let go of the GIL: on an idle 2-core host two
    threads answer 1.5x as many a second as one."""

    workers = min(probe_workers(), max(1, len(sizes) // PROBES_PER_WORKER))

    def share(k: int) -> list[bytes]:  # every workers-th size from the k-th
        torch.set_num_threads(threads)
        return [layout(pack(size)) for size in sizes[k::workers]]

    if workers == 1:
        return share(0)
    found: list[bytes] = [b""] * len(sizes)
    with ThreadPoolExecutor(workers, thread_name_prefix="prepack-probe") as pool:
        for k, answers in enumerate(pool.map(share, range(workers))):
            found[k::workers] = answers
    return found


def probe_workers() -> int:
    """Threads asking oneDNN at once: the CPUs this compile has (Inductor's ``compile_threads``, which
    the local executor sets to each compile worker's share of the host's)."""
    from torch._inductor import config

    return max(1, int(config.compile_threads or 1))


def probe_threads() -> list[int]:
    """The OpenMP thread counts a variant is probed at: one (each of several calls at once) and this
    host's count (a lone call), as the loader sizes a call's team between them."""
    return sorted({1, torch.get_num_threads()})


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


def _reorder(w: torch.Tensor, gm: torch.fx.GraphModule, node: torch.fx.Node, size: list[int]) -> torch.Tensor:
    """``w`` (plain) packed the way oneDNN wants it for an input of ``size``: the calls Inductor's own
    passes make for a static size (``mkldnn_fusion.pack_conv_weight``, ``quantization.py``'s
    ``qconv_weight_prepack``), private to torch."""
    stride, padding, dilation, groups = (_argument(node, a) for a in ("stride", "padding", "dilation", "groups"))
    if node.target is CONVOLUTION:
        return torch.ops.mkldnn._reorder_convolution_weight(w, padding, stride, dilation, groups, size)
    scales = attrgetter(_argument(node, "w_scale").target)(gm)
    x_scale, x_zero_point = node.args[1:3]
    return torch.ops.onednn.qconv_prepack(w, scales, x_scale, x_zero_point, stride, padding, dilation, groups, size)


def layout(packed: torch.Tensor) -> bytes:
    """A packed tensor's bytes as oneDNN laid them out: equal for two packings of one weight exactly
    when their formats agree (oneDNN's serialized descriptor also holds shape-dependent fields that
    ideep does not compare: a bf16 weight packed for 28² serves 16² and 48² without a reorder)."""
    return ctypes.string_at(torch.ops.mkldnn.data_ptr(packed), torch.ops.mkldnn._nbytes(packed))


def _pack(gm: torch.fx.GraphModule, node: torch.fx.Node) -> None:
    """``node``'s weight packed for the hint, a frozen constant (freezing's helper, ``_constant``)."""
    weight = _argument(node, "weight")
    hint = [optimization_hint(s) for s in node.args[0].meta["val"].shape]
    packed = _reorder(_plain_weight(gm, node), gm, node, hint)
    node.replace_input_with(weight, _constant(gm, node, packed, weight.meta.get("val")))
    if not weight.users:
        gm.graph.erase_node(weight)


def _choosable(node: torch.fx.Node, found: Layouts) -> bool:
    """Whether ``node`` can choose its weight per call: its input is channels-last (and not also
    contiguous), and every size it can take at run time lies within the probed ones' least and
    greatest; if not, its weight stays plain. A branch of the choice lays out the convolution's
    output by its input's layout as FX records it, and Inductor may lay a contiguous-looking input
    out channels-last (Segformer's convolutions on reshaped sequences: its build's check failed,
    max abs error 1.4e-3); a table indexed past its sizes would be read out of bounds (a dim without
    a maximum)."""
    val = node.args[0].meta["val"]
    if val.dim() != 4 or not guard_or_false(val.is_contiguous(memory_format=torch.channels_last)):
        return False
    if guard_or_true(val.is_contiguous()):
        return False
    sizes = [*(size for group in found.groups for size in group), *found.mixed]
    for d, s in enumerate(node.args[0].meta["val"].shape):
        if isinstance(s, torch.SymInt):
            r = s.node.shape_env.bound_sympy(s.node.expr)
            if not (r.lower.is_finite and r.upper.is_finite):
                return False
            if int(r.lower) < min(size[d] for size in sizes) or int(r.upper) > max(size[d] for size in sizes):
                return False
    return True


def _pick_per_call(gm: torch.fx.GraphModule, node: torch.fx.Node, found: Layouts) -> None:
    """Replace ``node`` by one copy of its weight per format in ``formats`` and a choice among them at
    each call: ``torch.cond`` on a 0-d bool read from a build-time table indexed by the convolution's
    input sizes (AOTInductor inlines each branch in its C++: an ``if`` on a table byte per call).
    The mixed sizes (``Layouts``) take the plain weight; those the probes skipped (past
    ``MAX_PROBES``) the first group's format. What Inductor would fuse into
    the convolution (``_epilogue``: an addition, a ReLU, a ReLU6, a SiLU) is fused into each branch
    (the fusion patterns run after this pass and cannot see into a branch)."""
    graph = gm.graph
    x, weight = node.args[0], _argument(node, "weight")
    val = x.meta["val"]
    formats = [*found.groups, found.mixed] if found.mixed else found.groups
    dims = [d for d, s in enumerate(val.shape) if isinstance(s, torch.SymInt)]
    sizes = [size for group in formats for size in group]
    low = [min(size[d] for size in sizes) for d in dims]
    extent = [max(size[d] for size in sizes) - lo + 1 for d, lo in zip(dims, low)]
    choice = torch.zeros(extent, dtype=torch.int8)  # the format's index per size; 0 (the hint's) unprobed
    for k, group in enumerate(formats):
        for size in group:
            choice[tuple(size[d] - lo for d, lo in zip(dims, low))] = k
    if node.target is CONVOLUTION:
        other, unary, scalars, folded = _epilogue(node)
        tensors = [t for t in (x, other, node.args[2]) if isinstance(t, torch.fx.Node)]
        call = _conv_call(node, other, unary, scalars, len(tensors))
    else:  # Inductor's freezing fused its epilogue already
        folded = [node]
        tensors, call = _quantized_call(gm, node)
    last = folded[-1]
    w = _plain_weight(gm, node)
    with graph.inserting_before(last):  # after the addend, which may come after the convolution
        packed = [
            _constant(gm, last, _reorder(w, gm, node, group[0]), weight.meta.get("val")) for group in found.groups
        ]
        if found.mixed:
            packed.append(weight)
        index = [graph.call_function(operator.sub, (_sym_size(graph, x, d), lo)) for d, lo in zip(dims, low)]
        for n, d, lo in zip(index, dims, low):
            n.meta["val"] = val.shape[d] - lo
        predicates = []
        for k in range(len(formats) - 1):
            table = (choice == k).contiguous()
            p = _constant(gm, last, table, val.fake_mode.from_tensor(table))
            for i in index:
                p_val = p.meta["val"].select(0, i.meta["val"])
                p = graph.call_function(torch.ops.aten.select.int, (p, 0, i))
                p.meta["val"] = p_val
            predicates.append(p)
        operands = (*tensors, *packed, *predicates[1:])
        out_val = last.meta["val"]
        branches = _branches(gm, graph, [o.meta["val"] for o in operands], call, 0, len(formats), out_val)
        cond = graph.call_function(torch.ops.higher_order.cond, (predicates[0], *branches, operands))
        cond.meta["val"] = [out_val]
        out = graph.call_function(operator.getitem, (cond, 0))
    out.meta.update(last.meta)
    last.replace_all_uses_with(out)
    for n in folded[::-1]:
        graph.erase_node(n)
    if not weight.users:
        graph.erase_node(weight)


def _epilogue(node: torch.fx.Node) -> tuple[torch.fx.Node | None, str, list[Any], list[torch.fx.Node]]:
    """What Inductor's fusion would fold into ``node`` (the convolution): the addend of an addition
    that is its only user (same shape, no broadcast); after it a ReLU, or with no addend a ReLU, a
    ReLU6-style clamp (``hardtanh``) or a SiLU (``swish``), as post-grad decomposed them or not; the
    unary's name and scalars, and the nodes folded, the convolution first, in graph order."""
    other, folded = None, [node]
    (user,) = node.users if len(node.users) == 1 else (None,)
    if user is not None and user.target is aten.add.Tensor and len(user.args) == 2 and not user.kwargs:
        addend = user.args[1] if user.args[0] is node else user.args[0]
        if (
            isinstance(addend, torch.fx.Node)
            and addend is not node
            and addend.meta.get("val") is not None
            and addend.meta["val"].shape == node.meta["val"].shape
            and addend.meta["val"].dtype == node.meta["val"].dtype
        ):
            other, folded = addend, [node, user]
    value = folded[-1]
    (user,) = value.users if len(value.users) == 1 else (None,)
    if user is not None and user.target is aten.relu.default:
        return other, "relu", [], [*folded, user]
    if other is not None:
        return other, "none", [], folded  # the binary op's only unary after an addition is a ReLU
    if user is not None and user.target is aten.hardtanh.default and _numbers(user.args[1:3]):
        return None, "hardtanh", [float(a) for a in user.args[1:3]], [*folded, user]
    if user is not None and user.target is aten.clamp_min.default and _numbers(user.args[1:2]):
        (top,) = user.users if len(user.users) == 1 else (None,)
        if top is not None and top.target is aten.clamp_max.default and _numbers(top.args[1:2]):
            return None, "hardtanh", [float(user.args[1]), float(top.args[1])], [*folded, user, top]
    if user is not None and user.target is aten.silu.default:
        return None, "swish", [], [*folded, user]
    silu = _decomposed_silu(value)
    if silu:
        return None, "swish", [], [*folded, *silu]
    return None, "none", [], folded


def _numbers(args: Any) -> bool:
    return all(isinstance(a, (int, float)) and not isinstance(a, bool) for a in args)


def _decomposed_silu(x: torch.fx.Node) -> list[torch.fx.Node]:
    """``x / (exp(-x) + 1)``, Inductor's decomposition of SiLU, when ``x``'s only users are its own
    (``neg``, ``exp``, ``add``, ``div``, in graph order); else []."""
    users = {u.target: u for u in x.users}
    neg, div = users.get(aten.neg.default), users.get(aten.div.Tensor)
    if len(x.users) != 2 or neg is None or div is None or len(neg.users) != 1:
        return []
    (exp,) = neg.users
    if exp.target is not aten.exp.default or len(exp.users) != 1:
        return []
    (add,) = exp.users
    if add.target is not aten.add.Tensor or add.args != (exp, 1) or len(add.users) != 1 or div.args != (x, add):
        return []
    return [neg, exp, add, div]


def _conv_call(
    node: torch.fx.Node, other: torch.fx.Node | None, unary: str, unary_scalars: list[Any], n_tensors: int
) -> Callable[[list[torch.fx.Node], int], tuple[Any, tuple[Any, ...]]]:
    """How a branch calls the convolution, its epilogue fused, on its placeholders (the input, the
    addend if any, the bias if any, the weights) with weight ``k``: the target and the arguments."""
    _, _, bias, padding, stride, dilation, groups, attr, scalars, algorithm = node.args
    if unary != "none" and attr != "none":
        raise AssertionError(f"{node}: a convolution fused already, before the fusion passes")

    def call(places: list[torch.fx.Node], k: int) -> tuple[Any, tuple[Any, ...]]:
        x, w = places[0], places[n_tensors + k]
        b = places[n_tensors - 1] if bias is not None else None
        if other is None:
            return CONVOLUTION, (
                x,
                w,
                b,
                padding,
                stride,
                dilation,
                groups,
                unary if unary != "none" else attr,
                unary_scalars if unary != "none" else scalars,
                algorithm,
            )
        return _add_fused, (
            x,
            places[1],
            w,
            b,
            padding,
            stride,
            dilation,
            groups,
            "add",
            None,
            None if unary == "none" else unary,
            [],
            "",
        )

    return call


def _quantized_call(
    gm: torch.fx.GraphModule, node: torch.fx.Node
) -> tuple[list[torch.fx.Node], Callable[[list[torch.fx.Node], int], tuple[Any, tuple[Any, ...]]]]:
    """The tensor operands a branch's int8 convolution reads (but its weights), and how it calls
    ``node`` on its placeholders (those, then the weights) with weight ``k``: through the op's
    overload whose input scale and zero point are tensors, frozen constants of ``gm`` (Inductor's
    lowering makes a float's a constant of the graph being lowered, and AOTInductor's C++ then
    names one made inside a branch without declaring it: the build does not compile)."""
    weight, val = _argument(node, "weight"), node.args[0].meta["val"]
    args = list(node.args)
    for i, dtype in ((1, torch.float32), (2, torch.int32)):
        value = torch.tensor(args[i], dtype=dtype)
        args[i] = _constant(gm, node, value, val.fake_mode.from_tensor(value))
    tensors = [a for a in args if isinstance(a, torch.fx.Node) and a is not weight]
    target = _binary_on_copy if node.target is QUANTIZED[2] else TENSOR_SCALES[node.target]

    def call(places: list[torch.fx.Node], k: int) -> tuple[Any, tuple[Any, ...]]:
        swap = {**dict(zip(tensors, places)), weight: places[len(tensors) + k]}
        return target, tuple(swap.get(a, a) if isinstance(a, torch.fx.Node) else a for a in args)

    return tensors, call


def _binary_on_copy(*args: Any) -> Any:
    """``onednn.qconv2d_pointwise.binary_tensor`` on a copy of its addend, lowered by Inductor when the
    branch is: the op writes its addend (argument 6) in place and returns it, and a ``torch.cond``
    branch may not write its inputs (the copy is of one activation, far cheaper than the reorder of
    a weight in the wrong blocking). A pass-through lowering as ``_add_fused``, private to Inductor."""
    from torch._inductor.lowering import lowerings  # Inductor's lowering table, filled once it is imported

    op = torch.ops.onednn.qconv2d_pointwise.binary_tensor
    if isinstance(args[6], torch.Tensor):  # cond run on fake tensors (the FX passes' metadata)
        return op(*args[:6], args[6].clone(), *args[7:])
    return lowerings[op](*args[:6], lowerings[torch.ops.aten.clone.default](args[6]), *args[7:])


_binary_on_copy._inductor_lowering_function = True  # type: ignore[attr-defined]


def _branches(
    owner: torch.fx.GraphModule,
    graph: torch.fx.Graph,
    values: list[Any],
    call: Callable[[list[torch.fx.Node], int], tuple[Any, tuple[Any, ...]]],
    k: int,
    n: int,
    out: Any,
) -> list[torch.fx.Node]:
    """``graph``'s get_attr nodes (submodules of ``owner``) of a cond's two branches: the convolution
    with format ``k``, and one with a later format (a cond nested on the next predicate, past the
    ``n`` weights in the operands ``values``, or the last format)."""
    made = []
    for later in (False, True):
        module = torch.fx.GraphModule(torch.nn.Module(), torch.fx.Graph())
        g = module.graph
        places = [g.placeholder(f"arg{i}") for i in range(len(values))]
        for p, v in zip(places, values):
            p.meta["val"] = v
        if not later or k + 2 == n:
            target, args = call(places, k + later)
            result = g.call_function(target, args)
        else:
            inner = _branches(module, g, values, call, k + 1, n, out)
            n_tensors = len(values) - n - (n - 2)
            cond = g.call_function(torch.ops.higher_order.cond, (places[n_tensors + n + k], *inner, tuple(places)))
            cond.meta["val"] = [out]
            result = g.call_function(operator.getitem, (cond, 0))
        result.meta["val"] = out
        g.output((result,))
        module.recompile()
        name = _free_name(owner, "_layout_branch")
        owner.register_module(name, module)
        made.append(graph.create_node("get_attr", name))
    return made


def _free_name(module: torch.nn.Module, prefix: str) -> str:
    i = 0
    while hasattr(module, f"{prefix}{i}"):
        i += 1
    return f"{prefix}{i}"


def _sym_size(graph: torch.fx.Graph, x: torch.fx.Node, d: int) -> torch.fx.Node:
    size = graph.call_function(torch.ops.aten.sym_size.int, (x, d))
    size.meta["val"] = x.meta["val"].shape[d]
    return size


def _constant(gm: torch.fx.GraphModule, before: torch.fx.Node, value: torch.Tensor, val: Any) -> torch.fx.Node:
    """``value`` as a frozen constant of ``gm``, read before ``before`` (with the helper freezing
    turns a folded value into a constant with, private to Inductor)."""
    with gm.graph.inserting_before(before):
        stub = gm.graph.call_function(torch.ops.aten.empty.memory_format, ([0],))  # replaced at once
    stub.meta["val"] = val
    replace_node_with_constant(gm, stub, value)
    return before.prev


def _add_fused(*args: Any) -> Any:
    """``mkldnn._convolution_pointwise.binary`` lowered by Inductor when the branch is: the op has no
    fake kernel for the FX passes after this one to run on, and Inductor's own fused nodes are such
    pass-through lowerings (``pattern_matcher.register_lowering_pattern``), private to Inductor."""
    from torch._inductor.lowering import lowerings  # Inductor's lowering table, filled once it is imported

    x, _, w, b, padding, stride, dilation, groups = args[:8]
    if isinstance(x, torch.Tensor):  # cond run on fake tensors (the FX passes' metadata): the unfused shape
        return CONVOLUTION(x, w, b, padding, stride, dilation, groups, "none", [], "")
    return lowerings[torch.ops.mkldnn._convolution_pointwise.binary](*args)


_add_fused._inductor_lowering_function = True  # type: ignore[attr-defined]
