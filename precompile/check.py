"""Stage 4, check: run the compiled code through the real loader and compare it with eager, and
run every pad/split policy past its dim's range the same way (a policy that changes the results is
the profile's error)."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

import loader
from loader.manifest import OutputSpec
from loader.outputs import flatten
from loader.policy import split_problem, split_sizes

from .errors import CheckError, ModelError, ProfileError
from .profile import LoadedProfile, Profile
from .samples import make_inputs, to_device


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
        f"{where} is {type(value).__name__}; forward() may return tensors and tuples, lists or dicts of tensors "
        "(name the outputs to keep in the profile: `model: {factory: ..., outputs: [logits]}`)"
    )


def run_eager(model: torch.nn.Module, args: tuple, *, profile: Profile | None = None, sizes: dict[str, int] | None = None) -> Any:
    """forward() on sample inputs; a failure is a ModelError saying the shapes, and (given the
    profile and the sizes) which sizes the build chose and why. The original exception is kept as
    the error's ``cause`` for explain_eager_failure."""
    try:
        with torch.no_grad():
            return model(*args)
    except Exception as e:
        shapes = ", ".join(f"{tuple(a.shape)}" for a in args)
        lines = [f"eager forward() failed on sample inputs of shapes {shapes}: {type(e).__name__}: {str(e).strip()}"]
        if profile is not None and sizes:
            lines.append(f"  {sample_sizes(profile, sizes)}")
        if isinstance(e, IndexError) and profile is not None and any(
            spec.dtype not in ("float16", "bfloat16", "float32", "float64", "bool") for spec in profile.inputs.values()
        ):
            lines.append(
                "  an index past a table: either the sample values (drawn from each integer input's `range`) or a "
                "dim larger than a table the model indexes by position; `precompile doctor PROFILE` says which"
            )
        elif profile is not None and sizes:
            lines.append("  `precompile doctor PROFILE` lists every size the model fixes or bounds, with its source line")
        error = ModelError("\n".join(lines))
        error.cause = e
        raise error from None


def sample_sizes(profile: Profile, sizes: dict[str, int]) -> str:
    """``the sample size the build chose: seq=181, the geometric mean of [8, 4096]; ...``: each
    dim's size and where it came from (the profile's hint, the geometric mean, the traffic)."""
    parts = []
    for d, n in sizes.items():
        spec = profile.dims.get(d)
        if spec is None:
            parts.append(f"{d}={n}")
        elif spec.hint is not None and n == spec.hint:
            parts.append(f"{d}={n}, dims.{d}.hint")
        elif spec.min == spec.max:
            parts.append(f"{d}={n}, its only size")
        elif n == profile.hint(d):
            parts.append(f"{d}={n}, the geometric mean of [{spec.min}, {spec.max}]")
        else:
            parts.append(f"{d}={n}, from the observed traffic in its range [{spec.min}, {spec.max}]")
    return "the sample size the build chose: " + "; ".join(parts)


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



# --- out-of-range policies -----------------------------------------------------------------------


def check_policy_outputs(loaded: LoadedProfile) -> None:
    """Refuse, before anything compiles, a ``split`` whose pieces cannot be put back together: an
    output that follows the dim on several axes (attention scores ``[batch, seq, seq]`` split on seq
    would lose every entry across pieces) or on none."""
    profile = loaded.profile
    if profile.outputs is None:
        return  # the profile check already refuses pad/split without outputs
    output_dims = [[s if isinstance(s, str) and s in profile.dims else None for s in o.shape] for o in profile.outputs]
    problems = [
        (f"policy.out_of_range.{d}", f"split cannot be undone: {problem}; use pad or error for {d!r}")
        for d, policy in profile.policy.out_of_range.items()
        if policy == "split" and (problem := split_problem(d, output_dims)) is not None
    ]
    if problems:
        raise ProfileError(str(loaded.path), problems)


def check_policies(loaded: LoadedProfile, model: torch.nn.Module, folder: Path, report: CheckReport) -> None:
    """Call the artifact in ``folder`` through the real loader with each pad/split dim past its range
    (the other dims at their hint) and compare with eager on the same inputs; a policy that changes
    the results is a ProfileError naming the dim and the policy."""
    profile = loaded.profile
    policies = {d: p for d, p in profile.policy.out_of_range.items() if p != "error"}
    if not policies:
        return
    compiled = loader.load(folder, precision="fp32")  # the policies are checked on the fp32 variants
    hints = {d: min(max(profile.hint(d), spec.min), spec.max) for d, spec in profile.dims.items()}
    for d, policy in policies.items():
        for size in policy_sizes(profile.dims[d].min, profile.dims[d].max, policy):
            sizes = {**hints, d: size}
            args = make_inputs(profile, sizes, seed=profile.check.seed + size)
            want = run_eager(model, args)
            got, variant = compiled.call_detailed(*to_device(args, compiled.device, None))
            dtype = next((v.dtype for v in compiled.variants if v.id == variant.split("+")[0]), None)
            try:
                compare(profile, want, got, sizes, f"{variant} ({d}: {policy})", report, compute_dtype=dtype)
            except CheckError as e:
                fix = "pad_value that leaves the results unchanged" if policy == "pad" else "model whose items are independent along it"
                problem = f"{policy} changes the results ({e}); use error for {d!r}, or a {fix}"
                raise ProfileError(str(loaded.path), [(f"policy.out_of_range.{d}", problem)]) from None


def policy_sizes(lo: int, hi: int, policy: str) -> list[int]:
    """Sizes past [lo, hi] that ``policy`` serves, to check it with: for pad, the smallest and the
    largest below the range; for split, the first size above it that splits (unevenly, mostly) and
    an even split into two."""
    if policy == "pad":
        return sorted({1, lo - 1}) if lo >= 2 else []
    candidates = dict.fromkeys(n for n in (hi + 1, 2 * hi + 1, 2 * hi) if split_sizes(n, lo, hi) is not None)
    return list(candidates)[:2]
