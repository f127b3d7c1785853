"""torch's shared libraries and this host's facts, found without importing torch.

The torch-free loader needs the torch wheel installed, for its ``libc10`` and ``libtorch_cpu`` (the
compiled code is linked against them), but never imports the Python package (about 1 s and 100 MB
a process). This module finds the wheel on ``sys.path`` and reads its version from
``torch/version.py``; gathers the facts ``loader.host``'s compatibility check compares (CPU features
from the kernel's ``/proc/cpuinfo``, under the names torch's cpuinfo gives them); and starts the
runtime: OpenMP reads its settings when ``libgomp`` loads, so they are put in the environment first.
"""

from __future__ import annotations

import ctypes
import functools
import os
import platform
import re
import sys
import threading
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from ..cuda import CudaFacts
from ..errors import LoaderError
from ..host import CPU_CAPABILITY_ORDER, HostFacts
from ..threads import WAIT_POLICY_ENV, cpu_allowance, default_threads, openmp_env, threading_problems, warn_once
from .capi import Shim, open_library

LIBRARIES = ("libc10.so", "libtorch_cpu.so")
OPENMP = "libgomp.so.1"  # torch's wheel ships the one its compiled code is built against
GLOBAL_DEPS = "libtorch_global_deps.so"  # what `import torch` opens first, RTLD_GLOBAL (OpenMP and friends)
VERSION_RE = re.compile(r"""^__version__\s*=\s*['"]([^'"]+)['"]""", re.MULTILINE)
CUDA_RE = re.compile(r"""^cuda\s*(?::[^=]*)?=\s*['"]([^'"]+)['"]""", re.MULTILINE)

# /proc/cpuinfo flag -> torch.cpu.get_capabilities() name, where they differ beyond "avx512x" -> "avx512_x".
CPUINFO_NAMES = {"fma": "fma3", "pni": "sse3", "bmi1": "bmi", "abm": "lzcnt", "sha_ni": "sha"}


@dataclass(frozen=True)
class TorchLibraries:
    """An installed torch wheel, as the torch-free loader uses it: its folder and version."""

    folder: Path  # .../site-packages/torch
    version: str  # torch.__version__, read from torch/version.py
    cuda: str | None  # torch.version.cuda: None for a CPU build

    @property
    def lib(self) -> Path:
        return self.folder / "lib"


def find_torch(paths: list[str] | None = None) -> TorchLibraries:
    """The first torch wheel on ``paths`` (default ``sys.path``) that has its shared libraries."""
    for entry in sys.path if paths is None else paths:
        folder = Path(entry or ".") / "torch"
        version_file = folder / "version.py"
        if not all((folder / "lib" / name).is_file() for name in LIBRARIES) or not version_file.is_file():
            continue
        try:
            text = version_file.read_text(encoding="utf-8")
        except OSError:
            continue
        version = VERSION_RE.search(text)
        if version is None:
            continue
        cuda = CUDA_RE.search(text)
        return TorchLibraries(folder, version.group(1), cuda.group(1) if cuda else None)
    raise LoaderError(
        "the torch-free loader needs torch's shared libraries (torch/lib/libtorch_cpu.so of an installed torch "
        "wheel, on sys.path): none found; install the torch version the artifact was built with"
    )


@functools.cache
def host_facts(torch: TorchLibraries) -> HostFacts:
    """What ``loader.host.compatibility_problems`` compares, for this host and that torch."""
    features = cpu_features()
    return HostFacts(
        torch_version=torch.version,
        platform=platform.system().lower(),
        machine=platform.machine(),
        cpu_capability=cpu_capability(features),
        cpu_features=features,
        cuda=CudaFacts(torch.cuda),  # GPUs are not looked at: this path runs CPU variants only
    )


def cpu_features(cpuinfo: str | os.PathLike = "/proc/cpuinfo") -> frozenset[str]:
    """The CPU's features as the kernel lists them (x86 ``flags``, Arm ``Features``), named as
    torch's cpuinfo names them (``avx512f`` -> ``avx512_f``, ``fma`` -> ``fma3``)."""
    try:
        text = Path(cpuinfo).read_text(encoding="utf-8", errors="replace")
    except OSError:
        return frozenset()
    for line in text.splitlines():
        key, _, value = line.partition(":")
        if key.strip() in ("flags", "Features"):
            return frozenset(feature_name(flag) for flag in value.split())
    return frozenset()


