"""Standalone CPU variants: compiled code that runs with neither libc10 nor libtorch_cpu loaded.

A CPU variant's library calls libtorch only through the AOTI C shim: tensor bookkeeping
(``aoti_torch_empty_strided``, views, data pointers, ...) and the extern kernels Inductor did not
generate code for (``aoti_torch_cpu__linear_pointwise``, ``..._scaled_dot_product_flash_attention_for_cpu``,
``aoti_torch_cpu_bmm_out``, ...). A standalone variant has no extern kernel left:

- attention is decomposed into its math (bmm, softmax) instead of the flash-attention fallback
  Inductor keeps (``torch._inductor.decomposition.decomps_to_exclude``);
- matrix products run Inductor's C++ GEMM templates (``max_autotune_gemm_backends="CPP"``, no ATen
  choice). The template refuses a product whose n or k is dynamic
  (``torch._inductor.utils.use_cpp_gemm_template``: "support dynamic shapes for n or k"), which
  attention's two bmms are when the sequence length varies: those are decomposed into a multiply and
  a sum, which Inductor generates as a loop; a linear on a 3-d input (a bmm over one expanded
  weight) becomes one mm;
- the library is linked without libtorch (``aot_inductor.link_libtorch=False``: no DT_NEEDED on it);
- the FP32 micro-kernel's register block is one vector wide (``single_vector_blocks``): GCC 12 keeps
  a copy of every accumulator of a wider block (8x48, 8x32 on AVX-512; 4x24, 4x16 on AVX2) in memory,
  one store per FMA in the innermost loop, which halves the kernel's speed; a 16x16 block (8x8 on
  AVX2) stays in registers, its FMAs taking A broadcast from memory.

What the library still calls, precompile's own shim provides (``shim.cpp``: refcounted, 64-byte
aligned storage and strided views), compiled here with the compiler Inductor uses and shipped in the
artifact. ``problem`` opens the variant in a fresh interpreter beside that shim alone: a symbol left
unresolved (an extern kernel) makes it not standalone, and the build keeps the torch path for it.
"""

from __future__ import annotations

import contextlib
import os
import subprocess
import sys
import tempfile
import zipfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch
from torch.export import ExportedProgram

from loader import constants as C

from ..options import STANDALONE

OPTION = STANDALONE  # compile.standalone in a profile; the key a unit's options carry it under
SHIM_SOURCE = Path(__file__).with_name("shim.cpp")
INDUCTOR_OPTIONS: dict[str, Any] = {
    "max_autotune": True,
    "max_autotune_gemm_backends": "CPP",
    "aot_inductor.link_libtorch": False,
}

aten = torch.ops.aten


def without_option(options: dict[str, Any]) -> tuple[dict[str, Any], bool]:
    """``options`` without precompile's ``standalone`` key (Inductor has no such option), and
    whether it asked for a standalone compile."""
    return {k: v for k, v in options.items() if k != OPTION}, bool(options.get(OPTION))


def inductor_options(configs: dict[str, Any]) -> dict[str, Any]:
    """Inductor's options for a standalone compile of what ``configs`` compiles."""
    return {**configs, **INDUCTOR_OPTIONS}


@contextlib.contextmanager
def single_vector_blocks() -> Iterator[None]:
    """Within the block, the C++ GEMM template's FP32 vector micro-kernel on x86 takes only register
    blocks one vector wide (see the module's docstring).

    A private entry point, as ``precompile.cpu_isa.pinned_vector_isa``'s: ``micro_gemm_configs`` is
    the only place Inductor lists the blocks (``create_micro_gemm`` ranks them) and torch offers no
    option to choose one. The executors run one compile at a time per process.
    """
    import torch._inductor.compile_fx  # noqa: F401  (cpp_micro_gemm imported first is a circular import)
    from torch._inductor.codegen import cpp_micro_gemm as micro
    from torch._inductor.cpu_vec_isa import VecAVX2, VecAVX512

    configs = micro.micro_gemm_configs
    original = configs[micro.CppMicroGemmFP32Vec]
    lanes = {VecAVX512: 16, VecAVX2: 8}  # fp32 lanes of one vector
    configs[micro.CppMicroGemmFP32Vec] = [
        c for c in original if c.vec_isa_cls not in lanes or c.register_blocking.block_n == lanes[c.vec_isa_cls]
    ]
    try:
        yield
    finally:
        configs[micro.CppMicroGemmFP32Vec] = original


def refusal(e: BaseException) -> str:
    """Why a standalone compile failed, in one line: Inductor's first line (a GEMM template that
    refused a product names the op), never its multi-page IR dump."""
    text = str(e).strip()
    target = next((line.strip() for line in text.splitlines() if line.strip().startswith("target:")), "")
    first = text.splitlines()[0][:300] if text else type(e).__name__
    return f"Inductor could not compile it without extern kernels: {first}" + (f" ({target})" if target else "")


