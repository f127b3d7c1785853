"""One way to run each thing the build compares: the model in eager, a compiled package on its own
constants, and a variant of a loaded artifact; and one way to time calls against each other.

    want = run_eager(model, args)                     # forward() under no_grad; a ModelError saying the shapes
    run = open_candidate(unit.package, "cpu")         # a callable taking the inputs, returning flat outputs
    fast, slow = time_calls(lambda: run(*args), lambda: other(*args))   # median ms, calls interleaved
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable
from typing import Any

import torch

from loader.aoti import load_constants, open_package

from .errors import ModelError
from .profile import Profile
from .units import CompiledPackage

Runner = Callable[..., list[torch.Tensor]]  # inputs in forward() order -> flat outputs
Timer = Callable[..., list[float]]  # time_calls: callables -> the median ms of each


def run_eager(
    model: torch.nn.Module, args: tuple, *, profile: Profile | None = None, sizes: dict[str, int] | None = None
) -> Any:
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
        if (
            isinstance(e, IndexError)
            and profile is not None
            and any(
                spec.dtype not in ("float16", "bfloat16", "float32", "float64", "bool")
                for spec in profile.inputs.values()
            )
        ):
            lines.append(
                "  an index past a table: either the sample values (drawn from each integer input's `range`) or a "
                "dim larger than a table the model indexes by position; `precompile doctor PROFILE` says which"
            )
        elif profile is not None and sizes:
            lines.append(
                "  `precompile doctor PROFILE` lists every size the model fixes or bounds, with its source line"
            )
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


def open_candidate(pkg: CompiledPackage, device: str) -> Runner:
    """A callable running one compiled package on its own constants (kept alive by the closure)."""
    runner = open_package(str(pkg.path), device_index=0 if device == "cuda" else None, standalone=pkg.standalone)
    constants = {name: t.to(device) for name, t in pkg.constants.items()}
    if not pkg.embedded:
        load_constants(runner, constants)

    def run(*args: torch.Tensor) -> list[torch.Tensor]:
        keep = constants  # noqa: F841  (the runner reads these tensors in place)
        return runner.run(list(args))

    return run


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


def device_sync(device: str) -> Callable[[], None]:
    """What waits for a device's queued work before a timer stops: CUDA's synchronize, else nothing."""
    return torch.cuda.synchronize if device == "cuda" else (lambda: None)
