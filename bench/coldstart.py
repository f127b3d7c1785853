"""Cold start: fresh processes, from start to the first correct result, every method in the same run.

Rounds alternate the methods (floor, eager, precompile, compile cold, warm, Mega-Cache, the peers, then
again), so a neighbour's load slows them alike. The time is taken from just before the process is started to
the child's report of its first result (``bench.child_cold``): interpreter start-up and every import count.
Interpreter shutdown does not. The peers (ONNX Runtime, OpenVINO) start from the ONNX file written at
prepare time, as our loader starts from the built artifact; where that export failed they are
reported as failed, with its reason, and not started.
"""

from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any, TypeVar

from .cases import ROOT
from .peers import LABELS, tolerance
from .peers import METHODS as PEERS

# (label, bench.child_cold method, Inductor cache): "fresh" an empty folder, "warm" the folder a cold
# compile of the same round filled, "mega" an empty folder plus the Mega-Cache file of round 1.
METHODS: tuple[tuple[str, str, str], ...] = (
    ("import torch", "import-torch", "fresh"),
    ("eager", "eager", "fresh"),
    ("precompile", "loader", "fresh"),
    ("torch.compile cold", "compile", "fresh"),
    ("torch.compile warm cache", "compile", "warm"),
    ("torch.compile Mega-Cache", "compile", "mega"),
    *((LABELS[p], p, "fresh") for p in PEERS),
)
FLOOR = "import torch"
T = TypeVar("T")


def child_env(cache_dir: Path) -> dict[str, str]:
    env = dict(os.environ)
    env.update(
        {
            "TORCHINDUCTOR_CACHE_DIR": str(cache_dir),
            "HF_HUB_OFFLINE": "1",
            "TRANSFORMERS_OFFLINE": "1",
            "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT), env.get("PYTHONPATH")])),
        }
    )
    return env


class ChildFailed(RuntimeError):
    """A child process of the bench exited with an error; ``reason`` is the last line it wrote."""

    def __init__(self, what: str, code: int | None, stderr: str):
        lines = [line for line in stderr.splitlines() if line.strip()]
        self.reason = lines[-1].strip() if lines else f"exit {code}"
        super().__init__(f"{what} failed (exit {code}):\n{stderr[-3000:]}")


def unrunnable_peers(spec: Path) -> dict[str, str]:
    """Per peer, why it cannot run at all: the ONNX export at prepare time failed (else empty)."""
    reason = json.loads(spec.read_text(encoding="utf-8"))["onnx"].get("failed")
    return {p: reason for p in PEERS} if reason else {}


def peer_failure(method: str, start: Callable[[], T]) -> T | ChildFailed:
    """``start()``; a peer's failure comes back (the results report it), any other method's is raised:
    ours and torch's must run, and a failure there is a bug to see."""
    try:
        return start()
    except ChildFailed as e:
        if method not in PEERS:
            raise
        return e


def start_once(method: str, spec: Path, cache_dir: Path, extra: list[str]) -> dict[str, Any]:
    """One fresh interpreter; seconds from before its start to its first result, and its marks."""
    start = time.time()
    proc = subprocess.run(
        [sys.executable, "-m", "bench.child_cold", method, str(spec), *extra],
        env=child_env(cache_dir),
        cwd=ROOT,
        capture_output=True,
        text=True,
    )
    if proc.returncode != 0:
        raise ChildFailed(f"cold start {method}", proc.returncode, proc.stderr)
    report = json.loads(proc.stdout.strip().splitlines()[-1])
    marks = {k: v - start for k, v in report["marks"].items()}
    precision = report.get("precision", "f32")
    return {
        "seconds": report["done"] - start,
        "marks": marks,
        "error": report["error"],
        "precision": precision,
        "tolerance": tolerance(precision),
    }


def run(spec: Path, work: Path, runs: int, log: Callable[[str], None]) -> tuple[dict[str, Any], Path]:
    """Every method ``runs`` times, round-robin; per method the runs, their median, min and max (or,
    for a peer without an ONNX file, why it failed). Also the Inductor cache the last cold compile
    filled, for a torch.compile server to restart with."""
    mega = work / "mega.bin"
    failed = {LABELS[p]: reason for p, reason in unrunnable_peers(spec).items()}
    samples: dict[str, list[dict[str, Any]]] = {label: [] for label, _, _ in METHODS}
    cold_dir: Path | None = None
    for r in range(runs):
        for label, method, cache in METHODS:
            if label in failed:
                continue
            extra: list[str] = []
            if cache == "warm" and cold_dir is not None:  # filled by this round's cold compile, just before
                cache_dir = cold_dir
            else:
                cache_dir = Path(tempfile.mkdtemp(prefix="inductor-", dir=work))
            if label == "torch.compile cold":
                cold_dir = cache_dir
                if r == 0:
                    extra = ["--save-mega", str(mega)]
            if cache == "mega":
                extra = ["--mega", str(mega)]
            sample = peer_failure(method, lambda: start_once(method, spec, cache_dir, extra))
            if isinstance(sample, ChildFailed):
                failed[label] = sample.reason
                log(f"  cold start {r + 1}/{runs} {label:<26} FAILED: {sample.reason}")
                continue
            samples[label].append(sample)
            ok = "" if sample["error"] <= sample["tolerance"] else f"  WRONG RESULT (error {sample['error']:.1e})"
            log(f"  cold start {r + 1}/{runs} {label:<26} {sample['seconds']:6.2f} s{ok}")
    warm = cold_dir if cold_dir is not None else Path(tempfile.mkdtemp(prefix="inductor-", dir=work))
    results = {
        label: {"failed": failed[label]} if label in failed else summarize(runs_) for label, runs_ in samples.items()
    }
    return results, warm


def summarize(samples: list[dict[str, Any]]) -> dict[str, Any]:
    seconds = [s["seconds"] for s in samples]
    marks = {k: statistics.median(s["marks"][k] for s in samples) for k in samples[0]["marks"]}
    return {
        "seconds": seconds,
        "median": statistics.median(seconds),
        "min": min(seconds),
        "max": max(seconds),
        "marks": marks,  # median seconds from process start to each step
        "max_error": max(s["error"] for s in samples),
        "precision": samples[0]["precision"],
        "tolerance": samples[0]["tolerance"],
        "correct": all(s["error"] <= s["tolerance"] for s in samples),
    }
