"""The CPUs a process really gets (affinity, cgroup v1 and v2 quotas) and the threading warnings."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import textwrap
import warnings
from pathlib import Path

import pytest
import torch

from loader import threads as T
from loader.malloc import malloc_env
from loader.threads import CpuAllowance, cpu_allowance, threading_problems

ROOT = Path(__file__).resolve().parent.parent


def cgroup_v2(tmp_path, quota: str, path: str = "/kubepods/pod1/ctr") -> tuple:
    folder = tmp_path.joinpath("fs", *path.strip("/").split("/"))
    folder.mkdir(parents=True)
    (folder / "cpu.max").write_text(quota + "\n")
    proc = tmp_path / "cgroup"
    proc.write_text(f"0::{path}\n")
    return tmp_path / "fs", proc


def test_a_v2_quota_limits_the_cpus(tmp_path):
    root, proc = cgroup_v2(tmp_path, "150000 100000")
    allowance = cpu_allowance(root, proc)
    assert allowance.quota == 1.5
    assert allowance.cpus == min(allowance.affinity, 2)


def test_a_quota_on_a_parent_cgroup_applies(tmp_path):
    root, proc = cgroup_v2(tmp_path, "max 100000")
    (root / "kubepods" / "cpu.max").write_text("50000 100000\n")
    assert cpu_allowance(root, proc).quota == 0.5
    assert cpu_allowance(root, proc).cpus == 1


def test_no_quota_leaves_the_affinity(tmp_path):
    root, proc = cgroup_v2(tmp_path, "max 100000")
    allowance = cpu_allowance(root, proc)
    assert allowance.quota is None and allowance.cpus == allowance.affinity


def test_a_v1_quota_limits_the_cpus(tmp_path):
    folder = tmp_path / "fs" / "cpu,cpuacct" / "docker" / "abc"
    folder.mkdir(parents=True)
    (folder / "cpu.cfs_quota_us").write_text("100000\n")
    (folder / "cpu.cfs_period_us").write_text("100000\n")
    proc = tmp_path / "cgroup"
    proc.write_text("5:cpu,cpuacct:/docker/abc\n4:memory:/docker/abc\n")
    assert cpu_allowance(tmp_path / "fs", proc).quota == 1.0


@pytest.mark.parametrize("text", ["", "garbage", "0::/nowhere\n"])
def test_unreadable_cgroup_files_mean_no_quota(tmp_path, text):
    proc = tmp_path / "cgroup"
    proc.write_text(text)
    assert cpu_allowance(tmp_path / "missing", proc).quota is None


def test_more_threads_than_cpus_is_a_problem_with_the_fix():
    (problem,) = threading_problems(
        CpuAllowance(host=8, affinity=8, quota=None), threads=16, wait_policy="PASSIVE", load=0.0
    )
    assert "torch uses 16 threads but this process gets 8 CPU(s)" in problem
    assert "torch.set_num_threads(8)" in problem


def test_spin_waiting_on_a_share_of_the_host_is_a_problem():
    share = CpuAllowance(host=64, affinity=64, quota=2.0)
    (problem,) = threading_problems(share, threads=2, wait_policy="", load=0.0, spin_count="")
    assert "OMP_WAIT_POLICY=ACTIVE GOMP_SPINCOUNT=10000" in problem and "a cgroup quota of 2 CPUs" in problem
    assert threading_problems(share, threads=2, wait_policy="passive", load=0.0) == []
    # any policy with a spin count sleeps after it; ACTIVE alone spins forever
    assert threading_problems(share, threads=2, wait_policy="ACTIVE", load=0.0, spin_count="10000") == []
    assert threading_problems(share, threads=2, wait_policy="ACTIVE", load=0.0, spin_count="") != []
    assert (
        threading_problems(
            CpuAllowance(host=4, affinity=4, quota=None), threads=4, wait_policy="", load=0.0, spin_count=""
        )
        == []
    )


def test_spin_waiting_beside_other_work_on_the_whole_host_is_a_problem():
    """No quota, no affinity mask, but the host's load and these threads do not fit its CPUs."""
    host = CpuAllowance(host=8, affinity=8, quota=None)
    (problem,) = threading_problems(host, threads=8, wait_policy="", load=0.5, spin_count="")
    assert "a load of 0.5 on 8 CPUs" in problem and "import loader before torch" in problem
    assert threading_problems(host, threads=4, wait_policy="", load=3.5, spin_count="") == []  # room for both
    assert threading_problems(host, threads=8, wait_policy="PASSIVE", load=6.0, spin_count="0") == []


