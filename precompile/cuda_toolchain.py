"""The CUDA toolchain a CUDA build needs, found the way torch's Inductor will look for it.

AOTInductor with ``emit_multi_arch_kernel`` builds each kernel's fatbin with ``nvcc -fatbin`` (or
``fatbinary`` beside nvcc), and Inductor finds nvcc only through ``CUDACXX``, ``CUDA_HOME`` or
``PATH``. The wrapper library is linked with ``-lcuda``: a machine whose driver folder holds only
``libcuda.so.1`` (a read-only container mount, say) needs the toolkit's driver stub
(``lib64/stubs/libcuda.so``) on the link path. ``find_toolchain`` looks in the usual places and
``Toolchain.env()`` is what to export for a build; the stub goes on ``LIBRARY_PATH`` (the linker's
search path) only, never on ``LD_LIBRARY_PATH``, where it would shadow the real driver at run time.
"""

from __future__ import annotations

import glob
import os
import re
from dataclasses import dataclass, field
from pathlib import Path

# Where a CUDA toolkit is installed when no variable names it (newest version first for cuda-X.Y).
DEFAULT_ROOTS = ("/usr/local/cuda", "/usr/local/cuda-*", "/opt/cuda", "/usr/lib/cuda")
STUB_DIRS = ("lib64/stubs", "lib/stubs", "targets/x86_64-linux/lib/stubs", "targets/sbsa-linux/lib/stubs")
# Folders the linker searches for -lcuda without being told (Debian/Ubuntu, RHEL layouts).
SYSTEM_LIB_DIRS = (
    "/usr/lib/x86_64-linux-gnu",
    "/usr/lib64",
    "/usr/lib",
    "/lib/x86_64-linux-gnu",
    "/usr/local/nvidia/lib64",
)


@dataclass(frozen=True)
class Toolchain:
    """What was found (None: not found) and where each came from, for the record."""

    nvcc: str | None = None
    cuda_home: str | None = None
    fatbinary: str | None = None
    cuobjdump: str | None = None
    libcuda_link_dir: str | None = None  # a folder with a linkable libcuda.so: the driver's, or the stub's
    stub: bool = False  # libcuda_link_dir is the toolkit's driver stub
    how: dict[str, str] = field(default_factory=dict)  # what -> how it was found

    def problems(self) -> list[str]:
        """What a CUDA build with multi-arch kernels will lack, as sentences with the fix."""
        out = []
        if self.nvcc is None:
            out.append(
                "nvcc: not found through CUDACXX, CUDA_HOME, PATH or /usr/local/cuda; install the CUDA toolkit or set CUDACXX"
            )
        if self.libcuda_link_dir is None:
            out.append(
                "libcuda.so: no linkable driver library or toolkit stub (lib64/stubs/libcuda.so) found for -lcuda; "
                "set CUDA_HOME to a toolkit that has lib64/stubs"
            )
        return out

    def env(self, base: dict[str, str] | None = None) -> dict[str, str]:
        """The variables to export for a build: CUDACXX, CUDA_HOME, nvcc's folder first on PATH, and
        the link folder for -lcuda on LIBRARY_PATH."""
        base = dict(os.environ if base is None else base)
        out: dict[str, str] = {}
        if self.nvcc is not None:
            out["CUDACXX"] = self.nvcc
            out["PATH"] = _prepend(str(Path(self.nvcc).parent), base.get("PATH", ""))
        if self.cuda_home is not None:
            out["CUDA_HOME"] = self.cuda_home
        if self.libcuda_link_dir is not None:
            out["LIBRARY_PATH"] = _prepend(self.libcuda_link_dir, base.get("LIBRARY_PATH", ""))
        return out

    def to_dict(self) -> dict:
        return {
            "nvcc": self.nvcc,
            "cuda_home": self.cuda_home,
            "fatbinary": self.fatbinary,
            "cuobjdump": self.cuobjdump,
            "libcuda_link_dir": self.libcuda_link_dir,
            "stub": self.stub,
            "how": dict(self.how),
            "problems": self.problems(),
        }


def find_toolchain(
    env: dict[str, str] | None = None,
    *,
    roots: tuple[str, ...] = DEFAULT_ROOTS,
    system_lib_dirs: tuple[str, ...] = SYSTEM_LIB_DIRS,
) -> Toolchain:
    """Find nvcc, the toolkit root, fatbinary, cuobjdump and a libcuda.so to link against.

    nvcc, in Inductor's order: ``CUDACXX``, then ``CUDA_HOME``/``CUDA_PATH``'s bin, then ``PATH``,
    then the usual install roots. The toolkit root is nvcc's folder's parent.
    """
    env = dict(os.environ if env is None else env)
    how: dict[str, str] = {}
    nvcc = None
    candidates: list[tuple[str, str]] = []
    if env.get("CUDACXX"):
        candidates.append((env["CUDACXX"], "CUDACXX"))
    for var in ("CUDA_HOME", "CUDA_PATH"):
        if env.get(var):
            candidates.append((os.path.join(env[var], "bin", "nvcc"), var))
    found_on_path = _which("nvcc", env.get("PATH", ""))
    if found_on_path:
        candidates.append((found_on_path, "PATH"))
    for root in _expand_roots(roots):
        candidates.append((os.path.join(root, "bin", "nvcc"), root))
    for path, where in candidates:
        if _executable(path):
            nvcc, how["nvcc"] = os.path.realpath(path), where
            break
    cuda_home = str(Path(nvcc).parent.parent) if nvcc else None
    if cuda_home:
        how["cuda_home"] = "nvcc's folder's parent"
    fatbinary = cuobjdump = None
    for tool in ("fatbinary", "cuobjdump"):
        path = os.path.join(cuda_home, "bin", tool) if cuda_home else None
        if path and _executable(path):
            how[tool] = "beside nvcc"
        else:
            path = _which(tool, env.get("PATH", ""))
            if path:
                how[tool] = "PATH"
        if tool == "fatbinary":
            fatbinary = path
        else:
            cuobjdump = path
    link_dir, stub = None, False
    for d in [*(env.get("LIBRARY_PATH", "").split(os.pathsep)), *system_lib_dirs]:
        if d and os.path.isfile(os.path.join(d, "libcuda.so")):
            link_dir, how["libcuda"] = d, "linkable driver library"
            break
    if link_dir is None and cuda_home:
        for sub in STUB_DIRS:
            d = os.path.join(cuda_home, sub)
            if os.path.isfile(os.path.join(d, "libcuda.so")):
                link_dir, stub, how["libcuda"] = d, True, "the toolkit's driver stub"
                break
    return Toolchain(nvcc, cuda_home, fatbinary, cuobjdump, link_dir, stub, how)


def _expand_roots(roots: tuple[str, ...]) -> list[str]:
    out = []
    for root in roots:
        if any(ch in root for ch in "*?["):
            out += sorted(glob.glob(root), key=_version_key, reverse=True)
        else:
            out.append(root)
    return out


def _version_key(path: str) -> tuple[int, ...]:
    return tuple(int(n) for n in re.findall(r"\d+", os.path.basename(path)))


def _executable(path: str) -> bool:
    return os.path.isfile(path) and os.access(path, os.X_OK)


def _which(name: str, path: str) -> str | None:
    for d in path.split(os.pathsep):
        candidate = os.path.join(d, name)
        if d and _executable(candidate):
            return candidate
    return None


def _prepend(item: str, path: str) -> str:
    parts = [p for p in path.split(os.pathsep) if p and p != item]
    return os.pathsep.join([item, *parts])
