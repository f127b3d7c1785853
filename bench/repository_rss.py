"""Memory of N small models in one `precompile serve REPO` against N one-model processes.

    python -m bench.repository_rss ARTIFACT [-n 10]

ARTIFACT is a small artifact folder (the tests' tiny classifier will do). It is released under N
names (the manifest's name rewritten: same compiled files), each packed, so every model is served
from its read-only cache entry. Then, with a fresh cache of its own:

1. one `precompile serve REPO` serving the N packs: its RSS and PSS once /readyz is 200;
2. N `precompile serve PACK` processes, one per pack: the sum of their RSS and of their PSS once all
   are ready.

RSS (VmRSS in /proc/PID/status) counts every page a process has resident, shared ones included; PSS
(Pss in /proc/PID/smaps_rollup) divides each shared page among the processes that map it, so the
PSS sum is what the host really spends. Memory, not time: fine to measure on a busy machine.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import tempfile
import time
from pathlib import Path

from .serve_load import free_port, start_server, stop_server, wait_ready


def start(target: Path) -> tuple[subprocess.Popen, str]:
    port = free_port()
    return start_server("precompile", target, Path(), port, []), f"http://127.0.0.1:{port}"


def memory_kib(pid: int) -> tuple[int, int]:
    """(RSS, PSS) of ``pid`` in KiB."""
    rss = next(int(line.split()[1]) for line in open(f"/proc/{pid}/status") if line.startswith("VmRSS:"))
    pss = next(int(line.split()[1]) for line in open(f"/proc/{pid}/smaps_rollup") if line.startswith("Pss:"))
    return rss, pss


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("artifact", type=Path)
    parser.add_argument("-n", type=int, default=10)
    args = parser.parse_args()
    from precompile.ship.pack import pack

    with tempfile.TemporaryDirectory(prefix="repository-rss-") as scratch:
        scratch = Path(scratch)
        repo = scratch / "models"
        repo.mkdir()
        packs = []
        for i in range(args.n):
            folder = scratch / f"model-{i}"
            shutil.copytree(args.artifact, folder)
            manifest = json.loads((folder / "manifest.json").read_text())
            manifest["name"] = f"tiny-{i}"
            (folder / "manifest.json").write_text(json.dumps(manifest, indent=2) + "\n")
            packs.append(pack(folder, repo / f"tiny-{i}.tar.zst"))
        os.environ["PRECOMPILE_CACHE"] = str(scratch / "cache")  # the servers' own, fresh

        one, base = start(repo)
        try:
            wait_ready(base, one)
            time.sleep(2)
            rss, pss = memory_kib(one.pid)
        finally:
            stop_server(one)
        print(f"one server, {args.n} models: RSS {rss / 1024:.0f} MiB, PSS {pss / 1024:.0f} MiB")

        many = [start(p) for p in packs]
        try:
            for server, base in many:
                wait_ready(base, server)
            time.sleep(2)
            figures = [memory_kib(server.pid) for server, _ in many]
        finally:
            for server, _ in many:
                stop_server(server)
        rss_sum, pss_sum = sum(f[0] for f in figures), sum(f[1] for f in figures)
        each = sorted(f[0] / 1024 for f in figures)
        print(
            f"{args.n} one-model servers: RSS sum {rss_sum / 1024:.0f} MiB "
            f"(each {each[0]:.0f}-{each[-1]:.0f} MiB), PSS sum {pss_sum / 1024:.0f} MiB"
        )


if __name__ == "__main__":
    main()
