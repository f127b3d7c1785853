"""``precompile doctor``: every reason a profile will not build, found at once, in the profile's terms.

It runs forward() eagerly at the sample size the build would choose and at the ends of every range,
then ``torch.export.draft_export`` (which traces on past a failure and reports every one) for the
declared ranges, and reads the result: sizes the model fixes or bounds (with the line that does it),
branches on tensor values, tables a dim outgrows, ops Inductor has no kernel for. The export runs in
a thread with a time budget; past it, the report says what was found so far.

    report = diagnose("profiles/bert.yaml", max_seconds=300)
    print(report.format())
"""

from __future__ import annotations

import re
import threading
import time
import warnings
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
import torch.fx.experimental._config as _shape_config

from ..analysis.shapes import (
    TorchLog,
    axis_of,
    capture_torch_logs,
    dim_bound_problems,
    dim_symbols,
    fallback_ops,
    input_axes,
    symbol_ranges,
    user_line,
)
from ..errors import ModelError, ProfileError
from ..profile import LoadedProfile, load_profile
from ..progress import Progress
from ..runners import run_eager, sample_sizes
from ..samples import make_inputs
from ..stages.plan import make_plan
from ..stages.resolve import explain_eager_failure, resolve_model
from ..tracing import explain_export_failure, export_hints, takes_varargs


@dataclass
class Finding:
    """One problem (or note), where it is in the profile, what the model does, and what to change."""

    level: str  # "error" | "note"
    place: str  # "dims.seq", "inputs.x.shape[1]", "model", "ops"
    message: str
    fix: str = ""
    source: str = ""  # the model's line: "modeling_vit.py:152 in forward: if height != ..."
    eager: bool = False  # an eager failure at a size: dropped when the export explains that dim

    def format(self) -> str:
        text = f"  {self.place}: {self.message}" if self.level == "error" else f"  note: {self.place}: {self.message}"
        if self.source:
            text += f"\n      at {self.source}"
        if self.fix:
            text += f"\n      fix: {self.fix}"
        return text


@dataclass
class DoctorReport:
    source: str
    findings: list[Finding] = field(default_factory=list)
    finished: bool = True  # False: the export ran past its time budget
    checked: list[str] = field(default_factory=list)  # what was run, for the summary line

    @property
    def errors(self) -> list[Finding]:
        return [f for f in self.findings if f.level == "error"]

    def format(self) -> str:
        errors, notes = self.errors, [f for f in self.findings if f.level != "error"]
        head = f"{self.source}: " + (f"{len(errors)} problem(s)" if errors else "no problem found")
        head += f" ({'; '.join(self.checked)})" if self.checked else ""
        return "\n".join([head] + [f.format() for f in errors + notes])

    def add(self, finding: Finding) -> None:
        key = (finding.place, finding.message)
        if all((f.place, f.message) != key for f in self.findings):
            self.findings.append(finding)


def diagnose(profile_path: str | Path, *, max_seconds: float = 300.0, progress: Progress | None = None) -> DoctorReport:
    """Check the profile at ``profile_path`` against its model; every finding in one report. A
    profile that does not parse raises ProfileError (its problems are listed the same way)."""
    progress = progress or Progress()
    loaded = load_profile(profile_path)
    profile = loaded.profile
    report = DoctorReport(str(profile_path))
    with progress.stage("resolve", profile.model.factory):
        model = resolve_model(loaded)
    ranges = {d: (spec.min, spec.max) for d, spec in profile.dims.items()}
    sample = make_plan(loaded).variants[-1].hint  # the size the build runs eager and exports at
    shapes = _eager_shapes(loaded, sample)
    worked = []
    with progress.stage(
        "eager", f"forward() at {len(shapes)} shape(s): the build's sample size and every range's ends"
    ):
        if _eager_at(loaded, model, sample, "sample", report):
            worked.append(sample)
            for what, sizes in shapes[1:]:
                if _eager_at(loaded, model, sizes, what, report):
                    worked.append(sizes)
        elif _build_diagnosis(loaded, model, sample, report):  # a declared range past a table: build's words
            report.checked.append("eager at 1 shape(s)")
            return report
        else:  # every other size is then suspect too: look for one forward() takes, to trace there
            shapes = shapes[:1]
            found = _search_sample(loaded, model, sample)
            if found is not None:
                worked.append(found)
                progress.note(
                    "forward() works at " + ", ".join(f"{d}={n}" for d, n in found.items()) + ": traced there"
                )
    report.checked.append(f"eager at {len(shapes)} shape(s)")
    # Trace where forward() runs: the build's export sizes if they work, else one that did.
    hint = export_hints(ranges, sample)
    if hint != sample and worked and not _eager_at(loaded, model, hint, "export", DoctorReport("")):
        hint = worked[0]
    with progress.stage("export", f"draft_export for the declared ranges (budget {max_seconds:g} s)"):
        ep, log, error, seconds = _draft_export(loaded, model, ranges, hint, max_seconds, progress)
    if error is None and ep is None:
        report.finished = False
        report.checked.append(
            f"torch.export stopped after {seconds:.0f} s (--max-seconds), {len(log.guards)} guard(s) seen so far"
        )
        report.add(
            Finding(
                "error",
                "export",
                f"torch.export did not finish within {max_seconds:g} s; what it found so far is listed",
                fix="a dim the model fixes or bounds often makes export search long: narrow the ranges below, or rerun with a larger --max-seconds",
            )
        )
        for g in log.guards:
            _guard_finding(loaded, g.expr, _symbol_dims(loaded, log.sources), g.where, report)
        return report
    report.checked.append(f"draft_export in {seconds:.1f} s")
    if error is not None:
        report.add(Finding("error", "export", explain_export_failure(error, ranges, hint, log=log)))
        return report
    _read_export(loaded, ep, ranges, report)
    explained = {f.place for f in report.errors if not f.eager}
    report.findings = [f for f in report.findings if not (f.eager and f.place in explained)]
    return report


