"""torch.export with one ``Dim`` per profile dim, shared by every input that uses it.

Failures are translated into the profile's words: which dim, what torch said, what to change.
"""

from __future__ import annotations

import ast
import contextlib
import inspect
import io
import os
import re
import warnings
from pathlib import Path

import torch
from torch.export import Dim, ExportedProgram

from .analysis.shapes import TorchLog, capture_torch_logs, dim_bound_problems
from .errors import DimBoundError, ExportError
from .profile import Profile
from .samples import make_inputs, to_device


def export_hints(ranges: dict[str, tuple[int, int]], wanted: dict[str, int]) -> dict[str, int]:
    """Example sizes for export: the wanted ones, moved to ≥ 2 for dynamic dims (torch.export
    specializes 0 and 1) and made distinct between dynamic dims (equal example sizes can lead
    export to assume the dims are equal)."""
    out, taken = {}, set()
    for d, (lo, hi) in ranges.items():
        size = min(max(wanted[d], lo), hi)
        if lo == hi:
            out[d] = lo
            continue
        size = max(size, 2)
        candidates = [size] + [size + k for k in range(1, 64)] + [size - k for k in range(1, 64)]
        for c in candidates:
            if max(lo, 2) <= c <= hi and c not in taken:
                size = c
                break
        out[d] = size
        taken.add(size)
    return out


def export_model(
    model: torch.nn.Module,
    profile: Profile,
    ranges: dict[str, tuple[int, int]],
    hint: dict[str, int],
    *,
    device: str = "cpu",
    dtype: str | None = None,
) -> ExportedProgram:
    """Export ``model`` (already on ``device``) for the given dim ranges (min == max: static) with
    example sizes ``hint``; floating sample inputs are cast to ``dtype`` when given."""
    dims = {d: Dim(d, min=lo, max=hi) for d, (lo, hi) in ranges.items() if lo != hi}
    dynamic_shapes = tuple(
        {axis: dims[s] for axis, s in enumerate(spec.shape) if isinstance(s, str) and s in dims} or None
        for spec in profile.inputs.values()
    )
    if takes_varargs(model):  # a wrapper's forward(*args): torch.export wants the specs as that one argument
        dynamic_shapes = (dynamic_shapes,)
    args = to_device(make_inputs(profile, hint, seed=profile.check.seed), device, dtype)
    printed = io.StringIO()  # torch.export prints the partial graph of a failed trace to stderr (export/_trace.py)
    try:
        with warnings.catch_warnings(), capture_torch_logs() as log, contextlib.redirect_stderr(printed):
            warnings.simplefilter("ignore")
            ep = torch.export.export(model, args, dynamic_shapes=dynamic_shapes, strict=False)
    except Exception as e:  # torch.export raises many types; every one is reported the same way
        log.lines.extend(printed.getvalue().splitlines())  # into the log file, after our explanation
        raise ExportError(explain_export_failure(e, ranges, hint, log=log)) from None
    problems = dim_bound_problems(ep, [list(spec.shape) for spec in profile.inputs.values()], ranges)
    if problems:  # export proves nothing about index values: a position table past the range is found here
        raise DimBoundError(problems)
    return ep


def takes_varargs(model: torch.nn.Module) -> bool:
    """Whether ``forward`` takes only ``*args`` (a wrapper's), so dynamic shapes go in as one argument."""
    try:
        params = list(inspect.signature(model.forward).parameters.values())
    except (TypeError, ValueError):
        return False
    return len(params) == 1 and params[0].kind is inspect.Parameter.VAR_POSITIONAL


