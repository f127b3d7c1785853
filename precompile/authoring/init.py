"""``precompile init``: from a model and a few representative calls to a profile ``build`` accepts.

Axes whose size differs between the example calls are dynamic. torch.export (``Dim.AUTO``) then says
which of them the model keeps dynamic, which it fixes, which are one dim (shared between inputs) and
what it bounds; ``precompile.analysis.shapes`` adds the tables that bound a dim by position. The profile is
written with a comment per decision, so a reader sees why each range is what it is.

    calls = parse_examples(["input_ids=2x16:int64", "input_ids=4x40"])   # two calls: the name repeats
    result = init_profile("models:bert", calls, output=Path("bert.yaml"))
    Path("bert.yaml").write_text(result.text)
"""

from __future__ import annotations

import inspect
import json
import math
import re
import warnings
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import sympy
import torch
import torch.fx.experimental._config as _shape_config
from torch.export import Dim as ExportDim  # the profile's dims are this module's Dim

from loader.constants import DTYPES, INTEGER_DTYPES
from loader.guards import TORCH_DTYPES
from loader.host import cpu_features
from loader.isa import LEVELS, missing_features

from ..analysis.shapes import capture_torch_logs, input_axes, output_axes, symbol_ranges, table_bounds
from ..analysis.value_ranges import index_tables
from ..errors import ExportError, ModelError, PrecompileError, ProfileError
from ..profile import LoadedProfile, Profile
from ..progress import Progress
from ..stages.resolve import adapt, resolve_model
from ..tracing import explain_export_failure, takes_varargs


class InitError(PrecompileError):
    """The examples or the model cannot make a profile; the message says what to give instead."""


@dataclass
class Call:
    """One representative call: each input's shape and dtype, and how often it was seen."""

    shapes: dict[str, tuple[int, ...]]
    dtypes: dict[str, str | None]
    count: int = 1


# --- reading examples ----------------------------------------------------------------------------

_ITEM = re.compile(r"^(\w+)=((?:\d+(?:x\d+)*)?)(?::(\w+))?$")


def parse_examples(values: list[str]) -> list[Call]:
    """``--example`` values into calls. Each value holds one or more ``NAME=SHAPE[:DTYPE]`` items
    (``2x16``, ``1x3x224x224``; a scalar is ``NAME=``), separated by spaces or commas; ``;`` ends a
    call, and so does a name that is already in the current call. A dtype given once holds for the
    input's later calls."""
    calls: list[Call] = []
    current: Call | None = None
    dtypes: dict[str, str] = {}
    for value in values:
        for part in re.split(r"(;)|[,\s]+", value):
            if not part:
                continue
            if part == ";":
                current = None
                continue
            m = _ITEM.match(part)
            if m is None:
                raise InitError(f"--example {part!r}: expected NAME=SHAPE[:DTYPE], e.g. input_ids=2x16:int64")
            name, shape, dtype = m.group(1), m.group(2), m.group(3)
            if dtype is not None and dtype not in DTYPES:
                raise InitError(f"--example {part!r}: unknown dtype {dtype!r} (known: {', '.join(DTYPES)})")
            if current is None or name in current.shapes:
                current = Call({}, {})
                calls.append(current)
            current.shapes[name] = tuple(int(n) for n in shape.split("x")) if shape else ()
            current.dtypes[name] = dtype or dtypes.get(name)
            if dtype:
                dtypes[name] = dtype
    return _fill_dtypes(calls)


