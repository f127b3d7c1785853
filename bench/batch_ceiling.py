"""What dynamic batching can add on this host, before any server: a model's throughput in the
unbatched server's arrangement against each batched one, in one process.

    python -m bench.batch_ceiling ARTIFACT [--batches 2 4 8] [--seconds 5]

The unbatched server runs an execution instance per CPU, each calling batch 1 on an OpenMP team of one
thread, side by side (``precompile.serve.instances``); ``--batch`` runs batches on one team of every
CPU, or on an instance per CPU. Each row: ``--seconds`` of back-to-back calls at the first variant's
hint with the batch dim set, in as many threads as the arrangement has instances, items per second
and the ratio to the unbatched arrangement's. ARTIFACT's first variant must serve a ``batch`` dim over
the sizes asked. The ceiling is the best row's ratio: a server's batcher adds its own costs on top.
Asserts nothing; run it on a quiet machine (``python -m bench.monitor -- ...``).
"""

from __future__ import annotations

import argparse
import os
import threading
import time

from loader.threads import wait_env  # neither torch nor numpy

os.environ.update(wait_env())  # serve's OpenMP settings, before torch


def throughput(model, variant, instances: int, team: int, batch: int, seconds: float) -> float:
    """Items per second of ``instances`` threads calling ``variant`` at ``batch`` back to back, each on
    an OpenMP team of ``team`` threads."""
    import torch

    sizes = {**variant.hint, "batch": batch}
    inputs = dict(zip(model.input_names, model.example_inputs(variant, sizes)))
    done = [0] * instances
    start = threading.Barrier(instances + 1)
    stop = [0.0]  # set before the barrier lets the threads go

    def worker(k: int) -> None:
        torch.set_num_threads(team)
        model(**inputs)  # this thread's team and the shape warm
        start.wait()
        while time.perf_counter() < stop[0]:
            model(**inputs)
            done[k] += batch

    threads = [threading.Thread(target=worker, args=(k,)) for k in range(instances)]
    for t in threads:
        t.start()
    began = time.perf_counter()
    stop[0] = began + seconds
    start.wait()
    for t in threads:
        t.join()
    return sum(done) / (time.perf_counter() - began)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("artifact")
    parser.add_argument("--batches", type=int, nargs="+", default=[2, 4, 8])
    parser.add_argument("--seconds", type=float, default=5.0)
    args = parser.parse_args()

    import loader
    from loader.threads import default_threads

    model = loader.load(args.artifact)
    model.wait_opened()
    variant = model.variants[0]
    cpus = default_threads()
    rows = [(f"unbatched: {cpus} instances x 1 thread, batch 1", cpus, 1, 1)]
    rows.append((f"1 instance x {cpus} threads, batch 1", 1, cpus, 1))
    for b in args.batches:
        rows.append((f"batch {b}, 1 instance x {cpus} threads", 1, cpus, b))
        rows.append((f"batch {b}, {cpus} instances x 1 thread", cpus, 1, b))
    base = None
    for label, instances, team, batch in rows:
        rate = throughput(model, variant, instances, team, batch, args.seconds)
        base = base or rate
        print(f"{label:45s} {rate:8.1f} items/s  {rate / base:.2f}x the unbatched arrangement's", flush=True)


if __name__ == "__main__":
    main()
