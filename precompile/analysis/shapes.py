"""What an exported graph says about sizes: which symbol each input axis became, the tables that
bound a dim (a position table indexed with ``arange(seq)``), the guards torch added while tracing
and where in the model's code, and the ops Inductor has no kernel for.

Shared by ``precompile init`` (to find dims and ranges), ``precompile doctor`` (to report them) and
the build's error messages (to trace an ``IndexError`` at a size to the dim and table that cause it).

    ep = torch.export.export(model, args, dynamic_shapes=..., strict=False)
    axes = input_axes(ep)                 # [[s0, s1], [s0, 16]]: a sympy symbol or an int per axis
    for b in table_bounds(ep):            # TableBound(symbol=s1, max=64, table="wpe.weight", rows=64, ...)
        ...
"""

from __future__ import annotations

import logging
import re
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

import sympy
import torch
from torch.export import ExportedProgram

aten = torch.ops.aten

# Ops whose output holds the same values as their first argument (possibly fewer, rearranged or converted).
KEEP_VALUES = {
    aten.view,
    aten.reshape,
    aten._unsafe_view,
    aten.unsqueeze,
    aten.squeeze,
    aten.flatten,
    aten.unflatten,
    aten.expand,
    aten.permute,
    aten.transpose,
    aten.t,
    aten.contiguous,
    aten.clone,
    aten.alias,
    aten.detach,
    aten.slice,
    aten.select,
    aten.narrow,
    aten.repeat,
    aten.to,
    aten._to_copy,
    aten.lift_fresh_copy,
}

# The wrapper precompile.stages.resolve puts around a model keeps it under this attribute.
WRAPPED = "model."


# --- axes ----------------------------------------------------------------------------------------


def _expr(value: Any) -> Any:
    """A SymInt's sympy expression, an int as is."""
    if isinstance(value, torch.SymInt):
        expr = value.node.expr
        return int(expr) if expr.is_number else expr
    return int(value)


def input_axes(ep: ExportedProgram) -> list[list[Any]]:
    """Per user input of ``ep``, per axis: its sympy expression (a symbol when dynamic) or its int size."""
    nodes = {n.name: n for n in ep.graph.nodes if n.op == "placeholder"}
    out = []
    for name in ep.graph_signature.user_inputs:
        val = nodes[name].meta.get("val")
        out.append([_expr(s) for s in val.shape] if isinstance(val, torch.Tensor) else [])
    return out


def output_axes(ep: ExportedProgram) -> list[list[Any]]:
    """Per flat output of ``ep``, per axis: a sympy expression of the input symbols, or an int."""
    output = next(n for n in ep.graph.nodes if n.op == "output")
    out = []
    for arg in output.args[0]:
        val = arg.meta.get("val") if isinstance(arg, torch.fx.Node) else None
        out.append([_expr(s) for s in val.shape] if isinstance(val, torch.Tensor) else [])
    return out


def _finite(value: Any) -> int | None:
    try:
        return int(value) if value.is_number and bool(value.is_finite) else None
    except (TypeError, ValueError, AttributeError, OverflowError):
        return None


def symbol_ranges(ep: ExportedProgram) -> dict[Any, tuple[int | None, int | None]]:
    """The range torch.export proved for each symbol; None where it is unbounded."""
    out = {}
    for sym, vr in ep.range_constraints.items():
        lo, hi = vr.lower, vr.upper
        out[sym] = (_finite(lo), _finite(hi))
    return out


# --- tables that bound a dim ---------------------------------------------------------------------


@dataclass(frozen=True)
class TableBound:
    """A table indexed with values that grow with a dim: the dim can be at most ``max``."""

    symbol: Any  # the sympy symbol of the dim
    max: int
    table: str  # the parameter or buffer, e.g. "embeddings.position_embeddings.weight"
    rows: int
    index: Any  # sympy expression of the largest index in terms of ``symbol``

    def reason(self, dim: str) -> str:
        largest = str(self.index).replace(str(self.symbol), dim)
        return f"{self.table} has {self.rows} rows and is indexed with positions up to {largest}"


