"""Stage: choose each variant's Inductor options by measurement.

A profile may ask for several option sets (``compile.tune.candidates``, or a named preset). Every
variant is compiled under each of them (in parallel, by the compile stage), and here each candidate
package is opened, checked against eager and timed on the shapes its variant will serve, weighted by
the observed traffic. The fastest candidate that matches eager is kept; the trials of all of them go
into the manifest, so ``precompile inspect`` shows what was tried and why one won.

Options are not free wins (measured on this kind of machine: freezing made a small conv net 1.3×
slower and MiniLM at 1×16 tokens 2× faster), hence measuring rather than guessing.
"""

from __future__ import annotations

import statistics
import time
from dataclasses import asdict, dataclass, replace
from typing import Any, Callable

import torch

from loader import constants as C

from .check import CheckReport, compare, run_eager
from .compile import CompiledPackage
from .errors import CheckError
from .plan import VariantPlan
from .profile import LoadedProfile, Profile
from .samples import make_inputs, to_device

# Named candidate lists a profile can ask for (``compile: {tune: {preset: cpu}}``), documented in the
# README. The first candidate of every list is the baseline the others must beat.
PRESETS: dict[str, list[dict[str, Any]]] = {
    # Freezing folds constants and (with weight prepacking, the default) hands oneDNN pre-packed
    # weights, which must then live inside the variant's package instead of weights.safetensors.
    # (Freezing without prepacking is not offered: it folds weights into transposed views, which
    # weights.safetensors, storing tensors contiguously, cannot hand back.)
    "cpu": [
        {},
        {"freezing": True},
    ],
    # Adds Inductor's C++ GEMM templates, chosen by autotuning at build time (slow builds).
    "cpu-max": [
        {},
        {"freezing": True},
        {"freezing": True, "max_autotune": True, "max_autotune_gemm_backends": "CPP,ATEN"},
    ],
}


@dataclass
class Trial:
    """One candidate of one variant: how it compiled, whether it matched eager, how fast it ran."""

    variant: str
    candidate: int
    options: dict[str, Any]
    compile_s: float | None = None
    ms: float | None = None  # traffic-weighted mean of the median ms per shape
    max_abs_error: float | None = None
    error: str | None = None  # why it failed to compile or to match eager
    kept: bool = False

    def to_dict(self) -> dict[str, Any]:
        return {k: v for k, v in asdict(self).items() if v is not None}


def serving_shapes(vp: VariantPlan, distribution: dict[tuple[int, ...], int], dims: tuple[str, ...], top: int = 3) -> list[tuple[dict[str, int], float]]:
    """The shapes a variant will serve, hottest first with their traffic weights; its hint alone (weight
    1) when no observed traffic falls in its ranges."""
    inside = [
        (dict(zip(dims, key)), count)
        for key, count in distribution.items()
        if count > 0 and all(vp.ranges[d][0] <= key[i] <= vp.ranges[d][1] for i, d in enumerate(dims))
    ]
    inside.sort(key=lambda item: -item[1])
    chosen = inside[:top]
    if not chosen:
        return [(dict(vp.hint), 1.0)]
    total = sum(c for _, c in chosen)
    return [(sizes, count / total) for sizes, count in chosen]


def measure(
    run: Callable[..., Any],
    model: torch.nn.Module,
    profile: Profile,
    vp: VariantPlan,
    shapes: list[tuple[dict[str, int], float]],
    *,
    seconds_per_shape: float = 0.3,
) -> tuple[float, float]:
    """Check ``run`` (a callable taking the inputs) against eager on each shape and time it there.

    Returns (traffic-weighted mean of the median ms per shape, max abs error). Raises CheckError when
    it disagrees with eager. Runs enough calls for about ``seconds_per_shape`` per shape (at least 7).
    """
    report = CheckReport()
    weighted = 0.0
    sync = torch.cuda.synchronize if vp.device == "cuda" else (lambda: None)
    for i, (sizes, weight) in enumerate(shapes):
        args = make_inputs(profile, sizes, seed=profile.check.seed + 104729 + i)
        want = run_eager(model, args)
        args = to_device(args, vp.device, vp.dtype)
        compare(profile, want, run(*args), sizes, vp.id, report, compute_dtype=vp.dtype)
        (ms,) = time_calls(lambda: (run(*args), sync()), seconds=seconds_per_shape)
        weighted += weight * ms
    return weighted, report.max_abs_error


