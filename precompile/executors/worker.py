"""One unit of compile work, wherever it runs: export the variant (``stages.export``, or
``stages.quantize`` for a lower precision), read the tables its integer inputs index and refuse a
declared range past one (the profile's error, before compiling), then compile it (``stages.compile``).

The executors call ``compile_unit`` in this process, or ``compile_in_worker`` in a fresh one (which
resolves the model itself).
"""

from __future__ import annotations

import faulthandler
import os
import time
from collections.abc import Callable, Sequence
from dataclasses import replace
from pathlib import Path

import torch

from loader import constants as C
from loader.threads import cpu_allowance

from ..analysis.value_ranges import check_declared_ranges, index_tables
from ..calibration import Sample, calibration_inputs
from ..errors import PrecompileError, ProfileError
from ..profile import LoadedProfile
from ..quiet import quiet_third_party_warnings
from ..stages.compile import compile_package
from ..stages.export import export_variant
from ..stages.quantize import quantize
from ..stages.resolve import resolve_model
from ..tracing import export_hints
from ..traffic import read_distribution
from ..units import CompiledUnit, CompileTask, UnitResult


def compile_unit(
    loaded: LoadedProfile,
    model: torch.nn.Module,
    task: CompileTask,
    staging: Path,
    *,
    calibration: Callable[[], Sequence[Sample]] | None = None,
) -> UnitResult:
    """Export and compile ``task`` into ``staging/variants/<task.file>``. ``calibration`` gives the
    calibration samples when a static int8 unit needs them (default: read from the profile)."""
    vp = task.vp
    start = time.perf_counter()
    hint = export_hints(vp.ranges, vp.hint)
    try:
        if vp.precision == "fp32":
            ep = export_variant(model, loaded.profile, vp, hint)
        else:
            samples = (
                calibration() if calibration is not None else calibration_inputs(loaded, read_distribution(loaded))
            )
            ep = quantize(model, loaded.profile, vp, hint, samples)
        tables = index_tables(ep, loaded.profile)
        check_declared_ranges(loaded, tables)  # a range past a table is the profile's error: before compiling
        pkg = compile_package(
            ep,
            staging / C.VARIANTS_DIR / task.file,
            task.options,
            device=vp.device,
            multi_arch=loaded.profile.cuda.multi_arch,
            shapes=[list(spec.shape) for spec in loaded.profile.inputs.values()],
            isa=vp.isa,
            cache=task.cache,
        )
    except PrecompileError as e:
        if isinstance(e, ProfileError):
            raise
        raise type(e)(f"variant {vp.id} ({vp.describe()}): {e}") from None
    unit = CompiledUnit(replace(vp, hint=hint), pkg, time.perf_counter() - start, task.candidate)
    return UnitResult(unit, tables)


def compile_in_worker(loaded: LoadedProfile, task: CompileTask, staging: Path, compile_threads: int) -> UnitResult:
    """``compile_unit`` in a fresh process: resolves the model there (from the profile's factory, or
    the exported program's file)."""
    import torch._inductor.config as inductor_config  # about 1 s: only where a worker compiles

    faulthandler.enable()  # a worker killed by SIGSEGV/SIGABRT prints where it was
    quiet_third_party_warnings()
    # jobs workers each with a pool of one process per core would be cores² processes.
    inductor_config.compile_threads = compile_threads
    return compile_unit(loaded, resolve_model(loaded), task, staging)


def default_jobs(tasks: int) -> int:
    """Packages to compile at once: one per CPU this process gets, at most one per 3 GiB of available
    memory (an export and an AOTInductor compile of a large model each take a few GiB), at least 1."""
    jobs = cpu_allowance().cpus
    try:
        available = os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
        jobs = min(jobs, max(1, available // (3 << 30)))
    except (ValueError, OSError, AttributeError):
        pass
    return max(1, min(jobs, tasks))


def worker_died(task: CompileTask, jobs: int) -> str:
    retry = f"retry with --jobs {jobs // 2}, and with --jobs 1" if jobs > 2 else "retry with --jobs 1"
    return (
        f"variant {task.vp.id} ({task.vp.describe()}): its compile worker process died without an error "
        f"(killed by a signal: most often the out-of-memory killer, else a crash in torch or the compiler; "
        f"any traceback it printed is above). {jobs} packages compiled at once: {retry} to see the failure "
        "without other compiles beside it"
    )