def _param_name(ep: ExportedProgram, node: Any) -> str | None:
    if not isinstance(node, torch.fx.Node) or node.op != "placeholder":
        return None
    sig = ep.graph_signature
    name = sig.inputs_to_parameters.get(node.name) or sig.inputs_to_buffers.get(node.name)
    name = name or sig.inputs_to_lifted_tensor_constants.get(node.name)
    return name.removeprefix(WRAPPED) if name else None


def _constant(ep: ExportedProgram, node: Any) -> torch.Tensor | None:
    sig = ep.graph_signature
    name = sig.inputs_to_buffers.get(node.name) or sig.inputs_to_lifted_tensor_constants.get(node.name)
    if name is None:
        return None
    t = ep.state_dict.get(name)
    return t if t is not None else ep.constants.get(name)


def _is_arange(t: torch.Tensor) -> bool:
    """A buffer holding 0, 1, 2, ... along its last axis (HF's ``position_ids``)."""
    if t.dtype.is_floating_point or t.dim() == 0 or t.numel() == 0 or t.numel() > 1 << 20:
        return False
    n = t.shape[-1]
    return bool((t == torch.arange(n, dtype=t.dtype).expand_as(t)).all())


def _value_range(ep: ExportedProgram, node: Any, memo: dict) -> tuple[Any, Any] | None:
    """(lowest, highest) value ``node`` can hold, as sympy expressions of the input symbols, where
    the graph says so (aranges, shifts of them, views and slices of arange buffers); else None."""
    if isinstance(node, (int, torch.SymInt)):
        e = _expr(node)
        return (e, e)
    if not isinstance(node, torch.fx.Node):
        return None
    if node in memo:
        return memo[node]
    memo[node] = None  # cycles cannot happen in a graph, but keep lookups cheap
    val = node.meta.get("val")
    if isinstance(val, torch.SymInt):
        memo[node] = (_expr(val), _expr(val))
        return memo[node]
    result = None
    if node.op == "placeholder":
        t = _constant(ep, node)
        if t is not None and _is_arange(t):
            result = (sympy.Integer(0), sympy.Integer(t.shape[-1] - 1))
    elif node.op == "call_function" and isinstance(node.target, torch._ops.OpOverload):
        packet, args = node.target.overloadpacket, node.args
        if packet is aten.arange:
            step = args[2] if len(args) > 2 else node.kwargs.get("step", 1)
            if step == 1:
                start, end = (0, args[0]) if len(args) == 1 else (args[0], args[1])
                lo, hi = _value_range(ep, start, memo), _value_range(ep, end, memo)
                if lo is not None and hi is not None:
                    result = (lo[0], hi[1] - 1)
        elif packet in (aten.add, aten.sub) and len(args) == 2:
            a, b = _value_range(ep, args[0], memo), _value_range(ep, args[1], memo)
            if a is not None and b is not None:
                result = (a[0] + b[0], a[1] + b[1]) if packet is aten.add else (a[0] - b[1], a[1] - b[0])
        elif packet is aten.slice and args and isinstance(args[0], torch.fx.Node):
            source = _value_range(ep, args[0], memo)
            t = _constant(ep, args[0]) if args[0].op == "placeholder" else None
            axis = args[1] if len(args) > 1 else 0
            if t is not None and _is_arange(t) and axis % t.dim() == t.dim() - 1:
                start = args[2] if len(args) > 2 else 0
                end = args[3] if len(args) > 3 else t.shape[-1]
                lo, hi = _value_range(ep, start, memo), _value_range(ep, end, memo)
                if lo is not None and hi is not None and isinstance(end, (torch.fx.Node, torch.SymInt)):
                    result = (lo[0], hi[1] - 1)
                else:
                    result = source
            else:
                result = source
        elif packet in KEEP_VALUES and args:
            result = _value_range(ep, args[0], memo)
    memo[node] = result
    return result