def _eager_shapes(loaded: LoadedProfile, hint: dict[str, int]) -> list[tuple[str, dict[str, int]]]:
    profile = loaded.profile
    out = [("sample", dict(hint))]
    for d, spec in profile.dims.items():
        for end, label in ((spec.min, "min"), (spec.max, "max")):
            sizes = {**hint, d: end}
            if sizes not in [s for _, s in out]:
                out.append((f"{d} at its {label}", sizes))
    return out


def _build_diagnosis(
    loaded: LoadedProfile, model: torch.nn.Module, sample: dict[str, int], report: DoctorReport
) -> bool:
    """Eager failed at the build's sample size: what ``build`` says of that failure when it can say more
    (a declared value range, or a dim, past a table the model indexes: ``explain_eager_failure``), in
    place of the sample's finding; False when that is not the cause. Every sample is drawn from those
    ranges, so nothing after this would trace either."""
    profile = loaded.profile
    try:
        run_eager(model, make_inputs(profile, sample, seed=profile.check.seed), profile=profile, sizes=sample)
        return False
    except ModelError as e:
        try:
            explain_eager_failure(loaded, model, sample, e)
        except ProfileError as explained:
            report.findings = [f for f in report.findings if f.place != "dims"]
            for place, message in explained.problems:
                report.add(Finding("error", place, message))
            return True
    return False


def _search_sample(loaded: LoadedProfile, model: torch.nn.Module, sample: dict[str, int]) -> dict[str, int] | None:
    """A size forward() takes when the build's sample fails: the other dims moved together through
    powers of two and common image sizes in their ranges (a model fixing its size from its config
    usually wants one of them), the first dim (batch) kept."""
    profile = loaded.profile
    names = list(profile.dims)[1:] or list(profile.dims)
    candidates = sorted({1 << k for k in range(1, 13)} | {224, 384, 448, 512, 768})
    for c in candidates:
        sizes = dict(sample)
        for d in names:
            if profile.dims[d].min <= c <= profile.dims[d].max:
                sizes[d] = c
        if sizes != sample and _eager_at(loaded, model, sizes, "search", DoctorReport("")):
            return sizes
    return None


def _eager_at(
    loaded: LoadedProfile, model: torch.nn.Module, sizes: dict[str, int], what: str, report: DoctorReport
) -> bool:
    """forward() at ``sizes``; a failure becomes a finding on the dim at its end (or on the sample)."""
    profile = loaded.profile
    try:
        run_eager(model, make_inputs(profile, sizes, seed=profile.check.seed), profile=profile)
        return True
    except ModelError as e:
        cause = getattr(e, "cause", e)
        at = ", ".join(f"{d}={n}" for d, n in sizes.items())
        said = f"{type(cause).__name__}: {str(cause).strip().splitlines()[0] if str(cause).strip() else ''}"
        if what == "sample":
            report.add(
                Finding(
                    "error",
                    "dims",
                    f"eager forward() fails at {sample_sizes(profile, sizes)}: {said}",
                    fix="the findings below say which dim's size the model cannot take; set dims.<dim>.hint to a size it can",
                )
            )
        else:
            d = what.split(" ", 1)[0]
            report.add(
                Finding(
                    "error",
                    f"dims.{d}",
                    f"eager forward() fails at {at} ({what}): {said}",
                    fix=f"narrow dims.{d} to sizes the model takes",
                    eager=True,
                )
            )
        return False


