"""What this host is, and whether an artifact's compiled code can run on it.

Checked before any compiled code is touched: the code is tied to libtorch's ABI (torch version),
to a platform and machine, to a device type, to the CPU instruction set it was compiled for and, for
CUDA variants, to the GPUs' compute capabilities (``loader.cuda``). An AVX-512 build opened on an
AVX2-only CPU would die of SIGILL at the first call; it is refused here instead, with every mismatch
and what the artifact needs.

The host's facts are gathered once (``host_facts()``) from torch and the standard library, without
compiling or probing anything; every check takes them as an argument, so tests can feed recorded
facts of other machines, and the torch-free loader its own (``loader.native.libs``). torch is
imported by the functions that read it, so the checks themselves run without it.
"""

from __future__ import annotations

import functools
import platform
import re
from dataclasses import dataclass

from . import cuda as cuda_host
from .cuda import CudaFacts, cuda_problems, parse_device
from .errors import IncompatibleArtifactError
from .isa import NATIVE, isa_problem, present_isas
from .manifest import Manifest

# torch.backends.cpu.get_cpu_capability() values, weakest first. Code built for one level runs on
# that level and every level after it. Only used for manifests that do not record AOTI_CPU_ISA.
CPU_CAPABILITY_ORDER = ("DEFAULT", "VSX", "ZVECTOR", "NO AVX", "AVX2", "AVX512")

# AOTInductor records the vector ISA it compiled for as AOTI_CPU_ISA: str(pick_vec_isa()).upper(),
# e.g. "AVX2", "AVX512 AVX512_VNNI", "AVX512 AVX512_VNNI AMX_TILE", "ASIMD". Each word needs the CPU
# features (torch.cpu.get_capabilities() names) behind the compiler flags Inductor builds it with
# (torch/_inductor/cpu_vec_isa.py: -mavx2 -mfma -mf16c; -mavx512f -mavx512dq -mavx512vl -mavx512bw
# -mfma; -mavx512vnni; -mamx-tile -mamx-bf16 -mamx-int8). ASIMD, VSX and ZVECTOR are the baseline of
# their machine architecture, which the platform check covers.
ISA_FEATURES: dict[str, tuple[str, ...]] = {
    "AVX2": ("avx2", "fma3", "f16c"),
    "AVX512": ("avx512_f", "avx512_dq", "avx512_vl", "avx512_bw", "fma3"),
    "AVX512_VNNI": ("avx512_vnni",),
    "AMX_TILE": ("amx_tile", "amx_bf16", "amx_int8"),
    "ASIMD": (),
    "NEON": (),
    "VSX": (),
    "ZVECTOR": (),
}
NO_VECTOR_ISA = "INVALID_VEC_ISA"  # Inductor found no vector ISA: plain C++, runs on the machine type


@dataclass(frozen=True)
class HostFacts:
    """What the compatibility checks need to know about a host."""

    torch_version: str
    platform: str  # platform.system().lower()
    machine: str  # platform.machine()
    cpu_capability: str  # torch.backends.cpu.get_cpu_capability()
    cpu_features: frozenset[str]  # the CPU features present, by torch.cpu.get_capabilities() name
    cuda: CudaFacts | None = None  # the GPUs; None: not looked at yet (only CUDA loads need them)


@functools.cache
def host_facts() -> HostFacts:
    """This host's facts, CUDA left out: it is only looked at when a load asks for a GPU."""
    import torch

    return HostFacts(
        torch_version=torch.__version__,
        platform=platform.system().lower(),
        machine=platform.machine(),
        cpu_capability=cpu_capability(),
        cpu_features=cpu_features(),
    )


def cpu_capability() -> str:
    import torch

    return torch.backends.cpu.get_cpu_capability()


def cpu_features() -> frozenset[str]:
    """The CPU features this host has, as cpuinfo (through torch) reports them: no compiler is run."""
    import torch

    get = getattr(torch.cpu, "get_capabilities", None)
    if get is not None:
        return frozenset(name for name, present in get().items() if present is True)
    # Older torch: the private helpers Inductor's own ISA picker calls.
    helpers = {
        "_is_avx2_supported": ISA_FEATURES["AVX2"],
        "_is_avx512_supported": ISA_FEATURES["AVX512"],
        "_is_vnni_supported": ISA_FEATURES["AVX512_VNNI"],
        "_is_amx_tile_supported": ISA_FEATURES["AMX_TILE"],
    }
    return frozenset(f for name, feats in helpers.items() if getattr(torch.cpu, name, lambda: False)() for f in feats)


def torch_release(version: str) -> tuple[int, int]:
    """'2.13.0+cpu' -> (2, 13): the part of a torch version that fixes libtorch's ABI."""
    m = re.match(r"(\d+)\.(\d+)", version)
    return (int(m.group(1)), int(m.group(2))) if m else (-1, -1)


