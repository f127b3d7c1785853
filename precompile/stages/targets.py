"""Stage targets: the variants to compile per target device and precision, and the units of compile
work they make (a variant under one option candidate).

AOTInductor cannot cross-compile CUDA code (pytorch/pytorch#153697): without a GPU, CUDA targets are
skipped, or refused if they are all. CUDA variants are named ``cuda-<id>``; a CPU variant compiled for
an x86-64 level of ``cpu.isa`` ``<id>-v3`` (``native`` keeps ``<id>``); a lower-precision copy of a CPU
variant ``<precision>-<id>``.

    devices = usable_targets(profile, progress)
    variants = expand_precisions(expand_targets(plan, devices, profile), profile)
    tasks = compile_tasks(variants, profile.compile.candidates())
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import replace
from typing import Any

import torch

from loader.host import cpu_features
from loader.isa import NATIVE
from loader.manifest import CudaInfo

from ..cpu_isa import build_host_problem
from ..errors import PrecompileError
from ..options import same_as_earlier, unit_options
from ..profile import Profile
from ..progress import Progress
from ..units import CompileTask, Plan, VariantPlan, isa_suffix, package_file


def usable_targets(profile: Profile, progress: Progress) -> tuple[str, ...]:
    """The profile's devices this host can build for. AOTInductor cannot cross-compile CUDA code
    (pytorch/pytorch#153697): without a GPU, CUDA targets are skipped, or refused if they are all.
    Every x86-64 level of ``cpu.isa`` must run here: the build runs every variant against eager."""
    devices = profile.targets
    if "cpu" in devices:
        here = cpu_features()
        problems = [
            f"cpu.isa[{i}]: {problem}"
            for i, isa in enumerate(profile.cpu.isa)
            if (problem := build_host_problem(isa, here)) is not None
        ]
        if problems:
            raise PrecompileError("; ".join(problems))
    if "cuda" in devices and not torch.cuda.is_available():
        rest = tuple(d for d in devices if d != "cuda")
        reason = (
            "target cuda needs a CUDA GPU on the build host (AOTInductor compiles kernels for the GPU it "
            "runs on and cannot cross-compile them, pytorch/pytorch#153697); this host has none"
        )
        if not rest:
            raise PrecompileError(f"{reason}. Build on a GPU host, or add cpu to target: [cpu, cuda].")
        progress.note(f"[yellow]warning[/]: {reason}; building {', '.join(rest)} only")
        return rest
    return devices


def cuda_info(profile: Profile) -> CudaInfo:
    major, minor = torch.cuda.get_device_capability(0)
    capability = f"{major}.{minor}"
    name = torch.cuda.get_device_name(0)
    if profile.cuda.arch is not None and capability not in profile.cuda.arch:
        raise PrecompileError(
            f"cuda.arch: the build GPU ({name}) has compute capability {capability}, not one of "
            f"{profile.cuda.arch}; AOTInductor compiles kernels for the GPU it runs on: build on such a GPU, "
            f"or add {capability!r} to cuda.arch"
        )
    return CudaInfo(
        torch_cuda=torch.version.cuda or "",
        capability=capability,
        archs=(capability,),
        multi_arch=profile.cuda.multi_arch,
        cuda_graphs=profile.cuda.cuda_graphs,
        device_name=name,
    )


def expand_targets(plan: Plan, devices: tuple[str, ...], profile: Profile) -> list[VariantPlan]:
    """The plan's variants once per device, and on CPU once per ``cpu.isa`` entry (named <id>-v3 for
    x86-64-v3); CUDA ones are named cuda-<id> and compute in cuda.dtype."""
    out = []
    for device in devices:
        for vp in plan.variants:
            if device == "cpu":
                out += [
                    vp if isa == NATIVE else replace(vp, id=f"{vp.id}{isa_suffix(isa)}", isa=isa)
                    for isa in profile.cpu.isa
                ]
            else:
                dtype = profile.cuda.dtype if profile.cuda.dtype != "float32" else None
                out.append(replace(vp, id=f"{device}-{vp.id}", device=device, dtype=dtype))
    return out


def expand_precisions(variants: list[VariantPlan], profile: Profile) -> list[VariantPlan]:
    """The variants, then a copy of each CPU one per lower precision the profile asks for, named
    ``<precision>-<id>``."""
    out = list(variants)
    for precision in profile.precisions("cpu")[1:]:
        out += [replace(vp, id=f"{precision}-{vp.id}", precision=precision) for vp in variants if vp.device == "cpu"]
    return out


def compile_tasks(variants: Sequence[VariantPlan], candidates: Sequence[dict[str, Any]]) -> list[CompileTask]:
    """Every variant under every candidate; every variant's first candidate comes first, so a time
    budget that cuts the list short still leaves one package per variant. A lower-precision variant
    compiles once, under the first candidate (with ``options.LOWER_PRECISION``)."""
    tuning = len(candidates) > 1
    tasks = []
    for k, options in enumerate(candidates):
        for vp in variants:
            if vp.precision != "fp32":
                if k == 0:
                    tasks.append(CompileTask(vp, 0, unit_options(options, vp.precision, vp.isa), package_file(vp.id)))
                continue
            if same_as_earlier(list(candidates), k, vp.isa) is not None:
                continue  # the level's options make it an earlier candidate: tune reports it as that one
            tasks.append(
                CompileTask(vp, k, unit_options(options, isa=vp.isa), package_file(vp.id, k if tuning else None))
            )
    return tasks
