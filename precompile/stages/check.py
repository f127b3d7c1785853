"""Stage check: run the compiled code through the real loader and compare it with eager, every variant
on its own shapes, and run every pad/split policy past its dim's range the same way (a policy that
changes the results is the profile's error).

    report = check_artifact(loaded, model, staging, variants)     # CheckReport; CheckError on a mismatch
    check_policies(loaded, model, staging, report)
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

import torch

import loader
from loader.isa import AUTO, NATIVE
from loader.policy import split_problem, split_sizes

from ..compare import CheckReport, compare
from ..errors import CheckError, ProfileError
from ..profile import LoadedProfile
from ..runners import run_eager
from ..samples import check_shapes, make_inputs, to_device
from ..units import VariantPlan


class Staged:
    """The staged artifact, opened through the real loader at most once per device, precision request
    and CPU ISA: with every precision (what ``check_artifact`` runs the variants through, each ISA's in
    turn) and with fp32 only (what the policies and the static timing run on, for the best ISA this
    host runs; the same model when there is no lower precision)."""

    def __init__(self, folder: Path, *, target: str, lower_precisions: bool):
        self.folder = folder
        self.target = target  # the artifact's primary device, the one a plain loader.load opens
        self.lower_precisions = lower_precisions
        self._opened: dict[tuple[str, bool, str], loader.CompiledModel] = {}

    def every(self, device: str, isa: str | None = None) -> loader.CompiledModel:
        """Every precision, of the CPU variants built for ``isa`` (None: the build host's own)."""
        return self._open(device, fp32=False, isa=(isa or NATIVE) if device == "cpu" else AUTO)

    def fp32(self, device: str | None = None) -> loader.CompiledModel:
        return self._open(device or self.target, fp32=self.lower_precisions, isa=AUTO)

    def _open(self, device: str, *, fp32: bool, isa: str) -> loader.CompiledModel:
        if (device, fp32, isa) not in self._opened:
            precision = {"precision": "fp32"} if fp32 else {}
            # eager: every variant opened and warmed before load() returns, none in a background
            # thread while the build times them (the gate, the static variants' measure)
            self._opened[(device, fp32, isa)] = loader.load(
                self.folder, device=device, cpu_isa=isa, open="eager", **precision
            )
        return self._opened[(device, fp32, isa)]


def check_artifact(
    loaded: LoadedProfile, model: torch.nn.Module, staged: Staged, plan: Sequence[VariantPlan]
) -> CheckReport:
    """Compare every variant of ``plan``, run through the real loader, with eager on its own shapes:
    a static variant on its shape, a dynamic one at its range ends and random sizes inside."""
    profile = loaded.profile
    report = CheckReport()
    seed = profile.check.seed
    for vp in plan:
        compiled = staged.every(vp.device, vp.isa)
        for i, sizes in enumerate(check_shapes(profile, vp.ranges, profile.check.random_shapes, seed)):
            args = make_inputs(profile, sizes, seed=seed + i)
            want = run_eager(model, args)
            got = compiled.run_variant(vp.id, *to_device(args, vp.device, None))
            compare(profile, want, got, sizes, vp.id, report, compute_dtype=vp.dtype)
    return report


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


def check_policies(loaded: LoadedProfile, model: torch.nn.Module, staged: Staged, report: CheckReport) -> None:
    """Call the staged artifact on its primary device with each pad/split dim past its range (the other
    dims at their hint) and compare with eager on the same inputs; a policy that changes the results
    is a ProfileError naming the dim and the policy."""
    profile = loaded.profile
    policies = {d: p for d, p in profile.policy.out_of_range.items() if p != "error"}
    if not policies:
        return
    compiled = staged.fp32()  # the policies are checked on the fp32 variants
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
                fix = (
                    "pad_value that leaves the results unchanged"
                    if policy == "pad"
                    else "model whose items are independent along it"
                )
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
