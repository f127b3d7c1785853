"""scripts/gpu-check's machinery, on this CPU host: steps bounded by the deadline with their whole
process group killed on time-out (real children that spawn grandchildren), every record written
before the next step, a missing dmesg, the derived profiles, and the run's start on a host without a GPU."""

from __future__ import annotations

import importlib.machinery
import importlib.util
import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from precompile.profile import load_profile

SCRIPTS = Path(__file__).resolve().parent.parent / "scripts"
sys.path.insert(0, str(SCRIPTS))

import bounded  # noqa: E402


def _script(name: str):
    loader = importlib.machinery.SourceFileLoader(name.replace("-", "_"), str(SCRIPTS / name))
    spec = importlib.util.spec_from_loader(loader.name, loader)
    module = importlib.util.module_from_spec(spec)
    loader.exec_module(module)
    return module


gpu_check = _script("gpu-check")

# A child that starts two grandchildren (each sleeping), says their pids, and sleeps itself.
SPAWNER = """
import subprocess, sys, time
kids = [subprocess.Popen([sys.executable, "-c", "import time; time.sleep(120)"]) for _ in range(2)]
print(" ".join(str(k.pid) for k in kids), flush=True)
time.sleep(float(sys.argv[1]))
"""


def gone(pid: int) -> bool:
    """The process has exited (a zombie waiting for its reaper counts as gone)."""
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except (FileNotFoundError, ProcessLookupError):
        return True
    return state in ("Z", "X")


def wait_gone(pids, within_s: float = 10.0) -> bool:
    end = time.monotonic() + within_s
    while time.monotonic() < end:
        if all(gone(p) for p in pids):
            return True
        time.sleep(0.05)
    return False


@pytest.mark.integration
def test_a_child_past_its_time_is_killed_with_its_grandchildren(tmp_path):
    log = tmp_path / "child.log"
    child = bounded.Child([sys.executable, "-c", SPAWNER, "120"], log=log)
    end = time.monotonic() + 60
    while not log.read_text().strip() and time.monotonic() < end:
        time.sleep(0.05)
    kids = [int(p) for p in log.read_text().split()]
    start = time.monotonic()
    finished = child.wait(1.0)
    assert finished.timed_out and finished.returncode is None and not finished.ok
    assert time.monotonic() - start < 1.0 + bounded.GRACE_S + 5
    assert gone(child.proc.pid) and wait_gone(kids)


@pytest.mark.integration
def test_what_a_finished_child_left_running_is_killed(tmp_path):
    finished = bounded.run_bounded([sys.executable, "-c", SPAWNER, "0"], 60)
    assert finished.ok and not finished.timed_out
    kids = [int(p) for p in finished.output.split()]
    assert wait_gone(kids)


def test_a_missing_program_is_an_exit_not_an_exception():
    finished = bounded.run_bounded(["/nonexistent/dmesg"], 5)
    assert finished.returncode == 127 and "No such file" in finished.output


@pytest.mark.integration
def test_a_step_past_the_deadline_is_recorded_before_the_next_starts(tmp_path):
    run = gpu_check.Run(tmp_path, deadline_s=600)
    value = run.child_step("facts (cut short)", "facts", {}, cap_s=0.3)  # importing torch alone takes longer
    assert value is None
    saved = json.loads((tmp_path / "gpu-check.json").read_text())
    (failure,) = saved["failures"]
    assert (
        failure["step"] == "facts (cut short)"
        and "timed out after" in failure["error"]
        and "process group was killed" in failure["error"]
    )
    assert saved["steps"][0]["timed_out"] is True
    assert "## FAILED: facts (cut short)" in (tmp_path / "gpu-check.md").read_text()
    facts = run.child_step("facts", "facts", {}, cap_s=120)
    assert facts["torch"] and facts["bindings"]["load_constants"]
    assert [s["step"] for s in json.loads((tmp_path / "gpu-check.json").read_text())["steps"]] == [
        "facts (cut short)",
        "facts",
    ]


def test_no_time_left_skips_a_step_and_says_so(tmp_path):
    run = gpu_check.Run(tmp_path, deadline_s=gpu_check.REPORT_RESERVE_S + 2)
    assert run.child_step("cold_start", "cold_start", {}, cap_s=100, needs_s=60) is None
    (skipped,) = json.loads((tmp_path / "gpu-check.json").read_text())["skipped"]
    assert skipped.startswith("cold_start:") and "needs about 60 s" in skipped


def test_a_missing_dmesg_is_noted_not_raised(monkeypatch, tmp_path):
    monkeypatch.setenv("PATH", str(tmp_path))
    assert gpu_check.kernel_log() == "(dmesg is not installed here)"


def test_the_derived_profiles_build_for_cuda_and_bf16_checks_at_a_bf16_tolerance(tmp_path):
    for dtype in gpu_check.DTYPES:
        folder = tmp_path / dtype
        folder.mkdir()
        profile = load_profile(gpu_check.derived_profile(folder, dtype, quick=True)).profile
        assert profile.targets == ("cuda",) and profile.cuda.dtype == dtype and profile.cuda.cuda_graphs
        assert [s["batch"] for s in profile.distribution.shapes] == [1, 8]
        if dtype == "bfloat16":
            assert profile.tolerance("bfloat16") == (0.1, 0.1)
        else:
            assert profile.tolerance("float32") == (1e-4, 1e-4)  # the build's default


def test_cpus_are_split_into_disjoint_shares():
    assert gpu_check.cpu_split(2, list(range(16))) == [list(range(8)), list(range(8, 16))]
    assert gpu_check.cpu_split(2, [0, 1, 2]) == [[0], [1, 2]]
    assert gpu_check.cpu_split(2, [5]) == [[5], [5]]


