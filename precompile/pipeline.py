"""The build pipeline: one profile through its stages into one artifact.

    prepare   profile, traffic, plan, targets, resolve, batching  → BuildContext
    compile   export and compile every unit (executors)            → CompiledUnits
    finish    value ranges → tune → gate → assemble → check → measure → references → publish

Each stage is a plain function in its own module under ``precompile.stages`` with a typed result;
this module only runs them in order and reports each one to a Progress. The artifact is assembled in
a staging folder and only published once it has been loaded through the real loader and every
variant matched eager on its own shapes. ``precompile.shard`` runs the same stages split across hosts.
"""

from __future__ import annotations

import shutil
import tempfile
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Union

from torch.export import ExportedProgram

from loader import constants as C
from loader.manifest import Manifest, expires_problem

from .analysis.value_ranges import with_value_ranges
from .build_cache import cache_folder
from .calibration import Sample, gate_inputs
from .compare import CheckReport
from .context import BuildContext
from .cuda_targets import with_kernel_targets
from .errors import PrecompileError
from .executors import Executor, compile_units
from .executors.worker import compile_unit
from .profile import PROFILE_NAME, Profile, read_profile
from .progress import Progress, escape
from .quiet import quiet_third_party_warnings
from .stages.assemble import assemble_manifest, finish_manifest
from .stages.batching import check_batching
from .stages.check import Staged, check_artifact, check_policies, check_policy_outputs
from .stages.gate import GateResult, gate_precisions, wants_fallback, with_fallback
from .stages.measure import StaticTiming, dropped_variants, measure_statics
from .stages.plan import make_plan
from .stages.quantize import int8_method, sensitivity
from .stages.references import write_references
from .stages.resolve import resolve
from .stages.resolve.program import model_source
from .stages.targets import compile_tasks, cuda_info, expand_precisions, expand_targets, usable_targets
from .stages.tune import FIRST_CALL_BOUND, Trial, describe, tune_variants
from .traffic import read_distribution
from .units import CompiledUnit, CompiledUnits, Plan, VariantPlan
from .write import publish, staging_folder


@dataclass(frozen=True)
class BuildResult:
    path: Path
    manifest: Manifest
    plan: Plan
    check: CheckReport
    seconds: dict[str, float] = field(default_factory=dict)  # compile time per variant
    measured: tuple[StaticTiming, ...] = ()


ProfileSource = Union[str, Path, dict[str, Any], Profile]
ProgramSource = Union[ExportedProgram, str, Path]


def build(
    profile: ProfileSource,
    output: str | Path | None = None,
    *,
    program: ProgramSource | None = None,
    folder: str | Path | None = None,
    progress: Progress | None = None,
    version: int = 1,
    expires: str | None = None,
    jobs: int | None = None,
    executor: Executor | None = None,
    cache: str | Path | None = None,
) -> BuildResult:
    """Build the artifact a profile describes; return where it is, its plan and what was checked.

    ``profile`` is a file's path, a dict (as the YAML parses) or a ``Profile``, checked alike; a dict's
    or a Profile's model imports and weights are relative to ``folder`` (default: the current
    directory). ``program`` (an ``ExportedProgram``, or a ``.pt2`` file ``torch.export.save`` wrote)
    replaces the profile's model factory: the profile still gives the dims, ranges, traffic and checks,
    and the program must be dynamic wherever the profile is. ``output`` defaults to
    ``artifacts/<name>``. ``version`` (increasing per release of a name) and ``expires`` (ISO 8601 with
    a time zone) go into the manifest for the loader's rollback and expiry checks. ``jobs`` variants
    compile at once (default: one per core); ``executor`` runs them elsewhere (precompile.executors:
    ``executor_named("ray", address=...)``); a share of them on each of several hosts is
    ``precompile.shard.build_part``. ``cache``: the build cache's folder (``precompile.build_cache``;
    default ``$PRECOMPILE_BUILD_CACHE``, else none). Raises a PrecompileError subclass for anything the user can fix;
    on any failure nothing is left at ``output`` but what was there before.
    """
    progress = progress or Progress()
    check_expires(expires)
    cache = cache_folder(cache)
    with tempfile.TemporaryDirectory(prefix="precompile-build-") as scratch:
        ctx = prepare(profile, progress, program=program, folder=folder, scratch=Path(scratch))
        target = Path(output) if output is not None else Path("artifacts") / ctx.profile.name
        staging = staging_folder(target)
        try:
            (staging / C.VARIANTS_DIR).mkdir()
            tasks = compile_tasks(ctx.variants, ctx.candidates)
            units = compile_units(ctx, tasks, staging, jobs=jobs, progress=progress, executor=executor, cache=cache)
            return finish(ctx, units, staging, target, progress=progress, version=version, expires=expires)
        finally:
            shutil.rmtree(staging, ignore_errors=True)


