"""Sharded builds: compile a deterministic share of the units on each CI runner, then assemble.

A unit is one package to compile: a variant (per target and precision) under one option candidate
(``units.CompileTask``). ``precompile build PROFILE --shard K/N`` (``build_part``) takes every N-th unit from the
K-th, in the order of their file names, and writes a **part**: the packages it compiled, their
constants, and ``part.json`` saying which profile, model weights and torch they come from. A part is
not an artifact: ``loader.load`` refuses it.

``precompile assemble PARTS... -o ARTIFACT`` checks the parts belong together (one profile, one
model, one torch, shards 1..N each once, every unit present), puts their packages in one staging
folder and runs the rest of the build on them, as a single-host build would: value ranges, tuning,
the precision gate, weights stored once, every check against eager, references; then writes the
artifact atomically. Assembling needs the profile and its model (the checks run eager); by default
the profile is read from where the parts were built (the same path in the CI checkout).
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import re
import shutil
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import load_file, save_file

from loader import constants as C
from loader.manifest import CudaInfo

from .analysis.value_ranges import IndexTable
from .build_cache import cache_folder
from .context import BuildContext
from .errors import PrecompileError
from .executors import Executor, compile_units
from .pipeline import BuildResult, check_expires, finish, prepare
from .progress import Progress
from .stages.targets import compile_tasks
from .units import CompiledPackage, CompiledUnit, CompiledUnits, CompileTask, FailedUnit, VariantPlan, smallest_tables
from .version import __version__
from .write import publish, staging_folder

PART_FILE = "part.json"
PART_FORMAT = "precompile-part"
PART_VERSION = 1
CONSTANTS_DIR = "constants"


class PartError(PrecompileError):
    """Parts that cannot be assembled: missing, unreadable, or not from the same build."""


@dataclass(frozen=True)
class PartResult:
    path: Path
    shard: tuple[int, int]
    units: list[str]  # the files this part compiled
    seconds: float


def parse_shard(text: str) -> tuple[int, int]:
    """ "K/N" (1 ≤ K ≤ N) as (K, N)."""
    m = re.fullmatch(r"\s*(\d+)\s*/\s*(\d+)\s*", text or "")
    if not m or not 1 <= int(m.group(1)) <= int(m.group(2)):
        raise PrecompileError(f"--shard {text!r}: expected K/N with 1 ≤ K ≤ N, e.g. 2/4")
    return int(m.group(1)), int(m.group(2))


def share(tasks: list[CompileTask], k: int, n: int) -> list[CompileTask]:
    """The k-th of n shares of ``tasks``: every n-th unit from the k-th, by file name (the same on
    every runner, whatever order the planner listed them in)."""
    ordered = sorted(tasks, key=lambda t: t.file)
    return [t for i, t in enumerate(ordered) if i % n == k - 1]


# --- what makes parts belong together -------------------------------------------------------------


def profile_digest(ctx: BuildContext) -> str:
    """The profile file and every file it names (traffic, calibration, weights): their bytes."""
    loaded = ctx.loaded
    profile = loaded.profile
    h = hashlib.sha256(loaded.path.read_bytes())
    for name in (profile.distribution.file, profile.calibration.file, profile.model.weights):
        if name is not None:
            h.update(b"\0" + name.encode() + b"\0" + (loaded.folder / name).read_bytes())
    return h.hexdigest()


def model_digest(model: torch.nn.Module) -> str:
    """The model's parameters and buffers: names, dtypes, shapes and values."""
    h = hashlib.sha256()
    for name, t in sorted(model.state_dict().items()):
        t = t.detach().cpu().contiguous()
        h.update(f"{name}|{t.dtype}|{tuple(t.shape)}\0".encode())
        h.update(t.reshape(-1).view(torch.uint8).numpy().tobytes() if t.numel() else b"")
    return h.hexdigest()


# --- writing a part -------------------------------------------------------------------------------


