"""One comparison of outputs against their reference, with a typed result; and the accuracy metrics the
precision gate judges lower-precision variants by.

Every place the build compares (compiled code against eager in the check stage and in tuning, the
pad/split policies, batched calls against single ones) goes through ``compare_tensors``:

    c = compare_tensors(want, got, atol=1e-4, rtol=1e-4)
    c.passed, c.max_abs_error, c.first_mismatch      # True, 3.1e-06, None
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from loader.outputs import flatten

from .errors import CheckError
from .profile import AccuracyRule, Profile


@dataclass(frozen=True)
class TensorComparison:
    """One output against its reference: the largest error (floating outputs: max |want - got|, a NaN
    or an infinity where both hold it counting as equal; other dtypes: how many elements differ), the
    tolerance it was judged by, and the first index beyond it (None: within tolerance everywhere)."""

    max_abs_error: float
    atol: float
    rtol: float
    first_mismatch: tuple[int, ...] | None = None

    @property
    def passed(self) -> bool:
        return self.first_mismatch is None


def compare_tensors(want: torch.Tensor, got: torch.Tensor, *, atol: float, rtol: float) -> TensorComparison:
    """``got`` against ``want`` (same shape, on the CPU) within ``atol + rtol * |want|``."""
    if want.is_floating_point():
        same = (want == got) | (torch.isnan(want) & torch.isnan(got))  # NaN and infinities where both have them
        err = torch.where(same, 0.0, (want.double() - got.double()).abs())
        infinite = ~torch.isfinite(want) | ~torch.isfinite(got)  # an infinity only matches itself
        bad = (~(err <= atol + rtol * want.double().abs()) | infinite) & ~same
        worst = float(err.max()) if err.numel() else 0.0
    else:
        bad = want != got
        worst = float(bad.sum())
    first = tuple(int(i) for i in bad.nonzero()[0]) if bool(bad.any()) else None
    return TensorComparison(worst, atol, rtol, first)


@dataclass(frozen=True)
class ShapeCheck:
    variant: str
    dims: dict[str, int]
    max_abs_error: float


@dataclass
class CheckReport:
    """What the check stage compared: how many shapes, the largest error, each shape's."""

    shapes: int = 0
    max_abs_error: float = 0.0
    per_shape: list[ShapeCheck] = field(default_factory=list)

    def add(self, variant: str, sizes: dict[str, int], worst: float) -> None:
        self.shapes += 1
        self.max_abs_error = max(self.max_abs_error, worst)
        self.per_shape.append(ShapeCheck(variant, dict(sizes), worst))


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
        dtype = (
            compute_dtype
            if compute_dtype is not None and w.is_floating_point()
            else str(w.dtype).removeprefix("torch.")
        )
        atol, rtol = profile.tolerance(dtype)
        c = compare_tensors(w, g, atol=atol, rtol=rtol)
        if not c.passed:
            index = c.first_mismatch
            raise CheckError(
                f"{where}: compiled differs from eager beyond tolerance (atol={atol}, rtol={rtol}): "
                f"max abs error {c.max_abs_error:.3g}, first at index {index} (eager {w[index].item():.6g}, "
                f"compiled {g[index].item():.6g}); raise check.atol/check.rtol in the profile if this is expected"
            )
        worst = max(worst, c.max_abs_error)
    report.add(variant, sizes, worst)


# --- accuracy metrics (the precision gate) ----------------------------------------------------------


def row_values(rule: AccuracyRule, want: torch.Tensor, got: torch.Tensor) -> torch.Tensor:
    """``rule``'s metric between fp32 eager's ``want`` and a variant's ``got``, one value per output row
    (the last axis; a 0-d or 1-d output is one row): cosine, max |want - got|, or 1.0 where the argmax agrees."""
    w, g = want.detach().double().cpu(), got.detach().double().cpu()
    rows_w = w.reshape(-1, w.shape[-1]) if w.dim() >= 2 else w.reshape(1, -1)
    rows_g = g.reshape(rows_w.shape)
    if rows_w.numel() == 0:
        return torch.empty(0, dtype=torch.float64)
    if rule.metric == "max_abs":
        return (rows_w - rows_g).abs().amax(-1)
    if rule.metric == "top1":
        return (rows_w.argmax(-1) == rows_g.argmax(-1)).double()
    return torch.nn.functional.cosine_similarity(rows_w, rows_g, dim=-1, eps=1e-12)