def read_traffic(path: Path) -> list[Call]:
    """A JSON-lines file of observed calls: ``{"inputs": {"input_ids": "2x16:int64", ...}, "count": 12}``
    per line; an input is also ``[2, 16]`` or ``{"shape": [2, 16], "dtype": "int64"}``."""
    try:
        lines = path.read_text(encoding="utf-8").splitlines()
    except OSError as e:
        raise InitError(f"--traffic {path}: cannot read: {e}") from None
    calls = []
    for i, line in enumerate(lines, 1):
        if not line.strip():
            continue
        try:
            row = json.loads(line)
            inputs = row["inputs"]
            count = int(row.get("count", 1))
            call = Call({}, {}, count)
            for name, spec in inputs.items():
                if isinstance(spec, str):
                    call.shapes.update(parse_examples([f"{name}={spec}"])[0].shapes)
                    call.dtypes[name] = spec.partition(":")[2] or None
                elif isinstance(spec, list):
                    call.shapes[name], call.dtypes[name] = tuple(int(n) for n in spec), None
                else:
                    call.shapes[name], call.dtypes[name] = tuple(int(n) for n in spec["shape"]), spec.get("dtype")
        except (ValueError, KeyError, TypeError, AttributeError) as e:
            raise InitError(
                f'--traffic {path}, line {i}: {e!r}; expected {{"inputs": {{NAME: "2x16:int64"}}, "count": N}}'
            ) from None
        calls.append(call)
    if not calls:
        raise InitError(f"--traffic {path}: no calls in the file")
    return _fill_dtypes(calls)


def _fill_dtypes(calls: list[Call]) -> list[Call]:
    known = {n: d for c in calls for n, d in c.dtypes.items() if d}
    for c in calls:
        for n in c.shapes:
            c.dtypes[n] = c.dtypes.get(n) or known.get(n) or "float32"
    return calls


# --- the profile ---------------------------------------------------------------------------------


@dataclass
class Dim:
    name: str
    min: int
    max: int
    why_min: str
    why_max: str
    symbols: set = field(default_factory=set)  # the sympy symbols export gave its axes
    axes: list[tuple[str, int]] = field(default_factory=list)


@dataclass
class InitResult:
    text: str  # the profile, commented
    notes: list[str]  # what the user should know: sizes the model fixes, examples it cannot serve
    dims: dict[str, Dim]


def init_profile(
    factory: str,
    calls: list[Call],
    *,
    output: Path,
    kwargs: dict[str, Any] | None = None,
    name: str | None = None,
    command: str = "",
    progress: Progress | None = None,
) -> InitResult:
    """A profile for ``factory`` (``module:callable``, imported as ``build`` will: the profile's folder
    first on sys.path) serving calls like ``calls``. Raises InitError / ModelError / ExportError."""
    progress = progress or Progress()
    if not calls:
        raise InitError("give at least one --example call (two or more with different sizes make dims dynamic)")
    names = _same_inputs(calls)
    profile_name = name or re.sub(r"[^a-z0-9._-]+", "-", factory.rpartition(":")[2].lower()).strip("-._") or "model"
    draft = _draft(profile_name, factory, kwargs or {}, calls[0], names, None, output)
    with progress.stage("resolve", factory):
        inner = _import_model(draft, output)
        names = _forward_order(inner, names)
        draft = _draft(profile_name, factory, kwargs or {}, calls[0], names, None, output)
        probe = adapt(inner, names, None)
        first = _sample(calls[0], names, {})
        out = _eager(probe, first, "example call 1")
        keep, kind = _outputs_to_keep(out)
        model = adapt(inner, names, keep)
    varying = {
        (n, a) for n in names for a in range(len(calls[0].shapes[n])) if len({c.shapes[n][a] for c in calls}) > 1
    }
    with progress.stage("eager", f"forward() on {min(len(calls), 16)} example call(s)"):
        working, notes = _working_calls(model, calls, names)
    example = _export_example(working, names, varying)
    with progress.stage("export", f"{len(varying)} varying axis/axes, torch.export with Dim.AUTO"):
        ep, log = _export(model, _sample(example, names, {}), names, varying)
    axes = dict(zip(names, input_axes(ep)))
    notes += _fixed_axis_notes(calls, varying, axes, log)
    dims = _dims(calls, names, varying, axes, ep, log)
    tables = _index_ranges(ep, draft)
    ranges = {n: tables.get(n) or _guess_range(n, calls[0].dtypes[n]) for n in names}
    shape_of = {
        n: [_axis_name(dims, n, a, axes[n][a], calls[0].shapes[n][a]) for a in range(len(axes[n]))] for n in names
    }
    with progress.stage("check", "eager on every example call and at the ends of every range"):
        notes += _check_calls(model, calls, names, ranges, dims, shape_of)
    outs = _outputs_decl(ep, dims)
    text = _write(
        profile_name, factory, kwargs or {}, keep, kind, names, calls[0], shape_of, ranges, dims, outs, calls, command
    )
    return InitResult(text, notes, dims)


