"""A load never stalls the other models: the latency of a ready model's calls while another model of
the same repository loads, against the same calls while nothing loads, on each runtime.

    python -m bench.load_stall ARTIFACT [--seconds 8] [--rounds 3] [--clients 2]

ARTIFACT is served twice in one repository, as models ``a`` and ``b`` (the manifest's name rewritten:
same compiled files, weights and hashes). ``--clients`` threads call ``a`` back to back the way the
server does (``Service.instances``: the execution instances every protocol's infer goes through, at
its default count), at its hint shape. Each round measures a quiet window, then a window during
which ``b`` is loaded and unloaded back to back through the repository's control (reading and
hashing its files, opening its libraries, handing its weights, warming it up), and reports
p50/p99/max of ``a``'s calls in each; windows alternate, so a machine shared with other work
distorts both alike. Each runtime runs in a fresh process of its own.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

from loader.threads import wait_env


def percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


def serve_twice(artifact: Path, scratch: Path) -> Path:
    """A repository under ``scratch`` serving ``artifact`` as models ``a`` and ``b`` (the manifest's
    name rewritten: same compiled files, weights and hashes)."""
    repo = scratch / "models"
    for name in ("a", "b"):
        shutil.copytree(artifact, repo / name)
        manifest_path = repo / name / "manifest.json"
        manifest = json.loads(manifest_path.read_text())
        manifest["name"] = name
        manifest_path.write_text(json.dumps(manifest))
    return repo


def run_child(module: str, runtime: str, repo: Path, options: list[str]) -> dict | None:
    """``python -m module --child RUNTIME REPO *options`` in a fresh process (OpenMP's threads
    sleeping when idle); the JSON its last line prints, or None (its error said on stderr)."""
    command = [sys.executable, "-m", module, "--child", runtime, str(repo), *options]
    env = {**os.environ, **wait_env({})}  # serve's OpenMP settings
    out = subprocess.run(command, env=env, capture_output=True, text=True)
    if out.returncode != 0:
        print(f"{runtime}: failed\n{out.stderr[-3000:]}", file=sys.stderr)
        return None
    return json.loads(out.stdout.strip().splitlines()[-1])


def child(runtime: str, repo: str, seconds: float, rounds: int, clients: int) -> None:
    from precompile.serve.config import ServeConfig
    from precompile.serve.repository import Repository

    repository = Repository(ServeConfig(repo, repository=True, allow_repository_control=True, runtime=runtime))
    repository.start()
    repository.wait_loaded()
    repository.unload("b")
    service = repository.lookup("a")
    model = service.live.model
    variant = model.variants[0]
    inputs = dict(zip(model.input_names, model.example_inputs(variant)))
    stop = threading.Event()
    calls: list[tuple[float, float]] = []  # (end, seconds)
    lock = threading.Lock()

    def client() -> None:
        while not stop.is_set():
            start = time.perf_counter()
            service.instances.submit(service.live.call_detailed, **inputs).result()
            end = time.perf_counter()
            with lock:
                calls.append((end, end - start))

    threads = [threading.Thread(target=client, daemon=True) for _ in range(clients)]
    for t in threads:
        t.start()
    time.sleep(1.0)  # every instance warm
    windows = {"quiet": [], "loading": []}
    loads: list[float] = []
    for _ in range(rounds):
        for kind in ("quiet", "loading"):
            begin = time.perf_counter()
            if kind == "loading":
                while time.perf_counter() - begin < seconds:
                    start = time.perf_counter()
                    repository.load("b")
                    loads.append(time.perf_counter() - start)
                    repository.unload("b")
            else:
                time.sleep(seconds)
            end = time.perf_counter()
            with lock:
                windows[kind].append([s for e, s in calls if begin <= e <= end])
    stop.set()
    for t in threads:
        t.join()
    repository.stop()
    out = {"runtime": runtime, "variant": variant.id, "hint": dict(variant.hint), "loads": len(loads)}
    out["load_seconds_median"] = statistics.median(loads) if loads else None
    for kind, samples in windows.items():
        out[kind] = [
            {
                "calls": len(s),
                "p50_ms": 1e3 * percentile(s, 0.5),
                "p99_ms": 1e3 * percentile(s, 0.99),
                "max_ms": 1e3 * max(s),
            }
            for s in samples
        ]
    print(json.dumps(out))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("artifact", type=Path, nargs="?")
    parser.add_argument("--seconds", type=float, default=8.0)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--clients", type=int, default=2)
    parser.add_argument("--runtimes", nargs="+", default=["torch", "native"])
    parser.add_argument("--child", nargs=2, metavar=("RUNTIME", "REPO"), help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        return child(args.child[0], args.child[1], args.seconds, args.rounds, args.clients)
    if args.artifact is None:
        parser.error("give an artifact folder")
    with tempfile.TemporaryDirectory(prefix="bench-load-stall-") as scratch:
        repo = serve_twice(args.artifact, Path(scratch))
        for runtime in args.runtimes:
            options = ["--seconds", str(args.seconds), "--rounds", str(args.rounds), "--clients", str(args.clients)]
            r = run_child("bench.load_stall", runtime, repo, options)
            if r is None:
                continue
            print(
                f"{runtime}: variant {r['variant']} at {r['hint']}, {args.clients} clients; "
                f"b loaded {r['loads']} times (median {r['load_seconds_median']:.3f} s)"
            )
            for i, (quiet, loading) in enumerate(zip(r["quiet"], r["loading"]), 1):
                print(
                    f"  round {i}: quiet p50 {quiet['p50_ms']:.2f} p99 {quiet['p99_ms']:.2f} max {quiet['max_ms']:.1f} ms"
                    f" ({quiet['calls']} calls) | loading p50 {loading['p50_ms']:.2f} p99 {loading['p99_ms']:.2f}"
                    f" max {loading['max_ms']:.1f} ms ({loading['calls']} calls) | p99 ratio "
                    f"{loading['p99_ms'] / quiet['p99_ms']:.2f}"
                )


if __name__ == "__main__":
    main()
