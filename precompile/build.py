"""The build pipeline: profile → resolve → export → compile → check → write.

Each stage is a plain function in its own module; ``build`` runs them in order and reports each one
to a Progress. The artifact is assembled in a staging folder and only published once it has been
loaded through the real loader and matched eager on every check shape.
"""

from __future__ import annotations

import datetime
import platform
import shutil
from dataclasses import dataclass, replace
from pathlib import Path

import torch

import loader
from loader import constants as C
from loader.host import cpu_capability
from loader.manifest import DimRange, InputSpec, Manifest, Target, Variant, parse_manifest

from . import __version__
from .check import CheckReport, compare, output_spec, run_eager
from .compile import CompiledPackage, compile_package
from .errors import CompileError, PrecompileError
from .export import export_hints, export_model
from .plan import VariantPlan, default_plan
from .profile import LoadedProfile, load_profile
from .progress import Progress
from .resolve import resolve_model
from .samples import check_shapes, make_inputs
from .write import file_entries, publish, staging_folder, write_manifest, write_weights


@dataclass
class BuildResult:
    path: Path
    manifest: Manifest
    check: CheckReport


def build(
    profile_path: str | Path,
    output: str | Path | None = None,
    *,
    progress: Progress | None = None,
    version: int = 1,
    expires: str | None = None,
) -> BuildResult:
    """Build the artifact a profile describes; return where it is and what was checked.

    ``output`` defaults to ``artifacts/<name>``. ``version`` (increasing per release of a name) and
    ``expires`` (ISO 8601 with a time zone) go into the manifest for the loader's rollback and
    expiry checks. Raises a PrecompileError subclass for anything the
    user can fix; on any failure nothing is left at ``output`` but what was there before.
    """
    progress = progress or Progress()
    _check_expires(expires)
    with progress.stage("profile", str(profile_path)):
        loaded = load_profile(profile_path)
    profile = loaded.profile
    target = Path(output) if output is not None else Path("artifacts") / profile.name
    with progress.stage("resolve", profile.model.factory):
        model = resolve_model(loaded)
        eager_out = run_eager(model, make_inputs(profile, default_plan(profile)[0].hint, seed=profile.check.seed))
        out_spec = output_spec(eager_out)
    plan = default_plan(profile)
    staging = staging_folder(target)
    try:
        packages: list[tuple[VariantPlan, CompiledPackage]] = []
        (staging / C.VARIANTS_DIR).mkdir()
        for vp in plan:
            hint = export_hints(vp.ranges, vp.hint)
            with progress.stage("export", f"{vp.id} {_describe(vp.ranges)}"):
                ep = export_model(model, profile, vp.ranges, hint)
            with progress.stage("compile", vp.id):
                pkg = compile_package(
                    ep, staging / C.VARIANTS_DIR / f"{vp.id}{C.VARIANT_SUFFIX}", dict(profile.compile.inductor)
                )
            packages.append((VariantPlan(vp.id, vp.kind, vp.ranges, hint), pkg))
        with progress.stage("write", str(target)):
            manifest = _assemble(loaded, staging, packages, out_spec)
        with progress.stage("check", "compiled vs eager"):
            report = check_artifact(loaded, model, staging, plan)
        manifest = replace(
            manifest,
            check={"shapes": report.shapes, "max_abs_error": report.max_abs_error},
            version=version,
            expires=expires,
        )
        parse_manifest(manifest.to_json())  # the loader must accept what we write
        write_manifest(staging, manifest.to_json())
        publish(staging, target)
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    progress.note(f"{target}: {len(plan)} variant(s), {report.shapes} shapes checked, max abs error {report.max_abs_error:.2e}")
    return BuildResult(target, manifest, report)


def _assemble(
    loaded: LoadedProfile, staging: Path, packages: list[tuple[VariantPlan, CompiledPackage]], out_spec
) -> Manifest:
    profile = loaded.profile
    constants: dict[str, torch.Tensor] = {}
    for vp, pkg in packages:
        for name, tensor in pkg.constants.items():
            seen = constants.get(name)
            if seen is None:
                constants[name] = tensor
            elif seen.shape != tensor.shape or seen.dtype != tensor.dtype or not torch.equal(seen, tensor):
                raise CompileError(f"variant {vp.id}: constant {name!r} differs from another variant's")
    const_specs = write_weights(staging, constants)
    metadata = packages[0][1].metadata
    manifest = Manifest(
        name=profile.name,
        torch_version=torch.__version__,
        precompile_version=__version__,
        created=datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        target=Target(
            device=profile.target,
            cpu_capability=cpu_capability(),
            aoti_cpu_isa=metadata.get("AOTI_CPU_ISA", ""),
            platform=platform.system().lower(),
            machine=platform.machine(),
        ),
        inputs=tuple(InputSpec(name, spec.dtype, tuple(spec.shape)) for name, spec in profile.inputs.items()),
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
            )
            for vp, pkg in packages
        ),
        constants=const_specs,
        files=file_entries(staging),
    )
    write_manifest(staging, manifest.to_json())
    return manifest


def check_artifact(loaded: LoadedProfile, model: torch.nn.Module, folder: Path, plan: list[VariantPlan]) -> CheckReport:
    """Load ``folder`` with the real loader and compare every variant with eager on its check shapes."""
    profile = loaded.profile
    compiled = loader.load(folder)
    report = CheckReport()
    seed = profile.check.seed
    for vp in plan:
        for i, sizes in enumerate(check_shapes(profile, vp.ranges, profile.check.random_shapes, seed)):
            args = make_inputs(profile, sizes, seed=seed + i)
            want = run_eager(model, args)
            got = compiled.run_variant(vp.id, *args)
            compare(profile, want, got, sizes, vp.id, report)
    return report


def _check_expires(expires: str | None) -> None:
    if expires is None:
        return
    try:
        moment = datetime.datetime.fromisoformat(expires)
    except ValueError:
        raise PrecompileError(f"--expires: {expires!r} is not an ISO 8601 date-time") from None
    if moment.tzinfo is None:
        raise PrecompileError(f"--expires: {expires!r} needs a time zone, e.g. {expires}+00:00")


def _describe(ranges: dict[str, tuple[int, int]]) -> str:
    return " ".join(f"{d}={lo}" if lo == hi else f"{d}∈[{lo},{hi}]" for d, (lo, hi) in ranges.items())