def feature_name(flag: str) -> str:
    """A /proc/cpuinfo flag under the name torch.cpu.get_capabilities() gives it."""
    if flag in CPUINFO_NAMES:
        return CPUINFO_NAMES[flag]
    if flag.startswith("avx512") and not flag.startswith("avx512_"):
        return "avx512_" + flag[len("avx512") :]
    return flag


def cpu_capability(features: frozenset[str], environ: dict[str, str] | None = None) -> str:
    """What ``torch.backends.cpu.get_cpu_capability()`` would say: the best vector level the CPU
    has (torch's own test), lowered by ``ATEN_CPU_CAPABILITY`` as torch lowers it."""
    environ = os.environ if environ is None else environ
    if {"avx512_vl", "avx512_bw", "avx512_dq", "fma3"} <= features:
        best = "AVX512"
    elif {"avx2", "fma3"} <= features:
        best = "AVX2"
    else:
        best = "DEFAULT"
    asked = environ.get("ATEN_CPU_CAPABILITY", "").strip().upper()
    if asked in ("DEFAULT", "AVX2", "AVX512") and CPU_CAPABILITY_ORDER.index(asked) < CPU_CAPABILITY_ORDER.index(best):
        return asked
    return best


_runtime: Shim | None = None
_runtime_lock = threading.Lock()


def start_runtime(torch: TorchLibraries, threads: int | None = None) -> Shim:
    """Open torch's libraries once per process, OpenMP configured first; return libtorch's shim.

    Unless the process already runs an OpenMP runtime (torch imported, or an earlier load), the
    environment gets ``wait_env()``'s settings (a short spin, then sleep; unless set) and ``OMP_NUM_THREADS`` = ``threads``,
    by default the count torch would use, cut to the CPUs this process gets. A runtime already
    running keeps the count its owner gave it, unless ``threads`` asks for another (for the calling
    thread: OpenMP's setting is per thread). A ThreadingWarning says what still hurts, as
    ``loader.load`` does.
    """
    global _runtime
    allowance = cpu_allowance()
    with _runtime_lock:
        if _runtime is None and shim_in_global_scope():
            raise LoaderError(MIXED)
        count, _ = _configure_openmp(allowance, threads)
        if _runtime is None:
            try:
                deps = torch.lib / GLOBAL_DEPS
                if deps.is_file():
                    open_lazily(deps, ctypes.RTLD_GLOBAL)
                loaded = [open_lazily(torch.lib / name) for name in LIBRARIES]
            except OSError as e:
                raise LoaderError(f"{torch.lib}: cannot open torch's libraries ({e})") from None
            _runtime = Shim(loaded[-1])
    warn_once(threading_problems(allowance, threads=count, wait_policy=os.environ.get(WAIT_POLICY_ENV)))
    return _runtime


_standalone: Shim | None = None
SHIM_MARK = "precompile_shim_last_error"  # a symbol only precompile's shim exports
MIXED = (
    "this process runs standalone variants on precompile's shim, which provides the aoti_torch_* calls to "
    "every library opened after it: a variant that needs libtorch_cpu cannot run beside them (serve it from "
    "another process, or build it standalone too)"
)


def shim_in_global_scope() -> bool:
    """Whether precompile's shim provides this process's ``aoti_torch_*`` symbols (a standalone
    variant was opened on it): libraries opened later bind to it before their own libtorch_cpu."""
    try:
        getattr(ctypes.CDLL(None), SHIM_MARK)
    except AttributeError:
        return False
    return True


def start_standalone_runtime(shim: Path, torch: TorchLibraries | None = None, threads: int | None = None) -> Shim:
    """What runs standalone variants: OpenMP and precompile's own tensor shim (``shim``, shipped in
    a standalone artifact), never libc10 or libtorch_cpu, whose calls are all that a standalone
    variant's library makes. OpenMP is configured first, as ``start_runtime`` does; it is torch's
    ``libgomp`` where a torch wheel is found (the one the variant was built against), else the
    system's. The shim is opened RTLD_GLOBAL, so that each variant's library (opened RTLD_LOCAL)
    binds its ``aoti_torch_*`` and SLEEF calls to it.

    One provider of those calls per process: the first shim opened serves every later standalone
    variant (each artifact's is built from the same source), and where torch's libraries run
    already (``start_runtime``, or ``import torch``), they do: libtorch_cpu is made global instead.
    """
    global _standalone
    if torch is not None and (_runtime is not None or torch_libraries_loaded()):
        runtime = start_runtime(torch, threads)
        expose_libtorch(torch)
        return runtime
    allowance = cpu_allowance()
    with _runtime_lock:
        count, fresh = _configure_openmp(allowance, threads)
        if fresh:
            gomp = torch.lib / OPENMP if torch is not None and (torch.lib / OPENMP).is_file() else None
            try:
                ctypes.CDLL(str(gomp) if gomp is not None else OPENMP, mode=ctypes.RTLD_GLOBAL)
            except OSError as e:
                raise LoaderError(f"cannot open the OpenMP runtime ({OPENMP}): {e}") from None
        if _standalone is None:
            try:
                _standalone = Shim(ctypes.CDLL(str(shim), mode=ctypes.RTLD_GLOBAL), where="the standalone shim")
            except OSError as e:
                raise LoaderError(f"{shim}: cannot open the standalone shim ({e})") from None
    warn_once(threading_problems(allowance, threads=count, wait_policy=os.environ.get(WAIT_POLICY_ENV)))
    return _standalone


