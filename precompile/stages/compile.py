"""Stage compile: AOTInductor turns an exported program into a package with weights kept out.

Inductor is asked to write the constants beside the code (``pickle_weights``) rather than inside the
shared library; they are then taken out of the package, so that the artifact stores them once in
``weights.safetensors`` for every variant and the loader memory-maps them. Reading them from the
package, not from the module's state dict, gives exactly the tensors the compiled code asks for.
"""

from __future__ import annotations

import contextlib
import copy
import io
import json
import warnings
import zipfile
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch
from torch.export import ExportedProgram

from loader.aoti import open_package

from .. import build_cache, standalone
from ..cpu_isa import pinned_vector_isa
from ..errors import CompileError
from ..index_analysis import codegen_mark, generated_code
from ..options import CONV_ROUTES, DEFAULTS, WEIGHTS_OUT, embeds_constants, prepacks_convolutions, with_kind_defaults
from ..passes import convnets
from ..units import CompiledPackage


def compile_package(
    ep: ExportedProgram,
    out: Path,
    options: dict[str, Any],
    *,
    device: str = "cpu",
    multi_arch: bool = False,
    shapes: Sequence[Sequence[Any]] = (),
    isa: str | None = None,
    cache: str | None = None,
) -> CompiledPackage:
    """Compile ``ep`` to ``out`` (a .pt2 path), take its constants out (as CPU tensors), return both.

    For CUDA, ``multi_arch`` emits PTX beside the build GPU's SASS, so newer GPUs can run the kernels.
    ``isa``: the x86-64 level a CPU variant is compiled for (``options`` hold its ``ISA_OPTIONS``),
    Inductor's vector ISA pinned to it (``precompile.cpu_isa``); None: the build host's own.
    ``shapes`` (the profile's input shapes, ``[batch, seq]``) name the dims in a lowering failure.
    ``cache``: the build cache's folder (``precompile.build_cache``): a compile it holds is copied
    from it, and one it does not is written to it (standalone variants are always compiled).
    """
    from ..passes.prepack import PrepackConvolutions  # imports torch._inductor too

    options, wanted = standalone.without_option(options)
    options = with_kind_defaults(options, convnets.model_kind(ep))  # convnets: frozen unless told otherwise
    routes = tuple(options.pop(CONV_ROUTES, ()))
    embedded = embeds_constants(options, device)
    configs = _known_defaults({**options} if embedded else {**options, **WEIGHTS_OUT})
    configs["post_grad_custom_post_pass"] = codegen_mark()  # index_analysis.plain_divisions, in the caches' keys
    if prepacks_convolutions(options, device):  # Inductor packs only static ones (precompile.passes.prepack)
        configs["post_grad_custom_pre_pass"] = PrepackConvolutions()
    if device == "cuda" and multi_arch:
        configs["aot_inductor.emit_multi_arch_kernel"] = True
    raw = out.with_suffix(".full.pt2")
    if routes:  # rewritten on a copy: the program may be compiled again under other options (tuning)
        ep = copy.deepcopy(ep)
    # Inductor defects around pooling and convolutions, and the convolutions that need no per-shape
    # oneDNN primitive (precompile.passes.convnets, conv_routes)
    convnets.rewrite(ep, routes)
    shim, not_standalone = None, None
    key = _cache_key(ep, configs, device, multi_arch, isa) if cache and not (wanted and device == "cpu") else None
    with build_cache.claimed(Path(cache), key) if cache and key else contextlib.nullcontext():
        hit = build_cache.lookup(Path(cache), key, out) if cache and key else None
        if hit is not None:
            constants, embedded = hit
        else:
            if wanted and device == "cpu":
                shim, not_standalone = _compile_standalone(ep, raw, configs, isa, out.parent.parent)
            if shim is None:
                _compile(ep, raw, configs, isa, shapes)
            if embedded:
                raw.replace(out)
                constants = {}
            else:
                constants = _strip_weights(raw, out)
                raw.unlink()
            if cache and key:
                build_cache.store(Path(cache), key, out, constants, embedded)
    runner = open_package(str(out), device_index=0 if device == "cuda" else None, standalone=shim is not None)
    missing = set(runner.get_constant_fqns()) - set(constants)
    if missing and not embedded:
        raise CompileError(f"the compiled code needs constants the package did not contain: {sorted(missing)}")
    return CompiledPackage(
        out, constants, dict(runner.get_metadata()), embedded, shim is not None, not_standalone, hit is not None
    )


