"""Figures for builds and artifacts past one machine (issue 11): build wall time by executor, push and
pull through an S3-compatible store, cold start from it.

    python -m bench.fleet [--out bench/results/fleet.json] [--mb 100] [--ray-nodes 2] [--ray-node-cpus 1]
    python -m bench.fleet --quick      # the harness on a 1-unit build and a 4 MB artifact (a few minutes)

- **build**: wall time of `precompile build` (a fresh process, as CI runs it) of one 8-unit profile,
  the example text classifier's traffic plan (4 variants) under the `cpu` tuning preset (2 option
  sets), with `--jobs 1`, `--jobs 2`, two shards in sequence (each `--jobs 2`) then `precompile
  assemble`, and `--executor ray` on a local cluster of
  `--ray-nodes` nodes with `--ray-node-cpus` CPUs each (tests/ray_cluster.py: loopback addresses only).
- **transfer**: a pack of about `--mb` MB (a model with that much float32 weights, which zstandard
  cannot shrink) pushed to and pulled from `rclone serve s3` on loopback (tests/test_remote.py's
  server), against a plain file copy of the same pack; `precompile push`/`pull` (which check every
  member) and the store's raw put/get. Median of `--repeats`, in MB/s.
- **cold start**: `loader.load(url)` of that pack from the store in a fresh process, the first time
  (empty cache: download, checks, unpack) and cached (the ETag matches: nothing downloaded); also the
  first call. Median of `--repeats`.

Every row is printed and the whole written as JSON (`--out`). Run it on a quiet machine: the build rows
compile 8 packages three or four times over (tens of minutes on 2 cores).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import statistics
import subprocess
import sys
import tempfile
import textwrap
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))  # the harness reuses the tests' S3 server, Ray cluster and tiny profile
EXAMPLES = ROOT / "profiles" / "examples"

# The example planned classifier (4 variants: 2 static, 2 dynamic) under the cpu preset's 2 option sets.
EIGHT_UNITS = (
    (EXAMPLES / "text_classifier_planned.yaml")
    .read_text()
    .replace("compile:\n  inductor: {freezing: true}", "compile:\n  inductor: {}\n  tune: {preset: cpu}")
)
assert "preset: cpu" in EIGHT_UNITS, "profiles/examples/text_classifier_planned.yaml changed: update bench/fleet.py"

# A model whose pack is about `mb` MB: an embedding table of random float32 rows (incompressible).
HEAVY_MODEL = """
import torch
from torch import nn


class Heavy(nn.Module):
    def __init__(self, rows: int, width: int):
        super().__init__()
        self.table = nn.Embedding(rows, width)
        self.head = nn.Linear(width, 4)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.head(self.table(ids).mean(1))


def heavy(rows: int, width: int = 256) -> nn.Module:
    torch.manual_seed(0)
    return Heavy(rows, width)
"""

HEAVY_PROFILE = """
name: heavy
model: {{factory: "heavy:heavy", kwargs: {{rows: {rows}, width: 256}}}}
inputs:
  ids: {{shape: [batch, seq], dtype: int64}}
dims:
  batch: {{min: 1, max: 8}}
  seq:   {{min: 2, max: 64}}
