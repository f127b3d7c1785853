"""How many CPUs this process really gets, and whether torch's threading fits them.

A container's CPU quota (cgroup ``cpu.max``, or ``cpu.cfs_quota_us`` on cgroup v1) and the process's
affinity mask can give it far fewer CPUs than the host has; torch sizes its OpenMP pool from the
host's cores. Too many threads for the CPUs at hand, or OpenMP threads that spin-wait between
parallel regions while other processes want the same cores, make every call far slower than a fair
share of the machine (measured: 6.6× slower beside two neighbours on 2 cores, against 2.7× with
``OMP_WAIT_POLICY=PASSIVE``).

The wait policy is read once, when the OpenMP runtime starts (at ``import torch``), so only a
process's launcher can set it: ``precompile serve`` does so for itself, ``import loader`` before
torch does so for a library user who has not set it, and ``load()`` warns when the settings will hurt. The torch-free loader starts the
runtime itself (``loader.native``), so it sets ``openmp_env()`` before it does. Only the functions
that ask torch import it.
"""

from __future__ import annotations

import math
import os
import threading
import warnings
from dataclasses import dataclass
from pathlib import Path

from .constants import SPIN_COUNT, SPIN_COUNT_ENV, WAIT_POLICY, WAIT_POLICY_ENV

THREADS_ENV = "OMP_NUM_THREADS"


class ThreadingWarning(UserWarning):
    """torch's threading does not fit the CPUs this process gets."""


@dataclass(frozen=True)
class CpuAllowance:
    host: int  # the host's logical CPUs
    affinity: int  # CPUs this process may run on (sched_getaffinity)
    quota: float | None  # CPUs' worth of time per period the cgroup allows; None: no quota

    @property
    def cpus(self) -> int:
        """The threads worth running: the affinity mask, cut to the quota rounded up."""
        n = self.affinity
        if self.quota is not None:
            n = min(n, max(1, math.ceil(self.quota)))
        return max(1, n)

    def describe(self) -> str:
        parts = [f"{self.affinity} of {self.host} CPUs in its affinity mask"]
        if self.quota is not None:
            parts.append(f"a cgroup quota of {self.quota:g} CPUs")
        return ", ".join(parts)


def cpu_allowance(
    cgroup_root: str | os.PathLike = "/sys/fs/cgroup", proc_cgroup: str | os.PathLike = "/proc/self/cgroup"
) -> CpuAllowance:
    """This process's CPUs: affinity and the tightest cgroup CPU quota on its path (v2 or v1)."""
    host = os.cpu_count() or 1
    try:
        affinity = len(os.sched_getaffinity(0))
    except (AttributeError, OSError):  # not on Linux
        affinity = host
    return CpuAllowance(host, affinity, _cgroup_quota(Path(cgroup_root), Path(proc_cgroup)))


def _cgroup_quota(root: Path, proc_cgroup: Path) -> float | None:
    try:
        lines = proc_cgroup.read_text().splitlines()
    except OSError:
        return None
    quotas = []
    for line in lines:
        _, controllers, path = (line.split(":", 2) + ["", ""])[:3]
        rel = path.strip("/")
        if controllers == "":  # cgroup v2: one unified hierarchy
            quotas += [q for d in _ancestors(root, rel) if (q := _read_v2(d / "cpu.max")) is not None]
        elif "cpu" in controllers.split(","):
            for mount in (root / controllers, root / "cpu", root / "cpu,cpuacct"):
                if mount.is_dir():
                    quotas += [q for d in _ancestors(mount, rel) if (q := _read_v1(d)) is not None]
                    break
    return min(quotas) if quotas else None


def _ancestors(mount: Path, rel: str) -> list[Path]:
    """The cgroup's folder and each parent up to the mount: a quota anywhere above applies too.
    Inside a container the path may not exist under the mount (it is the container's root)."""
    parts = [p for p in rel.split("/") if p]
    return [mount.joinpath(*parts[:i]) for i in range(len(parts), -1, -1)]


def _read_v2(path: Path) -> float | None:
    try:
        quota, period = path.read_text().split()[:2]
    except (OSError, ValueError):
        return None
    if quota == "max":
        return None
    try:
        return int(quota) / int(period)
    except (ValueError, ZeroDivisionError):
        return None


def _read_v1(folder: Path) -> float | None:
    try:
        quota = int((folder / "cpu.cfs_quota_us").read_text())
        period = int((folder / "cpu.cfs_period_us").read_text())
    except (OSError, ValueError):
        return None
    if quota <= 0 or period <= 0:
        return None
    return quota / period