def _fmt(c: Call, n: str) -> str:
    return "x".join(map(str, c.shapes[n])) + f":{c.dtypes[n]}"


def _same_inputs(calls: list[Call]) -> list[str]:
    """The input names of call 1; an InitError unless every call has the same inputs with the same
    ranks and dtypes, since one profile has to serve them all."""
    names = list(calls[0].shapes)
    for i, c in enumerate(calls[1:], 2):
        if set(c.shapes) != set(names):
            raise InitError(
                f"example call {i} has inputs {sorted(c.shapes)}, call 1 has {sorted(names)}: every call needs the same inputs"
            )
        for n in names:
            if len(c.shapes[n]) != len(calls[0].shapes[n]) or c.dtypes[n] != calls[0].dtypes[n]:
                raise InitError(
                    f"input {n!r}: call {i} is {_fmt(c, n)}, call 1 is {_fmt(calls[0], n)}: ranks and dtypes must agree"
                )
    return names


def _import_model(draft: LoadedProfile, output: Path) -> torch.nn.Module:
    """The draft's model (unwrapped when resolve gives a named-inputs adapter). A module that does not
    import gets a hint when the profile goes to another folder than the current one: build imports
    from the profile's folder, so that is where init looks too."""
    try:
        inner = resolve_model(draft)
    except ProfileError as e:
        folder = output.resolve().parent
        if folder != Path.cwd().resolve() and any("cannot import" in m for _, m in e.problems):
            hint = (
                f"the module is imported from the folder the profile is written to ({folder}), as build will: "
                "write the profile beside the module (-o), or make the module importable (PYTHONPATH)"
            )
            raise ProfileError(e.source, [*e.problems, ("model.factory", hint)]) from None
        raise
    return inner.model if hasattr(inner, "names") else inner


def _working_calls(model: torch.nn.Module, calls: list[Call], names: list[str]) -> tuple[list[Call], list[str]]:
    """The example calls eager forward() runs (call 1, which already ran, and up to 15 more), and a
    note for each one it fails: export and the profile then follow only what the model can serve."""
    notes: list[str] = []
    working = [calls[0]]
    for i, c in enumerate(calls[1:16], 2):
        try:
            _eager(model, _sample(c, names, {}, seed=i), f"example call {i}")
            working.append(c)
        except ModelError as e:
            notes.append(f"{e}; the profile serves what the model can")
    return working, notes


def _fixed_axis_notes(calls: list[Call], varying: set, axes: dict, log) -> list[str]:
    """A note per axis whose size differs between the examples but that torch.export fixed (with the
    line that fixed it, when a guard names it): the profile writes it static, and the user should know."""
    notes = []
    for n, a in sorted(varying):
        if isinstance(axes[n][a], int):
            sizes = sorted({c.shapes[n][a] for c in calls})
            guard = next((g for g in log.guards if re.search(rf"Eq\(\w+, {axes[n][a]}\)", g.expr)), None)
            where = f" ({guard.where})" if guard and guard.where else ""
            notes.append(
                f"inputs.{n}.shape[{a}]: the examples have sizes {sizes}, but the model fixes it to {axes[n][a]}{where}: "
                f"written as the static size {axes[n][a]}"
            )
    return notes


