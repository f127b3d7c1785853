"""The build pipeline: profile → plan → resolve → export + compile (per variant) → check → write.

Each stage is a plain function in its own module; ``build`` runs them in order and reports each one
to a Progress. Variants are exported and compiled in parallel worker processes. The artifact is
assembled in a staging folder and only published once it has been loaded through the real loader and
every variant matched eager on its own shapes.
"""

from __future__ import annotations

import copy
import datetime
import os
import platform
import shutil
import time
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import save_file

import loader
from loader import constants as C
from loader.host import cpu_capability
from loader.guards import TORCH_DTYPES
from loader.manifest import CheckRecord, CudaInfo, DimRange, Manifest, OutputSpec, Target, Variant, expires_problem, parse_manifest
from loader.outputs import flatten

from . import __version__, native_check
from .batching import check_batching
from .check import CheckReport, check_policies, check_policy_outputs, compare, output_spec, run_eager
from .compile import CompiledPackage, compile_package
from .cuda_targets import with_kernel_targets
from .errors import CompileError, ModelError, PrecompileError, ProfileError
from .executors import CompileJob, Executor
from .executors.local import LocalExecutor
from .export import export_hints
from .plan import Plan, VariantPlan, make_plan, read_distribution
from .precision import (
    PRECISION_OPTIONS,
    GateResult,
    base_id,
    calibration_inputs,
    expand_precisions,
    export_variant,
    gate_precisions,
    needed_features,
    quiet_third_party_warnings,
)
from .profile import LoadedProfile, Profile, load_profile
from .progress import Progress
from .resolve import resolve_model
from .samples import check_shapes, make_inputs, to_device
from .tune import Trial, describe, time_calls, tune_variants
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


@dataclass
class Prepared:
    """What every build stage after ``prepare`` works from: the checked profile and its plan, the
    variants to compile, the model and what its eager outputs look like."""

    loaded: LoadedProfile
    plan: Plan
    devices: tuple[str, ...]
    cuda: CudaInfo | None
    variants: list[VariantPlan]
    model: torch.nn.Module
    out_spec: OutputSpec
    output_dims: Any
    batching: Any
    candidates: list[dict[str, Any]]

    def tasks(self) -> list[CompileTask]:
        """Every unit of compile work: a variant (per target and precision) under one option set."""
        return compile_tasks(self.variants, self.candidates)


def build(
    profile_path: str | Path,
    output: str | Path | None = None,
    *,
    progress: Progress | None = None,
    version: int = 1,
    expires: str | None = None,
    jobs: int | None = None,
    executor: Executor | None = None,
    shard: tuple[int, int] | None = None,
) -> BuildResult:
    """Build the artifact a profile describes; return where it is, its plan and what was checked.

    ``output`` defaults to ``artifacts/<name>``. ``version`` (increasing per release of a name) and
    ``expires`` (ISO 8601 with a time zone) go into the manifest for the loader's rollback and
    expiry checks. ``jobs`` variants compile at once (default: one per core); ``executor`` runs them
    elsewhere (precompile.executors: ``executor_named("ray", address=...)``). ``shard=(k, n)``
    compiles only the k-th of n shares of the units into a part for ``precompile.shard.assemble``
    (``output`` defaults to ``artifacts/<name>.part-k-of-n``). Raises a PrecompileError subclass for
    anything the user can fix; on any failure nothing is left at ``output`` but what was there before.
    """
    progress = progress or Progress()
    _check_expires(expires)
    prepared = prepare(profile_path, progress)
    profile = prepared.loaded.profile
    if shard is not None:
        from .shard import build_part

        return build_part(prepared, shard, output, jobs=jobs, executor=executor, progress=progress)
    target = Path(output) if output is not None else Path("artifacts") / profile.name
    staging = staging_folder(target)
    try:
        (staging / C.VARIANTS_DIR).mkdir()
        budget = profile.compile.tune.max_seconds if profile.compile.tune is not None else None
        compiled, tables, failed = compile_variants(
            prepared.loaded, prepared.model, prepared.tasks(), staging, jobs=jobs, progress=progress, max_seconds=budget, executor=executor
        )
        return finish(prepared, compiled, tables, failed, staging, target, progress=progress, version=version, expires=expires)
    finally:
        shutil.rmtree(staging, ignore_errors=True)


