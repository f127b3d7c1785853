"""Unload frees: one version loaded and unloaded N times through a repository's control
(``Repository.load`` / ``unload``, what ``POST /v2/repository/models/{name}/load`` and ``.../unload``
run), on each runtime; mapped model libraries (``/proc/self/maps``), RSS and threads along the way.

    python -m bench.unload ARTIFACT [--cycles 500]

ARTIFACT is a small artifact folder (the tests' tiny classifier will do). Each runtime runs in a fresh
process of its own (the torch-free one never imports torch). Prints a Markdown table; memory, not
time: fine to measure on a busy machine.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import shutil
import subprocess
import sys
import tempfile
import threading
from pathlib import Path

from loader.threads import wait_env

LIBRARY_MARKS = ("/precompile-native-", "/aotinductor_")
REPORTED = (1, 10, 50, 100, 250, 500, 1000)


def model_libraries() -> set[str]:
    """The compiled models' libraries this process maps now: the loaders' private copies of a
    variant's library (the C entry points' runners, loader.native.containers; torch's package loader,
    for CUDA and proxy-executor variants)."""
    with open("/proc/self/maps") as f:
        return {
            parts[5].strip()
            for parts in (line.split(maxsplit=5) for line in f)
            if len(parts) == 6 and ".so" in parts[5] and any(m in parts[5] for m in LIBRARY_MARKS)
        }


def rss_mib() -> float:
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) for line in f if line.startswith("VmRSS")) / 1024


def child(runtime: str, repo: str, cycles: int) -> None:
    from precompile.serve.config import ServeConfig
    from precompile.serve.repository import Repository

    name = os.listdir(repo)[0]
    repository = Repository(ServeConfig(repo, repository=True, allow_repository_control=True, runtime=runtime))
    repository.start()
    repository.wait_loaded()
    rows = []
    for i in range(1, cycles + 1):
        repository.unload(name)
        gc.collect()
        if i in REPORTED or i == cycles:
            rows.append(
                {
                    "cycle": i,
                    "libraries": len(model_libraries()),
                    "rss_mib": rss_mib(),
                    "threads": threading.active_count(),
                }
            )
        repository.load(name)
    repository.stop()
    print(json.dumps({"runtime": runtime, "torch_imported": "torch" in sys.modules, "rows": rows}))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("artifact", type=Path, nargs="?")
    parser.add_argument("--cycles", type=int, default=500)
    parser.add_argument("--child", nargs=2, metavar=("RUNTIME", "REPO"), help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        return child(args.child[0], args.child[1], args.cycles)
    if args.artifact is None:
        parser.error("give an artifact folder")
    manifest = json.loads((args.artifact / "manifest.json").read_text())
    with tempfile.TemporaryDirectory(prefix="bench-unload-") as scratch:
        repo = Path(scratch) / "models"
        shutil.copytree(args.artifact, repo / manifest["name"] / str(manifest["version"]))
        env = {**os.environ, **wait_env({})}  # serve's OpenMP settings
        results = []
        for runtime in ("torch", "native"):
            out = subprocess.run(
                [sys.executable, "-m", "bench.unload", "--child", runtime, str(repo), "--cycles", str(args.cycles)],
                env=env,
                capture_output=True,
                text=True,
                check=True,
            )
            results.append(json.loads(out.stdout.strip().splitlines()[-1]))
    print(f"{manifest['name']}: {args.cycles} unload/load cycles through the repository's control\n")
    print("| runtime | after cycle | model libraries mapped | RSS (MiB) | vs cycle 10 | threads |")
    print("|---|---:|---:|---:|---:|---:|")
    for r in results:
        base = next(row["rss_mib"] for row in r["rows"] if row["cycle"] == 10) if args.cycles >= 10 else None
        for row in r["rows"]:
            ratio = f"{row['rss_mib'] / base:.3f}" if base else "-"
            print(
                f"| {r['runtime']} | {row['cycle']} | {row['libraries']} | {row['rss_mib']:.1f} | {ratio} | {row['threads']} |"
            )


if __name__ == "__main__":
    main()
