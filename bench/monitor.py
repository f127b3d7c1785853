"""Run a benchmark with a monitor beside it: ``python -m bench.monitor --log FILE -- COMMAND...``.

A benchmark on a busy machine lies (torch's OpenMP threads spin-wait; 2 cores shared with anything
else make every call slower). The monitor writes, every ``--every`` seconds, the 1-minute load
average and every process that used more than ``--min-cpu`` percent of a core since the last look,
so a results page can say how quiet the machine was and what else ran. It reads /proc only.

At the end it prints one summary line: the load average's range, and the processes seen that are
not the command's own (its process tree).
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import time
from pathlib import Path

TICKS = os.sysconf("SC_CLK_TCK")


def cpu_times() -> dict[int, tuple[str, int, int]]:
    """pid -> (command name, parent pid, user+system ticks), for every process readable now."""
    out = {}
    for entry in os.scandir("/proc"):
        if not entry.name.isdigit():
            continue
        try:
            stat = Path(entry.path, "stat").read_text()
        except OSError:
            continue
        name = stat[stat.index("(") + 1 : stat.rindex(")")]
        fields = stat[stat.rindex(")") + 2 :].split()
        out[int(entry.name)] = (name, int(fields[1]), int(fields[11]) + int(fields[12]))
    return out


def descendants(root: int, table: dict[int, tuple[str, int, int]]) -> set[int]:
    children: dict[int, list[int]] = {}
    for pid, (_, ppid, _) in table.items():
        children.setdefault(ppid, []).append(pid)
    seen, todo = {root}, [root]
    while todo:
        for child in children.get(todo.pop(), []):
            if child not in seen:
                seen.add(child)
                todo.append(child)
    return seen


def load_average() -> float:
    return float(Path("/proc/loadavg").read_text().split()[0])


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.monitor", description=__doc__.splitlines()[0])
    parser.add_argument("--log", type=Path, required=True, help="where the monitor's lines go")
    parser.add_argument("--every", type=float, default=20.0, help="seconds between looks (default 20)")
    parser.add_argument("--min-cpu", type=float, default=5.0, help="percent of a core worth a line (default 5)")
    parser.add_argument("command", nargs=argparse.REMAINDER, help="-- then the benchmark command")
    args = parser.parse_args(argv)
    command = args.command[1:] if args.command[:1] == ["--"] else args.command
    if not command:
        parser.error("give the command to run after --")
    child = subprocess.Popen(command)
    loads, strangers = [], set()
    before, then = cpu_times(), time.monotonic()
    with args.log.open("w") as log:
        log.write(f"# {time.strftime('%Y-%m-%d %H:%M:%S')} monitoring: {' '.join(command)}\n")
        while True:
            try:
                child.wait(timeout=args.every)
                done = True
            except subprocess.TimeoutExpired:
                done = False
            now_table, now = cpu_times(), time.monotonic()
            ours = descendants(child.pid, now_table) | {os.getpid()}
            load = load_average()
            loads.append(load)
            busy = []
            for pid, (name, _, ticks) in now_table.items():
                if pid in before and before[pid][0] == name:
                    share = 100.0 * (ticks - before[pid][2]) / TICKS / max(now - then, 1e-6)
                    if share >= args.min_cpu:
                        mine = pid in ours
                        busy.append(f"{name}[{pid}]{'' if mine else '*'} {share:.0f}%")
                        if not mine:
                            strangers.add(name)
            log.write(f"{time.strftime('%H:%M:%S')} load1 {load:.2f}  {'  '.join(busy)}\n")
            log.flush()
            before, then = now_table, now
            if done:
                break
        summary = (
            f"load1 {min(loads):.2f}-{max(loads):.2f} over {len(loads)} looks; "
            f"other processes above {args.min_cpu:g}%: {', '.join(sorted(strangers)) or 'none'} (* in the log)"
        )
        log.write(f"# {summary}\n")
    print(f"monitor: {summary}", file=sys.stderr)
    return child.returncode


if __name__ == "__main__":
    sys.exit(main())