def _draft(name: str, factory: str, kwargs: dict, call: Call, names: list[str], keep, output: Path) -> LoadedProfile:
    try:
        profile = Profile.model_validate(
            {
                "name": name,
                "model": {"factory": factory, "kwargs": kwargs, **({"outputs": keep} if keep else {})},
                "inputs": {n: {"shape": list(call.shapes[n]), "dtype": call.dtypes[n]} for n in names},
            }
        )
    except Exception as e:  # pydantic's ValidationError: a malformed factory or name
        raise InitError(f"cannot make a profile from these arguments: {e}") from None
    return LoadedProfile(profile=profile, path=output.resolve())


def _forward_order(model: torch.nn.Module, names: list[str]) -> list[str]:
    """The inputs in forward()'s parameter order; an error for a name forward() does not take."""
    try:
        params = inspect.signature(model.forward).parameters
    except (TypeError, ValueError):
        return names
    if any(p.kind is inspect.Parameter.VAR_POSITIONAL for p in params.values()):
        return names
    unknown = [n for n in names if n not in params]
    if unknown:
        raise InitError(f"forward() takes no {', '.join(map(repr, unknown))}; its parameters: {', '.join(params)}")
    order = list(params)
    return sorted(names, key=order.index)


def _sample(
    call: Call, names: list[str], ranges: dict[str, tuple[float, float] | None], seed: int = 0
) -> tuple[torch.Tensor, ...]:
    gen = torch.Generator().manual_seed(seed)
    out = []
    for n in names:
        shape, dtype = call.shapes[n], TORCH_DTYPES[call.dtypes[n]]
        lo, hi = ranges.get(n) or (0, 1)
        if dtype is torch.bool:
            t = torch.ones(shape, dtype=torch.bool)
        elif dtype.is_floating_point:
            lo, hi = ranges.get(n) or (-1.0, 1.0)
            t = (torch.rand(shape, generator=gen, dtype=torch.float64) * (hi - lo) + lo).to(dtype)
        elif "mask" in n:  # a padding mask of all ones serves every call; random holes can empty a row
            t = torch.ones(shape, dtype=dtype)
        else:
            t = torch.randint(int(lo), int(hi) + 1, shape, generator=gen).to(dtype)
        out.append(t)
    return tuple(out)


def _eager(model: torch.nn.Module, args: tuple, what: str) -> Any:
    try:
        with torch.no_grad():
            return model(*args)
    except Exception as e:
        shapes = ", ".join(str(tuple(a.shape)) for a in args)
        raise ModelError(
            f"{what} ({shapes}) fails in eager forward(): {type(e).__name__}: {str(e).strip()[:500]}"
        ) from None


def _outputs_to_keep(out: Any) -> tuple[list[str | int] | None, str]:
    """Which outputs the profile names: the tensor fields of a dict / ModelOutput (caches and other
    objects dropped), the tensor items of a tuple that holds anything else; None to keep it all."""
    kind = type(out).__name__
    if isinstance(out, dict) or (hasattr(out, "keys") and not isinstance(out, torch.Tensor)):
        keep = [k for k in out.keys() if isinstance(out[k], torch.Tensor)]
        if not keep:
            raise InitError(f"forward() returned a {kind} with no tensor in it ({', '.join(out.keys())})")
        return keep, kind
    if isinstance(out, (tuple, list)) and not all(isinstance(v, torch.Tensor) for v in out):
        keep = [i for i, v in enumerate(out) if isinstance(v, torch.Tensor)]
        if not keep:
            raise InitError(f"forward() returned a {kind} with no tensor directly in it")
        return keep, kind
    return None, kind