def threading_problems(
    allowance: CpuAllowance | None = None,
    *,
    threads: int | None = None,
    wait_policy: str | None = None,
    load: float | None = None,
    spin_count: str | None = None,
) -> list[str]:
    """Why torch's threading will hurt in this process, as sentences with the fix; [] when it fits.
    ``load``: the host's runnable work (default: its load average over the last minute);
    ``spin_count``: ``GOMP_SPINCOUNT`` (default: this process's)."""
    allowance = allowance or cpu_allowance()
    if threads is None:
        import torch

        threads = torch.get_num_threads()
    policy = os.environ.get(WAIT_POLICY_ENV) if wait_policy is None else wait_policy
    spin_count = os.environ.get(SPIN_COUNT_ENV) if spin_count is None else spin_count
    load = _load_average() if load is None else load
    problems = []
    if threads > allowance.cpus:
        problems.append(
            f"torch uses {threads} threads but this process gets {allowance.cpus} CPU(s) ({allowance.describe()}): "
            f"call torch.set_num_threads({allowance.cpus}) or load(..., threads={allowance.cpus})"
        )
    shared = allowance.cpus < allowance.host or allowance.quota is not None
    crowded = load + threads > allowance.host  # other work cannot all run beside these threads
    if threads > 1 and (shared or crowded) and not sleeps_when_idle(policy, spin_count):
        where = allowance.describe() if shared else f"a load of {load:.1f} on {allowance.host} CPUs"
        problems.append(
            f"OpenMP threads spin-wait between calls ({WAIT_POLICY_ENV} is {policy or 'unset'}, "
            f"{SPIN_COUNT_ENV} {spin_count or 'unset'}) on a host they share ({where}): neighbours slow every call; "
            f"start the process with {WAIT_POLICY_ENV}={WAIT_POLICY} {SPIN_COUNT_ENV}={SPIN_COUNT} (a spin of "
            "0.1 ms, then sleep), or import loader before torch (the policy is read when torch is imported)"
        )
    elif threads > 1 and load >= 1 and crowded and _spins(spin_count):
        # At least one busy neighbour on average, and no CPU left for every thread of the team: a parallel
        # region waits for its slowest thread, and a thread that spins before it sleeps loses its CPU to
        # the neighbour at the next region (bench.spin, MobileNetV2 on 2 threads beside one busy process:
        # 3-9x slower per call with the short spin than sleeping at once; one thread beats both).
        free = max(1, int(allowance.host - load))
        problems.append(
            f"{threads} OpenMP threads spin briefly before they sleep ({SPIN_COUNT_ENV}={spin_count}) on a host "
            "whose other work "
            f"(a load of {load:.1f} on {allowance.host} CPUs) leaves them about {free} CPU(s): every call waits on a "
            f"thread that lost its CPU; use the CPUs left (load(..., threads={free}); for precompile serve, "
            f"OMP_NUM_THREADS={free}), or start the process with {SPIN_COUNT_ENV}=0"
        )
    return problems


def _spins(count: str | None) -> bool:
    """Whether libgomp spins before it sleeps under the passive policy (an unset count: it does not)."""
    return (_count(count) or 0) > 0


def _count(text: str | None) -> int | None:
    """``GOMP_SPINCOUNT`` as a number of spins; None where unset or not a number."""
    try:
        return int((text or "").strip())
    except ValueError:
        return None


def _load_average() -> float:
    try:
        return os.getloadavg()[0]
    except OSError:  # not known on this platform
        return 0.0


_warned = False


def fit_threads(threads: int | None = None) -> int:
    """Size torch's thread pool for this process: ``threads`` if given, else cut torch's count to the
    CPUs the process gets. Warns once per process (ThreadingWarning) about what still hurts."""
    import torch

    allowance = cpu_allowance()
    want = threads if threads is not None else min(torch.get_num_threads(), allowance.cpus)
    if want != torch.get_num_threads():
        torch.set_num_threads(want)
    warn_once(threading_problems(allowance, threads=want))
    return want


def warn_once(problems: list[str]) -> None:
    """One ThreadingWarning per process for ``threading_problems``' sentences (none when empty)."""
    global _warned
    if problems and not _warned:
        _warned = True
        warnings.warn("precompile: " + "; ".join(problems), ThreadingWarning, stacklevel=4)


MAX_RUNNERS = 8


def concurrent_runners(allowance: CpuAllowance | None = None) -> int:
    """How many calls one CPU variant runs at once: one per CPU this process gets, at most
    MAX_RUNNERS. AOTInductor runs each call on one of its container's model instances (they share
    the constants; each holds its activations) and makes a call wait while all are busy, so this
    bounds what execution or batch instances, or a caller's own threads, can run side by side."""
    return max(1, min(MAX_RUNNERS, (allowance or cpu_allowance()).cpus))


def default_threads(allowance: CpuAllowance | None = None, environ: dict[str, str] | None = None) -> int:
    """The thread count ``fit_threads`` gives torch by default, found without torch: its own default
    (``OMP_NUM_THREADS``, else the host's physical cores) cut to the CPUs this process gets."""
    allowance = allowance or cpu_allowance()
    environ = os.environ if environ is None else environ
    try:
        wanted = int(environ.get(THREADS_ENV, ""))
    except ValueError:
        wanted = 0
    return max(1, min(wanted if wanted > 0 else physical_cores(), allowance.cpus))


