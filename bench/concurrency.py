"""How to make one loaded model serve many threads: more runners, or one runner and a lock?

    .venv/bin/python bench/concurrency.py ARTIFACT [--seconds 3] [--batch 4] [--seq 128]

For every combination of OpenMP threads per call (OMP_NUM_THREADS: 1, and the default, one per
core), runners per variant (the package loader's ``num_runners``: 1, 2) and client threads (1, 2,
4, 8), runs the model from that many threads for ``--seconds`` and prints calls per second, plus one
row where a Python lock serializes the calls. Each combination runs in a fresh process, since OpenMP
reads its thread count once. It also checks that every concurrent result equals the serial one.

``num_runners`` is not an option of ``loader.load()`` yet; this script patches the single function
that opens packages (``loader.model.open_package``), for measuring only.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import threading
import time


def measure(artifact: str, runners: int, threads: int, lock: bool, seconds: float, batch: int, seq: int) -> dict:
    import torch

    import loader
    import loader.model as model_module
    from loader import constants as C

    def open_package(path: str):
        return torch._C._aoti.AOTIModelPackageLoader(path, C.AOTI_MODEL_NAME, False, runners, -1)

    model_module.open_package = open_package
    model = loader.load(artifact)
    model.warmup()
    gen = torch.Generator().manual_seed(0)
    calls = [
        (torch.randint(0, 50, (batch, seq), generator=gen), torch.ones(batch, seq, dtype=torch.bool)) for _ in range(8)
    ]
    expected = [model(*c) for c in calls]
    guard = threading.Lock()
    stop = time.perf_counter() + seconds
    counts = [0] * threads
    mismatches = [0] * threads

    def client(k: int) -> None:
        i = k
        while time.perf_counter() < stop:
            args = calls[i % len(calls)]
            if lock:
                with guard:
                    out = model(*args)
            else:
                out = model(*args)
            if not torch.equal(out, expected[i % len(calls)]):
                mismatches[k] += 1
            counts[k] += 1
            i += 1

    workers = [threading.Thread(target=client, args=(k,)) for k in range(threads)]
    start = time.perf_counter()
    for w in workers:
        w.start()
    for w in workers:
        w.join()
    elapsed = time.perf_counter() - start
    return {"calls_per_s": sum(counts) / elapsed, "mismatches": sum(mismatches)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("artifact")
    parser.add_argument("--seconds", type=float, default=3.0)
    parser.add_argument("--batch", type=int, default=4)
    parser.add_argument("--seq", type=int, default=128)
    parser.add_argument("--one", help=argparse.SUPPRESS)  # internal: "runners,threads,lock" in this process
    args = parser.parse_args()
    if args.one:
        runners, threads, lock = (int(x) for x in args.one.split(","))
        print(json.dumps(measure(args.artifact, runners, threads, bool(lock), args.seconds, args.batch, args.seq)))
        return

    cores = os.cpu_count() or 1
    print(f"{args.artifact}: batch {args.batch}, seq {args.seq}, {cores} cores, {args.seconds:g} s per row")
    print(f"{'omp threads':>11} {'runners':>7} {'clients':>7} {'lock':>5} {'calls/s':>9} {'mismatches':>10}")
    rows = [(r, t, 0) for r in (1, 2) for t in (1, 2, 4, 8)] + [(1, 4, 1)]
    for omp in ("1", str(cores)):
        for runners, threads, lock in rows:
            env = dict(os.environ, OMP_NUM_THREADS=omp)
            out = subprocess.run(
                [
                    sys.executable,
                    __file__,
                    args.artifact,
                    "--seconds",
                    str(args.seconds),
                    "--batch",
                    str(args.batch),
                    "--seq",
                    str(args.seq),
                    "--one",
                    f"{runners},{threads},{lock}",
                ],
                env=env,
                capture_output=True,
                text=True,
                check=True,
            )
            r = json.loads(out.stdout.strip().splitlines()[-1])
            print(
                f"{omp:>11} {runners:>7} {threads:>7} {'yes' if lock else 'no':>5} {r['calls_per_s']:>9.1f} {r['mismatches']:>10}"
            )


if __name__ == "__main__":
    main()