def test_a_short_spin_beside_a_busy_neighbour_that_leaves_no_cpu_per_thread_is_a_problem():
    """The passive policy with GOMP_SPINCOUNT (what import loader sets): on 2 CPUs beside one busy
    process, 2 threads lose every parallel region to it (bench.spin: 3-9x slower per call)."""
    two = CpuAllowance(host=2, affinity=2, quota=None)
    (problem,) = threading_problems(two, threads=2, wait_policy="PASSIVE", load=1.1, spin_count="10000")
    assert "GOMP_SPINCOUNT=10000" in problem and "(a load of 1.1 on 2 CPUs) leaves them about 1 CPU(s)" in problem
    assert "load(..., threads=1)" in problem and "OMP_NUM_THREADS=1" in problem and "GOMP_SPINCOUNT=0" in problem
    assert threading_problems(two, threads=2, wait_policy="PASSIVE", load=1.1, spin_count="0") == []  # sleeps at once
    assert threading_problems(two, threads=1, wait_policy="PASSIVE", load=1.1, spin_count="10000") == []  # no team
    assert threading_problems(two, threads=2, wait_policy="PASSIVE", load=0.6, spin_count="10000") == []  # no neighbour
    eight = CpuAllowance(host=8, affinity=8, quota=None)
    assert threading_problems(eight, threads=4, wait_policy="PASSIVE", load=3.0, spin_count="10000") == []  # room
    assert threading_problems(eight, threads=8, wait_policy="PASSIVE", load=2.0, spin_count="junk") == []


def test_fit_threads_cuts_torch_to_the_allowance(monkeypatch):
    before = torch.get_num_threads()
    torch.set_num_threads(2)
    monkeypatch.setattr(T, "cpu_allowance", lambda: CpuAllowance(host=2, affinity=1, quota=None))
    try:
        assert T.fit_threads() == 1 and torch.get_num_threads() == 1
        assert T.fit_threads(threads=2) == 2 and torch.get_num_threads() == 2  # an explicit count wins
    finally:
        torch.set_num_threads(before)


def test_fit_threads_warns_once_per_process(monkeypatch):
    before = torch.get_num_threads()
    torch.set_num_threads(2)
    monkeypatch.setattr(T, "cpu_allowance", lambda: CpuAllowance(host=4, affinity=2, quota=None))
    monkeypatch.setattr(T, "_warned", False)
    monkeypatch.setenv("OMP_WAIT_POLICY", "ACTIVE")
    monkeypatch.delenv("GOMP_SPINCOUNT", raising=False)  # ACTIVE alone: spins forever
    try:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            T.fit_threads()
            T.fit_threads()
        (warning,) = [w for w in caught if issubclass(w.category, T.ThreadingWarning)]
        assert "OMP_WAIT_POLICY=ACTIVE GOMP_SPINCOUNT=10000" in str(warning.message)
    finally:
        torch.set_num_threads(before)