def _draft_export(loaded: LoadedProfile, model, ranges, hint, max_seconds: float, progress: Progress):
    """draft_export (export where this torch has none) in a daemon thread, abandoned past the budget:
    (program or None, the torch log, the exception or None, seconds)."""
    from torch.export import Dim

    profile = loaded.profile
    dims = {d: Dim(d, min=lo, max=hi) for d, (lo, hi) in ranges.items() if lo != hi}
    specs = tuple(
        {a: dims[s] for a, s in enumerate(spec.shape) if isinstance(s, str) and s in dims} or None
        for spec in profile.inputs.values()
    )
    dynamic_shapes = (specs,) if takes_varargs(model) else specs
    args = make_inputs(profile, hint, seed=profile.check.seed)
    exporter = getattr(torch.export, "draft_export", None)
    result: dict[str, Any] = {}
    log_holder: list[TorchLog] = []
    done = threading.Event()

    def work() -> None:
        try:
            # No duck sizing: two dims sampled at the same size keep their own symbols, so a guard names
            # the one dim it is about (the sample may need equal sizes: an image model's height and width).
            with (
                warnings.catch_warnings(),
                _shape_config.patch(use_duck_shape=False),
                capture_torch_logs(guards=True) as log,
            ):
                log_holder.append(log)
                warnings.simplefilter("ignore")
                if exporter is not None:
                    result["ep"] = exporter(model, args, dynamic_shapes=dynamic_shapes, strict=False)
                else:
                    result["ep"] = torch.export.export(model, args, dynamic_shapes=dynamic_shapes, strict=False)
        except Exception as e:  # every export failure is reported as a finding
            result["error"] = e
        finally:
            done.set()

    start = time.perf_counter()
    threading.Thread(target=work, name="precompile-doctor-export", daemon=True).start()
    next_note = 15.0
    while not done.wait(1.0):
        elapsed = time.perf_counter() - start
        if elapsed >= max_seconds:
            break
        if elapsed >= next_note:
            guards = len(log_holder[0].guards) if log_holder else 0
            progress.note(f"export still running: {elapsed:.0f} s, {guards} guard(s) on sizes so far")
            next_note += 15.0
    seconds = time.perf_counter() - start
    log = log_holder[0] if log_holder else TorchLog()
    if not done.is_set():
        return None, TorchLog(list(log.guards), dict(log.sources), []), None, seconds
    return result.get("ep"), log, result.get("error"), seconds


def _read_export(loaded: LoadedProfile, ep, ranges, report: DoctorReport) -> None:
    """Everything the exported program says against the profile, in this order: what torch.export's
    report found, dims it specialized, ranges it proved, tables that bound a dim, ops without a kernel.
    The order matters: a dim already reported fixed by a guard is not reported again as specialized."""
    shapes = [list(spec.shape) for spec in loaded.profile.inputs.values()]
    _export_report_findings(loaded, ep, report)
    _specialized_dim_findings(loaded, ep, ranges, report)
    _proven_range_findings(loaded, ep, ranges, report)
    for place, message in dim_bound_problems(ep, shapes, ranges):
        text, _, fix = message.partition("; set ")
        report.add(Finding("error", place, text, fix=("set " + fix) if fix else ""))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        fallbacks = fallback_ops(ep)
    if fallbacks:
        listed = ", ".join(f"{op} ×{n}" for op, n in sorted(fallbacks.items()))
        report.add(Finding("note", "ops", f"without an Inductor kernel (the compiled code calls aten's own): {listed}"))