def build_part(
    profile_path: str | Path,
    shard: tuple[int, int],
    output: str | Path | None = None,
    *,
    jobs: int | None = None,
    executor: Executor | None = None,
    progress: Progress | None = None,
    cache: str | Path | None = None,
) -> PartResult:
    """Compile the ``shard=(k, n)``-th share of a profile's units into a part at ``output`` (default:
    ``artifacts/<name>.part-k-of-n``), for ``assemble``. ``cache``: as ``precompile.build``'s."""
    progress = progress or Progress()
    cache = cache_folder(cache)
    ctx = prepare(profile_path, progress)
    k, n = shard
    target = Path(output) if output is not None else Path("artifacts") / f"{ctx.profile.name}.part-{k}-of-{n}"
    tasks = compile_tasks(ctx.variants, ctx.candidates)
    mine = share(tasks, k, n)
    progress.note(f"shard {k}/{n}: {len(mine)} of {len(tasks)} units")
    start = time.perf_counter()
    staging = staging_folder(target, marker=PART_FILE, what="a build part")
    try:
        (staging / C.VARIANTS_DIR).mkdir()
        (staging / CONSTANTS_DIR).mkdir()
        units = (
            compile_units(ctx, mine, staging, jobs=jobs, progress=progress, executor=executor, cache=cache)
            if mine
            else CompiledUnits()
        )
        record = _part_record(ctx, shard, tasks, mine, units, staging)
        (staging / PART_FILE).write_text(json.dumps(record, indent=1) + "\n", encoding="utf-8")
        publish(staging, target)
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    seconds = time.perf_counter() - start
    built = [b["file"] for b in record["built"]]
    progress.note(
        f"{target}: part {k}/{n}, {len(built)} unit(s) compiled in {seconds:.1f} s; assemble all {n} parts with precompile assemble"
    )
    return PartResult(target, (k, n), built, seconds)


def _part_record(
    ctx: BuildContext,
    shard: tuple[int, int],
    tasks: list[CompileTask],
    mine: list[CompileTask],
    units: CompiledUnits,
    staging: Path,
) -> dict[str, Any]:
    """``part.json``: where the part comes from, and per unit it compiled (its constants saved beside)."""
    built = []
    for unit in sorted(units.units, key=lambda u: (u.variant.id, u.candidate)):
        file, pkg = unit.package.path.name, unit.package  # variants/<the task's file>
        if pkg.constants:
            save_file(
                {name: t.contiguous() for name, t in pkg.constants.items()},
                str(staging / CONSTANTS_DIR / f"{file}.safetensors"),
            )
        built.append(
            {
                "file": file,
                "candidate": unit.candidate,
                "variant": _plan_to_dict(unit.variant),
                "seconds": unit.seconds,
                "metadata": pkg.metadata,
                "embedded": pkg.embedded,
                "constants": sorted(pkg.constants),
            }
        )
    return {
        "format": PART_FORMAT,
        "format_version": PART_VERSION,
        "name": ctx.profile.name,
        "shard": list(shard),
        "profile": {"path": str(ctx.loaded.path), "sha256": profile_digest(ctx)},
        "model_sha256": model_digest(ctx.model),
        "torch_version": torch.__version__,
        "precompile_version": __version__,
        "devices": list(ctx.devices),
        "cuda": None if ctx.cuda is None else ctx.cuda.to_dict(),
        "units": sorted(t.file for t in tasks),
        "built": built,
        "failed": [
            {"variant": f.variant, "candidate": f.candidate, "file": _file(mine, f), "error": f.reason}
            for f in units.failed
        ],
        "tables": {name: dataclasses.asdict(t) for name, t in units.tables.items()},
    }


def _file(tasks: list[CompileTask], failed: FailedUnit) -> str:
    return next(t.file for t in tasks if t.vp.id == failed.variant and t.candidate == failed.candidate)


def _plan_to_dict(vp: VariantPlan) -> dict[str, Any]:
    out = dataclasses.asdict(vp)
    out["ranges"] = {d: list(r) for d, r in vp.ranges.items()}
    return out


def _plan_from_dict(raw: dict[str, Any]) -> VariantPlan:
    raw = dict(raw)
    raw["ranges"] = {d: (int(lo), int(hi)) for d, (lo, hi) in raw["ranges"].items()}
    raw["warm"] = tuple(dict(sizes) for sizes in raw.get("warm", ()))
    return VariantPlan(**raw)


# --- assembling ----------------------------------------------------------------------------------------


