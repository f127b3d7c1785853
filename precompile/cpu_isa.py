"""Compiling for one x86-64 level (the profile's ``cpu.isa``) rather than for the build host.

Inductor compiles CPU code for the build host: ``-march=native`` (unless ``cpp.march``) and the widest
vector ISA the host has (``torch._inductor.cpu_vec_isa.pick_vec_isa``). ``options.ISA_OPTIONS`` sets
``cpp.march`` to the level and ``cpp.simdlen`` to its vector width, but the width alone does not pin
the vector ISA: at 512 bits Inductor takes the best 512-bit one the host has (AVX512_VNNI, or AMX,
adding ``-mavx512vnni``, ``-mamx-*``, and ``-mavx512bf16`` where the host has AVX512_BF16), none of
which x86-64-v4 includes. ``pinned_vector_isa`` makes the level's own the only one Inductor finds.

    with pinned_vector_isa("x86-64-v4"):
        torch._inductor.aoti_compile_and_package(ep, inductor_configs={**options, **ISA_OPTIONS[isa]})
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

from loader.isa import LEVELS, missing_features

from .errors import PrecompileError


def vector_isa(level: str):  # -> torch._inductor.cpu_vec_isa.VecISA (imported here: build side only)
    """The Inductor vector ISA that compiles exactly ``level``'s instructions."""
    from torch._inductor import cpu_vec_isa

    class _AVX512Only(cpu_vec_isa.VecAVX512):
        """AVX-512 F/DQ/VL/BW (x86-64-v4): never the -mavx512bf16 that VecAVX512 adds on a host with it."""

        __hash__ = cpu_vec_isa.VecISA.__hash__

        def build_arch_flags(self) -> str:
            return cpu_vec_isa.VecAVX512._arch_flags

        def is_avx512_bf16_supported(self) -> bool:
            return False

    isas = {"x86-64-v3": cpu_vec_isa.VecAVX2, "x86-64-v4": _AVX512Only}
    if level not in isas:
        raise PrecompileError(f"cpu.isa: no vector ISA known for {level!r} (known: {', '.join(isas)})")
    return isas[level]()


@contextlib.contextmanager
def pinned_vector_isa(level: str | None) -> Iterator[None]:
    """Within the block, Inductor's vector ISA is ``level``'s (None: the build host's, untouched).

    A private entry point, on purpose and in this one place: ``cpu_vec_isa.valid_vec_isa_list`` (the
    vector ISAs the host has, which ``pick_vec_isa`` chooses among by ``cpp.simdlen``) is the only
    place Inductor decides it, and torch offers no option to name one. The executors run one compile
    at a time per process, so no other compile sees the pinned list.
    """
    if level is None:
        yield
        return
    from torch._inductor import cpu_vec_isa

    isa = vector_isa(level)
    original = cpu_vec_isa.valid_vec_isa_list
    cpu_vec_isa.valid_vec_isa_list = lambda: [isa]
    try:
        yield
    finally:
        cpu_vec_isa.valid_vec_isa_list = original


def build_host_problem(level: str, features: frozenset[str]) -> str | None:
    """Why this build host cannot build ``level`` (the build runs every variant against eager)."""
    missing = missing_features(level, features) if level in LEVELS else ()
    if not missing:
        return None
    return (
        f"{level} needs {', '.join(missing)}, which this build host lacks; the build runs every variant "
        "against eager, so build on a CPU that has them, or leave it out"
    )
