"""The planner: from a profile and its observed traffic to the variants worth compiling.

A pure, deterministic function. Static variants go to the hottest exact shapes, until
``plan.max_specialized`` of them or until they serve ``plan.coverage`` of the traffic; dynamic variants
always cover every declared range completely, one per sub-range when ``plan.ranges`` gives split
points. Each dynamic variant is exported with the most frequent shape of its sub-range that no static
variant takes, so Inductor's size hints fit the traffic it will really serve. Shapes outside the declared dims are reported, never silently dropped.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass, field
from typing import Any

from loader.policy import split_sizes
from loader.traffic import TrafficFileError, read_histogram

from .errors import ProfileError
from .profile import LoadedProfile, Profile

Shape = tuple[int, ...]


@dataclass(frozen=True)
class VariantPlan:
    id: str
    kind: str  # "static" | "dynamic"
    ranges: dict[str, tuple[int, int]]
    hint: dict[str, int]
    share: float = 0.0  # share of observed traffic this variant will serve
    count: int = 0  # calls of observed traffic it will serve
    device: str = "cpu"
    dtype: str | None = None  # compute dtype (CUDA variants); None: the model's own
    precision: str = "fp32"  # fp32 | bf16 | int8 (precompile.precision)

    def describe(self) -> str:
        return " ".join(f"{d}={lo}" if lo == hi else f"{d}∈[{lo},{hi}]" for d, (lo, hi) in self.ranges.items())


@dataclass(frozen=True)
class Plan:
    dims: tuple[str, ...]
    variants: tuple[VariantPlan, ...]
    total: int  # calls in the distribution
    static_count: int
    dynamic_count: int
    by_policy: dict[str, int]  # out-of-range calls the loader will pad or split, per policy
    rejected_count: int  # out-of-range calls the loader will refuse (policy error)
    out_of_range: tuple[tuple[dict[str, int], int], ...] = field(default=())  # (dims, count), hottest first

    def share(self, count: int) -> float:
        return count / self.total if self.total else 0.0

    def to_dict(self) -> dict[str, Any]:
        return {
            "variants": [
                {
                    "id": v.id,
                    "kind": v.kind,
                    "ranges": {d: list(r) for d, r in v.ranges.items()},
                    "hint": v.hint,
                    "count": v.count,
                    "share": round(v.share, 6),
                }
                for v in self.variants
            ],
            "traffic": {
                "total": self.total,
                "static": {"count": self.static_count, "share": round(self.share(self.static_count), 6)},
                "dynamic": {"count": self.dynamic_count, "share": round(self.share(self.dynamic_count), 6)},
                "out_of_range_by_policy": {
                    p: {"count": c, "share": round(self.share(c), 6)} for p, c in sorted(self.by_policy.items())
                },
                "rejected": {"count": self.rejected_count, "share": round(self.share(self.rejected_count), 6)},
            },
            "out_of_range": [{"dims": d, "count": c} for d, c in self.out_of_range],
        }


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
            what = "; ".join(x for x in (f"missing {missing}" if missing else "", f"unknown {extra}" if extra else "") if x)
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
        raise ProfileError(source, problems[:20] + ([("", f"... and {len(problems) - 20} more")] if len(problems) > 20 else []))
    return counts


def sub_ranges(profile: Profile) -> dict[str, list[tuple[int, int]]]:
    """Per dim, the ranges of the dynamic variants: split at ``plan.ranges`` points (each point ends a sub-range)."""
    out = {}
    for d, spec in profile.dims.items():
        points = sorted(set(p for p in profile.plan.ranges.get(d, []) if spec.min <= p < spec.max))
        bounds, lo = [], spec.min
        for p in points:
            bounds.append((lo, p))
            lo = p + 1
        bounds.append((lo, spec.max))
        out[d] = bounds
    return out


def plan_variants(profile: Profile, distribution: dict[Shape, int]) -> Plan:
    """The variants to build for this traffic. Deterministic: ties go to the smaller shape."""
    dims = tuple(profile.dims)
    ranges = {d: (s.min, s.max) for d, s in profile.dims.items()}
    total = sum(distribution.values())
    in_range = {k: c for k, c in distribution.items() if c > 0 and all(ranges[d][0] <= k[i] <= ranges[d][1] for i, d in enumerate(dims))}
    outside = {k: c for k, c in distribution.items() if c > 0 and k not in in_range}

    statics: list[VariantPlan] = []
    covered = 0
    if any(lo != hi for lo, hi in ranges.values()):
        for key, count in sorted(in_range.items(), key=lambda kv: (-kv[1], kv[0])):
            if len(statics) >= profile.plan.max_specialized or (total and covered / total >= profile.plan.coverage):
                break
            sizes = dict(zip(dims, key))
            statics.append(
                VariantPlan(
                    id=f"static-{len(statics)}",
                    kind="static",
                    ranges={d: (n, n) for d, n in sizes.items()},
                    hint=sizes,
                    share=count / total if total else 0.0,
                    count=count,
                )
            )
            covered += count
    static_keys = {tuple(v.hint[d] for d in dims) for v in statics}

    boxes = list(itertools.product(*(sub_ranges(profile)[d] for d in dims))) if dims else [()]
    dynamic: list[VariantPlan] = []
    for i, box in enumerate(boxes):
        box_ranges = dict(zip(dims, box))
        inside = {
            k: c for k, c in in_range.items() if all(box_ranges[d][0] <= k[j] <= box_ranges[d][1] for j, d in enumerate(dims))
        }
        serves = {k: c for k, c in inside.items() if k not in static_keys}
        served = sum(serves.values())
        if inside:
            # Tune for the traffic this variant will really serve; the static shapes are served elsewhere.
            hottest = min((serves or inside).items(), key=lambda kv: (-kv[1], kv[0]))[0]
            hint = dict(zip(dims, hottest))
        else:
            hint = {d: min(max(profile.hint(d), lo), hi) for d, (lo, hi) in box_ranges.items()}
        kind = "dynamic" if any(lo != hi for lo, hi in box_ranges.values()) else "static"
        vid = ("dynamic" if len(boxes) == 1 else f"dynamic-{i}") if kind == "dynamic" else f"fixed-{i}"
        dynamic.append(VariantPlan(vid, kind, box_ranges, hint, served / total if total else 0.0, served))

    by_policy: dict[str, int] = {}
    rejected = 0
    for key, count in outside.items():
        policies = {
            profile.policy.out_of_range.get(d, "error")
            for i, d in enumerate(dims)
            if not ranges[d][0] <= key[i] <= ranges[d][1]
        }
        usable = _policy_serves(profile, dict(zip(dims, key)))
        if usable:
            name = "+".join(sorted(policies))
            by_policy[name] = by_policy.get(name, 0) + count
        else:
            rejected += count
    return Plan(
        dims=dims,
        variants=tuple(statics + dynamic),
        total=total,
        static_count=covered,
        dynamic_count=sum(v.count for v in dynamic),
        by_policy=by_policy,
        rejected_count=rejected,
        out_of_range=tuple(
            (dict(zip(dims, k)), c) for k, c in sorted(outside.items(), key=lambda kv: (-kv[1], kv[0]))
        ),
    )


def _policy_serves(profile: Profile, sizes: dict[str, int]) -> bool:
    """Whether the loader's policies can serve this out-of-range shape (pad up from below, split from above)."""
    for d, n in sizes.items():
        spec = profile.dims[d]
        if spec.min <= n <= spec.max:
            continue
        policy = profile.policy.out_of_range.get(d, "error")
        if not ((policy == "pad" and n < spec.min) or (policy == "split" and n > spec.max and split_sizes(n, spec.min, spec.max))):
            return False
    return True


