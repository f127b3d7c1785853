"""The build pipeline: profile → plan → resolve → export + compile (per variant) → check → write.

Each stage is a plain function in its own module; ``build`` runs them in order and reports each one
to a Progress. Variants are exported and compiled in parallel worker processes. The artifact is
assembled in a staging folder and only published once it has been loaded through the real loader and
every variant matched eager on its own shapes.
"""

from __future__ import annotations

import copy
import datetime
import multiprocessing
import os
import platform
import shutil
import statistics
import time
from concurrent.futures import FIRST_EXCEPTION, ProcessPoolExecutor, wait
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import save_file

import loader
from loader import constants as C
from loader.host import cpu_capability
from loader.guards import TORCH_DTYPES
from loader.manifest import CudaInfo, DimRange, Manifest, OutputSpec, Target, Variant, expires_problem, parse_manifest

from . import __version__
from .check import CheckReport, check_policies, check_policy_outputs, compare, flatten, output_spec, run_eager
from .compile import CompiledPackage, compile_package
from .errors import CompileError, ModelError, PrecompileError, ProfileError
from .export import export_hints, export_model
from .plan import Plan, VariantPlan, make_plan
from .profile import LoadedProfile, Profile, load_profile
from .progress import Progress
from .resolve import resolve_model
from .samples import check_shapes, make_inputs, to_device
from .values import (
    IndexTable,
    check_declared_ranges,
    explain_eager_failure,
    index_tables,
    manifest_inputs,
    with_value_ranges,
)
from .write import file_entries, publish, staging_folder, write_manifest, write_weights

REFERENCES_FILE = "references.safetensors"


@dataclass
class BuildResult:
    path: Path
    manifest: Manifest
    plan: Plan
    check: CheckReport
    seconds: dict[str, float] = field(default_factory=dict)  # compile time per variant
    measured: list[dict[str, Any]] = field(default_factory=list)


def build(
    profile_path: str | Path,
    output: str | Path | None = None,
    *,
    progress: Progress | None = None,
    version: int = 1,
    expires: str | None = None,
    jobs: int | None = None,
) -> BuildResult:
    """Build the artifact a profile describes; return where it is, its plan and what was checked.

    ``output`` defaults to ``artifacts/<name>``. ``version`` (increasing per release of a name) and
    ``expires`` (ISO 8601 with a time zone) go into the manifest for the loader's rollback and
    expiry checks. ``jobs`` variants compile at once (default: one per core). Raises a
    PrecompileError subclass for anything the user can fix; on any failure nothing is left at
    ``output`` but what was there before.
    """
    progress = progress or Progress()
    _check_expires(expires)
    with progress.stage("profile", str(profile_path)):
        loaded = load_profile(profile_path)
        profile = loaded.profile
        plan = make_plan(loaded)
    target = Path(output) if output is not None else Path("artifacts") / profile.name
    devices = usable_targets(profile, progress)
    cuda = cuda_info(profile) if "cuda" in devices else None
    variants = expand_targets(plan, devices, profile)
    with progress.stage("resolve", profile.model.factory):
        model = resolve_model(loaded)
        args = make_inputs(profile, plan.variants[-1].hint, seed=profile.check.seed)
        try:
            eager_out = run_eager(model, args)
        except ModelError:
            explain_eager_failure(loaded, model, plan.variants[-1].hint)  # a range past a table, if that is why
            raise
        out_spec = output_spec(eager_out)
        output_dims = _output_dims(loaded, flatten(eager_out), plan.variants[-1].hint)
        check_policy_outputs(loaded)
    staging = staging_folder(target)
    try:
        (staging / C.VARIANTS_DIR).mkdir()
        packages, seconds, tables = compile_variants(loaded, model, variants, staging, jobs=jobs, progress=progress)
        loaded, notes = with_value_ranges(loaded, tables)
        profile = loaded.profile
        for level, text in notes:
            progress.note(f"[yellow]warning[/]: {text}" if level == "warning" else text)
        with progress.stage("write", str(target)):
            manifest = _assemble(loaded, staging, packages, out_spec, output_dims, cuda)
        with progress.stage("check", "compiled vs eager, every variant"):
            report = check_artifact(loaded, model, staging, [vp for vp, _ in packages])
            check_policies(loaded, model, staging, report)
        measured: list[dict[str, Any]] = []
        if profile.plan.measure and any(v.kind == "static" for v in variants):
            with progress.stage("measure", f"static variants must be ≥ {profile.plan.min_speedup}× faster"):
                for device in devices:
                    measured += measure_statics(loader.load(staging, device=device), profile)
            dropped = {m["variant"] for m in measured if not m["kept"]}
            for m in measured:
                progress.note(
                    f"{m['variant']}: {m['static_ms']:.3f} ms static vs {m['dynamic_ms']:.3f} ms dynamic "
                    f"({m['speedup']:.2f}×) → {'kept' if m['kept'] else 'dropped'}"
                )
            if dropped:
                for vp, pkg in packages:
                    if vp.id in dropped:
                        pkg.path.unlink()
                packages = [(vp, pkg) for vp, pkg in packages if vp.id not in dropped]
                manifest = _assemble(loaded, staging, packages, out_spec, output_dims, cuda)
        with progress.stage("write", "references and manifest"):
            references = write_references(loaded, model, staging, [vp for vp, _ in packages])
            manifest = replace(
                manifest,
                files=file_entries(staging),
                check={
                    "shapes": report.shapes,
                    "max_abs_error": report.max_abs_error,
                    "references": references,
                    "measure": measured,
                    "plan": plan.to_dict()["traffic"],
                },
                version=version,
                expires=expires,
            )
            parse_manifest(manifest.to_json())  # the loader must accept what we write
            write_manifest(staging, manifest.to_json())
            publish(staging, target)
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    progress.note(
        f"{target}: {len(manifest.variants)} variant(s), {report.shapes} shapes checked, "
        f"max abs error {report.max_abs_error:.2e}"
    )
    return BuildResult(target, manifest, plan, report, seconds, measured)


