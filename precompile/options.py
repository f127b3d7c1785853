"""Every Inductor option precompile sets, refuses or offers, in one place.

- ``MANAGED``: options precompile sets itself; a profile may not override them (with the reason why).
- ``WEIGHTS_OUT``: how a package is compiled with its weights kept out of the shared library.
- ``DEFAULTS``: what every build starts from (a profile's ``compile.inductor`` overrides them).
- ``KIND_DEFAULTS``: what a model of one kind (``passes.convnets.model_kind``) gets where nothing
  else set the option (``with_kind_defaults``, applied to a unit's options when it compiles).
- ``LOWER_PRECISION``: what every bf16/int8 variant compiles with, over the profile's first candidate.
- ``PRESETS``: the named candidate lists ``compile.tune.preset`` can ask for (docs/compile-options.md).
- ``ISA_OPTIONS``: what a variant built for one x86-64 level (the profile's ``cpu.isa``) compiles with, last.

    options = unit_options(candidate, precision="fp32")   # the option set one compile unit gets
    options_label(options)                                 # "freezing=True" (what it adds to DEFAULTS)
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
    "post_grad_custom_post_pass": "precompile marks how it prints generated indices there (precompile.index_analysis)",
}

# compile.standalone's mark in a unit's options (not an Inductor option: precompile.standalone takes it
# out and compiles the unit without extern kernels and libtorch, or says why it cannot).
STANDALONE = "standalone"

# compile.conv_routes in a unit's options (not an Inductor option either: the compile stage takes it
# out and rewrites those convolutions before Inductor sees them, ``precompile.passes.conv_routes``):
# the kinds of convolution compiled without a per-shape oneDNN primitive.
CONV_ROUTES = "conv_routes"
ALL_CONV_ROUTES = ("conv1x1_as_gemm", "depthwise_as_loops", "stem_as_loops", "dense_as_gemm")

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
    # No DWARF line tables (g++ -g1) in the compiled libraries: a model's libraries half the size
    # (the text classifier's artifact 2.65 -> 1.42 MB, ResNet-18's 49.2 -> 47.9 MB) and each
    # compile's g++ a fifth faster (the AOTInductor wrapper 4.2 -> 3.4 s), nothing changed in the
    # code. Symbols stay, so perf and gdb still name each kernel; a profile that wants source lines
    # sets it back (compile.inductor: {aot_inductor.enable_line_tables: true}). A torch without the
    # option compiles as it always did (stages.compile drops a default it does not know).
    "aot_inductor.enable_line_tables": False,
}

# Per model kind, filled in under a unit's options where neither the defaults, the profile
# (compile.inductor, a tuning candidate), its precision nor its ISA level set the option.
# - convnet: freezing, so that every convolution runs on a weight oneDNN does not re-lay out at each
#   call: packed by Inductor with static sizes, by precompile.passes.prepack with dynamic ones (where
#   oneDNN keeps one layout over the range). Unfrozen, every weight is reordered at every call:
#   dynamic ResNet-50 (batch 1-4, 96-256²) under ONEDNN_VERBOSE, 53 reorders (94 MB) a call at
#   4×256² and random shapes against 25 (32 MB) frozen; MobileNetV2 52 (8.8 MB) against 19 (6.2),
#   RegNet-Y 159 (78 MB) against 76 (49). At 1×96² aten runs the smallest unfrozen convolutions
#   outside oneDNN (ResNet-50: 27 reorders, 24 MB): timed by bench.vision, not yet quietly.
# - other (transformers): nothing; freezing measured no help on MiniLM (152 against 148 ms).
KIND_DEFAULTS: dict[str, dict[str, Any]] = {"convnet": {"freezing": True}, "other": {}}

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
    # Convnets: every convolution oneDNN's, or the 1×1 ones (then the depthwise ones and the stem too)
    # compiled without a per-shape primitive (compile.conv_routes): oneDNN's kernels are the fastest
    # steady call on most hosts, the routes' first call at a new image size costs no more than their
    # steady one; the tune stage's first-call bound (compile.tune.first_call) weighs the two on the
    # build host. The last candidate routes the stem with the depthwise ones: MobileNetV2 on an AVX2
    # EPYC ran 1.22× oneDNN's steady call so, 1.50× with its stem left to oneDNN
    # (bench/results/conv_routes.md).
    "convnet": [
        {"freezing": True},
        {"freezing": True, CONV_ROUTES: ["conv1x1_as_gemm"]},
        {"freezing": True, CONV_ROUTES: ["conv1x1_as_gemm", "depthwise_as_loops", "stem_as_loops"]},
    ],
}


def unit_options(candidate: dict[str, Any], precision: str = "fp32", isa: str | None = None) -> dict[str, Any]:
    """The options one compile unit gets: the defaults, then the candidate (``compile.inductor``
    merged with one tuning candidate), then what a lower precision needs, then its ISA level's."""
    lower = LOWER_PRECISION if precision != "fp32" else {}
    return {**DEFAULTS, **candidate, **lower, **ISA_OPTIONS.get(isa or "", {})}