def _export_example(calls: list[Call], names: list[str], varying: set) -> Call:
    """The call to export with: one whose varying sizes are all ≥ 2 (export specializes 0 and 1) and
    distinct where they belong to different axes, else the largest, moved up to 2."""
    for c in sorted(calls, key=lambda c: -sum(math.prod(s) for s in c.shapes.values())):
        if all(c.shapes[n][a] >= 2 for n, a in varying):
            return c
    c = max(calls, key=lambda c: sum(math.prod(s) for s in c.shapes.values()))
    shapes = {n: tuple(max(s, 2) if (n, a) in varying else s for a, s in enumerate(c.shapes[n])) for n in names}
    return Call(shapes, dict(c.dtypes))


def _export(model: torch.nn.Module, args: tuple, names: list[str], varying: set):
    specs = tuple({a: ExportDim.AUTO for n2, a in sorted(varying) if n2 == n} or None for n in names)
    dynamic_shapes = (specs,) if takes_varargs(model) else specs
    try:
        # No duck sizing: axes of equal example sizes (a square image) keep their own symbols.
        with (
            warnings.catch_warnings(),
            _shape_config.patch(use_duck_shape=False),
            capture_torch_logs(guards=True) as log,
        ):
            warnings.simplefilter("ignore")
            ep = torch.export.export(model, args, dynamic_shapes=dynamic_shapes, strict=False)
    except Exception as e:
        raise ExportError(explain_export_failure(e, {}, {}, log=log)) from None
    return ep, log


def _dims(calls: list[Call], names: list[str], varying: set, axes: dict, ep, log) -> dict[str, Dim]:
    """One Dim per symbol; axes of different inputs at the same position with equal sizes in every
    call are one dim too (an attention mask's batch and seq), whatever export proved."""
    groups: list[list[tuple[str, int]]] = []
    for key in sorted(varying, key=lambda k: (names.index(k[0]), k[1])):
        n, a = key
        if isinstance(axes[n][a], int):
            continue
        sizes = [c.shapes[n][a] for c in calls]
        for g in groups:
            gn, ga = g[0]
            if axes[gn][ga] == axes[n][a] or (gn != n and ga == a and [c.shapes[gn][ga] for c in calls] == sizes):
                g.append(key)
                break
        else:
            groups.append([key])
    proven = symbol_ranges(ep)
    bounds = {b.symbol: b for b in table_bounds(ep)}
    dims: dict[str, Dim] = {}
    for g in groups:
        symbols = {axes[n][a] for n, a in g}
        name = _unique(_dim_name(g[0], calls[0], names, g), dims)
        observed = [c.shapes[n][a] for c in calls for n, a in g]
        lo_proven = max((proven.get(s, (None, None))[0] or 0) for s in symbols)
        his = [(proven[s][1], s) for s in symbols if proven.get(s, (None, None))[1] is not None]
        table = min((bounds[s] for s in symbols if s in bounds), key=lambda b: b.max, default=None)
        if lo_proven > max(2, min(observed)):  # export always proves ≥ 2: it specializes 0 and 1
            lo, why_min = lo_proven, f"the model needs {name} ≥ {lo_proven} (torch.export proved it)"
        elif name == "batch":
            lo, why_min = 1, "the model sets no lower bound"
        else:  # below the sizes shown, a model may take another path (a pooling that empties): not claimed
            lo, why_min = min(observed), "the smallest example; smaller sizes may work (`precompile doctor` checks)"
        hi_proven = min(his, default=(None, None))[0]
        if table is not None and (hi_proven is None or table.max <= hi_proven):
            hi, why_max = table.max, f"the model's limit: {table.reason(name)}"
        elif hi_proven is not None:
            guard = next(
                (
                    gd
                    for gd in log.guards
                    if re.search(rf"\b{re.escape(str(min(his)[1]))}\b", gd.expr) and "<" in gd.expr
                ),
                None,
            )
            hi, why_max = (
                hi_proven,
                f"the model's limit: its code needs {name} ≤ {hi_proven}"
                + (f" (torch.export: {guard.expr} {guard.where})" if guard else " (torch.export proved it)"),
            )
        else:
            top = max(observed)
            hi = 1 << max(1, math.ceil(math.log2(max(top, 2))))
            why_max = f"the model sets no upper bound: the largest example ({top}) rounded up to a power of two; raise it to what you serve"
        dims[name] = Dim(name, lo, max(hi, lo), why_min, why_max, symbols, list(g))
    return dims