def physical_cores(cpus: str | os.PathLike = "/sys/devices/system/cpu") -> int:
    """The host's physical cores (what torch sizes its pool by), from the kernel's CPU topology."""
    cores = set()
    for topology in Path(cpus).glob("cpu[0-9]*/topology"):
        try:
            cores.add((topology / "core_cpus_list").read_text().strip())
        except OSError:
            try:
                cores.add((topology / "thread_siblings_list").read_text().strip())
            except OSError:
                continue
    return len(cores) or os.cpu_count() or 1


def wait_env(environ: dict[str, str] | None = None) -> dict[str, str]:
    """How idle OpenMP threads wait, what is to be added to ``environ`` (default ``os.environ``) before
    the runtime starts: a short spin (``GOMP_SPINCOUNT``, ``constants.SPIN_COUNT``: about 0.1 ms), so
    the parallel regions of one call (one per kernel, microseconds apart) do not each pay a wake-up,
    then sleep, so a thread idle between calls leaves its CPU to other work. Where no policy is set:
    ``OMP_WAIT_POLICY=ACTIVE`` with that count, which libgomp reads as "spin that long, then sleep",
    and which keeps a short spin where several threads run teams (``constants.WAIT_POLICY``); where the
    user set a policy of passive, the count alone. A count the user set is kept (``GOMP_SPINCOUNT=0``
    sleeps at once); a policy the user set with no count is theirs (ACTIVE alone spins forever)."""
    environ = os.environ if environ is None else environ
    env = {}
    if WAIT_POLICY_ENV not in environ:
        env[WAIT_POLICY_ENV] = WAIT_POLICY
        if SPIN_COUNT_ENV not in environ:
            env[SPIN_COUNT_ENV] = SPIN_COUNT
    elif environ[WAIT_POLICY_ENV].strip().lower() == "passive" and SPIN_COUNT_ENV not in environ:
        env[SPIN_COUNT_ENV] = SPIN_COUNT
    return env


def sleeps_when_idle(policy: str | None, spin_count: str | None) -> bool:
    """Whether libgomp's idle threads go to sleep, after a spin of at most ``spin_count``: the passive
    policy, or any policy with a count given. Unset, they spin 3 ms; ACTIVE alone, forever."""
    return (policy or "").strip().lower() == "passive" or _count(spin_count) is not None


def openmp_env(
    threads: int | None = None, *, workers: int = 1, environ: dict[str, str] | None = None
) -> dict[str, str]:
    """The OpenMP settings to add before the runtime starts: how idle threads wait (``wait_env``: sleep
    after a short spin) unless the user chose, and ``OMP_NUM_THREADS`` = ``threads``
    when given, else (unless the user set it) each of ``workers``' share of the CPUs this process gets."""
    environ = os.environ if environ is None else environ
    env = wait_env(environ)
    if threads is not None:
        env[THREADS_ENV] = str(threads)
    elif THREADS_ENV not in environ:
        env[THREADS_ENV] = str(max(1, cpu_allowance().cpus // workers))
    return env


# oneDNN keeps the kernels it compiled for each (primitive, shape) in one cache per process, and ideep
# its plan for each in one cache per calling thread; both hold 1024 entries by default and are sized
# from these variables once, at their first use (the first convolution or matmul torch runs).
ONEDNN_CACHE_ENV = ("ONEDNN_PRIMITIVE_CACHE_CAPACITY", "LRU_CACHE_CAPACITY")
# A dynamic variant meets a new entry per layer for each new shape: ResNet-50's ~70 primitives a call
# fill 1024 entries in 15 shapes, after which every shape evicts another and pays oneDNN's compile
# again. 8192 keeps ~120 shapes of such a network compiled (a few KB to ~100 KB of code each).
ONEDNN_CACHE_CAPACITY = 8192


def onednn_cache_env(environ: dict[str, str] | None = None) -> dict[str, str]:
    """oneDNN's cache sizes to add before its first use (``import loader`` sets them before torch,
    so every load meets them): ``ONEDNN_CACHE_CAPACITY`` entries each, unless the user set a size."""
    environ = os.environ if environ is None else environ
    return {name: str(ONEDNN_CACHE_CAPACITY) for name in ONEDNN_CACHE_ENV if name not in environ}


# How much nicer (lower priority) than the process a thread doing background work runs (the
# background opener, a server's load of one model while others serve).
BACKGROUND_NICENESS = 10


def lower_priority() -> None:
    """Make the calling thread (and the threads it starts from now on: OpenMP's team, which a
    warm-up call starts) yield the CPUs to the process's others, ``BACKGROUND_NICENESS`` nicer.
    Linux gives each thread its own nice value; elsewhere this does nothing. Not undone: an
    unprivileged thread cannot raise its priority again."""
    try:
        tid = threading.get_native_id()
        os.setpriority(os.PRIO_PROCESS, tid, os.getpriority(os.PRIO_PROCESS, tid) + BACKGROUND_NICENESS)
    except (AttributeError, OSError):
        pass
