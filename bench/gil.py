"""Compiled calls off the GIL: requests per second of two models served by one process, 16 client
threads on each, on the torch runtime and on the torch-free one.

    python -m bench.gil ARTIFACT [--seconds 8] [--repeats 3] [--clients 16] [--instances 2]

ARTIFACT is served twice in one repository, as models ``a`` and ``b``. Each client thread calls its
model back to back the way the server does (``Service.instances``, ``--instances`` execution
instances per model, the same on both runtimes), at the model's hint shape. Each runtime runs in a
fresh process of its own; repeats alternate between the runtimes, so a machine shared with other
work distorts both alike.
"""

from __future__ import annotations

import argparse
import json
import os
import tempfile
import threading
import time
from pathlib import Path

from .load_stall import run_child, serve_twice


def child(runtime: str, repo: str, seconds: float, clients: int, instances: int) -> None:
    from precompile.serve.config import ServeConfig
    from precompile.serve.repository import Repository

    config = ServeConfig(repo, repository=True, runtime=runtime, instances=instances)
    repository = Repository(config)
    repository.start()
    repository.wait_loaded()
    stop, counting = threading.Event(), threading.Event()
    counts = {"a": 0, "b": 0}
    lock = threading.Lock()

    def client(name: str) -> None:
        service = repository.lookup(name)
        model = service.live.model
        inputs = dict(zip(model.input_names, model.example_inputs(model.variants[0])))
        while not stop.is_set():
            service.instances.submit(service.live.call_detailed, **inputs).result()
            if counting.is_set():
                with lock:
                    counts[name] += 1

    threads = [threading.Thread(target=client, args=(n,), daemon=True) for n in ("a", "b") for _ in range(clients)]
    for t in threads:
        t.start()
    time.sleep(1.0)  # every instance warm
    counting.set()
    begin = time.perf_counter()
    time.sleep(seconds)
    counting.clear()
    elapsed = time.perf_counter() - begin
    stop.set()
    for t in threads:
        t.join()
    repository.stop()
    print(json.dumps({"runtime": runtime, "rps": {n: c / elapsed for n, c in counts.items()}}))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("artifact", type=Path, nargs="?")
    parser.add_argument("--seconds", type=float, default=8.0)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--clients", type=int, default=16)
    parser.add_argument("--instances", type=int, default=2)
    parser.add_argument("--child", nargs=2, metavar=("RUNTIME", "REPO"), help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        return child(args.child[0], args.child[1], args.seconds, args.clients, args.instances)
    if args.artifact is None:
        parser.error("give an artifact folder")
    with tempfile.TemporaryDirectory(prefix="bench-gil-") as scratch:
        repo = serve_twice(args.artifact, Path(scratch))
        print(f"2 models x {args.clients} clients, {args.instances} instances each, {args.seconds:g} s a run")
        for i in range(1, args.repeats + 1):
            for runtime in ("torch", "native"):
                options = ["--seconds", str(args.seconds), "--clients", str(args.clients)]
                result = run_child("bench.gil", runtime, repo, [*options, "--instances", str(args.instances)])
                if result is None:
                    continue
                rps = result["rps"]
                print(
                    f"  repeat {i} {runtime:6}: {rps['a'] + rps['b']:8.1f} requests/s "
                    f"(a {rps['a']:.1f}, b {rps['b']:.1f}); load {os.getloadavg()[0]:.2f}"
                )


if __name__ == "__main__":
    main()