def _indexed(node: torch.fx.Node) -> list[tuple[Any, Any]]:
    """(table node, index node) pairs ``node`` reads a table with along its first indexed axis."""
    packet, args = node.target.overloadpacket, node.args
    if packet in (aten.embedding, aten.embedding_bag, aten._embedding_bag) and len(args) > 1:
        return [(args[0], args[1])]
    if packet is aten.index_select and len(args) > 2 and args[1] == 0:
        return [(args[0], args[2])]
    if packet in (aten.index, aten._unsafe_index) and len(args) > 1 and args[1]:
        return [(args[0], args[1][0])] if args[1][0] is not None else []
    return []


def table_bounds(ep: ExportedProgram) -> list[TableBound]:
    """Every table whose index grows with a dynamic dim, with the largest size of that dim it allows
    (the tightest first). Export proves nothing about index values, so a position table read with
    ``arange(seq)`` leaves ``seq`` unbounded in ``ep.range_constraints``: this finds it."""
    memo: dict = {}
    found: dict[Any, TableBound] = {}
    for node in ep.graph.nodes:
        if node.op != "call_function" or not isinstance(node.target, torch._ops.OpOverload):
            continue
        for table, index in _indexed(node):
            tval = table.meta.get("val") if isinstance(table, torch.fx.Node) else None
            if not isinstance(tval, torch.Tensor) or tval.dim() == 0 or not isinstance(tval.shape[0], int):
                continue
            span = _value_range(ep, index, memo)
            if span is None:
                continue
            highest = sympy.expand(span[1])
            symbols = list(highest.free_symbols)
            if len(symbols) != 1:
                continue
            sym = symbols[0]
            poly = sympy.Poly(highest, sym)
            if poly.degree() != 1:
                continue
            a, b = (int(c) for c in poly.all_coeffs())
            if a <= 0:
                continue
            rows = int(tval.shape[0])
            limit = (rows - 1 - b) // a
            name = _param_name(ep, table) or table.name
            if sym not in found or limit < found[sym].max:
                found[sym] = TableBound(sym, limit, name, rows, highest)
    return sorted(found.values(), key=lambda b: b.max)


# --- guards torch adds while tracing -------------------------------------------------------------


@dataclass
class Guard:
    """A condition torch.export assumed about sizes, and the model's line that made it."""

    expr: str  # e.g. "Eq(s100, 32)", "s21 <= 64"
    where: str  # "modeling_vit.py:152 in forward", or ""

    def symbols(self) -> set[str]:
        return set(re.findall(r"\bs\d+\b", self.expr))


@dataclass
class TorchLog:
    """What torch logged while tracing: guards with their source, symbol sources, and every line."""

    guards: list[Guard] = field(default_factory=list)
    sources: dict[str, str] = field(default_factory=dict)  # "s100" -> "L['pixel_values'].size()[2]"
    lines: list[str] = field(default_factory=list)


class _Collect(logging.Handler):
    def __init__(self, log: TorchLog):
        super().__init__(logging.DEBUG)
        self.log = log

    def emit(self, record: logging.LogRecord) -> None:
        try:
            text = record.getMessage()
        except Exception:  # a record whose arguments do not format: keep going
            return
        self.log.lines.append(f"{record.name}: {text}")
        if "[guard added]" in text:
            m = re.match(r"\S+ (.*?) \[guard added\](?: at )?(.*?)(?:, for more info.*)?$", text, flags=re.S)
            if m:
                self.log.guards.append(Guard(m.group(1).strip(), m.group(2).strip().removeprefix("at ").strip()))
        elif text.startswith("create_symbol"):
            m = re.match(r"create_symbol (\w+) = \S+ for (\S+)", text)
            if m:
                self.log.sources[m.group(1)] = m.group(2)


@contextmanager
def capture_torch_logs(*, guards: bool = False) -> Iterator[TorchLog]:
    """Route torch's log records to a TorchLog instead of stderr while tracing (torch otherwise
    prints its own dump before our explanation). ``guards``: log each guard at INFO, so every one
    is known even if the export never finishes (costs a stack summary per guard)."""
    log = TorchLog()
    handler = _Collect(log)
    names = ["torch"] + [n for n in logging.root.manager.loggerDict if n.startswith("torch.")]
    loggers = [logging.getLogger(n) for n in names]
    saved = [(lg, lg.propagate, lg.level, list(lg.handlers)) for lg in loggers]
    for lg in loggers:
        for h in list(lg.handlers):
            lg.removeHandler(h)
        lg.propagate = lg.name != "torch"
    root = logging.getLogger("torch")
    root.addHandler(handler)
    if guards:
        logging.getLogger("torch.fx.experimental.symbolic_shapes").setLevel(logging.INFO)
    try:
        yield log
    finally:
        root.removeHandler(handler)
        for lg, propagate, level, handlers in saved:
            lg.propagate = propagate
            lg.setLevel(level)
            for h in handlers:
                lg.addHandler(h)