def _export_report_findings(loaded: LoadedProfile, ep, report: DoctorReport) -> None:
    """The failures non-strict torch.export recorded in its draft report (``ep._report``), each with
    the user's line: guards it added on sizes, branches on tensor values, custom ops without a
    (right) fake kernel."""
    draft = getattr(ep, "_report", None)
    files = getattr(draft, "str_to_filename", {}) if draft is not None else {}
    for failure in getattr(draft, "failures", []) if draft is not None else []:
        kind, data = str(failure.failure_type), failure.data
        line = user_line(data.get("user_stack") or [], files)
        if kind == "GUARD_ADDED":
            sources = {sym: src for sym, src in data.get("symbol_to_sources", {}).items()}
            _guard_finding(loaded, data["expr"], _symbol_dims(loaded, sources), line, report)
        elif kind == "DATA_DEPENDENT_ERROR":
            report.add(
                Finding(
                    "error",
                    "model",
                    f"forward() branches on tensor values: torch cannot decide `{data.get('expr')}` without the data "
                    f"(it assumed {data.get('result')!r} for the sample)",
                    fix=(
                        "rewrite the branch with torch.where or torch.cond, assert the assumption with torch._check(...), "
                        "or move it out of forward()"
                    ),
                    source=line,
                )
            )
        elif kind in ("MISSING_FAKE_KERNEL", "MISMATCHED_FAKE_KERNEL"):
            what = (
                "has no fake (shape) kernel"
                if kind == "MISSING_FAKE_KERNEL"
                else f"has a fake kernel that disagrees with the real one ({data.get('reason')})"
            )
            report.add(
                Finding(
                    "error",
                    "ops",
                    f"custom op torch.ops.{data.get('op')} {what}: export cannot follow sizes through it",
                    fix="register one with torch.library.register_fake, computing the output shapes from the inputs'",
                )
            )


def _specialized_dim_findings(loaded: LoadedProfile, ep, ranges, report: DoctorReport) -> None:
    """A declared dynamic axis that the exported program holds as a number: the model fixes that dim
    (unless a guard finding already said so)."""
    profile = loaded.profile
    for (n, a), d in _declared_axes(loaded).items():
        size = input_axes(ep)[list(profile.inputs).index(n)][a]
        lo, hi = ranges[d]
        fixed = any(f.place == f"dims.{d}" and "fixes" in f.message for f in report.findings)
        if isinstance(size, int) and lo != hi and not fixed:
            report.add(
                Finding(
                    "error",
                    f"dims.{d}",
                    f"the model fixes {d} to {size} (inputs.{n}.shape[{a}] specialized by torch.export)",
                    fix=f"write {size} for {d} in the input shapes (a static size), or change the code that needs it exact",
                )
            )


def _proven_range_findings(loaded: LoadedProfile, ep, ranges, report: DoctorReport) -> None:
    """A dim whose range torch.export proved narrower than the profile declares (below 2 is not
    counted: export always proves ≥ 2, since it specializes 0 and 1)."""
    names = _dims_of(loaded, ep)
    for sym, (lo, hi) in symbol_ranges(ep).items():
        d = names.get(sym)
        if d is None or d not in ranges:
            continue
        if hi is not None and hi < ranges[d][1]:
            report.add(
                Finding(
                    "error",
                    f"dims.{d}",
                    f"the model serves {d} ≤ {hi}, the profile declares max {ranges[d][1]}",
                    fix=f"set dims.{d}.max to {hi}",
                )
            )
        if lo is not None and lo > max(ranges[d][0], 2):
            report.add(
                Finding(
                    "error",
                    f"dims.{d}",
                    f"the model needs {d} ≥ {lo}, the profile declares min {ranges[d][0]}",
                    fix=f"set dims.{d}.min to {lo}",
                )
            )


def _declared_axes(loaded: LoadedProfile) -> dict[tuple[str, int], str]:
    return {
        (n, a): s
        for n, spec in loaded.profile.inputs.items()
        for a, s in enumerate(spec.shape)
        if isinstance(s, str) and s in loaded.profile.dims
    }


def _dims_of(loaded: LoadedProfile, ep) -> dict[Any, str]:
    return dim_symbols(ep, [list(spec.shape) for spec in loaded.profile.inputs.values()])


def _symbol_dims(loaded: LoadedProfile, sources: dict[str, str]) -> dict[str, str]:
    """symbol name ("s100") → profile dim, from torch's source strings ("L['x'].size()[2]")."""
    inputs = list(loaded.profile.inputs)
    axes = _declared_axes(loaded)
    out = {}
    for sym, source in sources.items():
        found = axis_of(source)
        if found is None:
            continue
        n, a = found
        if n.startswith("#"):
            i = int(n[1:])
            n = inputs[i] if i < len(inputs) else n
        if (n, a) in axes:
            out[sym] = axes[(n, a)]
    return out


