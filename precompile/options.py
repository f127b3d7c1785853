"""Every Inductor option precompile sets, refuses or offers, in one place.

- ``MANAGED``: options precompile sets itself; a profile may not override them (with the reason why).
- ``WEIGHTS_OUT``: how a package is compiled with its weights kept out of the shared library.
- ``DEFAULTS``: what every build starts from (a profile's ``compile.inductor`` overrides them).
- ``LOWER_PRECISION``: what every bf16/int8 variant compiles with, over the profile's first candidate.
- ``PRESETS``: the named candidate lists ``compile.tune.preset`` can ask for (README: Choosing compile options).

    options = unit_options(candidate, precision="fp32")   # the option set one compile unit gets
"""

from __future__ import annotations

from typing import Any

MANAGED: dict[str, str] = {
    "aot_inductor.package": "precompile always writes an AOTInductor package",
    "aot_inductor.package_cpp_only": "precompile needs the compiled library, not C++ sources",
    "aot_inductor.output_path": "the artifact's layout is precompile's",
    "aot_inductor.package_constants_in_so": "weights are kept out of the library and stored once, memory-mapped",
    "aot_inductor.package_constants_on_disk_format": "precompile extracts the weights itself",
    "post_grad_custom_pre_pass": "precompile packs dynamic convolutions' weights there (precompile.passes.prepack)",
}

# Inductor writes the constants beside the code (not inside the .so), as pickles the build takes out.
WEIGHTS_OUT: dict[str, Any] = {
    "aot_inductor.package_constants_in_so": False,
    "aot_inductor.package_constants_on_disk_format": "pickle_weights",
}

DEFAULTS: dict[str, Any] = {
    # Parallel loops and reductions sized by the serving process's thread count (omp_get_max_threads)
    # instead of the build host's: an artifact built on a 64-core runner and served on 2 cores
    # (or the reverse) neither oversubscribes nor idles.
    "cpp.dynamic_threads": True,
}

# Freezing turns the quantized or bf16 weights into oneDNN's prepacked kernels.
LOWER_PRECISION: dict[str, Any] = {"freezing": True}

# The first candidate of every list is the baseline the others must beat.
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


def unit_options(candidate: dict[str, Any], precision: str = "fp32") -> dict[str, Any]:
    """The options one compile unit gets: the defaults, then the candidate (``compile.inductor``
    merged with one tuning candidate), then what a lower precision needs."""
    return {**DEFAULTS, **candidate, **(LOWER_PRECISION if precision != "fp32" else {})}


def embeds_constants(options: dict[str, Any], device: str) -> bool:
    """Whether a unit compiled with ``options`` must keep its constants inside its package.

    On CPU, freezing with weight prepacking (Inductor's default once freezing is on) hands oneDNN
    weights pre-packed into opaque tensors: they have no storage that safetensors could hold, and the
    runner cannot take them back through load_constants. Such a variant carries its own weights.
    """
    return device == "cpu" and bool(options.get("freezing")) and options.get("cpp.weight_prepack", True) is not False


def prepacks_convolutions(options: dict[str, Any], device: str) -> bool:
    """Whether the build packs the weights of dynamic-size convolutions for oneDNN itself
    (``precompile.passes.prepack``): wherever Inductor packs the static ones, that is wherever the
    variant carries its own (frozen) weights."""
    return embeds_constants(options, device)