def _known_defaults(configs: dict[str, Any]) -> dict[str, Any]:
    """``configs`` less the defaults (``options.DEFAULTS``) this torch's Inductor has no option for
    (an older torch); a profile's own unknown options were refused with the profile's checks."""
    import torch._inductor.config as inductor_config

    known = inductor_config.get_config_copy()
    return {k: v for k, v in configs.items() if k in known or k not in DEFAULTS}


def _cache_key(
    ep: ExportedProgram, configs: dict[str, Any], device: str, multi_arch: bool, isa: str | None
) -> str | None:
    """The build cache's key of this compile: the program and options, and the target it is for."""
    target: dict[str, Any] = {"device": device, "isa": isa, "multi_arch": multi_arch}
    if device == "cuda":
        target["gpu"] = [torch.cuda.get_device_name(0), list(torch.cuda.get_device_capability(0))]
    return build_cache.compile_key(ep, configs, target)


def _compile(ep: ExportedProgram, raw: Path, configs: dict[str, Any], isa: str | None, shapes) -> None:
    import torch._inductor  # build side only

    try:
        # Gradients off: Inductor's freezing (constant folding, weight prepacking) only applies to
        # graphs compiled without them; serving never needs them.
        with warnings.catch_warnings(), torch.no_grad(), pinned_vector_isa(isa), generated_code():
            warnings.simplefilter("ignore")
            torch._inductor.aoti_compile_and_package(ep, package_path=str(raw), inductor_configs=configs)
    except Exception as e:  # Inductor and the C++ toolchain raise many types
        said = convnets.explain_failure(
            e, ep, [list(shape) for shape in shapes]
        )  # a lowering failure: one line, in the profile's words
        raise CompileError(said or f"AOTInductor failed: {type(e).__name__}: {str(e).strip()[:4000]}") from None


def _compile_standalone(
    ep: ExportedProgram, raw: Path, configs: dict[str, Any], isa: str | None, staging: Path
) -> tuple[Path | None, str | None]:
    """Compile ``ep`` standalone (``precompile.standalone``) into ``raw``: the artifact's shim (built
    into ``staging`` once) and None; or None and why it cannot be, for a compile the usual way."""
    import torch._inductor  # build side only

    try:
        shim = standalone.artifact_shim(staging)
        with (
            warnings.catch_warnings(),
            torch.no_grad(),
            pinned_vector_isa(isa),
            standalone.single_vector_blocks(),
            generated_code(),
        ):
            warnings.simplefilter("ignore")
            torch._inductor.aoti_compile_and_package(
                standalone.decompose(ep), package_path=str(raw), inductor_configs=standalone.inductor_options(configs)
            )
    except Exception as e:  # Inductor, the template's refusal (NoValidChoicesError) and the toolchain
        raw.unlink(missing_ok=True)
        return None, standalone.refusal(e)
    problem = standalone.problem(raw, shim)
    if problem is not None:
        raw.unlink()
    return (None, problem) if problem else (shim, None)


def _strip_weights(src_path: Path, dst_path: Path) -> dict[str, torch.Tensor]:
    """Copy the package without its weights; return the weights by constant name."""
    constants: dict[str, torch.Tensor] = {}
    with zipfile.ZipFile(src_path) as src:
        names = src.namelist()
        configs = [n for n in names if n.endswith("/weights_config.json")]
        bases: dict[str, torch.Tensor] = {}
        for cfg_name in configs:
            root = cfg_name.split("/")[0]
            for fqn, (file, shape, stride, offset) in json.loads(src.read(cfg_name)).items():
                member = f"{root}/data/weights/{file}"
                if member not in bases:
                    bases[member] = torch.load(io.BytesIO(src.read(member)), weights_only=True, map_location="cpu")
                if list(stride) != _contiguous_strides(shape):
                    raise CompileError(
                        f"constant {fqn!r} is laid out with strides {stride} for shape {shape}; precompile "
                        "stores weights contiguously and cannot serve this layout"
                    )
                constants[fqn] = bases[member].as_strided(shape, stride, offset).detach().cpu().clone()
        with zipfile.ZipFile(dst_path, "w", zipfile.ZIP_STORED) as dst:
            for info in src.infolist():
                if "/data/weights/" in info.filename or info.filename.endswith("/weights_config.json"):
                    continue
                dst.writestr(info, src.read(info.filename))
    return constants


def _contiguous_strides(shape: list[int]) -> list[int]:
    strides, step = [], 1
    for size in reversed(shape):
        strides.append(step)
        step *= max(size, 1)
    return strides[::-1]