def summarize(rule: AccuracyRule, values: torch.Tensor, statistic: str | None = None) -> float:
    """Per-row ``values`` summed up as the gate judges them (``statistic``, default the rule's): top1 the
    share of rows agreeing; cosine and max_abs the worst row, the mean, or p5, the bound of the 5% worst
    rows (the 5th percentile of cosine, the 95th of max_abs, linearly interpolated)."""
    if values.numel() == 0:
        return 0.0 if rule.metric == "max_abs" else 1.0
    if rule.metric == "top1":
        return float(values.mean())
    statistic = statistic or rule.statistic
    high = rule.metric == "max_abs"  # larger is worse
    if statistic == "worst":
        return float(values.max() if high else values.min())
    if statistic == "mean":
        return float(values.mean())
    return float(torch.quantile(values, 0.95 if high else 0.05))


def agreement(rule: AccuracyRule, want: torch.Tensor, got: torch.Tensor) -> float:
    """``rule``'s metric between ``want`` and ``got`` at their worst row (top1: the share agreeing)."""
    return summarize(rule, row_values(rule, want, got), "worst")


def passes(rule: AccuracyRule, value: float) -> bool:
    return value <= rule.threshold if rule.metric == "max_abs" else value >= rule.threshold


# How much more error than the build host's a serving host may show on a reference input and still
# count as computing what the build host did: a quarter more (other thread counts sum in another
# order), plus BUILD_SLACK for an error of about zero.
BUILD_MARGIN = 0.25
BUILD_SLACK = 1e-6


def error_of(rule: AccuracyRule, value: float) -> float:
    """``rule``'s ``value`` as an error, 0 the best: max_abs itself, 1 - cosine, 1 - the top1 share."""
    return value if rule.metric == "max_abs" else 1.0 - value


def reproduces(rule: AccuracyRule, value: float, built: float | None) -> bool:
    """Whether a reference input's ``value`` on this host agrees with the build: at least as good as
    the gate's threshold, or within BUILD_MARGIN of ``built``, the build host's own value on that
    input (None, a manifest without it: the threshold alone)."""
    if passes(rule, value):
        return True
    if built is None:
        return False
    return error_of(rule, value) <= error_of(rule, built) * (1 + BUILD_MARGIN) + BUILD_SLACK


def accuracy_entries(
    profile: Profile, pairs: Sequence[tuple[Sequence[torch.Tensor], Sequence[Any]]]
) -> list[dict[str, Any]]:
    """Per output of the (fp32 eager, variant) output ``pairs``: the rule's metric over every row of
    every pair (``compare.summarize``), with how many rows and whether it passed."""
    rows: dict[int, list[torch.Tensor]] = {}
    equal: dict[int, list[bool]] = {}
    for want, got in pairs:
        for i, (w, g) in enumerate(zip(want, got)):
            if w.is_floating_point():
                rows.setdefault(i, []).append(row_values(profile.accuracy.rule(i), w, g))
            else:
                equal.setdefault(i, []).append(torch.equal(w, g.cpu()))
    accuracy = []
    for i in sorted({*rows, *equal}):
        rule = profile.accuracy.rule(i)
        if i in equal:
            entry = {"metric": "equal", "rows": len(equal[i]), "threshold": 1.0, "value": float(all(equal[i]))}
            entry["passed"] = all(equal[i])
        else:
            values = torch.cat(rows[i])
            value = summarize(rule, values)
            entry = {
                "metric": rule.metric,
                "statistic": "share" if rule.metric == "top1" else rule.statistic,
                "rows": int(values.numel()),
                "threshold": rule.threshold,
                "value": value,
                "passed": passes(rule, value),
            }
        accuracy.append({"output": i, **entry})
    return accuracy