@dataclass
class Part:
    path: Path
    record: dict[str, Any]

    @property
    def shard(self) -> tuple[int, int]:
        k, n = self.record["shard"]
        return int(k), int(n)


def read_part(path: str | Path) -> Part:
    path = Path(path)
    file = path / PART_FILE
    if not file.is_file():
        what = "an artifact, not a build part" if (path / C.MANIFEST_FILE).is_file() else "not a build part"
        raise PartError(f"{path}: {what} (no {PART_FILE}); give the folders `precompile build --shard K/N` wrote")
    try:
        record = json.loads(file.read_text(encoding="utf-8"))
        if record.get("format") != PART_FORMAT:
            raise ValueError(f"format is {record.get('format')!r}")
        if record.get("format_version") != PART_VERSION:
            raise ValueError(f"format_version {record.get('format_version')!r}, this precompile reads {PART_VERSION}")
        k, n = record["shard"]
        if not (isinstance(k, int) and isinstance(n, int) and 1 <= k <= n):
            raise ValueError(f"shard {record['shard']!r}")
        for key in ("profile", "model_sha256", "torch_version", "units", "built", "failed", "tables", "devices"):
            record[key]  # noqa: B018 (present)
    except (OSError, ValueError, KeyError, TypeError) as e:
        raise PartError(f"{file}: not a readable build part ({type(e).__name__}: {e})") from None
    return Part(path, record)


def check_parts(parts: list[Part]) -> None:
    """Shards 1..N each once, all from one profile, model, torch and set of devices."""
    if not parts:
        raise PartError("no parts given")
    first = parts[0]
    for part in parts[1:]:
        for key, what in (
            (("profile", "sha256"), "profile (or a file it names: traffic, calibration, weights)"),
            (("model_sha256",), "model weights"),
            (("torch_version",), "torch version"),
            (("devices",), "targets built"),
            (("units",), "list of units (the plan or the option candidates differ)"),
        ):
            a, b = _get(first.record, key), _get(part.record, key)
            if a != b:
                raise PartError(
                    f"{part.path} and {first.path} come from different builds: their {what} differ ({_short(b)} vs {_short(a)})"
                )
    counts = {p.shard[1] for p in parts}
    if len(counts) != 1:
        raise PartError(
            f"the parts were cut into different numbers of shards: {', '.join(f'{p.path}: {p.shard[0]}/{p.shard[1]}' for p in parts)}"
        )
    n = counts.pop()
    seen: dict[int, Path] = {}
    for p in parts:
        k = p.shard[0]
        if k in seen:
            raise PartError(f"shard {k}/{n} given twice: {seen[k]} and {p.path}")
        seen[k] = p.path
    missing = [k for k in range(1, n + 1) if k not in seen]
    if missing:
        raise PartError(
            f"shard(s) {', '.join(f'{k}/{n}' for k in missing)} missing: build them with --shard and give every part"
        )
    if first.record["torch_version"] != torch.__version__:
        raise PartError(
            f"the parts were compiled with torch {first.record['torch_version']}, this host has {torch.__version__}: "
            "assemble with the torch the parts were built with"
        )


def assemble(
    part_paths: list[str | Path],
    output: str | Path | None = None,
    *,
    profile: str | Path | None = None,
    progress: Progress | None = None,
    version: int = 1,
    expires: str | None = None,
) -> BuildResult:
    """Unite the parts of a sharded build into one artifact at ``output`` and check it as a whole."""
    progress = progress or Progress()
    check_expires(expires)
    with progress.stage("parts", f"{len(part_paths)} part(s)"):
        parts = [read_part(p) for p in part_paths]
        check_parts(parts)
    profile_path = Path(profile) if profile is not None else Path(parts[0].record["profile"]["path"])
    if not profile_path.is_file():
        raise PartError(f"{profile_path}: the profile the parts were built from is not there; give it with --profile")
    ctx = prepare(profile_path, progress)
    tasks = compile_tasks(ctx.variants, ctx.candidates)
    _check_same_build(ctx, tasks, parts[0], profile_path)
    target = Path(output) if output is not None else Path("artifacts") / ctx.profile.name
    staging = staging_folder(target)
    try:
        (staging / C.VARIANTS_DIR).mkdir()
        units = _unpack_parts(parts, tasks, staging)
        cuda = parts[0].record.get("cuda")
        if cuda is not None:
            ctx = dataclasses.replace(ctx, cuda=CudaInfo(**{**cuda, "archs": tuple(cuda["archs"])}))
        progress.note(f"assembling {len(units.units)} unit(s) from {len(parts)} part(s)")
        return finish(ctx, units, staging, target, progress=progress, version=version, expires=expires)
    finally:
        shutil.rmtree(staging, ignore_errors=True)