# --- targets -----------------------------------------------------------------------------------


def usable_targets(profile: Profile, progress: Progress) -> tuple[str, ...]:
    """The profile's devices this host can build for. AOTInductor cannot cross-compile CUDA code
    (pytorch/pytorch#153697): without a GPU, CUDA targets are skipped, or refused if they are all."""
    devices = profile.targets
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
    """The plan's variants once per device; CUDA ones are named cuda-<id> and compute in cuda.dtype."""
    out = []
    for device in devices:
        for vp in plan.variants:
            if device == "cpu":
                out.append(vp)
            else:
                dtype = profile.cuda.dtype if profile.cuda.dtype != "float32" else None
                out.append(replace(vp, id=f"{device}-{vp.id}", device=device, dtype=dtype))
    return out


# --- variants ----------------------------------------------------------------------------------


def compile_variants(
    loaded: LoadedProfile,
    model: torch.nn.Module,
    variants: list[VariantPlan],
    staging: Path,
    *,
    jobs: int | None,
    progress: Progress,
) -> tuple[list[tuple[VariantPlan, CompiledPackage]], dict[str, float], dict[str, IndexTable]]:
    """Export and compile every variant, ``jobs`` at a time, each in its own process; also return the
    tables integer inputs index (from the exported graphs: precompile.values).

    One failing variant fails the build with its error; the other results are discarded.
    """
    jobs = max(1, min(jobs or os.cpu_count() or 1, len(variants)))
    options = dict(loaded.profile.compile.inductor)
    results: dict[str, tuple[VariantPlan, CompiledPackage, float, dict[str, IndexTable]]] = {}
    if jobs == 1:
        for vp in variants:
            with progress.stage("variant", f"{vp.id} {vp.describe()}"):
                results[vp.id] = _compile_one(loaded, model, vp, staging, options)
    else:
        context = multiprocessing.get_context("spawn")  # a fresh interpreter: no forked OpenMP state
        with ProcessPoolExecutor(max_workers=jobs, mp_context=context) as pool:
            futures = {pool.submit(_compile_in_worker, loaded.path, vp, staging, options): vp for vp in variants}
            pending = set(futures)
            while pending:
                done, pending = wait(pending, return_when=FIRST_EXCEPTION)
                for future in done:
                    vp = futures[future]
                    error = future.exception()
                    if error is not None:
                        for other in pending:
                            other.cancel()  # running ones finish; their output dies with the staging folder
                        progress.failed("variant", f"{vp.id} {vp.describe()}", 0.0)
                        raise error
                    results[vp.id] = future.result()
                    progress.done("variant", f"{vp.id} {vp.describe()}", results[vp.id][2])
    packages = [(results[vp.id][0], results[vp.id][1]) for vp in variants]
    tables: dict[str, IndexTable] = {}
    for *_, found in results.values():
        for name, table in found.items():
            if name not in tables or table.rows < tables[name].rows:
                tables[name] = table
    return packages, {vp.id: results[vp.id][2] for vp in variants}, tables


