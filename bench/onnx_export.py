"""The peers' model: the bench model written once as ONNX, at prepare time, for ONNX Runtime and OpenVINO.

``torch.onnx.export(model, args, dynamo=True, dynamic_shapes=...)`` with one ``Dim`` per profile dim,
named as the profile names it (so the ONNX inputs say ``batch``, ``seq``…), and example sizes from
``precompile.tracing.export_hints`` (≥ 2 and distinct, as our own export uses). A model that does not
export is not an error of the benchmark: the result says why, and the peers are reported as failed.
"""

from __future__ import annotations

import contextlib
import logging
import re
import time
import traceback
import warnings
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch
from torch.export import Dim

from precompile.profile import Profile
from precompile.tracing import export_hints

from .workload import inputs_for


def dynamic_shapes(profile: Profile) -> tuple[dict[int, Dim] | None, ...]:
    """Per input, the axes that follow a profile dim, each mapped to that dim's ``Dim``."""
    dims = {d: Dim(d, min=s.min, max=s.max) for d, s in profile.dims.items() if s.min != s.max}
    return tuple(
        {axis: dims[s] for axis, s in enumerate(spec.shape) if isinstance(s, str) and s in dims} or None
        for spec in profile.inputs.values()
    )


@contextlib.contextmanager
def quiet(*names: str) -> Iterator[None]:
    """Errors only from these loggers: the exporter warns about every optional op it skips
    (torchvision's, absent here) and every constant it does not fold, none of which matters here."""
    loggers = [logging.getLogger(n) for n in names]
    levels = [lg.level for lg in loggers]
    for lg in loggers:
        lg.setLevel(logging.ERROR)
    try:
        yield
    finally:
        for lg, level in zip(loggers, levels):
            lg.setLevel(level)


def export_onnx(model: torch.nn.Module, profile: Profile, path: Path) -> dict[str, Any]:
    """Write ``model`` to ``path`` as ONNX; its seconds, size and example sizes, or ``failed`` with the
    reason (the exception's last line, the whole traceback beside it in ``path``.log)."""
    ranges = {d: (s.min, s.max) for d, s in profile.dims.items()}
    hint = export_hints(ranges, {d: profile.hint(d) for d in profile.dims})
    args = inputs_for(profile, hint, seed=0)
    start = time.perf_counter()
    try:
        with warnings.catch_warnings(), quiet("torch.onnx", "onnxscript"), torch.no_grad():
            warnings.simplefilter("ignore")
            program = torch.onnx.export(
                model,
                args,
                dynamo=True,
                dynamic_shapes=dynamic_shapes(profile),
                input_names=list(profile.inputs),
                verbose=False,
            )
            program.save(str(path))
    except Exception as e:  # torch.export and the ONNX translation raise many types: each one is a failed peer
        path.with_suffix(".log").write_text(traceback.format_exc(), encoding="utf-8")
        return {"failed": failure(e), "seconds": time.perf_counter() - start}
    return {
        "path": str(path),
        "seconds": time.perf_counter() - start,
        "bytes": path.stat().st_size,
        "example_sizes": hint,
    }


def failure(e: BaseException) -> str:
    """One line for the results: the exporter's step that failed, and the exception at its root
    (a data-dependent branch, an operator without an ONNX translation…)."""

    def first_line(x: BaseException) -> str:
        lines = [line for line in re.sub(r"\x1b\[[0-9;]*m", "", str(x)).splitlines() if line.strip()]
        return f"{type(x).__name__}: {lines[0].strip()[:240] if lines else ''}"

    root = e
    while root.__cause__ is not None:
        root = root.__cause__
    return f"torch.onnx.export: {first_line(e)}" + ("" if root is e else f" ← {first_line(root)}")