check: {{random_shapes: 1}}
"""

COLD_CHILD = """
import json, sys, time
start = time.perf_counter()
import torch, loader
imported = time.perf_counter()
model = loader.load(sys.argv[1])
loaded = time.perf_counter()
model(torch.zeros(1, 8, dtype=torch.int64))
called = time.perf_counter()
print(json.dumps({"import_s": imported - start, "load_s": loaded - imported, "first_call_s": called - loaded, "total_s": called - start}))
"""


def precompile(*args: str, env: dict[str, str] | None = None) -> float:
    """Run `precompile ARGS` in a fresh process; its wall time in seconds (raises on failure)."""
    start = time.perf_counter()
    done = subprocess.run([sys.executable, "-m", "precompile", *args], capture_output=True, text=True, env=env)
    seconds = time.perf_counter() - start
    if done.returncode != 0:
        raise RuntimeError(f"precompile {' '.join(args)} failed:\n{done.stderr[-4000:]}{done.stdout[-2000:]}")
    return seconds


def units_of(artifact: Path) -> int:
    """Packages the build compiled: variants × option sets tried (from the manifest's tuning record)."""
    manifest = json.loads((artifact / "manifest.json").read_text())
    tuning = manifest.get("check", {}).get("tuning")
    return len(tuning) if tuning else len(manifest["variants"])


def shard_support() -> str | None:
    """None when `precompile build --shard` and `precompile assemble` exist, else why the row is skipped."""
    build_help = subprocess.run(
        [sys.executable, "-m", "precompile", "build", "--help"], capture_output=True, text=True
    ).stdout
    assemble = subprocess.run(
        [sys.executable, "-m", "precompile", "assemble", "--help"], capture_output=True, text=True
    )
    if "--shard" not in build_help or assemble.returncode != 0:
        return "precompile build has no --shard (or there is no precompile assemble) yet: issue 11, part 2"
    return None


def build_rows(work: Path, profile_text: str, *, ray_nodes: int, ray_node_cpus: int) -> dict[str, Any]:
    folder = work / "build-profile"
    shutil.copytree(EXAMPLES, folder)
    shutil.copy(ROOT / "tests" / "models" / "tiny.py", folder / "tiny.py")
    profile = folder / "profile.yaml"
    profile.write_text(profile_text)
    rows: dict[str, Any] = {}

    def timed(name: str, *args: str) -> None:
        out = work / f"artifact-{name}"
        seconds = precompile("build", str(profile), "-o", str(out), *args)
        rows[name] = {"seconds": round(seconds, 2), "units": units_of(out)}
        print(f"  build {name:<22} {seconds:8.1f} s  ({rows[name]['units']} units)", flush=True)

    timed("jobs-1", "--jobs", "1")
    timed("jobs-2", "--jobs", "2")
    skipped = shard_support()
    if skipped is None:
        # Hook for sharded builds (issue 11, part 2); the flags follow the issue: --shard K/N, assemble PARTS -o.
        start = time.perf_counter()
        parts = []
        for k in (1, 2):
            part = work / f"part-{k}"
            precompile("build", str(profile), "-o", str(part), "--shard", f"{k}/2", "--jobs", "2")
            parts.append(str(part))
        out = work / "artifact-shards"
        precompile("assemble", *parts, "-o", str(out))
        seconds = time.perf_counter() - start
        rows["two-shards+assemble"] = {"seconds": round(seconds, 2), "units": units_of(out)}
        print(f"  build {'two-shards+assemble':<22} {seconds:8.1f} s", flush=True)
    else:
        rows["two-shards+assemble"] = {"skipped": skipped}
        print(f"  build two-shards+assemble  skipped: {skipped}", flush=True)
    try:
        import ray  # noqa: F401
    except ImportError:
        rows["ray"] = {"skipped": "ray is not installed (pip install 'precompile[ray]')"}
        return rows
    from tests.ray_cluster import LocalRayCluster

    cluster_start = time.perf_counter()
    with LocalRayCluster(work / "ray", nodes=ray_nodes, cpus=ray_node_cpus) as address:
        started = time.perf_counter() - cluster_start
        timed("ray", "--executor", "ray", "--address", address)
    rows["ray"].update({"nodes": ray_nodes, "cpus_per_node": ray_node_cpus, "cluster_start_s": round(started, 2)})
    return rows


def median_of(repeats: int, run: Callable[[int], float]) -> float:
    return statistics.median(run(i) for i in range(repeats))


def store_rows(work: Path, mb: int, repeats: int) -> tuple[dict[str, Any], dict[str, Any]]:
    """(transfer, cold start) against `rclone serve s3` on loopback."""
    from loader.stores import remote
    from tests.test_remote import BUCKET, S3Server

    packed = heavy_pack(work, mb)
    size_mb = packed.stat().st_size / 1e6
    print(f"  pack: {size_mb:.1f} MB", flush=True)
    env = store_credentials(work)
    os.environ.update(env)
    os.environ.pop("AWS_PROFILE", None)
    server = S3Server(work / "store")
    os.environ[remote.ENDPOINT_ENV] = server.endpoint
    try:
        transfer = {"pack_mb": round(size_mb, 1), **transfer_rows(work, packed, size_mb, repeats)}
        url = f"s3://{BUCKET}/push-0/heavy/1.tar.zst"  # pushed by transfer_rows
        cold = cold_start_rows(work, url, {**os.environ, **env, remote.ENDPOINT_ENV: server.endpoint}, repeats)
    finally:
        server.stop()
    return transfer, cold


def heavy_pack(work: Path, mb: int) -> Path:
    """Build the model of about ``mb`` MB of weights (HEAVY_MODEL) in a fresh process and pack it."""
    from precompile.ship.pack import pack

    folder = work / "heavy"
    folder.mkdir()
    (folder / "heavy.py").write_text(textwrap.dedent(HEAVY_MODEL))
    rows_per_mb = (1 << 20) // (256 * 4)
    (folder / "profile.yaml").write_text(textwrap.dedent(HEAVY_PROFILE.format(rows=mb * rows_per_mb)))
    precompile("build", str(folder / "profile.yaml"), "-o", str(folder / "artifact"), "--jobs", "1")
    return pack(folder / "artifact", work / "heavy.tar.zst")


def store_credentials(work: Path) -> dict[str, str]:
    """The test store's keys, and AWS config files that do not exist, so that nothing on this machine
    (a ~/.aws profile) changes what the figures measure."""
    from tests.test_remote import ACCESS_KEY, SECRET_KEY

    return {
        "AWS_ACCESS_KEY_ID": ACCESS_KEY,
        "AWS_SECRET_ACCESS_KEY": SECRET_KEY,
        "AWS_DEFAULT_REGION": "us-east-1",
        "AWS_CONFIG_FILE": str(work / "no-aws-config"),
        "AWS_SHARED_CREDENTIALS_FILE": str(work / "no-aws-credentials"),
    }


def transfer_rows(work: Path, packed: Path, size_mb: float, repeats: int) -> dict[str, Any]:
    """The pack copied, put and got raw, pushed and pulled: the median seconds and MB/s of each.
    Leaves ``push-0`` in the store, which the cold-start rows load."""
    from loader.stores import remote
    from precompile.ship.remote import pull, push
    from tests.test_remote import BUCKET

    def copy(i: int) -> float:
        start = time.perf_counter()
        shutil.copyfile(packed, work / f"copy-{i}.tar.zst")
        return time.perf_counter() - start

    def raw_put(i: int) -> float:
        fs, path = remote.filesystem(f"s3://{BUCKET}/raw/{i}.tar.zst")
        start = time.perf_counter()
        fs.put_file(str(packed), path)
        return time.perf_counter() - start

    def raw_get(i: int) -> float:
        fs, path = remote.filesystem(f"s3://{BUCKET}/raw/{i}.tar.zst")
        start = time.perf_counter()
        fs.get_file(path, str(work / f"raw-{i}.tar.zst"))
        return time.perf_counter() - start

    def push_one(i: int) -> float:
        start = time.perf_counter()
        push(packed, f"s3://{BUCKET}/push-{i}")  # a fresh store each time: a second push is a no-op
        return time.perf_counter() - start

    def pull_one(i: int) -> float:
        start = time.perf_counter()
        pull(f"s3://{BUCKET}/push-{i}/heavy", output=work / f"pulled-{i}.tar.zst")
        return time.perf_counter() - start

    rows: dict[str, Any] = {}
    for name, run in [
        ("file copy", copy),
        ("s3 put (raw)", raw_put),
        ("s3 get (raw)", raw_get),
        ("precompile push", push_one),
        ("precompile pull", pull_one),
    ]:
        seconds = median_of(repeats, run)
        rows[name] = {"seconds": round(seconds, 3), "MB_per_s": round(size_mb / seconds, 1)}
        print(f"  {name:<18} {seconds:7.2f} s  {size_mb / seconds:8.1f} MB/s", flush=True)
    return rows


def cold_start_rows(work: Path, url: str, child_env: dict[str, str], repeats: int) -> dict[str, Any]:
    """``loader.load(url)`` in a fresh process (COLD_CHILD), first with an empty cache and then with
    that cache again: the median of each figure the child reports."""

    def load(cache: Path) -> dict[str, float]:
        done = subprocess.run(
            [sys.executable, "-c", COLD_CHILD, url],
            capture_output=True,
            text=True,
            env={**child_env, "PRECOMPILE_CACHE": str(cache)},
        )
        if done.returncode != 0:
            raise RuntimeError(f"cold start failed:\n{done.stderr[-3000:]}")
        return json.loads(done.stdout.strip().splitlines()[-1])

    firsts, cached = [], []
    for i in range(repeats):
        cache = work / f"cache-{i}"
        firsts.append(load(cache))
        cached.append(load(cache))
    cold: dict[str, Any] = {}
    for name, runs in [("first load", firsts), ("cached", cached)]:
        cold[name] = {key: round(statistics.median(r[key] for r in runs), 3) for key in runs[0]}
        row = cold[name]
        print(
            f"  cold start {name:<11} load {row['load_s']:6.2f} s, first call {row['first_call_s']:6.3f} s, process {row['total_s']:6.2f} s",
            flush=True,
        )
    return cold


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "--quick", action="store_true", help="a 1-unit build and a 4 MB pack: checks the harness, not the figures"
    )
    parser.add_argument("--out", type=Path, default=ROOT / "bench" / "results" / "fleet.json")
    parser.add_argument("--mb", type=int, help="size of the transfer artifact's weights [default: 100; --quick: 4]")
    parser.add_argument("--repeats", type=int, help="runs per transfer and cold-start figure [default: 3; --quick: 1]")
    parser.add_argument("--ray-nodes", type=int, default=2)
    parser.add_argument("--ray-node-cpus", type=int, default=1)
    parser.add_argument("--skip-build", action="store_true", help="only the store rows")
    args = parser.parse_args()
    mb = args.mb or (4 if args.quick else 100)
    repeats = args.repeats or (1 if args.quick else 3)
    results: dict[str, Any] = {
        "machine": {"cpus": os.cpu_count(), "platform": platform.platform(), "python": platform.python_version()},
        "quick": args.quick,
    }
    import torch

    results["machine"]["torch"] = torch.__version__
    with tempfile.TemporaryDirectory(prefix="bench-fleet-") as scratch:
        work = Path(scratch)
        if not args.skip_build:
            print("build wall time:", flush=True)
            from tests.conftest import CLASSIFIER_PROFILE  # one unit

            profile = textwrap.dedent(CLASSIFIER_PROFILE) if args.quick else EIGHT_UNITS
            results["build"] = build_rows(work, profile, ray_nodes=args.ray_nodes, ray_node_cpus=args.ray_node_cpus)
        print("object store (rclone serve s3 on loopback):", flush=True)
        results["transfer"], results["cold_start"] = store_rows(work, mb, repeats)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(results, indent=2) + "\n")
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