def compatibility_problems(manifest: Manifest, device: str, host: HostFacts | None = None) -> list[str]:
    """Every reason this artifact cannot run on ``device`` ('cpu', 'cuda', 'cuda:1') of ``host`` (default:
    this one), as sentences saying what the artifact needs."""
    host = host or host_facts()
    kind, index = parse_device(device)
    problems = []
    kinds = sorted({v.device for v in manifest.variants})
    if kind == "cuda" and manifest.cuda is None:
        problems += cuda_problems(None, 0, CudaFacts(None))
    elif kind not in kinds:
        problems.append(f"device: the artifact has {', '.join(kinds)} variants only, asked to load on {device}")
    built, here = torch_release(manifest.torch_version), torch_release(host.torch_version)
    if built != here:
        problems.append(
            f"torch: built with {manifest.torch_version}, this host has {host.torch_version}; compiled code is "
            f"tied to libtorch's ABI, so install torch {built[0]}.{built[1]}.x or rebuild the artifact"
        )
    target = manifest.target
    if host.platform != target.platform or host.machine != target.machine:
        problems.append(
            f"platform: built for {target.platform}/{target.machine}, this host is {host.platform}/{host.machine}"
        )
    elif kind == "cpu" and kind in kinds:
        problem = _cpu_problem(manifest, host)
        if problem:
            problems.append(problem)
    if kind == "cuda" and manifest.cuda is not None:
        problems += cuda_problems(manifest.cuda, index, host.cuda if host.cuda is not None else cuda_host.host_facts())
    return problems


def _cpu_problem(manifest: Manifest, host: HostFacts) -> str | None:
    """Why this host runs none of the artifact's CPU code: the native code's vector ISA, or each of
    the x86-64 levels it was built for (``loader.isa``)."""
    return isa_problem(manifest.variants, host.cpu_features, native_cpu_problem(manifest, host))


def native_cpu_problem(manifest: Manifest, host: HostFacts) -> str | None:
    """Why this host cannot run the artifact's native CPU code (built for the build host's own ISA):
    the vector ISA AOTInductor recorded, or for older builds torch's CPU capability."""
    if NATIVE not in present_isas(manifest.variants):
        return None
    isa = " ".join(manifest.target.aoti_cpu_isa.upper().split())
    if not isa:
        return _capability_problem(manifest.target.cpu_capability, host.cpu_capability)
    if isa == NO_VECTOR_ISA:
        return None
    words = isa.split()
    unknown = [w for w in words if w not in ISA_FEATURES]
    if unknown:
        return (
            f"cpu: the code was compiled for {isa}; this loader does not know {', '.join(unknown)} and cannot tell "
            "whether this CPU runs it"
        )
    missing = sorted({f for w in words for f in ISA_FEATURES[w]} - host.cpu_features)
    if not missing:
        return None
    offers = best_isa(host.cpu_features)
    return (
        f"cpu: the code was compiled for {isa} and needs {', '.join(missing)}, which this CPU lacks (it offers "
        f"{offers or 'no vector instruction set Inductor uses'}); rebuild with cpu: {{isa: [x86-64-v3, x86-64-v4]}} "
        f"for portable code, or for this CPU, e.g. on a build host with ATEN_CPU_CAPABILITY="
        f"{(offers or 'default').split()[0].lower()}"
    )


def best_isa(features: frozenset[str]) -> str:
    """The AOTI_CPU_ISA an x86 build on a CPU with these features would record, at best ('' if none)."""
    for isa in ("AVX512 AVX512_VNNI AMX_TILE", "AVX512 AVX512_VNNI", "AVX512", "AVX2"):
        if all(f in features for w in isa.split() for f in ISA_FEATURES[w]):
            return isa
    return ""


def _capability_problem(need: str, have: str) -> str | None:
    if need in CPU_CAPABILITY_ORDER and have in CPU_CAPABILITY_ORDER:
        if CPU_CAPABILITY_ORDER.index(have) < CPU_CAPABILITY_ORDER.index(need):
            return f"cpu: the code was compiled for {need}, this CPU offers {have}; rebuild on a host with {have}"
        return None
    if need != have:
        return f"cpu: the code was compiled for {need!r}, this CPU reports {have!r}"
    return None


def check_compatible(manifest: Manifest, device: str, host: HostFacts | None = None) -> None:
    problems = compatibility_problems(manifest, device, host)
    if problems:
        raise IncompatibleArtifactError(
            f"artifact {manifest.name!r} cannot run on this host:\n" + "\n".join(f"  - {p}" for p in problems)
        )