def explain_export_failure(
    e: BaseException, ranges: dict[str, tuple[int, int]], hint: dict[str, int], *, log: TorchLog | None = None
) -> str:
    """Our explanation first (the dims involved, what to change), then the lines of torch's message
    that matter (its suggested fixes), once; its whole text and log go to a file the message names."""
    text = str(e)
    involved = [d for d in ranges if re.search(rf"\b{re.escape(d)}\b", text)]
    advice = [a for a in (_guard_advice(*g, ranges) for g in _violated_guards(text)) if a]
    for name, args in re.findall(r"(\w+) = Dim\('?\w+'?,?\s*([^)]*)\)", text):
        if name in ranges:
            advice.append(
                f"the model only works for part of dims.{name} {list(ranges[name])}: torch suggests {args.strip()}; "
                f"narrow the range in the profile, or change the model so every size in the range works"
            )
    for name, value in re.findall(r"^\s*(\w+) = (\d+)\s*$", text, flags=re.M):
        if name in ranges:
            advice.append(
                f"the model fixes dims.{name} to {value} (it specializes that size): declare it as the static size "
                f"{value} in the input shapes, or remove the code that depends on its exact value"
            )
    if "specialized" in text and not advice:
        for d in involved:
            advice.append(
                f"the model's code treats dims.{d} as a constant: make it static in the profile, or avoid "
                f"Python-level uses of its size (int(x.shape[...]), size-dependent branches)"
            )
    if "data-dependent" in text.lower() or "GuardOnDataDependentSymNode" in type(e).__name__:
        advice.append(
            "forward() branches on tensor values (data-dependent control flow): rewrite the branch with "
            "torch.cond or torch.where, or move it out of the model"
        )
    if re.search(r"inconsistent min=\d+, max=\d+", text):
        advice.append(
            "torch.export found a dim the model allows only one size of, but could not say which: "
            "`precompile doctor PROFILE` lists every size the model fixes, with its source line"
        )
    if not advice:
        advice.append("change the model so torch.export can trace it for every size in the declared ranges")
    where = ", ".join(f"{d} {list(ranges[d])} (example {hint[d]})" for d in involved) or "none named"
    logfile = _write_log(e, log)
    return (
        f"torch.export failed ({type(e).__name__})\n"
        f"  dims involved: {where}\n"
        + "".join(f"  what to change: {a}\n" for a in advice)
        + f"  torch says (all of it in {logfile}):\n"
        + "\n".join("    " + line for line in _useful_lines(text))
    ).rstrip()


# torch.export's report of a guard that holds for part of a dim's range only:
#   Not all values of height = L['x'].size()[2] in the specified range 32 <= height <= 96 satisfy the
#   generated guard (1 + (((-1) + L['x'].size()[2]) // 32)) != 1.
_VIOLATED = re.compile(
    r"Not all values of (\w+) = (\S+) in the specified range (-?\d+) <= \1 <= (-?\d+) "
    r"satisfy the generated guard (.+?)\.?\s*$",
    re.M,
)
_MOST_SIZES = 1 << 16  # sizes a guard is evaluated at, at most (one range): well under a second


def _violated_guards(text: str) -> list[tuple[str, str, str]]:
    """(dim, guard, the size's source in it) for each such line, once each."""
    return list(dict.fromkeys((m[1], m[5], m[2]) for m in _VIOLATED.finditer(text)))


def _guard_advice(dim: str, guard: str, source: str, ranges: dict[str, tuple[int, int]]) -> str | None:
    """Where in ``dim``'s declared range ``guard`` (naming no other size) changes between holding and
    not, as split points for ``plan.ranges``: each part then gets a variant of its own, exported for
    sizes the model's code treats alike. None where that cannot be worked out."""
    if dim not in ranges or ranges[dim][1] - ranges[dim][0] >= _MOST_SIZES:
        return None
    lo, hi = ranges[dim]
    try:
        tree = ast.parse(guard.replace(source, "size"), mode="eval")
        holds = [n for n in range(lo, hi + 1) if _evaluate(tree.body, n)]
    except (SyntaxError, ValueError, ZeroDivisionError, RecursionError):
        return None
    shown = f"torch's guard: {guard.replace(source, dim)}"
    if not holds:
        return f"no size of dims.{dim} in [{lo}, {hi}] passes the model's code ({shown}): make {dim} static"
    held = set(holds)
    if len(held) == hi - lo + 1:  # holds throughout: not what torch said, so not read right
        return None
    splits = [n for n in range(lo, hi) if (n in held) != (n + 1 in held)]
    others = ", ".join(_shown(r) for r in _runs([n for n in range(lo, hi + 1) if n not in held]))
    runs = _runs(holds)
    narrow = f", or narrow dims.{dim} to [{runs[0][0]}, {runs[0][1]}]" if len(runs) == 1 else ""
    return (
        f"the model's code takes another path for dims.{dim} at {others} than at {', '.join(map(_shown, runs))} "
        f"({shown}): split the range there, `plan: {{ranges: {{{dim}: {splits}}}}}` (beside any split points "
        f"already given), so that each part gets a variant of its own{narrow}"
    )


