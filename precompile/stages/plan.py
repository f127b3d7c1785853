"""Stage plan: from a profile and its observed traffic to the variants worth compiling.

A pure, deterministic function. Static variants go to the hottest exact shapes, until
``plan.max_specialized`` of them or until they serve ``plan.coverage`` of the traffic; dynamic variants
always cover every declared range completely, one per sub-range when ``plan.ranges`` gives split
points. Each dynamic variant is exported with the most frequent shape of its sub-range that no static
variant takes, so Inductor's size hints fit the traffic it will really serve. Shapes outside the declared dims are reported, never silently dropped.
"""

from __future__ import annotations

import itertools

from loader.policy import split_sizes

from ..profile import LoadedProfile, Profile
from ..traffic import Shape, read_distribution
from ..units import Plan, VariantPlan


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
    in_range = {
        k: c
        for k, c in distribution.items()
        if c > 0 and all(ranges[d][0] <= k[i] <= ranges[d][1] for i, d in enumerate(dims))
    }
    outside = {k: c for k, c in distribution.items() if c > 0 and k not in in_range}

    statics: list[VariantPlan] = []
    covered = 0
    if any(lo != hi for lo, hi in ranges.values()):
        for key, count in sorted(in_range.items(), key=_heat):
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
            k: c
            for k, c in in_range.items()
            if all(box_ranges[d][0] <= k[j] <= box_ranges[d][1] for j, d in enumerate(dims))
        }
        serves = {k: c for k, c in inside.items() if k not in static_keys}
        served = sum(serves.values())
        if inside:
            # Tune for the traffic this variant will really serve; the static shapes are served elsewhere.
            hottest = min((serves or inside).items(), key=_heat)[0]
            hint = dict(zip(dims, hottest))
        else:
            hint = {d: min(max(profile.hint(d), lo), hi) for d, (lo, hi) in box_ranges.items()}
        kind = "dynamic" if any(lo != hi for lo, hi in box_ranges.values()) else "static"
        vid = ("dynamic" if len(boxes) == 1 else f"dynamic-{i}") if kind == "dynamic" else f"fixed-{i}"
        warm = _warm_shapes(serves, dims, profile.plan.warm_shapes) if kind == "dynamic" else ()
        dynamic.append(VariantPlan(vid, kind, box_ranges, hint, served / total if total else 0.0, served, warm=warm))

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
        out_of_range=tuple((dict(zip(dims, k)), c) for k, c in sorted(outside.items(), key=_heat)),
    )


def _heat(item: tuple[Shape, int]) -> tuple[int, Shape]:
    """The order of a (shape, count) pair among others: the hottest first, ties to the smaller shape."""
    return -item[1], item[0]


def _warm_shapes(serves: dict[Shape, int], dims: tuple[str, ...], limit: int) -> tuple[dict[str, int], ...]:
    """The ``limit`` hottest shapes a dynamic variant serves, ties to the smaller shape. The hottest is
    its planned hint, kept: export may move the hint it compiles with (off a size of 1, or off another
    dim's size), and the manifest's ``warm`` then leaves out only the hint the variant has."""
    return tuple(dict(zip(dims, k)) for k, _ in sorted(serves.items(), key=_heat)[:limit])


def _policy_serves(profile: Profile, sizes: dict[str, int]) -> bool:
    """Whether the loader's policies can serve this out-of-range shape (pad up from below, split from above)."""
    for d, n in sizes.items():
        spec = profile.dims[d]
        if spec.min <= n <= spec.max:
            continue
        policy = profile.policy.out_of_range.get(d, "error")
        if not (
            (policy == "pad" and n < spec.min)
            or (policy == "split" and n > spec.max and split_sizes(n, spec.min, spec.max))
        ):
            return False
    return True


def make_plan(loaded: LoadedProfile, traffic: dict[Shape, int] | None = None) -> Plan:
    """The plan for a loaded profile and the traffic it names (``traffic``: already read)."""
    return plan_variants(loaded.profile, read_distribution(loaded) if traffic is None else traffic)


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