def time_calls(*fns: Callable[[], Any], seconds: float = 0.4) -> list[float]:
    """Median ms per call of each of ``fns``, calls interleaved round by round (so that a change in
    the machine's load hits all of them alike), for about ``seconds`` in all: at least 7 rounds."""
    for fn in fns:
        fn()
        fn()
    start = time.perf_counter()
    for fn in fns:
        fn()
    once = (time.perf_counter() - start) / len(fns)
    rounds = max(7, min(300, int(seconds / max(once * len(fns), 1e-6))))
    times: list[list[float]] = [[] for _ in fns]
    for _ in range(rounds):
        for k, fn in enumerate(fns):
            t = time.perf_counter()
            fn()
            times[k].append((time.perf_counter() - t) * 1000)
    return [statistics.median(t) for t in times]


def choose(trials: list[Trial]) -> Trial:
    """The fastest trial that matched eager (ties: the earlier candidate); marks it kept."""
    good = [t for t in trials if t.error is None and t.ms is not None]
    if not good:
        reasons = "; ".join(f"candidate {t.candidate} {t.options}: {t.error}" for t in trials)
        raise CheckError(f"variant {trials[0].variant}: no tuning candidate compiled and matched eager ({reasons})")
    best = min(good, key=lambda t: (t.ms, t.candidate))
    best.kept = True
    return best


def describe(trials: list[Trial]) -> str:
    """One line per variant for the build's output: each candidate's time, the winner marked."""
    parts = []
    for t in trials:
        label = ",".join(f"{k}={v}" for k, v in t.options.items()) or "defaults"
        if t.error is not None:
            parts.append(f"{label}: failed")
        else:
            parts.append(f"{'*' if t.kept else ''}{label}: {t.ms:.3f} ms")
    return f"{trials[0].variant}: " + "  ".join(parts)


def open_candidate(pkg: CompiledPackage, device: str) -> Callable[..., Any]:
    """A callable running one compiled package on its own constants (kept alive by the closure)."""
    from loader.model import open_package

    runner = open_package(str(pkg.path), device_index=0 if device == "cuda" else None)
    constants = {name: t.to(device) for name, t in pkg.constants.items()}
    if not pkg.embedded:
        runner.load_constants(constants, False, True, True)

    def run(*args: torch.Tensor) -> list[torch.Tensor]:
        keep = constants  # noqa: F841  (the runner reads these tensors in place)
        return runner.run(list(args))

    return run


def tune_variants(
    loaded: LoadedProfile,
    model: torch.nn.Module,
    variants: list[VariantPlan],
    compiled: dict[tuple[str, int], tuple[VariantPlan, CompiledPackage, float]],
    failed: dict[tuple[str, int], str],
    candidates: list[dict[str, Any]],
    distribution: dict[tuple[int, ...], int],
) -> tuple[list[tuple[VariantPlan, CompiledPackage]], list[Trial]]:
    """Time every compiled candidate of every variant on its serving shapes; keep the fastest that
    matches eager under the variant's own file name and delete the others."""
    profile = loaded.profile
    dims = tuple(profile.dims)
    packages, trials = [], []
    for vp in variants:
        shapes = serving_shapes(vp, distribution, dims)
        mine = []
        for k, options in enumerate(candidates):
            trial = Trial(vp.id, k, options)
            if (vp.id, k) in compiled:
                _, pkg, seconds = compiled[(vp.id, k)]
                trial.compile_s = seconds
                try:
                    run = open_candidate(pkg, vp.device)
                    trial.ms, trial.max_abs_error = measure(run, model, profile, vp, shapes)
                except (CheckError, RuntimeError) as e:
                    trial.error = str(e)[:2000]
            else:
                trial.error = failed.get((vp.id, k), "not compiled")
            mine.append(trial)
        best = choose(mine)
        chosen_vp, pkg, _ = compiled[(vp.id, best.candidate)]
        final = pkg.path.with_name(f"{vp.id}{C.VARIANT_SUFFIX}")
        for k in range(len(candidates)):
            if (vp.id, k) in compiled and k != best.candidate:
                compiled[(vp.id, k)][1].path.unlink()
        pkg.path.replace(final)
        packages.append((chosen_vp, replace(pkg, path=final)))
        trials += mine
    return packages, trials