def make_plan(loaded: LoadedProfile) -> Plan:
    """The plan for a loaded profile and the traffic it names."""
    return plan_variants(loaded.profile, read_distribution(loaded))


def format_plan(plan: Plan, profile_name: str) -> str:
    """The plan as a table for the terminal."""
    lines = [f"plan for {profile_name}: {len(plan.variants)} variant(s), {plan.total} observed calls"]
    lines.append(f"  {'variant':<12} {'kind':<8} {'shape / ranges':<36} {'hint':<28} {'share':>7}")
    for v in plan.variants:
        hint = " ".join(f"{d}={n}" for d, n in v.hint.items())
        lines.append(f"  {v.id:<12} {v.kind:<8} {v.describe():<36} {hint:<28} {v.share:>7.1%}")
    lines.append(
        f"  traffic: static {plan.share(plan.static_count):.1%}, dynamic {plan.share(plan.dynamic_count):.1%}"
        + "".join(f", {p} {plan.share(c):.1%}" for p, c in sorted(plan.by_policy.items()))
        + f", rejected {plan.share(plan.rejected_count):.1%}"
    )
    if plan.out_of_range:
        count = sum(c for _, c in plan.out_of_range)
        lines.append(
            f"  outside the declared dims: {count} calls ({plan.share(count):.1%}) in {len(plan.out_of_range)} shape(s), e.g. "
            + "; ".join(" ".join(f"{d}={n}" for d, n in dims.items()) + f" ×{c}" for dims, c in plan.out_of_range[:3])
        )
    return "\n".join(lines)