def prepare(
    profile: ProfileSource,
    progress: Progress,
    *,
    program: ProgramSource | None = None,
    folder: str | Path | None = None,
    scratch: Path | None = None,
) -> BuildContext:
    """The stages before compiling: the profile, its traffic and plan, the variants per target and
    precision, the model run once in eager, and every check of the profile that needs no compiling.
    An ``ExportedProgram`` given in memory is saved under ``scratch`` for the compile workers."""
    quiet_third_party_warnings()
    with progress.stage("profile", str(profile) if isinstance(profile, (str, Path)) else PROFILE_NAME):
        loaded = read_profile(profile, folder=folder, program=program is not None)
        traffic = read_distribution(loaded)
        plan = make_plan(loaded, traffic)
    profile = loaded.profile
    devices = usable_targets(profile, progress)
    cuda = cuda_info(profile) if "cuda" in devices else None
    variants = expand_precisions(expand_targets(plan, devices, profile), profile)
    with progress.stage("resolve", model_source(loaded, program)):
        resolved = resolve(loaded, plan.variants[-1].hint, program, scratch=scratch)
        loaded = resolved.loaded  # with the program's file, for the compile workers
        check_policy_outputs(loaded)
        ctx = BuildContext(
            loaded=loaded,
            model=resolved.model,
            traffic=traffic,
            plan=plan,
            devices=devices,
            cuda=cuda,
            variants=tuple(variants),
            candidates=tuple(profile.compile.candidates()),
            output=resolved.output,
            output_dims=resolved.output_dims,
        )
        if any(vp.precision != "fp32" for vp in variants):
            ctx.calibration  # noqa: B018 (a bad calibration file is the profile's error, before compiling)
        # The batching claim against eager, before anything compiles.
        return ctx.with_batching(check_batching(loaded, resolved.model))


def finish(
    ctx: BuildContext,
    units: CompiledUnits,
    staging: Path,
    target: Path,
    *,
    progress: Progress,
    version: int = 1,
    expires: str | None = None,
) -> BuildResult:
    """The stages after compiling, on the packages in ``staging``; then publish it at ``target``."""
    ctx = _value_ranges(ctx, units, progress)
    tuned, trials = _tune(ctx, units, progress)
    lower = [units.first(vp.id) for vp in ctx.variants if vp.precision != "fp32"]
    seconds = {u.variant.id: u.seconds for u in [*tuned, *lower]}
    kept, gates = _gate(ctx, [*tuned, *lower], staging, progress)
    records = {g.variant: g.to_dict() for g in gates}
    ctx = ctx.with_cuda(with_kernel_targets(ctx.cuda, [u.package.path for u in kept if u.variant.device == "cuda"]))
    with progress.stage("write", str(target)):
        manifest = assemble_manifest(ctx, staging, kept, records)
    with progress.stage("check", "compiled vs eager, every variant"):
        staged = Staged(staging, target=manifest.target.device, lower_precisions=len(kept) > len(tuned))
        report = check_artifact(
            ctx.loaded, ctx.model, staged, [u.variant for u in kept if u.variant.precision == "fp32"]
        )
        check_policies(ctx.loaded, ctx.model, staged, report)
    measured, paying = _measure(ctx, staged, kept, progress)
    if len(paying) < len(kept):
        kept, manifest = paying, assemble_manifest(ctx, staging, paying, records)
    with progress.stage("write", "references and manifest"):
        opened = lambda vp: staged.every(vp.device, vp.isa)  # what the check stage ran, through the loader
        references = write_references(ctx.loaded, ctx.model, staging, [u.variant for u in kept], opened)
        check = _check_section(ctx, report, references, measured, trials, gates)
        manifest = finish_manifest(ctx, staging, manifest, check=check, version=version, expires=expires)
        publish(staging, target)
    for v in manifest.variants:
        if v.shim is not None:
            progress.note(f"variant {v.id}: standalone (the torch-free loader runs it without libtorch)")
        elif v.not_standalone is not None:
            progress.note(
                f"[yellow]variant {v.id}: not standalone[/]: {escape(v.not_standalone)}; it runs on torch's libraries"
            )
    progress.note(
        f"{target}: {len(manifest.variants)} variant(s), {report.shapes} shapes checked, "
        f"max abs error {report.max_abs_error:.2e}"
    )
    return BuildResult(target, manifest, ctx.plan, report, seconds, tuple(measured))