def with_kind_defaults(options: dict[str, Any], kind: str) -> dict[str, Any]:
    """``options`` with what ``KIND_DEFAULTS`` gives a model of ``kind`` where they say nothing."""
    return {**KIND_DEFAULTS.get(kind, {}), **options}


def options_label(options: dict[str, Any]) -> str:
    """An option set in one short line, as the build's output and ``inspect`` name a candidate: what
    it sets beyond ``DEFAULTS``, or "defaults"."""
    own = {k: v for k, v in options.items() if k not in DEFAULTS or DEFAULTS[k] != v}
    return ",".join(f"{k}={v}" for k, v in own.items()) or "defaults"


def embeds_constants(options: dict[str, Any], device: str) -> bool:
    """Whether a unit compiled with ``options`` must keep its constants inside its package.

    On CPU, freezing with weight prepacking (Inductor's default once freezing is on) hands oneDNN
    weights pre-packed into opaque tensors: they have no storage that safetensors could hold, and the
    runner cannot take them back through load_constants. Such a variant carries its own weights.
    """
    return device == "cpu" and bool(options.get("freezing")) and options.get("cpp.weight_prepack", True) is not False


# cpu.isa: a portable variant is compiled for exactly one x86-64 level, its vector width (the simdlen
# that makes Inductor pick that level's vector ISA, which ``precompile.cpu_isa`` pins) and -march
# alike. Freezing is off: its weight prepacking lays the weights out for the build host's CPU (MKL's
# packed GEMM and oneDNN's blocked formats are chosen for the ISA of the machine that packs them), and
# without prepacking it folds weights into views weights.safetensors cannot hold. Unfrozen, oneDNN's
# and MKL's kernels pick their code at run time, on the serving host.
ISA_OPTIONS: dict[str, dict[str, Any]] = {
    "x86-64-v3": {"cpp.simdlen": 256, "cpp.march": "x86-64-v3", "freezing": False},
    "x86-64-v4": {"cpp.simdlen": 512, "cpp.march": "x86-64-v4", "freezing": False},
}


def same_as_earlier(candidates: list[dict[str, Any]], k: int, isa: str | None) -> int | None:
    """The earlier candidate that compiles exactly as candidate ``k`` does for ``isa`` (None: none):
    a level's options override the candidates' (``{}`` and ``{freezing: true}`` are then one), so
    such a candidate is compiled and timed once."""
    if isa is None:
        return None
    mine = unit_options(candidates[k], isa=isa)
    return next((j for j in range(k) if unit_options(candidates[j], isa=isa) == mine), None)


def prepacks_convolutions(options: dict[str, Any], device: str) -> bool:
    """Whether the build packs the weights of dynamic-size convolutions for oneDNN itself
    (``precompile.passes.prepack``): wherever Inductor packs the static ones, that is wherever the
    variant carries its own (frozen) weights."""
    return embeds_constants(options, device)