def prepare(profile_path: str | Path, progress: Progress) -> Prepared:
    """Stages profile and resolve: parse and plan, the variants per target and precision, the model
    run once in eager, and every check of the profile that needs no compiling."""
    quiet_third_party_warnings()
    with progress.stage("profile", str(profile_path)):
        loaded = load_profile(profile_path)
        profile = loaded.profile
        plan = make_plan(loaded)
    devices = usable_targets(profile, progress)
    cuda = cuda_info(profile) if "cuda" in devices else None
    variants = expand_precisions(expand_targets(plan, devices, profile), profile)
    with progress.stage("resolve", profile.model.factory):
        model = resolve_model(loaded)
        args = make_inputs(profile, plan.variants[-1].hint, seed=profile.check.seed)
        try:
            eager_out = run_eager(model, args, profile=profile, sizes=plan.variants[-1].hint)
        except ModelError as e:
            explain_eager_failure(loaded, model, plan.variants[-1].hint, e)  # a range past a table, if that is why
            raise
        out_spec = output_spec(eager_out)
        output_dims = _output_dims(loaded, flatten(eager_out), plan.variants[-1].hint)
        check_policy_outputs(loaded)
        if any(vp.precision != "fp32" for vp in variants):
            calibration_inputs(loaded)  # a bad calibration file is the profile's error: before compiling
        batching = check_batching(loaded, model)  # the batching: claim against eager, before anything compiles
    return Prepared(loaded, plan, devices, cuda, variants, model, out_spec, output_dims, batching, profile.compile.candidates())


def finish(
    prepared: Prepared,
    compiled: dict[tuple[str, int], tuple[VariantPlan, CompiledPackage, float]],
    tables: dict[str, IndexTable],
    failed: dict[tuple[str, int], str],
    staging: Path,
    target: Path,
    *,
    progress: Progress,
    version: int = 1,
    expires: str | None = None,
) -> BuildResult:
    """Everything after compiling, on the packages in ``staging``: value ranges from the index tables,
    tuning, the precision gate, the manifest, the checks against eager, static measurements,
    references; then publish ``staging`` at ``target``."""
    loaded, model, plan, variants, candidates = prepared.loaded, prepared.model, prepared.plan, prepared.variants, prepared.candidates
    devices, cuda, out_spec, output_dims = prepared.devices, prepared.cuda, prepared.out_spec, prepared.output_dims
    loaded, notes = with_value_ranges(loaded, tables)
    profile = loaded.profile
    for level, text in notes:
        progress.note(f"[yellow]warning[/]: {text}" if level == "warning" else text)
    trials: list[Trial] = []
    fp32 = [vp for vp in variants if vp.precision == "fp32"]
    if len(candidates) > 1:
        with progress.stage("tune", f"{len(candidates)} option sets per variant, timed on its traffic"):
            packages, trials = tune_variants(loaded, model, fp32, compiled, failed, candidates, read_distribution(loaded))
        for vp in fp32:
            progress.note(describe([t for t in trials if t.variant == vp.id]))
    else:
        packages = [compiled[(vp.id, 0)][:2] for vp in fp32]
    kept = {t.variant: t.candidate for t in trials if t.kept}
    seconds = {vp.id: compiled[(vp.id, kept.get(vp.id, 0))][2] for vp in variants}
    gates: list[GateResult] = []
    lower = [vp for vp in variants if vp.precision != "fp32"]
    if lower:
        packages += [compiled[(vp.id, 0)][:2] for vp in lower]
        with progress.stage("gate", f"{len(lower)} bf16/int8 variant(s): accuracy against fp32 eager, speed against fp32"):
            packages, gates = gate_precisions(loaded, model, packages, read_distribution(loaded))
        for g in gates:
            progress.note(g.describe() if g.kept else f"[yellow]{g.describe()}[/]")
    cuda = with_kernel_targets(cuda, [pkg.path for vp, pkg in packages if vp.device == "cuda"])
    with progress.stage("write", str(target)):
        manifest = _assemble(loaded, staging, packages, out_spec, output_dims, cuda, gates)
    with progress.stage("check", "compiled vs eager, every variant"):
        report = check_artifact(loaded, model, staging, [vp for vp, _ in packages if vp.precision == "fp32"])
        check_policies(loaded, model, staging, report)
    measured: list[dict[str, Any]] = []
    if profile.plan.measure and any(v.kind == "static" for v in variants):
        with progress.stage("measure", f"static variants must be ≥ {profile.plan.min_speedup}× faster"):
            for device in devices:
                measured += measure_statics(loader.load(staging, device=device, precision="fp32"), profile)
        dropped = {m["variant"] for m in measured if not m["kept"]}
        dropped |= {vp.id for vp, _ in packages if vp.precision != "fp32" and base_id(vp) in dropped}  # their twins too
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
            manifest = _assemble(loaded, staging, packages, out_spec, output_dims, cuda, gates)
    with progress.stage("write", "references and manifest"):
        references = write_references(loaded, model, staging, [vp for vp, _ in packages])
        manifest = replace(
            manifest,
            files=file_entries(staging),
            check=CheckRecord.from_dict({
                "shapes": report.shapes,
                "max_abs_error": report.max_abs_error,
                "references": references,
                "measure": measured,
                "plan": plan.to_dict()["traffic"],
                **({"tuning": [t.to_dict() for t in trials]} if trials else {}),
                **({"precision": [dict(variant=g.variant, **g.to_dict()) for g in gates]} if gates else {}),
            }),
            version=version,
            expires=expires,
            batching=prepared.batching,
        )
        parse_manifest(manifest.to_json())  # the loader must accept what we write
        write_manifest(staging, manifest.to_json())
        publish(staging, target)
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