def _value_ranges(ctx: BuildContext, units: CompiledUnits, progress: Progress) -> BuildContext:
    """The integer inputs' value ranges found in the exported graphs, as the profile's from now on."""
    loaded, notes = with_value_ranges(ctx.loaded, units.tables)
    for level, text in notes:
        progress.note(f"[yellow]warning[/]: {text}" if level == "warning" else text)
    return ctx.with_profile(loaded)


def _tune(ctx: BuildContext, units: CompiledUnits, progress: Progress) -> tuple[list[CompiledUnit], tuple[Trial, ...]]:
    """Per fp32 variant, its package: the fastest candidate that matches eager when tuning, else its only one."""
    fp32 = [vp for vp in ctx.variants if vp.precision == "fp32"]
    if not ctx.tuning:
        return [units.first(vp.id) for vp in fp32], ()
    with progress.stage("tune", f"{len(ctx.candidates)} option sets per variant, timed on its traffic"):
        tune = ctx.profile.compile.tune
        bound = tune.first_call if tune is not None else FIRST_CALL_BOUND
        twins = tune is not None and tune.keeps_first_calls
        result = tune_variants(
            ctx.profile, ctx.model, fp32, units, ctx.candidates, ctx.traffic, first_call_bound=bound, first_calls=twins
        )
    for vp in fp32:
        progress.note(describe([t for t in result.trials if t.variant == vp.id]))
    return list(result.kept), result.trials


def _gate(
    ctx: BuildContext, units: list[CompiledUnit], staging: Path, progress: Progress
) -> tuple[list[CompiledUnit], tuple[GateResult, ...]]:
    """The units the precision gate keeps (every fp32 one), and its results; an int8 static unit
    failing on accuracy is built again with its most sensitive layers in fp32 (``_int8_fallback``)."""
    lower = [u for u in units if u.variant.precision != "fp32"]
    if not lower:
        return units, ()

    static = int8_method(ctx.profile, ctx.model) == "static"

    def held_out(vp: VariantPlan) -> list[Sample]:
        calibrated = vp.precision == "int8" and static
        return gate_inputs(ctx.loaded, ctx.traffic, vp.ranges, calibrated=calibrated)

    with progress.stage("gate", f"{len(lower)} bf16/int8 variant(s): accuracy against fp32 eager, speed against fp32"):
        outcome = gate_precisions(ctx.profile, ctx.model, units, ctx.traffic, held_out)
    kept = {u.variant.id: u for u in outcome.kept}
    results = []
    for g in outcome.results:
        if wants_fallback(ctx.profile, g) and static:
            progress.note(
                f"[yellow]{g.variant}: {g.accuracy_said()} (accuracy gate): int8 again, its most sensitive layers in fp32[/]"
            )
            unit, g = _int8_fallback(ctx, units, g, held_out, staging, progress)
            if unit is not None:
                kept[unit.variant.id] = unit
        results.append(g)
        progress.note(g.describe() if g.kept else f"[yellow]{g.describe()}[/]")
    return [kept[u.variant.id] for u in units if u.variant.id in kept], tuple(results)