def _compile_one(
    loaded: LoadedProfile, model: torch.nn.Module, vp: VariantPlan, staging: Path, options: dict[str, Any]
) -> tuple[VariantPlan, CompiledPackage, float, dict[str, IndexTable]]:
    start = time.perf_counter()
    hint = export_hints(vp.ranges, vp.hint)
    if vp.device != "cpu":  # a copy, so the CPU model stays the reference for the checks
        cast = TORCH_DTYPES[vp.dtype] if vp.dtype is not None else None
        model = copy.deepcopy(model).to(device=vp.device, dtype=cast)
    try:
        ep = export_model(model, loaded.profile, vp.ranges, hint, device=vp.device, dtype=vp.dtype)
        tables = index_tables(ep, loaded.profile)
        check_declared_ranges(loaded, tables)  # a range past a table is the profile's error: before compiling
        pkg = compile_package(
            ep,
            staging / C.VARIANTS_DIR / f"{vp.id}{C.VARIANT_SUFFIX}",
            options,
            device=vp.device,
            multi_arch=loaded.profile.cuda.multi_arch,
        )
    except PrecompileError as e:
        if isinstance(e, ProfileError):
            raise
        raise type(e)(f"variant {vp.id} ({vp.describe()}): {e}") from None
    return replace(vp, hint=hint), pkg, time.perf_counter() - start, tables


def _compile_in_worker(
    profile_path: Path, vp: VariantPlan, staging: Path, options: dict[str, Any]
) -> tuple[VariantPlan, CompiledPackage, float, dict[str, IndexTable]]:
    loaded = load_profile(profile_path)
    return _compile_one(loaded, resolve_model(loaded), vp, staging, options)


# --- assembling the artifact ---------------------------------------------------------------------


def _output_dims(loaded: LoadedProfile, outputs: list[torch.Tensor], sizes: dict[str, int]):
    """The profile's ``outputs`` as per-axis dim names, checked against a real eager output."""
    profile = loaded.profile
    if profile.outputs is None:
        return None
    problems = []
    if len(profile.outputs) != len(outputs):
        problems.append(("outputs", f"declares {len(profile.outputs)} outputs, forward() returns {len(outputs)} tensors"))
    rows = []
    for i, (decl, t) in enumerate(zip(profile.outputs, outputs)):
        if len(decl.shape) != t.dim():
            problems.append((f"outputs[{i}].shape", f"has {len(decl.shape)} axes, the output has shape {tuple(t.shape)}"))
            continue
        row = []
        for axis, (s, n) in enumerate(zip(decl.shape, t.shape)):
            if isinstance(s, str) and s in profile.dims:
                if sizes[s] != n:
                    problems.append(
                        (f"outputs[{i}].shape[{axis}]", f"says it follows {s!r} ({s}={sizes[s]}) but the output's size is {n}")
                    )
                row.append(s)
            else:
                row.append(None)
        rows.append(tuple(row))
    if problems:
        raise ProfileError(str(loaded.path), problems)
    return tuple(rows)


def _assemble(
    loaded: LoadedProfile,
    staging: Path,
    packages: list[tuple[VariantPlan, CompiledPackage]],
    out_spec: OutputSpec,
    output_dims,
    cuda: CudaInfo | None = None,
) -> Manifest:
    profile = loaded.profile
    constants: dict[str, torch.Tensor] = {}
    prefixes: dict[str, str] = {}
    for vp, pkg in packages:
        # Variants share a stored tensor when theirs is identical; a CUDA variant in another dtype
        # (or with differently laid-out constants) gets its own copies under a prefix.
        prefix = ""
        if any(n in constants and not _same(constants[n], t) for n, t in pkg.constants.items()):
            prefix = f"{vp.device}.{vp.dtype or 'native'}/"
        for name, tensor in pkg.constants.items():
            seen = constants.get(prefix + name)
            if seen is None:
                constants[prefix + name] = tensor
            elif not _same(seen, tensor):
                raise CompileError(f"variant {vp.id}: constant {name!r} differs from another variant's")
        prefixes[vp.id] = prefix
    const_specs = write_weights(staging, constants)
    metadata = packages[0][1].metadata
    manifest = Manifest(
        name=profile.name,
        torch_version=torch.__version__,
        precompile_version=__version__,
        created=datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        target=Target(
            device=profile.targets[0] if profile.targets[0] in {vp.device for vp, _ in packages} else "cpu",
            cpu_capability=cpu_capability(),
            aoti_cpu_isa=metadata.get("AOTI_CPU_ISA", ""),
            platform=platform.system().lower(),
            machine=platform.machine(),
        ),
        inputs=manifest_inputs(profile),
        dims={d: DimRange(s.min, s.max) for d, s in profile.dims.items()},
        output=out_spec,
        variants=tuple(
            Variant(
                id=vp.id,
                kind=vp.kind,
                file=f"{C.VARIANTS_DIR}/{vp.id}{C.VARIANT_SUFFIX}",
                dims={d: DimRange(*r) for d, r in vp.ranges.items()},
                hint=dict(vp.hint),
                constants=tuple(sorted(pkg.constants)),
                device=vp.device,
                dtype=vp.dtype,
                constant_prefix=prefixes[vp.id],
            )
            for vp, pkg in packages
        ),
        constants=const_specs,
        files=file_entries(staging),
        policy={d: p for d, p in profile.policy.out_of_range.items() if p != "error"},
        pad_value=dict(profile.policy.pad_value),
        output_dims=output_dims,
        cuda=cuda,
    )
    write_manifest(staging, manifest.to_json())
    return manifest


