"""Stage resolve, from an exported program: a ``torch.export`` program (in memory, or a ``.pt2`` file
``torch.export.save`` wrote) in place of the profile's model factory.

The profile still says the dims, their ranges, the traffic and the checks; the program must serve
them: every axis the profile declares dynamic must be dynamic in the program over at least the
declared range, and every static size must be the program's. Its module is then what the build
exports again per variant (one range each) and runs as the eager reference.

    ep = read_program("model.pt2")              # ExportedProgram; PrecompileError naming the file
    check_program(ep, loaded)                   # ProfileError: inputs.ids.shape[0]: the program fixes batch ...
    model = program_module(ep)                  # the nn.Module the build runs and exports
    path = save_program(ep, scratch)            # a program given in memory, for the compile workers
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
from torch.export import ExportedProgram

from ...analysis.shapes import input_axes, symbol_ranges
from ...errors import PrecompileError, ProfileError
from ...profile import DimSpec, LoadedProfile


def read_program(path: str | Path) -> ExportedProgram:
    """The program ``torch.export.save`` wrote at ``path``."""
    try:
        return torch.export.load(str(path))
    except FileNotFoundError:
        raise PrecompileError(f"program {path}: file not found") from None
    except Exception as e:  # a file that is not a saved program: zip, pickle and version errors alike
        text = str(e).strip().splitlines()[0] if str(e).strip() else ""
        raise PrecompileError(
            f"program {path}: not a program torch.export.save wrote ({type(e).__name__}: {text})"
        ) from None


def check_program(ep: ExportedProgram, loaded: LoadedProfile) -> None:
    """Refuse a program whose inputs do not serve the profile's shapes, every problem at once."""
    profile = loaded.profile
    axes = input_axes(ep)
    if len(axes) != len(profile.inputs):
        raise ProfileError(
            str(loaded.path),
            [("inputs", f"the program takes {len(axes)} input(s), the profile declares {len(profile.inputs)}")],
        )
    proven = symbol_ranges(ep)
    problems = []
    for (name, spec), sizes in zip(profile.inputs.items(), axes):
        if len(sizes) != len(spec.shape):
            problems.append(
                (f"inputs.{name}.shape", f"has {len(spec.shape)} axes, the program's input has {len(sizes)}")
            )
            continue
        for axis, (declared, size) in enumerate(zip(spec.shape, sizes)):
            place = f"inputs.{name}.shape[{axis}]"
            problem = _axis_problem(declared, size, profile.dims, proven)
            if problem is not None:
                problems.append((place, problem))
    if problems:
        raise ProfileError(str(loaded.path), problems)


def _axis_problem(
    declared: str | int, size: Any, dims: dict[str, DimSpec], proven: dict[Any, tuple[int | None, int | None]]
) -> str | None:
    """What is wrong with one axis: the program's size (an int, or a sympy expression) against the
    profile's (a static int, or a dim name with a range)."""
    fixed = size if isinstance(size, int) else None
    if isinstance(declared, int) or declared not in dims:  # a static size (names outside dims are the check's)
        if isinstance(declared, int) and fixed is not None and fixed != declared:
            return f"the profile says {declared}, the program takes {fixed}"
        return None
    lo, hi = dims[declared].min, dims[declared].max
    if fixed is not None:
        if lo == hi == fixed:
            return None
        return (
            f"the program fixes {declared} to {fixed}, the profile declares it dynamic in [{lo}, {hi}]: export with "
            f"dynamic_shapes naming Dim({declared!r}, min={lo}, max={hi}) for this axis, or declare the static size {fixed}"
        )
    if not getattr(size, "is_symbol", False):
        return None  # an expression of other dims (a derived dim): its own dims are checked where they stand
    low, high = proven.get(size, (None, None))
    if (low is not None and low > lo) or (high is not None and high < hi):
        served = f"[{low if low is not None else 0}, {high if high is not None else '∞'}]"
        return (
            f"the program serves {declared} in {served}, the profile declares [{lo}, {hi}]: export with "
            f"Dim({declared!r}, min={lo}, max={hi}), or narrow dims.{declared}"
        )
    return None


def program_module(ep: ExportedProgram) -> torch.nn.Module:
    """The program as a module. It is not put in eval mode: an exported graph has its mode fixed at
    export (its module refuses ``eval()`` and ``train()``), so a program exported in training mode
    stays so."""
    return ep.module()


def save_program(ep: ExportedProgram, folder: Path) -> Path:
    """``ep`` saved under ``folder`` (the build's scratch space), for compile workers in other
    processes: they read the program where the build process was handed it."""
    path = folder / "program.pt2"
    try:
        torch.export.save(ep, str(path))
    except Exception as e:  # a program torch cannot serialize (a custom op without a serializer, ...)
        raise PrecompileError(f"program: torch.export.save cannot write it ({type(e).__name__}: {e})") from None
    return path


def model_source(loaded: LoadedProfile, program: ExportedProgram | str | Path | None) -> str:
    """Where the model comes from, for the build's progress line."""
    if isinstance(program, ExportedProgram):
        return "exported program (in memory)"
    if program is not None:
        return f"exported program {program}"
    return str(loaded.profile.model.factory)