def _check_same_build(ctx: BuildContext, tasks: list[CompileTask], part: Part, profile_path: Path) -> None:
    """This host prepares the build the parts come from: the same profile, model, units and targets."""
    if profile_digest(ctx) != part.record["profile"]["sha256"]:
        raise PartError(
            f"{profile_path} (or a file it names) is not the profile the parts were built from: it changed since"
        )
    if model_digest(ctx.model) != part.record["model_sha256"]:
        raise PartError(
            f"the model {ctx.profile.model.factory} resolves to other weights than the parts were built with"
        )
    if sorted(t.file for t in tasks) != part.record["units"]:
        raise PartError(
            "this host plans other units than the parts hold (another torch, targets or plan): assemble where the parts were built alike"
        )
    if list(ctx.devices) != part.record["devices"]:
        raise PartError(f"the parts were built for {part.record['devices']}, this host plans {list(ctx.devices)}")


def _unpack_parts(parts: list[Part], tasks: list[CompileTask], staging: Path) -> CompiledUnits:
    """Every part's packages in ``staging``, as the units a single-host build would have compiled."""
    by_file = {t.file: t for t in tasks}
    units: list[CompiledUnit] = []
    failed: list[FailedUnit] = []
    tables: dict[str, IndexTable] = {}
    done: set[str] = set()
    for part in parts:
        for entry in part.record["built"]:
            task = by_file.get(entry["file"])
            if task is None or entry["file"] in done:
                raise PartError(
                    f"{part.path}: unit {entry['file']} is not one this build plans, or another part holds it too"
                )
            done.add(entry["file"])
            units.append(_unpack_unit(part, entry, staging, task.candidate))
        for entry in part.record["failed"]:
            done.add(entry["file"])
            failed.append(FailedUnit(entry["variant"], int(entry["candidate"]), str(entry["error"])))
        tables = smallest_tables(tables, {name: IndexTable(**raw) for name, raw in part.record["tables"].items()})
    missing = sorted(set(by_file) - done)
    if missing:
        raise PartError(f"no part holds the unit(s) {', '.join(missing[:5])}{' …' if len(missing) > 5 else ''}")
    return CompiledUnits(tuple(units), tuple(failed), tables)


def _unpack_unit(part: Part, entry: dict[str, Any], staging: Path, candidate: int) -> CompiledUnit:
    src = part.path / C.VARIANTS_DIR / entry["file"]
    if not src.is_file():
        raise PartError(f"{part.path}: {C.VARIANTS_DIR}/{entry['file']} is missing")
    dst = staging / C.VARIANTS_DIR / entry["file"]
    shutil.copyfile(src, dst)
    constants: dict[str, torch.Tensor] = {}
    if entry["constants"]:
        file = part.path / CONSTANTS_DIR / f"{entry['file']}.safetensors"
        try:
            constants = load_file(str(file))
        except Exception as e:  # missing or corrupt: safetensors raises several types
            raise PartError(f"{file}: cannot read the unit's constants ({type(e).__name__}: {e})") from None
        if sorted(constants) != entry["constants"]:
            raise PartError(f"{file}: holds other constants than {PART_FILE} lists")
    pkg = CompiledPackage(dst, constants, dict(entry["metadata"]), bool(entry["embedded"]))
    return CompiledUnit(_plan_from_dict(entry["variant"]), pkg, float(entry["seconds"]), candidate)


def _get(record: dict, key: tuple[str, ...]) -> Any:
    for k in key:
        record = record.get(k) if isinstance(record, dict) else None
    return record


def _short(value: Any) -> str:
    text = str(value)
    return text[:16] + "…" if len(text) > 20 else text