def _guard_finding(loaded: LoadedProfile, expr: str, dims: dict[str, str], where: str, report: DoctorReport) -> None:
    """One guard torch added, in the profile's terms, when it narrows what the profile declares.
    Each form a guard takes (a fixed size, a bound, a multiple, two dims equal) has its own reader
    below; any other guard is reported as the assumption it is."""
    profile = loaded.profile
    if expr.startswith("Ne("):  # "not equal" guards exclude single sizes (0, 1, a coincidence), not ranges
        return
    named = re.sub(r"\b(s\d+)\b", lambda m: dims.get(m.group(1), m.group(1)), expr)
    syms = [s for s in re.findall(r"\bs\d+\b", expr) if s in dims]
    if not syms:
        return
    d = dims[syms[0]]
    lo, hi = profile.dims[d].min, profile.dims[d].max
    if m := re.fullmatch(r"Eq\((\w+), (\d+)\)", expr) or re.fullmatch(r"Eq\((\d+), (\w+)\)", expr):
        value = int(m.group(2) if m.group(2).isdigit() else m.group(1))
        findings = _fixed_size_findings(d, value, lo, hi, named, where)
    elif (m := re.fullmatch(r"(\w+) (<=|<|>=|>) (\d+)", expr)) and m.group(1) in dims:
        findings = _bound_findings(d, m.group(2), int(m.group(3)), lo, hi, where)
    elif (m := re.search(r"Mod\((\w+), (\d+)\)", expr)) and m.group(1) in dims:
        findings = [_multiple_finding(d, m.group(2), named, where)]
    elif (m := re.fullmatch(r"Eq\((\w+), (\w+)\)", expr)) and all(x in dims for x in m.groups()):
        findings = _equal_dims_findings(dims[m.group(1)], dims[m.group(2)], where)
    else:
        findings = [
            Finding(
                "error",
                f"dims.{d}",
                f"the model's code assumes {named}",
                source=where,
                fix=f"narrow dims.{d} to sizes where this holds, or change that line",
            )
        ]
    for finding in findings:
        report.add(finding)


def _fixed_size_findings(d: str, value: int, lo: int, hi: int, named: str, where: str) -> list[Finding]:
    """``Eq(s, 7)``: the model fixes the dim to one size, a finding unless the profile declares just that."""
    if lo == hi:
        return []
    return [
        Finding(
            "error",
            f"dims.{d}",
            f"the model fixes {d} to {value} (torch.export: {named})",
            source=where,
            fix=f"write {value} for {d} in the input shapes (a static size), or change that line so any {d} works",
        )
    ]


def _bound_findings(d: str, op: str, value: int, lo: int, hi: int, where: str) -> list[Finding]:
    """``s <= 512`` and the like: a finding where the bound cuts into the declared range (a lower
    bound of 2 or less is no news: export always proves ≥ 2)."""
    top = value if op == "<=" else value - 1 if op == "<" else None
    bottom = value if op == ">=" else value + 1 if op == ">" else None
    findings = []
    if top is not None and top < hi:
        findings.append(
            Finding(
                "error",
                f"dims.{d}",
                f"the model serves {d} ≤ {top}, the profile declares max {hi}",
                source=where,
                fix=f"set dims.{d}.max to {top}",
            )
        )
    if bottom is not None and bottom > max(lo, 2):
        findings.append(
            Finding(
                "error",
                f"dims.{d}",
                f"the model needs {d} ≥ {bottom}, the profile declares min {lo}",
                source=where,
                fix=f"set dims.{d}.min to {bottom}",
            )
        )
    return findings


def _multiple_finding(d: str, step: str, named: str, where: str) -> Finding:
    """``Mod(s, 8)``: the model needs the dim to be a multiple of ``step``."""
    return Finding(
        "error",
        f"dims.{d}",
        f"the model needs {d} to be a multiple of {step} (torch.export: {named})",
        source=where,
        fix=f"serve only such sizes as static ones, or pad {d} to a multiple of {step} inside the model",
    )


def _equal_dims_findings(a: str, b: str, where: str) -> list[Finding]:
    """``Eq(s1, s2)``: two profile dims the model needs equal, a finding unless they are one dim already."""
    if a == b:
        return []
    return [
        Finding(
            "error",
            f"dims.{b}",
            f"the model needs {a} == {b}",
            source=where,
            fix=f"use one dim name for both axes (replace {b} with {a} in the input shapes)",
        )
    ]
