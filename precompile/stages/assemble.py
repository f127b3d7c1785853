"""Stage assemble: the artifact's weights and manifest, from the units the build keeps.

``assemble_manifest`` stores every unit's constants once (``weights.safetensors``) and writes a
manifest of the units, which the check stage then loads through the real loader; ``finish_manifest``
adds what was learnt after (what was checked and measured, the references, the release) and has the
loader parse it before it is written: the loader must accept what the build writes.

    manifest = assemble_manifest(ctx, staging, units, gates)
    manifest = finish_manifest(ctx, staging, manifest, check={...}, version=1, expires=None)
"""

from __future__ import annotations

import datetime
import platform
from collections.abc import Sequence
from dataclasses import replace
from pathlib import Path
from typing import Any

import torch

from loader import constants as C
from loader.host import cpu_capability, cpu_features
from loader.isa import LEVELS
from loader.manifest import CheckRecord, ConstantSpec, DimRange, Manifest, Target, Variant, parse_manifest

from ..analysis.value_ranges import manifest_inputs
from ..context import BuildContext
from ..errors import CompileError
from ..native_check import needs_torch
from ..standalone import artifact_shim
from ..units import CompiledUnit
from ..version import __version__
from ..write import file_entries, write_manifest, write_weights

# CPU features (torch.cpu.get_capabilities() names) whose instructions a precision's kernels may use.
# A variant records those of the build host; a serving host lacking any of them gets fp32 instead.
PRECISION_FEATURES: dict[str, tuple[str, ...]] = {
    "bf16": ("avx512_bf16", "amx_bf16"),
    "int8": ("avx512_vnni", "avx_vnni", "amx_int8"),
}


def needed_features(precision: str, present: frozenset[str] | None = None, isa: str | None = None) -> tuple[str, ...]:
    """The features a ``precision`` variant built on this host needs where it is served; for one built
    for an x86-64 level, that level's (unfrozen, its oneDNN kernels choose their ISA at run time)."""
    if isa is not None:
        return LEVELS[isa]
    present = cpu_features() if present is None else present
    return tuple(f for f in PRECISION_FEATURES.get(precision, ()) if f in present)


def assemble_manifest(
    ctx: BuildContext, staging: Path, units: Sequence[CompiledUnit], gates: dict[str, dict[str, Any]] | None = None
) -> Manifest:
    """Store the units' constants once in ``staging`` (``weights.safetensors``) and write the manifest
    of those units; return it. ``gates``: the precision gate's record per variant it measured."""
    profile = ctx.profile
    measured = gates or {}
    const_specs, prefixes = _store_constants(staging, units)
    if any(u.package.standalone for u in units):
        artifact_shim(staging)  # already there, unless the units were compiled on other hosts (Ray)
    else:  # built for a candidate the build did not keep
        (staging / C.STANDALONE_SHIM).unlink(missing_ok=True)
    # The native code's vector ISA, which the loader checks native variants against.
    metadata = next((u for u in units if u.variant.isa is None), units[0]).package.metadata
    manifest = Manifest(
        name=profile.name,
        torch_version=torch.__version__,
        precompile_version=__version__,
        created=datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        target=Target(
            device=profile.targets[0] if profile.targets[0] in {u.variant.device for u in units} else "cpu",
            cpu_capability=cpu_capability(),
            aoti_cpu_isa=metadata.get("AOTI_CPU_ISA", ""),
            platform=platform.system().lower(),
            machine=platform.machine(),
        ),
        inputs=manifest_inputs(profile),
        dims={d: DimRange(s.min, s.max) for d, s in profile.dims.items()},
        output=ctx.output,
        variants=tuple(
            Variant(
                id=vp.id,
                kind=vp.kind,
                file=f"{C.VARIANTS_DIR}/{vp.id}{C.VARIANT_SUFFIX}",
                dims={d: DimRange(*r) for d, r in vp.ranges.items()},
                hint=dict(vp.hint),
                warm=tuple(dict(s) for s in vp.warm if s != vp.hint),
                constants=tuple(sorted(pkg.constants)),
                device=vp.device,
                dtype=vp.dtype,
                constant_prefix=prefixes[vp.id],
                embedded_constants=pkg.embedded,
                precision=vp.precision,
                cpu_features=needed_features(vp.precision, isa=vp.isa) if vp.precision != "fp32" or vp.isa else (),
                gate=measured.get(vp.id),
                isa=vp.isa,
                needs_torch=needs_torch(pkg.path, vp.device),
                shim=C.STANDALONE_SHIM if pkg.standalone else None,
                not_standalone=pkg.not_standalone,
                first_calls_of=vp.first_calls_of,
            )
            for vp, pkg in ((u.variant, u.package) for u in units)
        ),
        constants=const_specs,
        files=file_entries(staging),
        policy={d: p for d, p in profile.policy.out_of_range.items() if p != "error"},
        pad_value=dict(profile.policy.pad_value),
        output_dims=ctx.output_dims,
        cuda=ctx.cuda,
    )
    write_manifest(staging, manifest.to_json())
    return manifest


def _store_constants(staging: Path, units: Sequence[CompiledUnit]) -> tuple[dict[str, ConstantSpec], dict[str, str]]:
    """Every unit's constants in weights.safetensors, each stored once; the specs, and per variant
    the prefix its constants are stored under.

    Variants share a stored tensor when theirs is identical; a CUDA variant in another dtype, or one
    compiled with other options (frozen, differently laid-out constants), gets its own copies under
    a prefix."""
    constants: dict[str, torch.Tensor] = {}
    prefixes: dict[str, str] = {}
    for u in units:
        vp, pkg = u.variant, u.package

        def clashes(prefix: str) -> bool:
            return any(
                prefix + n in constants and not _same(constants[prefix + n], t) for n, t in pkg.constants.items()
            )

        prefix = next(p for p in ("", f"{vp.device}.{vp.dtype or 'native'}/", f"{vp.id}/") if not clashes(p))
        for name, tensor in pkg.constants.items():
            seen = constants.get(prefix + name)
            if seen is None:
                constants[prefix + name] = tensor
            elif not _same(seen, tensor):
                raise CompileError(f"variant {vp.id}: constant {name!r} differs from another variant's")
        prefixes[vp.id] = prefix
    return write_weights(staging, constants), prefixes


def _same(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.shape == b.shape and a.dtype == b.dtype and torch.equal(a, b)


def finish_manifest(
    ctx: BuildContext,
    staging: Path,
    manifest: Manifest,
    *,
    check: dict[str, Any],
    version: int = 1,
    expires: str | None = None,
) -> Manifest:
    """The manifest with the files as they now are, the ``check`` section, the release and the
    batching section; parsed by the loader, then written into ``staging``."""
    manifest = replace(
        manifest,
        files=file_entries(staging),
        check=CheckRecord.from_dict(check),
        version=version,
        expires=expires,
        batching=ctx.batching,
    )
    parse_manifest(manifest.to_json())  # the loader must accept what we write
    write_manifest(staging, manifest.to_json())
    return manifest
