"""Stage 4, check: run the compiled code through the real loader and compare it with eager."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch

from loader.manifest import OutputSpec

from .errors import CheckError, ModelError
from .profile import Profile


def output_spec(value: Any, where: str = "output") -> OutputSpec:
    """The structure of an eager output, in the order torch.export flattens it."""
    if isinstance(value, torch.Tensor):
        return OutputSpec("tensor")
    if isinstance(value, dict):  # also HF ModelOutput, which flattens its non-None fields in order
        keys = tuple(value.keys())
        if not all(isinstance(k, str) for k in keys):
            raise ModelError(f"{where}: dict outputs need string keys, got {keys!r}")
        return OutputSpec("dict", tuple(output_spec(value[k], f"{where}[{k!r}]") for k in keys), keys)
    if isinstance(value, (tuple, list)):
        kind = "list" if isinstance(value, list) else "tuple"
        return OutputSpec(kind, tuple(output_spec(v, f"{where}[{i}]") for i, v in enumerate(value)))
    raise ModelError(
        f"{where} is {type(value).__name__}; forward() may return tensors and tuples, lists or dicts of tensors"
    )


def flatten(value: Any) -> list[torch.Tensor]:
    if isinstance(value, torch.Tensor):
        return [value]
    if isinstance(value, dict):
        return [t for v in value.values() for t in flatten(v)]
    return [t for v in value for t in flatten(v)]


def run_eager(model: torch.nn.Module, args: tuple) -> Any:
    try:
        with torch.no_grad():
            return model(*args)
    except Exception as e:
        shapes = ", ".join(f"{tuple(a.shape)}" for a in args)
        raise ModelError(
            f"eager forward() failed on sample inputs of shapes {shapes}: {type(e).__name__}: {e}\n"
            "  (sample values come from each input's `range` in the profile)"
        ) from None


@dataclass
class CheckReport:
    shapes: int = 0
    max_abs_error: float = 0.0
    per_shape: list[dict[str, Any]] = field(default_factory=list)


def compare(
    profile: Profile,
    eager: Any,
    compiled: Any,
    sizes: dict[str, int],
    variant: str,
    report: CheckReport,
    compute_dtype: str | None = None,
) -> None:
    """Raise CheckError when ``compiled`` disagrees with ``eager``; record the error in ``report``.

    A variant computing in a lower precision (``compute_dtype``, CUDA builds) is compared after
    casting its floating outputs back, with that dtype's tolerance.
    """
    shape = ", ".join(f"{d}={n}" for d, n in sizes.items()) or "static shape"
    want, got = flatten(eager), flatten(compiled)
    if len(want) != len(got):
        raise CheckError(f"variant {variant}, {shape}: eager returned {len(want)} tensors, compiled {len(got)}")
    worst = 0.0
    for i, (w, g) in enumerate(zip(want, got)):
        where = f"variant {variant}, {shape}, output {i}"
        g = g.cpu()
        if compute_dtype is not None and g.is_floating_point() and w.is_floating_point():
            g = g.to(w.dtype)
        if tuple(w.shape) != tuple(g.shape) or w.dtype != g.dtype:
            raise CheckError(f"{where}: eager gave {w.dtype} {tuple(w.shape)}, compiled {g.dtype} {tuple(g.shape)}")
        dtype = compute_dtype if compute_dtype is not None and w.is_floating_point() else str(w.dtype).removeprefix("torch.")
        atol, rtol = profile.tolerance(dtype)
        if w.is_floating_point():
            err = (w.double() - g.double()).abs()
            err = torch.where(torch.isnan(w) & torch.isnan(g), torch.zeros_like(err), err)
            bad = ~(err <= atol + rtol * w.double().abs())
            max_err = float(err.max()) if err.numel() else 0.0
        else:
            bad = w != g
            max_err = float((w != g).sum())
        if bool(bad.any()):
            index = tuple(int(i) for i in bad.nonzero()[0])
            raise CheckError(
                f"{where}: compiled differs from eager beyond tolerance (atol={atol}, rtol={rtol}): "
                f"max abs error {max_err:.3g}, first at index {index} (eager {w[index].item():.6g}, "
                f"compiled {g[index].item():.6g}); raise check.atol/check.rtol in the profile if this is expected"
            )
        worst = max(worst, max_err)
    report.shapes += 1
    report.max_abs_error = max(report.max_abs_error, worst)
    report.per_shape.append({"variant": variant, "dims": dict(sizes), "max_abs_error": worst})

