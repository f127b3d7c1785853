"""OpenMP's short spin (``GOMP_SPINCOUNT=10000``, what precompile sets with the passive policy) against
sleeping at once (``GOMP_SPINCOUNT=0``), in process, quiet and beside busy loops, at equal priority
and with the model's process niced.

    .venv/bin/python -m bench.spin ARTIFACT [--seconds 5] [--rounds 2] [--busy 2] [--nice 10] [--out spin.json]

Per round, each case in turn, each in a fresh process (``loader.load``, the passive policy, the
spin count of the case, tcmalloc preloaded where installed, as ``precompile serve`` runs): the median
ms of back-to-back calls for ``--seconds`` at two shapes of the first dynamic fp32 variant (the
smallest shape its ranges hold, then its hint). Cases: quiet; beside ``--busy`` busy loops (one Python
process each, at nice 0); the same with the model's process at ``nice --nice``. ``bench.contention``
measures the server end to end beside a torch process; this one isolates the calls themselves.

Run it with nothing else running (``python -m bench.monitor``); the busy loops are the only neighbours.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
SPINS = ("0", "10000")
BUSY_LOOP = "import time, sys\nd = time.time() + float(sys.argv[1])\nwhile time.time() < d: pass\n"


def cases(busy: int, nice: int) -> list[tuple[int, int]]:
    """(busy loops, nice) per case: quiet, beside the loops, and beside them niced."""
    return [(0, 0), (busy, 0), (busy, nice)] if busy else [(0, 0)]


def measure(artifact: Path, *, seconds: float, rounds: int, busy: int, nice: int) -> list[dict[str, Any]]:
    from loader.malloc import malloc_env

    rows = []
    for r in range(rounds):
        for loops, level in cases(busy, nice):
            for spin in SPINS:
                env = {**os.environ, **malloc_env("auto"), "OMP_WAIT_POLICY": "PASSIVE", "GOMP_SPINCOUNT": spin}
                hogs = [subprocess.Popen([sys.executable, "-c", BUSY_LOOP, "600"]) for _ in range(loops)]
                try:
                    run = subprocess.run(
                        [*(["nice", "-n", str(level)] if level else []), sys.executable, "-m", "bench.spin",
                         "--child", str(artifact), "--seconds", str(seconds)],
                        cwd=ROOT, env=env, capture_output=True, text=True,
                    )  # fmt: skip
                finally:
                    for h in hogs:
                        h.kill()
                        h.wait()
                row = {"round": r, "busy": loops, "nice": level, "spin": int(spin)}
                if run.returncode != 0:
                    row["failed"] = (run.stderr.strip().splitlines() or ["exit"])[-1]
                else:
                    row["p50_ms"] = json.loads(run.stdout.strip().splitlines()[-1])
                rows.append(row)
    return rows


def _child(artifact: Path, seconds: float) -> dict[str, float]:
    import torch

    import loader
    from bench.firstcall import _input

    model = loader.load(artifact, open="eager")
    v = next(v for v in model.variants if v.kind == "dynamic" and v.precision == "fp32")
    smallest = {d: r.min for d, r in v.dims.items()}
    rng = random.Random(0)
    out = {}
    for sizes in (smallest, dict(v.hint)):
        args = [_input(torch, spec, sizes, rng) for spec in model.manifest.inputs]
        for _ in range(3):
            model.run_variant(v.id, *args)
        times, end = [], time.perf_counter() + seconds
        while time.perf_counter() < end or len(times) < 3:
            start = time.perf_counter()
            model.run_variant(v.id, *args)
            times.append((time.perf_counter() - start) * 1000)
        out["x".join(str(n) for n in sizes.values())] = statistics.median(times)
    return out


def report(rows: list[dict[str, Any]]) -> str:
    """One line per case and spin count: the p50 ms per shape, every round."""
    lines = []
    keys = dict.fromkeys((r["busy"], r["nice"], r["spin"]) for r in rows)
    for busy, nice, spin in keys:
        mine = [r for r in rows if (r["busy"], r["nice"], r["spin"]) == (busy, nice, spin)]
        case = "quiet" if not busy else f"{busy} busy loop(s)" + (f", nice {nice}" if nice else "")
        done = [r["p50_ms"] for r in mine if "p50_ms" in r]
        shapes = {s: " / ".join(f"{d[s]:.2f}" for d in done) for s in (done[0] if done else {})}
        said = "; ".join(f"{s}: {ms} ms" for s, ms in shapes.items()) or f"failed: {mine[0].get('failed')}"
        lines.append(f"{case:<24} GOMP_SPINCOUNT={spin:<6} {said}")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(prog="python -m bench.spin", description=__doc__.split("\n\n")[0])
    parser.add_argument("artifact", type=Path)
    parser.add_argument("--seconds", type=float, default=5.0, help="calls per shape per case")
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--busy", type=int, default=2, help="busy loops beside the model (0: quiet only)")
    parser.add_argument("--nice", type=int, default=10, help="the model's nice level in the last case")
    parser.add_argument("--out", type=Path, default=None)
    parser.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        print(json.dumps(_child(args.artifact, args.seconds)))
        return
    rows = measure(args.artifact, seconds=args.seconds, rounds=args.rounds, busy=args.busy, nice=args.nice)
    print(report(rows))
    if args.out:
        load = os.getloadavg()[0]
        args.out.write_text(json.dumps({"rows": rows, "load1_at_end": load, "cpus": os.cpu_count()}, indent=1) + "\n")
        print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