def _runs(values: list[int]) -> list[tuple[int, int]]:
    """Sorted integers as runs of consecutive ones: [1, 2, 3, 7] -> [(1, 3), (7, 7)]."""
    runs: list[tuple[int, int]] = []
    for v in values:
        if runs and runs[-1][1] == v - 1:
            runs[-1] = (runs[-1][0], v)
        else:
            runs.append((v, v))
    return runs


def _shown(run: tuple[int, int]) -> str:
    return str(run[0]) if run[0] == run[1] else f"{run[0]}-{run[1]}"


_BINARY = {
    ast.Add: lambda a, b: a + b,
    ast.Sub: lambda a, b: a - b,
    ast.Mult: lambda a, b: a * b,
    ast.FloorDiv: lambda a, b: a // b,
    ast.Mod: lambda a, b: a % b,
}
_COMPARE = {
    ast.Eq: lambda a, b: a == b,
    ast.NotEq: lambda a, b: a != b,
    ast.Lt: lambda a, b: a < b,
    ast.LtE: lambda a, b: a <= b,
    ast.Gt: lambda a, b: a > b,
    ast.GtE: lambda a, b: a >= b,
}
_CALLS = {
    "Eq": lambda a, b: a == b,
    "Ne": lambda a, b: a != b,
    "Mod": lambda a, b: a % b,
    "Max": max,
    "Min": min,
    "FloorDiv": lambda a, b: a // b,
}


def _evaluate(node: ast.AST, size: int) -> int:
    """The value of a guard's integer arithmetic at ``size``; ValueError for anything else (a name
    other than ``size``, an attribute, a float)."""
    if isinstance(node, ast.Name) and node.id == "size":
        return size
    if isinstance(node, ast.Constant) and type(node.value) in (int, bool):
        return int(node.value)
    if isinstance(node, ast.UnaryOp) and isinstance(node.op, ast.USub):
        return -_evaluate(node.operand, size)
    if isinstance(node, ast.UnaryOp) and isinstance(node.op, ast.Not):
        return int(not _evaluate(node.operand, size))
    if isinstance(node, ast.BinOp) and type(node.op) in _BINARY:
        return _BINARY[type(node.op)](_evaluate(node.left, size), _evaluate(node.right, size))
    if isinstance(node, ast.BoolOp):
        values = [_evaluate(v, size) for v in node.values]
        return int(all(values) if isinstance(node.op, ast.And) else any(values))
    if isinstance(node, ast.Compare):
        left = _evaluate(node.left, size)
        for op, right_node in zip(node.ops, node.comparators):
            right = _evaluate(right_node, size)
            if type(op) not in _COMPARE or not _COMPARE[type(op)](left, right):
                return 0
            left = right
        return 1
    if isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id in _CALLS and not node.keywords:
        return int(_CALLS[node.func.id](*(_evaluate(a, size) for a in node.args)))
    raise ValueError(f"not integer arithmetic: {ast.dump(node)[:80]}")


def _useful_lines(text: str, limit: int = 12) -> list[str]:
    """The part of torch's message a user acts on: its suggested fixes when it has them (at the
    bottom of a long dump), else its first lines; never the generated-code dump in between."""
    lines = [line for line in text.strip().splitlines() if line.strip()]
    for i, line in enumerate(lines):
        if "Suggested fixes" in line:
            return lines[i : i + limit]
    head = lines[:limit]
    return head + (["..."] if len(lines) > limit else [])


def _write_log(e: BaseException, log: TorchLog | None) -> str:
    """torch's whole message, traceback and log lines, in a file under the temp folder; its path."""
    import tempfile
    import traceback

    folder = Path(tempfile.gettempdir()) / f"precompile-logs-{os.getuid() if hasattr(os, 'getuid') else 'user'}"
    try:
        folder.mkdir(mode=0o700, exist_ok=True)
        with tempfile.NamedTemporaryFile("w", dir=folder, prefix="export-", suffix=".log", delete=False) as f:
            f.write("".join(traceback.format_exception(type(e), e, e.__traceback__)))
            if log is not None and log.lines:
                f.write("\n--- torch's log while exporting ---\n" + "\n".join(log.lines) + "\n")
            return f.name
    except OSError as err:  # the explanation matters more than the log: never fail on writing it
        return f"no log file: {folder} is not writable ({err.strerror})"