@dataclass(frozen=True)
class CompileTask:
    """One package to compile: a variant under one candidate set of Inductor options."""

    vp: VariantPlan
    candidate: int
    options: dict[str, Any]
    file: str  # name inside the staging folder's variants/

    def label(self, tuning: bool) -> str:
        return f"{self.vp.id} {self.vp.describe()}" + (f" [candidate {self.candidate}]" if tuning else "")


def compile_tasks(variants: list[VariantPlan], candidates: list[dict[str, Any]]) -> list[CompileTask]:
    """Every variant under every candidate; every variant's first candidate comes first, so a time
    budget that cuts the list short still leaves one package per variant."""
    tuning = len(candidates) > 1
    tasks = []
    for k, options in enumerate(candidates):
        for vp in variants:
            if vp.precision != "fp32":  # one option set: the first candidate's, with freezing (precompile.precision)
                if k == 0:
                    tasks.append(CompileTask(vp, 0, {**DEFAULT_INDUCTOR_OPTIONS, **options, **PRECISION_OPTIONS}, f"{vp.id}{C.VARIANT_SUFFIX}"))
                continue
            name = f"{vp.id}.c{k}{C.VARIANT_SUFFIX}" if tuning else f"{vp.id}{C.VARIANT_SUFFIX}"
            tasks.append(CompileTask(vp, k, {**DEFAULT_INDUCTOR_OPTIONS, **options}, name))
    return tasks


# Inductor options every build starts from (a profile's compile.inductor overrides them).
DEFAULT_INDUCTOR_OPTIONS: dict[str, Any] = {
    # Parallel loops and reductions sized by the serving process's thread count (omp_get_max_threads)
    # instead of the build host's: an artifact built on a 64-core runner and served on 2 cores
    # (or the reverse) neither oversubscribes nor idles.
    "cpp.dynamic_threads": True,
}


def compile_variants(
    loaded: LoadedProfile,
    model: torch.nn.Module,
    tasks: list[CompileTask],
    staging: Path,
    *,
    jobs: int | None,
    progress: Progress,
    max_seconds: float | None = None,
    executor: Executor | None = None,
) -> tuple[dict[tuple[str, int], tuple[VariantPlan, CompiledPackage, float]], dict[str, IndexTable], dict[tuple[str, int], str]]:
    """Export and compile every task through ``executor`` (default: on this host, ``jobs`` at a time,
    each in its own process; see precompile.executors).

    Returns the packages by (variant id, candidate), the tables integer inputs index (from the
    exported graphs: precompile.values), and why each candidate that did not compile failed. A
    variant's first candidate failing fails the build; a later one failing is only recorded, and
    later candidates still pending after ``max_seconds`` are not compiled.
    """
    tuning = any(t.candidate for t in tasks)
    results: dict[tuple[str, int], tuple[VariantPlan, CompiledPackage, float]] = {}
    tables: dict[str, IndexTable] = {}  # per input, the smallest table any variant's graph indexes
    failed: dict[tuple[str, int], str] = {}
    start = time.perf_counter()

    def admitted():
        """The tasks, as the executor has room for them; candidates past the budget are skipped."""
        for task in tasks:
            if task.candidate and max_seconds is not None and time.perf_counter() - start > max_seconds:
                failed[(task.vp.id, task.candidate)] = f"not compiled: compile.tune.max_seconds ({max_seconds:g} s) reached"
                continue
            yield task

    job = CompileJob(loaded, model, staging, jobs, len(tasks), tuning, progress)
    outcomes = (executor or LocalExecutor()).run(job, admitted())
    try:
        for outcome in outcomes:
            task, error = outcome.task, outcome.error
            label = task.label(tuning) + (f" on {outcome.where}" if outcome.where else "")
            if error is None:
                *package, found = outcome.result
                results[(task.vp.id, task.candidate)] = tuple(package)
                for name, table in found.items():
                    if name not in tables or table.rows < tables[name].rows:
                        tables[name] = table
                progress.done("variant", label, package[2])
                continue
            progress.failed("variant", label, 0.0)
            if task.candidate == 0 or isinstance(error, ProfileError):
                raise error
            failed[(task.vp.id, task.candidate)] = f"{type(error).__name__}: {error}"[:2000]
    finally:
        outcomes.close()  # a failure: the executor cancels what still runs
    return results, tables, failed


