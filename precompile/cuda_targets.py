"""What code objects a CUDA build's kernels really hold, read from the packages at build time.

The manifest used to claim, for ``cuda.multi_arch``, that PTX let newer GPUs run the kernels. On a
Hopper that is false: Triton compiles for ``sm_90a`` and Inductor's multi-arch fatbin adds PTX for
``compute_90a``, which no 10.x or 12.x GPU can JIT. So the build reads what the packages hold (the
``.target`` of any PTX inside, and ``cuobjdump --list-elf --list-ptx`` of each cubin and fatbin where
cuobjdump is found) and records it as ``cuda.kernels``; the loader's coverage rule
(``loader.cuda.runs_on``) decides from it.
"""

from __future__ import annotations

import re
import subprocess
import tempfile
import zipfile
from dataclasses import dataclass, replace
from pathlib import Path

from loader.manifest import CudaInfo

from .cuda_toolchain import find_toolchain

_PTX_TARGET = re.compile(r"^\s*\.target\s+([^\n/]+)", re.MULTILINE)
_ARCH = re.compile(r"\b(sm_\d+[af]?)\b")
# cuobjdump's listings: "ELF file    1: name.1.sm_90a.cubin", "PTX file    1: name.1.sm_90a.ptx"
_LISTED = re.compile(r"^(ELF|PTX) file\s+\d+:\s*\S*?\b(sm_\d+[af]?)\.(?:cubin|ptx)\s*$", re.MULTILINE)
KERNEL_SUFFIXES = (".cubin", ".fatbin", ".ptx")


def ptx_targets(text: str) -> set[str]:
    """The PTX code objects a PTX file is for, from its ``.target`` line: '.target sm_90a' -> {'compute_90a'}."""
    return {"compute_" + a.removeprefix("sm_") for line in _PTX_TARGET.findall(text) for a in _ARCH.findall(line)}


def cuobjdump_targets(listing: str) -> set[str]:
    """The code objects in ``cuobjdump --list-elf --list-ptx`` output: ELF entries are SASS (sm_XY),
    PTX entries are PTX (compute_XY)."""
    return {
        ("compute_" + arch.removeprefix("sm_")) if kind == "PTX" else arch for kind, arch in _LISTED.findall(listing)
    }


@dataclass(frozen=True)
class PackageKernels:
    """What one package's kernel files hold, and how that was found out."""

    kernels: frozenset[str]  # code objects, 'sm_90a' / 'compute_90a'
    files: int  # kernel files (cubin, fatbin, ptx) in the package
    unread: tuple[str, ...] = ()  # kernel files nothing could read (no cuobjdump, or it failed)


def package_kernels(path: Path, cuobjdump: str | None = None, timeout_s: float = 60.0) -> PackageKernels:
    """Read the kernel files inside one AOTInductor package (a zip)."""
    found: set[str] = set()
    unread: list[str] = []
    files = 0
    with zipfile.ZipFile(path) as z, tempfile.TemporaryDirectory(prefix="precompile-kernels-") as tmp:
        for name in z.namelist():
            if not name.endswith(KERNEL_SUFFIXES):
                continue
            files += 1
            if name.endswith(".ptx"):
                found |= ptx_targets(z.read(name).decode("utf-8", errors="replace"))
                continue
            listed: set[str] = set()
            if cuobjdump is not None:
                target = Path(tmp) / Path(name).name
                target.write_bytes(z.read(name))
                try:
                    out = subprocess.run(
                        [cuobjdump, "--list-elf", "--list-ptx", str(target)],
                        capture_output=True,
                        text=True,
                        timeout=timeout_s,
                    )
                    listed = cuobjdump_targets(out.stdout + out.stderr)
                except (OSError, subprocess.TimeoutExpired):
                    listed = set()
            if listed:
                found |= listed
            else:
                unread.append(name)
    return PackageKernels(frozenset(found), files, tuple(unread))


def with_kernel_targets(cuda: CudaInfo | None, packages: list[Path], cuobjdump: str | None = None) -> CudaInfo | None:
    """``cuda`` with ``kernels`` set to the code objects every CUDA package's kernels hold.

    A GPU must run every package, so only the targets all of them hold count. When a package's kernels
    could not be read (no cuobjdump for its cubins and fatbins), nothing is recorded and the loader
    falls back to ``loader.cuda.derived_kernels``: what torch's compilers emit for the build GPU.
    cuobjdump (unless given) is the one beside the nvcc Inductor builds with (CUDACXX, CUDA_HOME, PATH,
    /usr/local/cuda: cuda_toolchain.py), so a toolkit that is not on PATH is read too.
    """
    if cuda is None:
        return None
    cuobjdump = cuobjdump or find_toolchain().cuobjdump
    common: frozenset[str] | None = None
    for path in packages:
        read = package_kernels(path, cuobjdump)
        if not read.files:
            continue  # no kernels of its own (extern calls only): no constraint
        if read.unread or not read.kernels:
            return replace(cuda, kernels=())
        common = read.kernels if common is None else common & read.kernels
    return replace(cuda, kernels=tuple(sorted(common or ())))
