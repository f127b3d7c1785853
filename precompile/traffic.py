"""The profile's observed traffic: ``distribution.shapes`` and ``distribution.file`` as counts per shape.

Read once per build (``BuildContext.traffic``); the planner, tuning, the precision gate and the
calibration samples all work from that one reading.
"""

from __future__ import annotations

from typing import Any

from loader.serving.traffic import TrafficFileError, read_histogram

from .errors import ProfileError
from .profile import LoadedProfile
from .units import VariantPlan

Shape = tuple[int, ...]  # a size per dim, in the profile's dims order


def read_distribution(loaded: LoadedProfile) -> dict[Shape, int]:
    """Merge ``distribution.shapes`` and ``distribution.file`` into counts per shape (dims in profile order)."""
    profile = loaded.profile
    dims = tuple(profile.dims)
    source = str(loaded.path)
    counts: dict[Shape, int] = {}
    problems: list[tuple[str, str]] = []

    def add(entry: dict[str, Any], count: Any, place: str) -> None:
        if isinstance(count, bool) or not isinstance(count, int) or count < 0:
            problems.append((place, f"count must be a non-negative integer, got {count!r}"))
            return
        if set(entry) != set(dims):
            missing, extra = sorted(set(dims) - set(entry)), sorted(set(entry) - set(dims))
            what = "; ".join(
                x for x in (f"missing {missing}" if missing else "", f"unknown {extra}" if extra else "") if x
            )
            problems.append((place, f"needs a size for exactly the dims {list(dims)} ({what})"))
            return
        if not all(isinstance(entry[d], int) and not isinstance(entry[d], bool) and entry[d] >= 0 for d in dims):
            problems.append((place, f"sizes must be non-negative integers, got {entry}"))
            return
        key = tuple(entry[d] for d in dims)
        counts[key] = counts.get(key, 0) + count

    for i, item in enumerate(profile.distribution.shapes):
        entry = dict(item)
        add({k: v for k, v in entry.items() if k != "count"}, entry.get("count", 1), f"distribution.shapes[{i}]")
    if profile.distribution.file is not None and not problems:
        path = loaded.folder / profile.distribution.file

        def same_dims(sizes: dict[str, int], where: str) -> None:
            if set(sizes) != set(dims):
                raise TrafficFileError(f"{where}: dims {sorted(sizes)} are not the profile's {sorted(dims)}")

        try:
            recorded = read_histogram(path, check=same_dims)
        except TrafficFileError as e:
            raise ProfileError(source, [("distribution.file", str(e))]) from None
        for key, count in recorded.items():
            add(dict(key), count, f"distribution.file: {path.name}")
    if problems:
        raise ProfileError(
            source, problems[:20] + ([("", f"... and {len(problems) - 20} more")] if len(problems) > 20 else [])
        )
    return counts


def serving_shapes(
    vp: VariantPlan, distribution: dict[Shape, int], dims: tuple[str, ...], top: int = 3
) -> list[tuple[dict[str, int], float]]:
    """The shapes a variant will serve, hottest first with their traffic weights; its hint alone (weight
    1) when no observed traffic falls in its ranges."""
    inside = [
        (dict(zip(dims, key)), count)
        for key, count in distribution.items()
        if count > 0 and all(vp.ranges[d][0] <= key[i] <= vp.ranges[d][1] for i, d in enumerate(dims))
    ]
    inside.sort(key=lambda item: -item[1])
    chosen = inside[:top]
    if not chosen:
        return [(dict(vp.hint), 1.0)]
    total = sum(c for _, c in chosen)
    return [(sizes, count / total) for sizes, count in chosen]