def _dim_name(key: tuple[str, int], call: Call, names: list[str], group: list[tuple[str, int]]) -> str:
    """batch for a leading axis shared or first; seq for token axes; height/width for images;
    frames/samples for audio; a ``decoder_`` prefix for decoder inputs."""
    n, a = key
    rank = len(call.shapes[n])
    dtype = call.dtypes[n]
    prefix = "decoder_" if n.startswith("decoder_") else ""
    if a == 0 and rank >= 2:
        return "batch"
    if dtype in INTEGER_DTYPES or dtype == "bool":
        return prefix + ("seq" if a == rank - 1 else f"{n}_{a}")
    if rank == 4:
        return prefix + {2: "height", 3: "width"}.get(a, f"{n}_{a}")
    if rank == 5:
        return prefix + {2: "depth", 3: "height", 4: "width"}.get(a, f"{n}_{a}")
    if rank == 2 and a == 1:
        return prefix + "samples"
    if rank == 3:
        if "embeds" in n or "hidden" in n:
            return prefix + "seq"
        return prefix + ("frames" if a == 2 else "seq")
    return f"{n}_{a}"


def _unique(name: str, taken: dict) -> str:
    if name not in taken:
        return name
    k = 2
    while f"{name}{k}" in taken:
        k += 1
    return f"{name}{k}"


def _axis_name(dims: dict[str, Dim], n: str, a: int, expr: Any, size: int) -> str | int:
    for d in dims.values():
        if (n, a) in d.axes:
            return d.name
    return int(expr) if isinstance(expr, int) else size


def _index_ranges(ep, draft: LoadedProfile) -> dict[str, tuple[int, int]]:
    return {n: (0, t.rows - 1) for n, t in index_tables(ep, draft.profile).items()}


def _guess_range(name: str, dtype: str) -> tuple[int, int] | None:
    if dtype in INTEGER_DTYPES and "mask" in name:
        return (0, 1)
    return None


def _check_calls(
    model, calls: list[Call], names: list[str], ranges: dict, dims: dict[str, Dim], shape_of: dict
) -> list[str]:
    """Run eager at the ends of every range (the others at their min); say which fail."""
    notes = []
    base = {d.name: d.min for d in dims.values()}
    for d in dims.values():
        for size in dict.fromkeys((d.min, d.max)):
            sizes = {**base, d.name: size}
            call = Call(
                {n: tuple(sizes[s] if isinstance(s, str) else s for s in shape_of[n]) for n in names},
                dict(calls[0].dtypes),
            )
            at = ", ".join(f"{k}={v}" for k, v in sizes.items())
            try:
                _eager(model, _sample(call, names, ranges), f"at {at}")
            except ModelError as e:
                notes.append(f"dims.{d.name}: eager forward() fails {str(e).removeprefix('at ')}: narrow the range")
    return notes


def _outputs_decl(ep, dims: dict[str, Dim]) -> list[list[str | int]]:
    names = {}
    for d in dims.values():
        for s in d.symbols:
            names[s] = d.name
    out = []
    for axes in output_axes(ep):
        row: list[str | int] = []
        for e in axes:
            if isinstance(e, int):
                row.append(e)
            elif e in names:
                row.append(names[e])
            else:
                row.append(str(e.subs({s: sympy.Symbol(n) for s, n in names.items()})).replace(" ", ""))
        out.append(row)
    return out


