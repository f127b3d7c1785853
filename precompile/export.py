"""Stage 2, export: torch.export with one ``Dim`` per profile dim, shared by every input that uses it.

Failures are translated into the profile's words: which dim, what torch said, what to change.
"""

from __future__ import annotations

import re
import warnings

import torch
from torch.export import Dim, ExportedProgram

from .errors import ExportError
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
    args = to_device(make_inputs(profile, hint, seed=profile.check.seed), device, dtype)
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            return torch.export.export(model, args, dynamic_shapes=dynamic_shapes, strict=False)
    except Exception as e:  # torch.export raises many types; every one is reported the same way
        raise ExportError(explain_export_failure(e, ranges, hint)) from None


def explain_export_failure(e: BaseException, ranges: dict[str, tuple[int, int]], hint: dict[str, int]) -> str:
    text = str(e)
    involved = [d for d in ranges if re.search(rf"\b{re.escape(d)}\b", text)]
    advice = []
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
    if not advice:
        advice.append("change the model so torch.export can trace it for every size in the declared ranges")
    lines = text.strip().splitlines()
    said = "\n".join("    " + line for line in lines[:25]) + ("\n    ..." if len(lines) > 25 else "")
    where = ", ".join(f"{d} {list(ranges[d])} (example {hint[d]})" for d in involved) or "none named"
    return (
        f"torch.export failed ({type(e).__name__})\n"
        f"  dims involved: {where}\n"
        f"  torch says:\n{said}\n"
        + "".join(f"  what to change: {a}\n" for a in advice)
    ).rstrip()