def test_serve_adds_the_wait_policy_and_thread_count_but_keeps_the_users():
    from precompile.serve.server import serving_env

    env = serving_env(2, environ={})
    assert env["OMP_WAIT_POLICY"] == "ACTIVE" and env["GOMP_SPINCOUNT"] == "10000"
    assert env["OMP_NUM_THREADS"] == str(max(1, cpu_allowance().cpus // 2))
    assert serving_env(1, environ={"OMP_WAIT_POLICY": "ACTIVE", "OMP_NUM_THREADS": "7"}, malloc="system") == {}
    # and the allocator serve preloads (loader.malloc), unless the user preloaded one
    assert serving_env(1, environ={}, malloc="auto").keys() >= malloc_env("auto", {}).keys()
    assert "LD_PRELOAD" not in serving_env(1, environ={"LD_PRELOAD": "/opt/libjemalloc.so.2"})


def test_serve_warns_where_the_user_keeps_the_passive_policy():
    """precompile keeps a policy the user set; PASSIVE makes every call from a second thread sleep at
    its barriers (loader.constants.WAIT_POLICY), so the server says what it costs and what to do."""
    from precompile.serve.server import passive_policy_warning

    said = passive_policy_warning({"OMP_WAIT_POLICY": " passive "})
    assert "up to 2x slower" in said and "unset it" in said and "--instances 1" in said
    assert passive_policy_warning({"OMP_WAIT_POLICY": "ACTIVE", "GOMP_SPINCOUNT": "10000"}) is None
    assert passive_policy_warning({}) is None


# --- compile threads of the build's workers (precompile.executors.local.compile_threads) ------------

# Each case's affinity is set before compile_threads asks for it (the first before the import, too).
SIZE_IN_SUBPROCESS = """
import json, os, sys
os.environ.pop("PRECOMPILE_COMPILE_THREADS", None)
cases, out = json.loads(sys.argv[1]), []
for cpus, jobs in cases:
    os.sched_setaffinity(0, set(cpus))
    from precompile.executors.local import compile_threads
    out.append(compile_threads(jobs))
print(json.dumps(out))
"""


def sized(*cases: tuple[list[int], int]) -> list[int]:
    """compile_threads(jobs) under each (CPUs allowed, jobs), in one fresh process (one import of torch)."""
    env = {**os.environ, "OMP_WAIT_POLICY": "PASSIVE"}
    out = subprocess.run(
        [sys.executable, "-c", SIZE_IN_SUBPROCESS, json.dumps(cases)],
        capture_output=True,
        text=True,
        env=env,
        check=True,
    )
    return json.loads(out.stdout)


@pytest.mark.integration
@pytest.mark.skipif(not hasattr(os, "sched_setaffinity"), reason="needs sched_setaffinity (Linux)")
def test_compile_threads_follow_the_affinity_mask_not_the_host():
    mine = sorted(os.sched_getaffinity(0))
    one, every, oversubscribed = sized((mine[:1], 1), (mine, 1), (mine, 2 * len(mine)))
    assert one == 1  # one CPU allowed: one compile thread, however many the host has
    assert every == min(len(mine), T.cpu_allowance().cpus)
    assert oversubscribed == 1  # never 0


def test_compile_threads_env_override_and_its_errors():
    from precompile.errors import PrecompileError
    from precompile.executors.local import compile_threads

    assert compile_threads(4, {"PRECOMPILE_COMPILE_THREADS": "3"}) == 3
    assert compile_threads(1, {"PRECOMPILE_COMPILE_THREADS": " "}) == compile_threads(1, {})
    for bad in ("abc", "0", "-2", "1.5"):
        with pytest.raises(
            PrecompileError,
            match=rf"PRECOMPILE_COMPILE_THREADS='{re.escape(bad)}': expected a whole number of threads, 1 or more",
        ):
            compile_threads(2, {"PRECOMPILE_COMPILE_THREADS": bad})


def test_a_bad_compile_threads_value_stops_the_build_with_one_line(tmp_path, monkeypatch):
    from click.testing import CliRunner

    from precompile.cli import main

    from .conftest import STRUCTURED_PROFILE, write_profile

    monkeypatch.setenv("PRECOMPILE_COMPILE_THREADS", "many")
    path = write_profile(tmp_path, STRUCTURED_PROFILE)
    result = CliRunner().invoke(
        main, ["build", str(path), "-o", str(tmp_path / "out"), "--jobs", "2"], catch_exceptions=False
    )
    assert result.exit_code == 1
    assert "PRECOMPILE_COMPILE_THREADS='many': expected a whole number of threads, 1 or more" in result.output
    assert "Traceback" not in result.output and not (tmp_path / "out").exists()


def python(code: str, **env: str) -> subprocess.CompletedProcess:
    """``code`` in a fresh interpreter, with OMP_WAIT_POLICY and GOMP_SPINCOUNT unset unless given."""
    base = {k: v for k, v in os.environ.items() if k not in ("OMP_WAIT_POLICY", "GOMP_SPINCOUNT", "PYTHONPATH")}
    return subprocess.run(
        [sys.executable, "-c", textwrap.dedent(code)],
        env={**base, **env},
        capture_output=True,
        text=True,
        timeout=300,
        cwd=ROOT,
    )


@pytest.mark.integration
def test_importing_loader_before_torch_makes_openmp_sleep_when_idle():
    # libgomp prints the settings it started with: a spin of 10,000 (about 0.1 ms) before sleeping,
    # where torch alone spins for 300,000 (3 ms) and PASSIVE alone for 0; ACTIVE, whose spin where
    # threads outnumber the CPUs is 1,000 where PASSIVE's is 0 (loader.constants.WAIT_POLICY).
    result = python("import os, loader, torch; print(os.environ['OMP_WAIT_POLICY'])", OMP_DISPLAY_ENV="VERBOSE")
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == "ACTIVE"
    assert "GOMP_SPINCOUNT = '10000'" in result.stderr and "OMP_WAIT_POLICY = 'ACTIVE'" in result.stderr
    chosen = python("import loader, torch", OMP_DISPLAY_ENV="VERBOSE", GOMP_SPINCOUNT="0")  # the user's own wins
    assert "GOMP_SPINCOUNT = '0'" in chosen.stderr


@pytest.mark.integration
def test_the_users_wait_policy_is_kept():
    result = python("import os, loader; print(os.environ['OMP_WAIT_POLICY'])", OMP_WAIT_POLICY="ACTIVE")
    assert result.stdout.strip() == "ACTIVE"


LOAD_TWICE = """
    import os, warnings, torch, loader
    from loader.threads import ThreadingWarning
    warnings.simplefilter("always")
    with warnings.catch_warnings(record=True) as caught:
        for _ in range(2):
            loader.load({path!r}, threads=os.cpu_count(), warmup=False)
    print(os.environ.get("OMP_WAIT_POLICY"))
    for w in caught:
        if issubclass(w.category, ThreadingWarning):
            print(w.message)
"""


def test_torch_imported_first_without_passive_warns_once(classifier_artifact):
    """Too late to set the policy: every thread of the host in use, beside the load the host already
    has (this test's own), is where spinning threads slow every call."""
    result = python(LOAD_TWICE.format(path=str(classifier_artifact)))
    assert result.returncode == 0, result.stderr
    policy, *warned = result.stdout.strip().splitlines()
    assert policy == "None"  # not set behind the running OpenMP's back
    (warning,) = warned
    assert "OpenMP threads spin-wait between calls (OMP_WAIT_POLICY is unset, GOMP_SPINCOUNT unset)" in warning
    assert "start the process with OMP_WAIT_POLICY=ACTIVE GOMP_SPINCOUNT=10000 (a spin of 0.1 ms" in warning
    assert "or import loader before torch" in warning


def test_torch_imported_first_with_passive_does_not_warn(classifier_artifact):
    result = python(LOAD_TWICE.format(path=str(classifier_artifact)), OMP_WAIT_POLICY="PASSIVE")
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == "PASSIVE"


CONV_SIZES = """
    import os, torch, loader
    print(os.environ["ONEDNN_PRIMITIVE_CACHE_CAPACITY"], os.environ["LRU_CACHE_CAPACITY"], flush=True)
    conv = torch.nn.Conv2d(16, 16, 3).to(memory_format=torch.channels_last)
    with torch.no_grad():
        for size in (40, 41, 42, 43, 40):  # back to the first shape after four others
            print("=== ", size, flush=True)
            conv(torch.randn(1, 16, size, size).to(memory_format=torch.channels_last))
"""


def last_convolution_create(stdout: str) -> str:
    return [line for line in stdout.splitlines() if line.startswith("onednn_verbose") and "create:" in line
            and ",convolution," in line][-1].split(",")[3]  # fmt: skip


@pytest.mark.integration
def test_loader_sizes_onednns_caches_even_after_torch_and_the_user_wins():
    """oneDNN reads its cache size at its first use, not at ``import torch``: the size loader sets
    (after torch here) governs, and a size the user set is kept."""
    ours = python(CONV_SIZES, ONEDNN_VERBOSE="all")
    assert ours.returncode == 0, ours.stderr
    assert ours.stdout.splitlines()[0] == "8192 8192"
    assert last_convolution_create(ours.stdout) == "create:cache_hit"  # the first shape's kernel kept
    tiny = python(CONV_SIZES, ONEDNN_VERBOSE="all", ONEDNN_PRIMITIVE_CACHE_CAPACITY="2", LRU_CACHE_CAPACITY="2")
    assert tiny.stdout.splitlines()[0] == "2 2"
    assert last_convolution_create(tiny.stdout) == "create:cache_miss"  # evicted by the four others