def _int8_fallback(
    ctx: BuildContext,
    units: list[CompiledUnit],
    failed: GateResult,
    held_out: Callable[[VariantPlan], list[Sample]],
    staging: Path,
    progress: Progress,
) -> tuple[CompiledUnit | None, GateResult]:
    """A static int8 unit that failed the accuracy gate, built again with more of its layers in fp32
    (the most sensitive first, ``quantize.sensitivity``) until the gate passes or
    ``quantization.fallback`` (layers, builds) is spent: the unit kept (None: int8 dropped) and its
    gate result, whose ``fallback`` says what was kept and why."""
    by_id = {u.variant.id: u for u in units}
    unit, twin = by_id[failed.variant], by_id[failed.against]
    spec = ctx.profile.quantization
    with progress.stage("fallback", f"{unit.variant.id}: each int8 layer's share of the error, in eager"):
        ranked = sensitivity(
            ctx.model, ctx.profile, unit.variant, unit.variant.hint, ctx.calibration, prefixes=spec.fallback.layers
        )
    limit = min(spec.fallback.layers, len(ranked.layers))
    count = ranked.first_passing() or limit
    task = next(t for t in compile_tasks(ctx.variants, ctx.candidates) if t.vp.id == unit.variant.id)
    tries: list[dict[str, Any]] = []
    result, kept = failed, None
    while count and len(tries) < spec.fallback.builds:
        keep = [*spec.keep, *ranked.order[:count]]
        profile = ctx.profile.model_copy(update={"quantization": spec.model_copy(update={"keep": keep})})
        names = ", ".join(ranked.order[:count][:4]) + (", ..." if count > 4 else "")
        with progress.stage("fallback", f"{unit.variant.id}: int8 with {count} more layer(s) in fp32 ({names})"):
            built = compile_unit(
                ctx.loaded.model_copy(update={"profile": profile}),
                ctx.model,
                task,
                staging,
                calibration=lambda: ctx.calibration,
            ).unit
            outcome = gate_precisions(ctx.profile, ctx.model, [twin, built], ctx.traffic, held_out)
        (result,) = outcome.results
        tries.append({"fp32_layers": count, "accuracy": result.accuracy, "kept": result.kept})
        if result.kept or not result.reason.endswith("(accuracy gate)"):
            kept = built if result.kept else None
            break
        if count >= limit:
            break
        count = min(limit, 2 * count)
    return kept, with_fallback(failed, result, ranked.layers, ranked.error, tries, spec.fallback.model_dump())


def _measure(
    ctx: BuildContext, staged: Staged, units: list[CompiledUnit], progress: Progress
) -> tuple[list[StaticTiming], list[CompiledUnit]]:
    """With ``plan.measure``, each static variant timed against its dynamic fallback; the units that
    pay (a dropped unit's file is deleted, and its lower-precision twins' too)."""
    if not (ctx.profile.plan.measure and any(vp.kind == "static" for vp in ctx.variants)):
        return [], units
    measured: list[StaticTiming] = []
    with progress.stage("measure", f"static variants must be ≥ {ctx.profile.plan.min_speedup}× faster"):
        for device in ctx.devices:
            measured += measure_statics(staged.fp32(device), ctx.profile)
    for m in measured:
        progress.note(m.describe())
    dropped = dropped_variants(measured, [u.variant for u in units])
    for u in units:
        if u.variant.id in dropped:
            u.package.path.unlink()
    return measured, [u for u in units if u.variant.id not in dropped]


def _check_section(
    ctx: BuildContext,
    report: CheckReport,
    references: list[dict[str, Any]],
    measured: list[StaticTiming],
    trials: tuple[Trial, ...],
    gates: tuple[GateResult, ...],
) -> dict[str, Any]:
    """The manifest's ``check``: what was compared, measured, tuned and gated."""
    return {
        "shapes": report.shapes,
        "max_abs_error": report.max_abs_error,
        "references": references,
        "measure": [m.to_dict() for m in measured],
        "plan": ctx.plan.to_dict()["traffic"],
        **({"tuning": [t.to_dict() for t in trials]} if trials else {}),
        **({"precision": [dict(variant=g.variant, **g.to_dict()) for g in gates]} if gates else {}),
    }


def check_expires(expires: str | None) -> None:
    """Refuse a malformed ``--expires`` before anything is built."""
    problem = expires_problem(expires) if expires is not None else None
    if problem is not None:
        raise PrecompileError(f"--expires: {problem}")