def decompose(ep: ExportedProgram) -> ExportedProgram:
    """``ep`` in core ATen, attention as its math and bmms the C++ GEMM template cannot take as
    loops (see the module's docstring)."""
    from torch._decomp.decompositions import scaled_dot_product_flash_attention_for_cpu
    from torch.export import default_decompositions

    table = default_decompositions()
    table[aten._scaled_dot_product_flash_attention_for_cpu.default] = scaled_dot_product_flash_attention_for_cpu
    table[aten.bmm.default] = _bmm
    return ep.run_decompositions(table)


def _bmm(a: torch.Tensor, b: torch.Tensor):
    if b.stride(0) == 0:  # one matrix for every batch (a linear on a 3-d input): one mm
        batch, m, k = a.shape
        return aten.mm.default(a.reshape(batch * m, k), b[0]).view(batch, m, b.shape[2])
    if isinstance(a.shape[0], int) and a.shape[0] == 1:  # one batch (a routed 1×1 convolution): one mm
        # Inductor's bmm template fails to render an epilogue it fused in with a dynamic M
        # (torch 2.13, ``ir.py`` indexer: "len(index) == len(stride)"); its mm template does not.
        return aten.mm.default(a[0], b[0]).unsqueeze(0)
    if any(isinstance(d, torch.SymInt) for d in (a.shape[2], b.shape[2])):  # n or k dynamic
        return (a.unsqueeze(3) * b.unsqueeze(1)).sum(2)
    return NotImplemented  # the template takes it


def artifact_shim(staging: Path) -> Path:
    """The shim inside the artifact being built in ``staging`` (``loader.constants.STANDALONE_SHIM``),
    built by the first compile unit that needs it; units compiled at once each build theirs into a
    file of their own and move it in place, so a reader never sees half of one."""
    out = staging / C.STANDALONE_SHIM
    if not out.is_file():
        out.parent.mkdir(parents=True, exist_ok=True)
        mine = out.with_name(f".{out.name}.{os.getpid()}")
        build_shim(mine)
        os.replace(mine, out)
    return out


def build_shim(out: Path) -> Path:
    """Compile ``shim.cpp`` into ``out`` (a shared library) with the C++ compiler Inductor uses."""
    from torch._inductor.cpp_builder import get_cpp_compiler

    out.parent.mkdir(parents=True, exist_ok=True)
    command = [
        get_cpp_compiler(),
        "-O2",
        "-std=c++17",
        "-shared",
        "-fPIC",
        "-fvisibility=hidden",
        "-Wno-psabi",  # the SLEEF functions take vectors in registers of their own ISA, as SLEEF's do
        "-o",
        str(out),
        str(SHIM_SOURCE),
    ]
    done = subprocess.run(command, capture_output=True, text=True)
    if done.returncode != 0:
        raise RuntimeError(f"compiling the standalone shim failed: {done.stderr.strip()[:2000]}")
    return out


_CHECK = """
import ctypes, sys
gomp, shim, lib = sys.argv[1:4]
ctypes.CDLL(gomp, mode=ctypes.RTLD_GLOBAL)
ctypes.CDLL(shim, mode=ctypes.RTLD_GLOBAL)
try:
    ctypes.CDLL(lib)
except OSError as e:
    print(str(e).rsplit(":", 1)[-1].strip())
    sys.exit(3)
maps = open("/proc/self/maps").read()
if "libtorch" in maps or "libc10" in maps:
    print("it loaded torch's libraries"); sys.exit(4)
"""


def problem(package: Path, shim: Path) -> str | None:
    """Why the compiled ``package`` is not standalone, or None: its library is opened (every symbol
    bound now) in a fresh interpreter that has loaded only OpenMP and ``shim``."""
    with zipfile.ZipFile(package) as z, tempfile.TemporaryDirectory() as tmp:
        libraries = [n for n in z.namelist() if "/data/aotinductor/" in n and n.endswith(".so")]
        if len(libraries) != 1:
            return "the package does not hold exactly one compiled library"
        library = Path(tmp) / "variant.so"
        library.write_bytes(z.read(libraries[0]))
        env = {k: v for k, v in os.environ.items() if k not in ("LD_PRELOAD", "LD_LIBRARY_PATH")}
        done = subprocess.run(
            [sys.executable, "-S", "-c", _CHECK, str(openmp_library()), str(shim), str(library)],
            capture_output=True,
            text=True,
            env=env,
        )
    if done.returncode == 3:
        return f"its compiled code calls {done.stdout.strip() or 'a symbol'} of libtorch (an extern kernel)"
    if done.returncode != 0:
        return done.stdout.strip() or done.stderr.strip()[-500:] or f"the check exited {done.returncode}"
    return None


def openmp_library() -> Path:
    """The OpenMP runtime torch's wheel ships (the one its compiled code is built against)."""
    return Path(torch.__file__).parent / "lib" / "libgomp.so.1"
