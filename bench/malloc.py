"""The memory allocator under a compiled variant: glibc's malloc against tcmalloc and jemalloc, per call.

    .venv/bin/python -m bench.malloc ARTIFACT:SHAPE [ARTIFACT:SHAPE ...] [--allocators system tcmalloc jemalloc]
                                     [--seconds 1.0] [--rounds 3] [--out bench/results/malloc.json]

    SHAPE: the sizes of the artifact's first input, e.g. 1x3x96x96

Each (artifact, shape, allocator) runs in a fresh process started as ``precompile serve`` starts its
server (``loader.malloc.malloc_env``: the library preloaded, its settings), loads the artifact with
``loader.load``, warms the shape up, then times calls for ``--seconds``: the median wall ms a call,
the page faults and system CPU ms a call (``getrusage``), and the peak RSS. Rounds interleave the
allocators so that a change in the machine's load falls on each alike; the median over rounds is kept.
An allocator that is not installed is left out with a line saying so.

Run it on a quiet machine; on a busy one only the page faults mean something.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from loader.threads import wait_env

ROOT = Path(__file__).resolve().parent.parent


def environments(names: list[str]) -> dict[str, dict[str, str]]:
    """Each installed allocator's process environment (as serve would start it)."""
    from loader.malloc import MallocError, malloc_env

    base = {k: v for k, v in os.environ.items() if k not in ("LD_PRELOAD", "MALLOC_CONF")}
    base.update(wait_env(base))  # serve's OpenMP settings, unless set
    out = {}
    for name in names:
        try:
            extra = malloc_env(name, base)
        except MallocError as e:
            print(f"# {name}: left out ({e})", file=sys.stderr)
            continue
        out[name] = {**base, **extra}
    return out


def measure(
    cases: list[tuple[Path, list[int]]], allocators: list[str], *, seconds: float, rounds: int
) -> list[dict[str, Any]]:
    envs = environments(allocators)
    samples: dict[tuple[int, str], list[dict[str, float]]] = {}
    for _ in range(rounds):
        for i, (path, shape) in enumerate(cases):
            for name, env in envs.items():
                command = [
                    sys.executable,
                    "-m",
                    "bench.malloc",
                    "--child",
                    f"{path}:{'x'.join(map(str, shape))}",
                    "--seconds",
                    str(seconds),
                ]
                run = subprocess.run(command, cwd=ROOT, env=env, capture_output=True, text=True)
                if run.returncode != 0:
                    raise SystemExit(f"{path} {shape} on {name}: {run.stderr.strip().splitlines()[-1:]}")
                samples.setdefault((i, name), []).append(json.loads(run.stdout.strip().splitlines()[-1]))
    rows = []
    for i, (path, shape) in enumerate(cases):
        for name in envs:
            got = samples[(i, name)]
            rows.append(
                {
                    "artifact": str(path),
                    "shape": shape,
                    "allocator": name,
                    "ms": statistics.median(s["ms"] for s in got),
                    "faults_per_call": statistics.median(s["faults"] for s in got),
                    "sys_ms_per_call": statistics.median(s["sys_ms"] for s in got),
                    "peak_rss_mb": max(s["rss_mb"] for s in got),
                    "in_use": got[0]["in_use"],
                }
            )
    return rows


def _child(path: Path, shape: list[int], seconds: float) -> dict[str, float]:
    import torch

    import loader
    from loader.malloc import in_use

    model = loader.load(path)
    x = torch.randn(*shape)
    for _ in range(10):
        model(x)
    times = []
    before = resource.getrusage(resource.RUSAGE_SELF)
    end = time.perf_counter() + seconds
    while time.perf_counter() < end or len(times) < 5:
        start = time.perf_counter()
        model(x)
        times.append(time.perf_counter() - start)
    after = resource.getrusage(resource.RUSAGE_SELF)
    n = len(times)
    return {
        "ms": statistics.median(times) * 1e3,
        "faults": (after.ru_minflt - before.ru_minflt) / n,
        "sys_ms": (after.ru_stime - before.ru_stime) / n * 1e3,
        "rss_mb": after.ru_maxrss / 1024,
        "in_use": in_use(),
    }


def report(rows: list[dict[str, Any]]) -> str:
    lines = [
        "| artifact | shape | allocator | ms a call | page faults a call | system ms a call | peak RSS MB |",
        "|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        lines.append(
            f"| {Path(r['artifact']).parent.name or r['artifact']} | {'×'.join(map(str, r['shape']))} | {r['allocator']} | "
            f"{r['ms']:.2f} | {r['faults_per_call']:,.0f} | {r['sys_ms_per_call']:.2f} | {r['peak_rss_mb']:.0f} |"
        )
    return "\n".join(lines)


def _case(text: str) -> tuple[Path, list[int]]:
    path, _, shape = text.rpartition(":")
    try:
        sizes = [int(s) for s in shape.split("x")]
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text}: give ARTIFACT:SHAPE, e.g. artifacts/m:1x3x96x96") from None
    if not path or not sizes:
        raise argparse.ArgumentTypeError(f"{text}: give ARTIFACT:SHAPE, e.g. artifacts/m:1x3x96x96")
    return Path(path), sizes


def main() -> None:
    parser = argparse.ArgumentParser(prog="python -m bench.malloc", description=__doc__.split("\n\n")[0])
    parser.add_argument("cases", nargs="+", type=_case, metavar="ARTIFACT:SHAPE")
    parser.add_argument("--allocators", nargs="+", default=["system", "tcmalloc", "jemalloc"])
    parser.add_argument("--seconds", type=float, default=1.0)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--out", type=Path)
    parser.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        ((path, shape),) = args.cases
        print(json.dumps(_child(path, shape, args.seconds)))
        return
    rows = measure(args.cases, args.allocators, seconds=args.seconds, rounds=args.rounds)
    print(report(rows))
    if args.out:
        args.out.write_text(json.dumps({"rows": rows, "cpu": os.cpu_count()}, indent=1) + "\n")


if __name__ == "__main__":
    main()