def _same(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.shape == b.shape and a.dtype == b.dtype and torch.equal(a, b)


def check_artifact(loaded: LoadedProfile, model: torch.nn.Module, folder: Path, plan: list[VariantPlan]) -> CheckReport:
    """Load ``folder`` with the real loader and compare every variant with eager on its own shapes:
    a static variant on its shape, a dynamic one at its range ends and random sizes inside."""
    profile = loaded.profile
    report = CheckReport()
    seed = profile.check.seed
    for device in dict.fromkeys(vp.device for vp in plan):
        compiled = loader.load(folder, device=device)
        for vp in (vp for vp in plan if vp.device == device):
            for i, sizes in enumerate(check_shapes(profile, vp.ranges, profile.check.random_shapes, seed)):
                args = make_inputs(profile, sizes, seed=seed + i)
                want = run_eager(model, args)
                got = compiled.run_variant(vp.id, *to_device(args, device, None))
                compare(profile, want, got, sizes, vp.id, report, compute_dtype=vp.dtype)
    return report


def write_references(loaded: LoadedProfile, model: torch.nn.Module, folder: Path, plan: list[VariantPlan]) -> list[dict]:
    """A small input/output pair per variant (at its smallest shape), so a serving host can later
    check the artifact against what was built (``precompile verify --run``)."""
    profile = loaded.profile
    tensors: dict[str, torch.Tensor] = {}
    entries = []
    for vp in plan:
        sizes = {d: lo for d, (lo, _) in vp.ranges.items()}
        args = make_inputs(profile, sizes, seed=profile.check.seed + 7919)
        outs = flatten(run_eager(model, args))
        ins = [f"{vp.id}/in/{name}" for name in profile.inputs]
        outn = [f"{vp.id}/out/{i}" for i in range(len(outs))]
        tensors.update({k: t.contiguous() for k, t in zip(ins, args)})
        tensors.update({k: t.detach().contiguous() for k, t in zip(outn, outs)})
        entries.append(
            {
                "variant": vp.id,
                "dims": sizes,
                "inputs": ins,
                "outputs": outn,
                "device": vp.device,
                "tolerance": [
                    list(profile.tolerance(vp.dtype if vp.dtype and t.is_floating_point() else str(t.dtype).removeprefix("torch.")))
                    for t in outs
                ],
            }
        )
    save_file(tensors, str(folder / REFERENCES_FILE))
    return entries


# --- measuring static variants -------------------------------------------------------------------


def measure_statics(compiled: loader.CompiledModel, profile: Profile, repeats: int = 30) -> list[dict[str, Any]]:
    """Time each static variant against the dynamic variant that would serve its shape otherwise."""
    out = []
    mine = [v for v in compiled.variants if v.device == compiled.device_type]
    dynamic = [v for v in mine if v.kind == "dynamic"]
    for v in mine:
        if v.kind != "static":
            continue
        sizes = {d: r.min for d, r in v.dims.items()}
        fallback = next((d for d in dynamic if all(sizes[k] in d.dims[k] for k in sizes)), None)
        if fallback is None:
            continue
        args = to_device(make_inputs(profile, sizes, seed=profile.check.seed), v.device, None)
        sync = torch.cuda.synchronize if v.device == "cuda" else (lambda: None)
        static_ms = _median_ms(lambda: (compiled.run_variant(v.id, *args), sync()), repeats)
        dynamic_ms = _median_ms(lambda: (compiled.run_variant(fallback.id, *args), sync()), repeats)
        speedup = dynamic_ms / static_ms if static_ms > 0 else float("inf")
        out.append(
            {
                "variant": v.id,
                "dims": sizes,
                "static_ms": static_ms,
                "dynamic_ms": dynamic_ms,
                "against": fallback.id,
                "speedup": speedup,
                "kept": speedup >= profile.plan.min_speedup,
            }
        )
    return out


def _median_ms(fn, repeats: int) -> float:
    for _ in range(3):
        fn()
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append((time.perf_counter() - start) * 1000)
    return statistics.median(times)


def _check_expires(expires: str | None) -> None:
    problem = expires_problem(expires) if expires is not None else None
    if problem is not None:
        raise PrecompileError(f"--expires: {problem}")