@pytest.mark.integration
def test_on_a_host_without_a_gpu_the_run_stops_with_its_facts_written(tmp_path, capsys):
    if torch.cuda.is_available():
        pytest.skip("a GPU host runs the real thing")
    assert gpu_check.main(["--out", str(tmp_path), "--deadline", "120"]) == 2
    saved = json.loads((tmp_path / "gpu-check.json").read_text())
    assert saved["facts"]["gpu_visible"] is False and saved["toolchain"]["problems"] is not None
    assert any(s.startswith("every GPU step: no CUDA GPU visible") for s in saved["skipped"])
    assert "no CUDA GPU visible" in capsys.readouterr().err


@pytest.mark.integration
def test_the_device_run_records_the_machine_before_anything_else(tmp_path):
    (tmp_path / "wheels").mkdir()
    out = tmp_path / "out"
    env = {**os.environ, "OMP_WAIT_POLICY": "PASSIVE"}
    proc = subprocess.run(
        [
            sys.executable,
            str(SCRIPTS / "device-run"),
            "--out",
            str(out),
            "--deadline",
            "200",
            "--wheels",
            str(tmp_path / "wheels"),
            "--site",
            str(tmp_path / "site"),
        ],
        capture_output=True,
        text=True,
        env=env,
        timeout=300,
    )
    facts = json.loads((out / "device-facts.json").read_text())
    assert facts["facts"]["bindings"]["load_constants"][0].startswith("load_constants(constants_map")
    assert facts["facts"]["versions"]["torch"] and "cpus" in facts["facts"]
    assert facts["install"] == {"wheels": [], "ok": None}
    log = (out / "device-run.log").read_text()
    assert "no wheels in" in log and "gpu-check --quick --deadline" in log
    if not torch.cuda.is_available():
        assert proc.returncode == 1 and "gpu-check: exit 2" in log
        assert "every GPU step: no CUDA GPU visible" in (out / "gpu-check.md").read_text()


PARENT = """
import sys, time
sys.path.insert(0, {scripts!r})
import bounded
bounded.end_children_on_signal()
child = bounded.Child([sys.executable, "-c", {spawner!r}, "120"], log=__import__("pathlib").Path({log!r}))
child.wait(300)
"""


@pytest.mark.integration
def test_a_signal_to_the_runner_ends_its_children_groups_too(tmp_path):
    """The device tool kills the runner at its time-out; children in sessions of their own must not
    outlive it."""
    import signal

    log = tmp_path / "child.log"
    parent = subprocess.Popen(
        [sys.executable, "-c", PARENT.format(scripts=str(SCRIPTS), spawner=SPAWNER, log=str(log))]
    )
    end = time.monotonic() + 60
    while not (log.exists() and log.read_text().strip()) and time.monotonic() < end:
        time.sleep(0.05)
    kids = [int(p) for p in log.read_text().split()]
    parent.send_signal(signal.SIGTERM)
    assert parent.wait(30) == 128 + signal.SIGTERM
    assert wait_gone(kids)


def cpu_profile(folder, dtype, quick):  # noqa: ARG001
    """Stands in for derived_profile on this host: the tiny CPU model (no GPU here to build for)."""
    from .conftest import STRUCTURED_PROFILE, write_profile

    return write_profile(folder, STRUCTURED_PROFILE.replace("max: 32", "max: 4") + "check: {random_shapes: 1}\n")


@pytest.mark.integration
def test_both_builds_run_at_once_on_their_own_cpus_and_each_is_recorded(tmp_path, monkeypatch):
    monkeypatch.setattr(gpu_check, "derived_profile", cpu_profile)
    run = gpu_check.Run(tmp_path / "out", deadline_s=900)
    (tmp_path / "out").mkdir()
    built = gpu_check.build_all(run, tmp_path / "work", quick=True, jobs=1)
    assert sorted(built) == sorted(gpu_check.DTYPES)
    saved = json.loads((tmp_path / "out" / "gpu-check.json").read_text())
    shares = [saved["build"][d]["cpus"] for d in gpu_check.DTYPES]
    assert all(saved["build"][d]["exit"] == 0 and saved["build"][d]["compile_threads"] >= 1 for d in gpu_check.DTYPES)
    if len(os.sched_getaffinity(0)) >= 2:
        assert not set(shares[0]) & set(shares[1])
    assert sorted(s["step"] for s in saved["steps"]) == sorted(f"build {d}" for d in gpu_check.DTYPES)
    assert (Path(built["float32"]["artifact"]) / "manifest.json").exists()
    assert (tmp_path / "out" / "build-bfloat16.log").read_text()


@pytest.mark.integration
def test_builds_past_the_deadline_are_killed_and_recorded(tmp_path, monkeypatch):
    monkeypatch.setattr(gpu_check, "derived_profile", cpu_profile)
    (tmp_path / "out").mkdir()
    run = gpu_check.Run(tmp_path / "out", deadline_s=900)
    start = time.monotonic()
    assert gpu_check.build_all(run, tmp_path / "work", quick=True, jobs=1, cap_s=2.0) == {}
    assert time.monotonic() - start < 2.0 + 2 * bounded.GRACE_S + 10
    saved = json.loads((tmp_path / "out" / "gpu-check.json").read_text())
    assert all(saved["build"][d]["timed_out"] for d in gpu_check.DTYPES)
    assert {f["step"] for f in saved["failures"]} == {f"build {d}" for d in gpu_check.DTYPES}
    assert saved["build"]["kernel_log"]  # dmesg's end, or why it could not be read
