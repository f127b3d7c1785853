"""What this host is, and whether an artifact's compiled code can run on it.

Checked before any compiled code is touched: the code is tied to libtorch's ABI (torch version),
to a device type, and to the CPU instruction set it was compiled for.
"""

from __future__ import annotations

import platform
import re

import torch

from .errors import IncompatibleArtifactError
from .manifest import Manifest

# torch.backends.cpu.get_cpu_capability() values, weakest first. Code built for one level runs on
# that level and every level after it.
CPU_CAPABILITY_ORDER = ("DEFAULT", "VSX", "ZVECTOR", "NO AVX", "AVX2", "AVX512")


def cpu_capability() -> str:
    return torch.backends.cpu.get_cpu_capability()


def torch_release(version: str) -> tuple[int, int]:
    """'2.13.0+cpu' -> (2, 13): the part of a torch version that fixes libtorch's ABI."""
    m = re.match(r"(\d+)\.(\d+)", version)
    return (int(m.group(1)), int(m.group(2))) if m else (-1, -1)


def compatibility_problems(manifest: Manifest, device: str) -> list[str]:
    """Every reason this artifact cannot run here, as sentences saying what it needs."""
    problems = []
    target = manifest.target
    if device != target.device:
        problems.append(f"device: the artifact was built for {target.device}, asked to load on {device}")
    built, here = torch_release(manifest.torch_version), torch_release(torch.__version__)
    if built != here:
        problems.append(
            f"torch: built with {manifest.torch_version}, this host has {torch.__version__}; compiled code is "
            f"tied to libtorch's ABI, so install torch {built[0]}.{built[1]}.x or rebuild the artifact"
        )
    if platform.system().lower() != target.platform or platform.machine() != target.machine:
        problems.append(
            f"platform: built for {target.platform}/{target.machine}, this host is "
            f"{platform.system().lower()}/{platform.machine()}"
        )
    if target.device == "cpu":
        need, have = target.cpu_capability, cpu_capability()
        if need in CPU_CAPABILITY_ORDER and have in CPU_CAPABILITY_ORDER:
            if CPU_CAPABILITY_ORDER.index(have) < CPU_CAPABILITY_ORDER.index(need):
                problems.append(
                    f"cpu: the code was compiled for {need}, this CPU offers {have}; rebuild on a host "
                    f"with {have} or older instructions"
                )
        elif need != have:
            problems.append(f"cpu: the code was compiled for {need!r}, this CPU reports {have!r}")
    return problems


def check_compatible(manifest: Manifest, device: str) -> None:
    problems = compatibility_problems(manifest, device)
    if problems:
        raise IncompatibleArtifactError(
            f"artifact {manifest.name!r} cannot run on this host:\n" + "\n".join(f"  - {p}" for p in problems)
        )
