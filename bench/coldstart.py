"""Cold start: fresh processes, from start to the first correct result, every method in the same run.

Rounds alternate the methods (floor, eager, precompile, compile cold, warm, Mega-Cache, then again),
so a neighbour's load slows them alike. The time is taken from just before the process is started to
the child's report of its first result (``bench.child_cold``): interpreter start-up and every import count.
Interpreter shutdown does not.
"""

from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any, Callable

from .cases import ROOT

# (label, bench.child_cold method, Inductor cache): "fresh" an empty folder, "warm" the folder a cold
# compile of the same round filled, "mega" an empty folder plus the Mega-Cache file of round 1.
METHODS: tuple[tuple[str, str, str], ...] = (
    ("import torch", "import-torch", "fresh"),
    ("eager", "eager", "fresh"),
    ("precompile", "loader", "fresh"),
    ("torch.compile cold", "compile", "fresh"),
    ("torch.compile warm cache", "compile", "warm"),
    ("torch.compile Mega-Cache", "compile", "mega"),
)
FLOOR = "import torch"
# Good enough to call a result correct: float32 compiled code against eager, relative to the output's scale.
MAX_ERROR = 1e-3


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
        raise RuntimeError(f"cold start {method} failed (exit {proc.returncode}):\n{proc.stderr[-3000:]}")
    report = json.loads(proc.stdout.strip().splitlines()[-1])
    marks = {k: v - start for k, v in report["marks"].items()}
    return {"seconds": report["done"] - start, "marks": marks, "error": report["error"]}


def run(spec: Path, work: Path, runs: int, log: Callable[[str], None]) -> tuple[dict[str, Any], Path]:
    """Every method ``runs`` times, round-robin; per method the runs, their median, min and max.
    Also the Inductor cache the last cold compile filled, for a torch.compile server to restart with."""
    mega = work / "mega.bin"
    samples: dict[str, list[dict[str, Any]]] = {label: [] for label, _, _ in METHODS}
    cold_dir: Path | None = None
    for r in range(runs):
        for label, method, cache in METHODS:
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
            sample = start_once(method, spec, cache_dir, extra)
            samples[label].append(sample)
            ok = "" if sample["error"] <= MAX_ERROR else f"  WRONG RESULT (error {sample['error']:.1e})"
            log(f"  cold start {r + 1}/{runs} {label:<26} {sample['seconds']:6.2f} s{ok}")
    warm = cold_dir if cold_dir is not None else Path(tempfile.mkdtemp(prefix="inductor-", dir=work))
    return {label: summarize(runs_) for label, runs_ in samples.items()}, warm


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
        "correct": all(s["error"] <= MAX_ERROR for s in samples),
    }