def axis_of(source: str) -> tuple[str, int] | None:
    """``L['pixel_values'].size()[2]`` → ("pixel_values", 2); also the forms with ``args[i]``."""
    m = re.search(r"\[['\"](\w+)['\"]\]\.size\(\)\[(\d+)\]", source)
    if m:
        return m.group(1), int(m.group(2))
    m = re.search(r"\[(\d+)\]\.size\(\)\[(\d+)\]", source)
    return (f"#{m.group(1)}", int(m.group(2))) if m else None


def user_line(stack: list[dict[str, Any]], files: dict[int, str]) -> str:
    """The innermost frame of a draft_export stack outside torch: ``file.py:152 in forward: <code>``."""
    for frame in reversed(stack):
        path = files.get(frame.get("filename"), str(frame.get("filename")))
        if "/torch/" in path or path.startswith("<"):
            continue
        return f"{path.rsplit('/', 1)[-1]}:{frame.get('line')} in {frame.get('name')}: {frame.get('loc', '').strip()}"
    return ""


# --- ops Inductor runs through aten ---------------------------------------------------------------


def fallback_ops(ep: ExportedProgram) -> dict[str, int]:
    """Ops of ``ep`` (after the decompositions Inductor applies) that Inductor has no lowering for:
    they run through aten's eager kernel inside the compiled code. Custom ops too. {op: count}."""
    from torch._inductor.decomposition import select_decomp_table
    from torch._inductor.lowering import fallbacks, lowerings

    decomp = select_decomp_table()
    try:
        ep = ep.run_decompositions(decomp)
    except Exception:  # a graph Inductor would fail on too: the compile stage reports that, not this count
        pass
    out: dict[str, int] = {}
    for node in ep.graph.nodes:
        target = node.target
        if node.op != "call_function" or not isinstance(target, torch._ops.OpOverload):
            continue
        if target.namespace not in ("aten", "prims"):
            out[str(target)] = out.get(str(target), 0) + 1
            continue
        if target in decomp or target.overloadpacket in decomp:
            continue
        if (target in lowerings and target not in fallbacks) or target.overloadpacket in lowerings:
            continue
        out[str(target)] = out.get(str(target), 0) + 1
    return out


# --- dims the model bounds, in the profile's terms ------------------------------------------------


def dim_symbols(ep: ExportedProgram, shapes: list[list[Any]]) -> dict[Any, str]:
    """sympy symbol → profile dim name, from the inputs' declared shapes (``[batch, seq]``)."""
    out: dict[Any, str] = {}
    for declared, axes in zip(shapes, input_axes(ep)):
        for name, expr in zip(declared, axes):
            if isinstance(name, str) and isinstance(expr, sympy.Symbol):
                out.setdefault(expr, name)
    return out


def dim_bound_problems(
    ep: ExportedProgram, shapes: list[list[Any]], ranges: dict[str, tuple[int, int]]
) -> list[tuple[str, str]]:
    """A declared dim range past a table the model indexes by position, as (place, message)."""
    names = dim_symbols(ep, shapes)
    problems = []
    for bound in table_bounds(ep):
        d = names.get(bound.symbol)
        if d is None or d not in ranges or ranges[d][1] <= bound.max:
            continue
        lo, hi = ranges[d]
        problems.append(
            (
                f"dims.{d}",
                f"[{lo}, {hi}] goes past what the model serves: {bound.reason(d)}, so {d} can be at most {bound.max}; "
                f"set dims.{d}.max to {bound.max} (a larger {d} indexes past the table: IndexError in eager, "
                "undefined behaviour in compiled code)",
            )
        )
    return problems