def default_jobs(tasks: int) -> int:
    """Packages to compile at once: one per CPU this process gets, at most one per 3 GiB of available
    memory (an export and an AOTInductor compile of a large model each take a few GiB), at least 1."""
    from loader.threads import cpu_allowance

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


def _compile_one(
    loaded: LoadedProfile, model: torch.nn.Module, task: CompileTask, staging: Path
) -> tuple[VariantPlan, CompiledPackage, float, dict[str, IndexTable]]:
    vp = task.vp
    start = time.perf_counter()
    hint = export_hints(vp.ranges, vp.hint)
    if vp.device != "cpu":  # a copy, so the CPU model stays the reference for the checks
        cast = TORCH_DTYPES[vp.dtype] if vp.dtype is not None else None
        model = copy.deepcopy(model).to(device=vp.device, dtype=cast)
    try:
        ep = export_variant(model, loaded, vp, hint)
        tables = index_tables(ep, loaded.profile)
        check_declared_ranges(loaded, tables)  # a range past a table is the profile's error: before compiling
        pkg = compile_package(
            ep,
            staging / C.VARIANTS_DIR / task.file,
            task.options,
            device=vp.device,
            multi_arch=loaded.profile.cuda.multi_arch,
            shapes=[list(spec.shape) for spec in loaded.profile.inputs.values()],
        )
    except PrecompileError as e:
        if isinstance(e, ProfileError):
            raise
        raise type(e)(f"variant {vp.id} ({vp.describe()}): {e}") from None
    return replace(vp, hint=hint), pkg, time.perf_counter() - start, tables


def _compile_in_worker(
    profile_path: Path, task: CompileTask, staging: Path, compile_threads: int
) -> tuple[VariantPlan, CompiledPackage, float, dict[str, IndexTable]]:
    import faulthandler

    import torch._inductor.config as inductor_config

    faulthandler.enable()  # a worker killed by SIGSEGV/SIGABRT prints where it was
    quiet_third_party_warnings()
    # jobs workers each with a pool of one process per core would be cores² processes.
    inductor_config.compile_threads = compile_threads
    loaded = load_profile(profile_path)
    return _compile_one(loaded, resolve_model(loaded), task, staging)


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
    gates: list[GateResult] = (),
) -> Manifest:
    profile = loaded.profile
    measured = {g.variant: g for g in gates}
    constants: dict[str, torch.Tensor] = {}
    prefixes: dict[str, str] = {}
    for vp, pkg in packages:
        # Variants share a stored tensor when theirs is identical; a CUDA variant in another dtype, or
        # one compiled with other options (frozen, differently laid-out constants), gets its own
        # copies under a prefix.
        def clashes(prefix: str) -> bool:
            return any(prefix + n in constants and not _same(constants[prefix + n], t) for n, t in pkg.constants.items())

        prefix = next(p for p in ("", f"{vp.device}.{vp.dtype or 'native'}/", f"{vp.id}/") if not clashes(p))
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
                embedded_constants=pkg.embedded,
                precision=vp.precision,
                cpu_features=needed_features(vp.precision) if vp.precision != "fp32" else (),
                gate=measured[vp.id].to_dict() if vp.id in measured else None,
                needs_torch=native_check.needs_torch(pkg.path, vp.device),
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
        entry = {
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
        if vp.precision != "fp32":  # compared by the accuracy gate's rule, not by a tolerance
            entry["accuracy"] = [
                {"metric": profile.accuracy.rule(i).metric, "threshold": profile.accuracy.rule(i).threshold}
                if t.is_floating_point()
                else {"metric": "equal", "threshold": 1.0}
                for i, t in enumerate(outs)
            ]
        entries.append(entry)
    save_file(tensors, str(folder / REFERENCES_FILE))
    return entries


# --- measuring static variants -------------------------------------------------------------------


def measure_statics(compiled: loader.CompiledModel, profile: Profile, seconds: float = 0.5) -> list[dict[str, Any]]:
    """Time each static variant against the dynamic variant that would serve its shape otherwise,
    calls interleaved (``tune.time_calls``)."""
    out = []
    mine = [v for v in compiled.variants if v.device == compiled.device_type and v.precision == "fp32"]
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
        static_ms, dynamic_ms = time_calls(
            lambda: (compiled.run_variant(v.id, *args), sync()),
            lambda: (compiled.run_variant(fallback.id, *args), sync()),
            seconds=seconds,
        )
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


def _check_expires(expires: str | None) -> None:
    problem = expires_problem(expires) if expires is not None else None
    if problem is not None:
        raise PrecompileError(f"--expires: {problem}")