def torch_libraries_loaded(maps: str | os.PathLike = "/proc/self/maps") -> bool:
    """Whether libtorch_cpu is mapped in this process (torch imported, or its libraries opened)."""
    try:
        return "/libtorch_cpu.so" in Path(maps).read_text(encoding="utf-8", errors="replace")
    except OSError:
        return False


def expose_libtorch(torch: TorchLibraries) -> None:
    """Make the loaded libtorch_cpu's symbols global (it is opened RTLD_LOCAL), so that a
    standalone variant, linked without it, finds its C shim."""
    try:
        ctypes.CDLL(str(torch.lib / LIBRARIES[-1]), mode=ctypes.RTLD_GLOBAL | getattr(os, "RTLD_NOLOAD", 0))
    except OSError as e:
        raise LoaderError(f"{torch.lib}: cannot make libtorch_cpu's symbols global ({e})") from None


def _configure_openmp(allowance, threads: int | None) -> tuple[int, bool]:
    """OpenMP's thread count for this process, and whether its runtime is still to be opened: then
    its settings are put in the environment first (it reads them as it loads); a runtime already
    running keeps its count unless ``threads`` asks for another (for the calling thread)."""
    running = openmp_library()
    if running is None:
        count = threads if threads is not None else default_threads(allowance)
        os.environ.update(openmp_env(count))
        return count, True
    openmp = ctypes.CDLL(running)
    if threads is not None:
        openmp.omp_set_num_threads(threads)
    return openmp.omp_get_max_threads(), False


def start_runtime_soon(torch: TorchLibraries, threads: int | None = None) -> Callable[[], Shim]:
    """``start_runtime`` in another thread, so that opening torch's libraries (mostly the dynamic
    linker's relocations, CPU-bound, the GIL released) overlaps the load's reading and hashing of
    the artifact; the function returned waits for it and returns the shim (or raises its error)."""
    done: list = []

    def run() -> None:
        try:
            done.append(start_runtime(torch, threads))
        except BaseException as e:  # noqa: BLE001 -- raised again to the caller that waits
            done.append(e)

    thread = threading.Thread(target=run, name="open-torch-libraries", daemon=True)
    thread.start()

    def wait() -> Shim:
        thread.join()
        if isinstance(done[0], BaseException):
            raise done[0]
        return done[0]

    return wait


RTLD_LAZY = getattr(os, "RTLD_LAZY", 1)


def open_lazily(path: Path, mode: int = 0) -> ctypes.CDLL:
    """``ctypes.CDLL(path)``, but with lazy binding: ctypes always asks for RTLD_NOW, which binds
    every one of libtorch_cpu's function symbols up front (79,340 relocations of the three libraries
    against 34,911 lazily, counted with ``LD_DEBUG=statistics``); the rest are bound at their first
    call. Only for torch's own libraries, whose symbols are all there: a variant's library is opened
    with RTLD_NOW, so that one built against another torch fails to open instead of at a call."""
    return open_library(path, RTLD_LAZY | mode)


def openmp_library(maps: str | os.PathLike = "/proc/self/maps") -> str | None:
    """The path of the OpenMP runtime (libgomp) this process has loaded already, or None."""
    try:
        text = Path(maps).read_text(encoding="utf-8", errors="replace")
    except OSError:
        return None
    for line in text.splitlines():
        path = line.split(maxsplit=5)[-1] if line.count(" ") >= 5 else ""
        if "/libgomp" in path:
            return path.strip()
    return None