def _cpu_isa_line() -> str:
    """The ``cpu.isa`` proposal, commented out (the default, native, builds once, for CPUs like this one):
    the x86-64 levels this host can build and check."""
    levels = [isa for isa in LEVELS if not missing_features(isa, cpu_features())]
    if not levels:
        return "# cpu: {isa: [native]}                         # this host runs no x86-64 level: native code only"
    return (
        f"# cpu: {{isa: [{', '.join(levels)}]}}".ljust(48)
        + "  # portable code for a fleet of other CPUs: one compile per level (default [native]: this CPU's kind only)"
    )


def _flow(value: Any) -> str:
    """A YAML flow value: names and numbers bare, anything else quoted JSON."""
    if isinstance(value, list):
        return "[" + ", ".join(_flow(v) for v in value) + "]"
    if (
        isinstance(value, str)
        and re.fullmatch(r"[A-Za-z_]\w*", value)
        and value not in ("true", "false", "null", "yes", "no", "on", "off")
    ):
        return value
    return json.dumps(value)


def _write(name, factory, kwargs, keep, kind, names, call, shape_of, ranges, dims, outs, calls, command) -> str:
    lines = [
        "# Written by `precompile init`" + (f": {command}" if command else "") + ".",
        "# Edit the ranges to the traffic you serve; `precompile doctor` checks the profile, `precompile build` builds it.",
        f"name: {name}",
        "model:",
        f"  factory: {json.dumps(factory)}",
    ]
    if kwargs:
        lines.append(f"  kwargs: {json.dumps(kwargs)}")
    if keep is not None:
        lines.append(
            f"  outputs: {_flow(keep)}".ljust(48)
            + f"  # what forward()'s {kind} holds as tensors; drop what you do not serve"
        )
    lines.append("inputs:                                         # in forward() order")
    for n in names:
        spec = f"{{shape: {_flow(shape_of[n])}, dtype: {call.dtypes[n]}"
        comment = ""
        r = ranges.get(n)
        if r is not None and "mask" in n and r == (0, 1):
            # calls are padded (zeros), samples are real rows: the build's checks then compare real outputs
            spec += ", range: [0, 1], sample: {range: [1, 1]}"
            comment = "  # values: a mask (0 or 1); the build's samples: ones"
        elif r is not None:
            spec += f", range: [{r[0]}, {r[1]}]"
            comment = f"  # values: the rows of the table it indexes ({r[1] + 1})"
        elif call.dtypes[n] in INTEGER_DTYPES:
            comment = "  # indexes no table the model has: declare range: [low, high] to guard its values"
        lines.append(f"  {n}: {spec}}}".ljust(48) + comment)
    if dims:
        lines.append("dims:")
        for d in dims.values():
            lines.append(
                f"  {d.name}: {{min: {d.min}, max: {d.max}}}".ljust(48) + f"  # min: {d.why_min}; max: {d.why_max}"
            )
    else:
        lines.append(
            "dims: {}                                        # every axis static: give a second --example call with other sizes to make some dynamic"
        )
    lines.append(
        "outputs:                                        # flat, in order; a dim name: the axis follows that dim"
    )
    labels = [str(k) for k in keep] if keep is not None and len(keep) == len(outs) else [""] * len(outs)
    for row, label in zip(outs, labels):
        lines.append(f"  - {{shape: {_flow(row)}}}".ljust(48) + (f"  # {label}" if label else ""))
    lines.append(_cpu_isa_line())
    shapes = Counter()
    dynamic = [d for d in dims.values()]
    for c in calls:
        key = tuple(c.shapes[d.axes[0][0]][d.axes[0][1]] for d in dynamic)
        if all(d.min <= k <= d.max for d, k in zip(dynamic, key)):
            shapes[key] += c.count
    if dynamic and sum(c.count for c in calls) > len(calls):  # a traffic file: keep what was seen for the planner
        lines.append("distribution:                                   # the observed calls, for the planner")
        lines.append("  shapes:")
        for key, count in shapes.most_common(64):
            lines.append("    - {" + ", ".join(f"{d.name}: {k}" for d, k in zip(dynamic, key)) + f", count: {count}}}")
    return "\n".join(lines) + "\n"
