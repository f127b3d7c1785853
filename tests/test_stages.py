"""The build's stages one by one, without a build: tuning, the precision gate, static timing, the
compile driver and the unit plan, on fake compiled units (package files that hold nothing) and fake
runners and clocks, with the real eager model (a seeded Linear) as the reference."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from precompile.analysis.value_ranges import IndexTable
from precompile.calibration import gate_inputs
from precompile.compare import compare_tensors
from precompile.context import BuildContext
from precompile.errors import CheckError, CompileError, ProfileError
from precompile.executors import Outcome, compile_units
from precompile.profile import LoadedProfile, Profile
from precompile.progress import Progress
from precompile.stages.gate import gate_precisions
from precompile.stages.measure import dropped_variants, measure_statics
from precompile.stages.targets import compile_tasks, expand_precisions
from precompile.stages.tune import tune_variants
from precompile.units import CompiledPackage, CompiledUnit, CompiledUnits, FailedUnit, UnitResult, VariantPlan

PROFILE = {
    "name": "stages",
    "model": {"factory": "tiny:linear"},
    "inputs": {"x": {"shape": ["batch", 4], "dtype": "float32"}},
    "dims": {"batch": {"min": 1, "max": 8}},
    "precision": ["fp32", "int8"],
}


@pytest.fixture
def profile() -> Profile:
    return Profile.model_validate(PROFILE)


@pytest.fixture
def model() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Linear(4, 3).eval()


DYNAMIC = VariantPlan("dynamic", "dynamic", {"batch": (1, 8)}, {"batch": 3})
STATIC = VariantPlan("static-0", "static", {"batch": (2, 2)}, {"batch": 2})


def unit(folder: Path, vp: VariantPlan, candidate: int = 0, seconds: float = 1.0) -> CompiledUnit:
    """A compiled unit whose package is an empty file (the fake runners never open it)."""
    path = folder / (f"{vp.id}.c{candidate}.pt2" if candidate else f"{vp.id}.pt2")
    path.write_bytes(b"")
    return CompiledUnit(vp, CompiledPackage(path, {}, {}), seconds, candidate)


def runners(model: torch.nn.Module, noise: dict[str, float]):
    """``open_runner`` handing out the eager model, its outputs shifted by ``noise[file name]``."""

    def open_runner(pkg: CompiledPackage, device: str):
        shift = noise.get(pkg.path.name, 0.0)
        return lambda *args: [model(*args).detach() + shift]

    return open_runner


# --- tune ---------------------------------------------------------------------------------------


def test_tuning_keeps_the_fastest_candidate_under_the_variants_own_name(tmp_path, profile, model):
    compiled = CompiledUnits(
        (unit(tmp_path, DYNAMIC, 0, 2.0), unit(tmp_path, DYNAMIC, 1, 3.0), unit(tmp_path, DYNAMIC, 2))
    )
    speed = {0: 5.0, 1: 2.0, 2: 4.0}
    result = tune_variants(
        profile,
        model,
        [DYNAMIC],
        compiled,
        [{}, {"freezing": True}, {"max_autotune": True}],
        {},
        open_runner=runners(model, {}),
        measure_unit=lambda run, u, shapes: (speed[u.candidate], 0.0),
    )
    (kept,) = result.kept
    assert kept.candidate == 1 and kept.package.path == tmp_path / "dynamic.pt2" and kept.package.path.exists()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["dynamic.pt2"]  # the losers are deleted
    assert [(t.candidate, t.ms, t.kept, t.compile_s) for t in result.trials] == [
        (0, 5.0, False, 2.0),
        (1, 2.0, True, 3.0),
        (2, 4.0, False, 1.0),
    ]


def test_a_candidate_that_did_not_compile_or_disagrees_with_eager_loses(tmp_path, profile, model):
    compiled = CompiledUnits(
        (unit(tmp_path, DYNAMIC, 0), unit(tmp_path, DYNAMIC, 2)), (FailedUnit("dynamic", 1, "CompileError: no kernel"),)
    )

    def measure_unit(run, u, shapes):
        if u.candidate == 2:
            raise CheckError("variant dynamic: compiled differs from eager")
        return 9.0, 1e-6

    result = tune_variants(
        profile,
        model,
        [DYNAMIC],
        compiled,
        [{}, {"a": 1}, {"b": 2}],
        {},
        open_runner=runners(model, {}),
        measure_unit=measure_unit,
    )
    assert result.kept[0].candidate == 0
    assert [t.error for t in result.trials] == [
        None,
        "CompileError: no kernel",
        "variant dynamic: compiled differs from eager",
    ]


def test_tuning_with_no_candidate_left_names_every_reason(tmp_path, profile, model):
    compiled = CompiledUnits((unit(tmp_path, DYNAMIC, 0),), (FailedUnit("dynamic", 1, "not compiled: budget"),))

    def measure_unit(run, u, shapes):
        raise RuntimeError("the runner crashed")

    with pytest.raises(
        CheckError,
        match=r"no tuning candidate compiled and matched eager \(candidate 0 \{\}: the runner crashed; candidate 1",
    ):
        tune_variants(
            profile,
            model,
            [DYNAMIC],
            compiled,
            [{}, {"a": 1}],
            {},
            open_runner=runners(model, {}),
            measure_unit=measure_unit,
        )


def test_tuning_measures_each_candidate_against_eager_on_its_traffic(tmp_path, profile, model):
    """The real measure: a runner off by more than the tolerance is refused, one equal to eager timed."""
    compiled = CompiledUnits((unit(tmp_path, DYNAMIC, 0), unit(tmp_path, DYNAMIC, 1)))
    result = tune_variants(
        profile,
        model,
        [DYNAMIC],
        compiled,
        [{}, {"a": 1}],
        {(4,): 10},
        open_runner=runners(model, {"dynamic.c1.pt2": 0.5}),
    )
    first, second = result.trials
    assert first.kept and first.ms > 0 and first.max_abs_error == 0.0
    assert not second.kept and "beyond tolerance" in second.error


# --- gate ---------------------------------------------------------------------------------------


INT8 = VariantPlan("int8-dynamic", "dynamic", {"batch": (1, 8)}, {"batch": 3}, precision="int8")


def fake_clock(ms: dict[int, float]):
    """A timer giving the k-th callable ``ms[k]``, after calling each once (so the runners run)."""

    def timer(*fns, seconds: float = 0.4):
        for fn in fns:
            fn()
        return [ms[k] for k in range(len(fns))]

    return timer


def test_the_gate_keeps_an_accurate_and_faster_lower_precision(tmp_path, profile, model):
    units = [unit(tmp_path, DYNAMIC), unit(tmp_path, INT8)]
    outcome = gate_precisions(
        profile, model, units, {}, held_out(profile), open_runner=runners(model, {}), timer=fake_clock({0: 2.0, 1: 1.0})
    )
    assert [u.variant.id for u in outcome.kept] == ["dynamic", "int8-dynamic"]
    (result,) = outcome.results
    assert result.kept and result.against == "dynamic" and result.speedup == 2.0
    rows = sum(sizes["batch"] for sizes, _ in held_out(profile)(INT8))
    assert result.accuracy == [
        {
            "output": 0,
            "metric": "cosine",
            "statistic": "p5",
            "rows": rows,
            "threshold": 0.99,
            "value": pytest.approx(1.0),
            "passed": True,
        }
    ]
    assert result.samples == profile.accuracy.samples == 64  # the held-out inputs, drawn inside the ranges


def test_the_gate_drops_an_inaccurate_one_and_deletes_its_file(tmp_path, profile, model):
    units = [unit(tmp_path, DYNAMIC), unit(tmp_path, INT8)]
    noisy = runners(model, {"int8-dynamic.pt2": 0.0})

    def open_runner(pkg, device):  # int8 gives the outputs reversed: cosine far below 0.99
        run = noisy(pkg, device)
        return (lambda *args: [-t for t in run(*args)]) if pkg.path.name.startswith("int8") else run

    outcome = gate_precisions(
        profile, model, units, {}, held_out(profile), open_runner=open_runner, timer=fake_clock({0: 2.0, 1: 1.0})
    )
    assert [u.variant.id for u in outcome.kept] == ["dynamic"]
    (result,) = outcome.results
    rows = sum(sizes["batch"] for sizes, _ in held_out(profile)(INT8))
    assert (
        result.reason == f"out0 cosine p5 -1.0000 < 0.99 on {rows} held-out rows (accuracy gate)" and result.ms is None
    )
    assert not result.kept
    assert not (tmp_path / "int8-dynamic.pt2").exists() and (tmp_path / "dynamic.pt2").exists()


def test_the_gate_drops_one_that_is_not_faster(tmp_path, profile, model):
    units = [unit(tmp_path, DYNAMIC), unit(tmp_path, INT8)]
    outcome = gate_precisions(
        profile, model, units, {}, held_out(profile), open_runner=runners(model, {}), timer=fake_clock({0: 1.0, 1: 1.0})
    )
    (result,) = outcome.results
    assert not result.kept and result.reason == "not faster than fp32 (1.000 vs 1.000 ms, accuracy.min_speedup)"
    assert [u.variant.id for u in outcome.kept] == ["dynamic"]


def test_the_gate_scores_the_held_out_inputs_of_the_variants_own_ranges(tmp_path, profile, model):
    asked = []

    def inputs(vp):
        asked.append(vp.ranges)
        return [({"batch": 2}, (torch.ones(2, 4),))]

    outcome = gate_precisions(
        profile,
        model,
        [unit(tmp_path, DYNAMIC), unit(tmp_path, INT8)],
        {},
        inputs,
        open_runner=runners(model, {}),
        timer=fake_clock({0: 2.0, 1: 1.0}),
    )
    assert asked == [INT8.ranges] and outcome.results[0].samples == 1 and outcome.results[0].accuracy[0]["rows"] == 2


def held_out(profile: Profile):
    """What the build hands the gate: ``calibration.gate_inputs`` of the profile, per variant's ranges."""
    loaded = LoadedProfile(profile=profile, path=Path("stages.yaml"))
    return lambda vp: gate_inputs(loaded, {}, vp.ranges)


# --- measure ------------------------------------------------------------------------------------


class FakeCompiled:
    """What measure_statics reads of a loaded artifact: its variants and run_variant."""

    device_type = "cpu"

    def __init__(self):
        from loader.manifest import DimRange, Variant

        def variant(vid, kind, lo, hi):
            return Variant(
                id=vid,
                kind=kind,
                file=f"variants/{vid}.pt2",
                dims={"batch": DimRange(lo, hi)},
                hint={"batch": lo},
                constants=(),
            )

        self.variants = [
            variant("static-0", "static", 2, 2),
            variant("static-1", "static", 16, 16),
            variant("dynamic", "dynamic", 1, 8),
        ]
        self.calls: list[str] = []

    def run_variant(self, vid, *args):
        self.calls.append(vid)
        return [args[0]]


def test_static_variants_are_kept_only_where_they_pay(profile):
    compiled = FakeCompiled()
    (timing,) = measure_statics(compiled, profile, timer=fake_clock({0: 1.0, 1: 1.5}))  # static-1: no dynamic serves 16
    assert (timing.variant, timing.against, timing.speedup, timing.kept) == ("static-0", "dynamic", 1.5, True)
    assert compiled.calls == ["static-0", "dynamic"]
    slow = measure_statics(
        FakeCompiled(),
        profile.model_copy(update={"plan": profile.plan.model_copy(update={"min_speedup": 2.0})}),
        timer=fake_clock({0: 1.0, 1: 1.5}),
    )
    assert not slow[0].kept and slow[0].describe() == "static-0: 1.000 ms static vs 1.500 ms dynamic (1.50×) → dropped"
    int8_twin = VariantPlan("int8-static-0", "static", {"batch": (2, 2)}, {"batch": 2}, precision="int8")
    assert dropped_variants(slow, [STATIC, DYNAMIC, int8_twin]) == {"static-0", "int8-static-0"}


# --- targets and the compile driver -------------------------------------------------------------


def test_every_variants_first_candidate_comes_first_and_lower_precisions_compile_once(profile):
    variants = expand_precisions([DYNAMIC, STATIC], profile)
    assert [v.id for v in variants] == ["dynamic", "static-0", "int8-dynamic", "int8-static-0"]
    tasks = compile_tasks(variants, [{}, {"freezing": True}])
    assert [(t.vp.id, t.candidate, t.file) for t in tasks] == [
        ("dynamic", 0, "dynamic.c0.pt2"),
        ("static-0", 0, "static-0.c0.pt2"),
        ("int8-dynamic", 0, "int8-dynamic.pt2"),
        ("int8-static-0", 0, "int8-static-0.pt2"),
        ("dynamic", 1, "dynamic.c1.pt2"),
        ("static-0", 1, "static-0.c1.pt2"),
    ]
    assert tasks[2].options == {
        "cpp.dynamic_threads": True,
        "aot_inductor.enable_line_tables": False,
        "freezing": True,
    }  # fmt: skip
    assert [t.file for t in compile_tasks([DYNAMIC], [{}])] == ["dynamic.pt2"]


def context(profile: Profile, model, candidates, tune=None) -> BuildContext:
    if tune is not None:
        profile = profile.model_copy(update={"compile": profile.compile.model_copy(update={"tune": tune})})
    from precompile.stages.plan import plan_variants

    loaded = LoadedProfile(profile=profile, path=Path("stages.yaml"))
    return BuildContext(
        loaded, model, {}, plan_variants(profile, {}), ("cpu",), None, (DYNAMIC,), tuple(candidates), None
    )


class FakeExecutor:
    """Compiles nothing: each task's outcome from ``results`` (a UnitResult, or an error to raise)."""

    def __init__(self, results):
        self.results = results
        self.seen = []

    def run(self, job, tasks):
        for task in tasks:
            self.seen.append((task.vp.id, task.candidate))
            value = self.results[task.candidate]
            yield Outcome(task, None, value) if isinstance(value, BaseException) else Outcome(task, value)


def test_the_compile_driver_collects_typed_units_and_the_smallest_tables(tmp_path, profile, model):
    ctx = context(profile, model, [{}, {"a": 1}, {"b": 2}])
    results = {
        0: UnitResult(unit(tmp_path, DYNAMIC, 0), {"x": IndexTable(10, "embedding")}),
        1: CompileError("no kernel"),
        2: UnitResult(unit(tmp_path, DYNAMIC, 2), {"x": IndexTable(7, "gather")}),
    }
    tasks = compile_tasks([DYNAMIC], ctx.candidates)
    units = compile_units(ctx, tasks, tmp_path, jobs=1, progress=Progress(), executor=FakeExecutor(results))
    assert [u.candidate for u in units.units] == [0, 2]
    assert units.failed == (FailedUnit("dynamic", 1, "CompileError: no kernel"),)
    assert units.tables == {"x": IndexTable(7, "gather")}
    assert units.first("dynamic").package.path.name == "dynamic.pt2"


def test_a_first_candidate_failing_fails_the_build_and_a_budget_skips_later_ones(tmp_path, profile, model):
    from precompile.profile import TuneSpec

    ctx = context(profile, model, [{}, {"a": 1}])
    with pytest.raises(CompileError, match="no kernel"):
        compile_units(
            ctx,
            compile_tasks([DYNAMIC], ctx.candidates),
            tmp_path,
            jobs=1,
            progress=Progress(),
            executor=FakeExecutor({0: CompileError("no kernel")}),
        )
    ctx = context(profile, model, [{}, {"a": 1}], tune=TuneSpec(candidates=[{"a": 1}], max_seconds=1e-9))
    executor = FakeExecutor({0: UnitResult(unit(tmp_path, DYNAMIC, 0)), 1: UnitResult(unit(tmp_path, DYNAMIC, 1))})
    units = compile_units(
        ctx, compile_tasks([DYNAMIC], ctx.candidates), tmp_path, jobs=1, progress=Progress(), executor=executor
    )
    assert executor.seen == [("dynamic", 0)]
    assert units.failed == (FailedUnit("dynamic", 1, "not compiled: compile.tune.max_seconds (1e-09 s) reached"),)


def test_a_profile_error_in_a_later_candidate_still_fails_the_build(tmp_path, profile, model):
    ctx = context(profile, model, [{}, {"a": 1}])
    executor = FakeExecutor(
        {0: UnitResult(unit(tmp_path, DYNAMIC, 0)), 1: ProfileError("p.yaml", [("inputs.x", "bad")])}
    )
    with pytest.raises(ProfileError):
        compile_units(
            ctx, compile_tasks([DYNAMIC], ctx.candidates), tmp_path, jobs=1, progress=Progress(), executor=executor
        )


# --- the context and the comparison -------------------------------------------------------------


def test_the_context_draws_its_calibration_samples_once(profile, model, monkeypatch):
    import precompile.context as context_module

    calls = []
    monkeypatch.setattr(
        context_module, "calibration_inputs", lambda loaded, traffic: calls.append(traffic) or [({"batch": 2}, ())]
    )
    ctx = context(profile, model, [{}])
    assert ctx.calibration is ctx.calibration and len(calls) == 1
    assert ctx.with_batching(None).calibration is ctx.calibration and len(calls) == 1
    assert ctx.with_profile(ctx.loaded).calibration == [({"batch": 2}, ())]  # another profile: drawn again
    assert len(calls) == 2


def test_one_comparison_for_every_stage():
    want = torch.tensor([1.0, float("nan"), 3.0])
    assert compare_tensors(want, torch.tensor([1.0, float("nan"), 3.00001]), atol=1e-4, rtol=0.0).passed
    off = compare_tensors(want, torch.tensor([1.0, float("nan"), 3.5]), atol=1e-4, rtol=0.0)
    assert (off.passed, off.first_mismatch, off.max_abs_error) == (False, (2,), 0.5)
    inf = float("inf")
    assert compare_tensors(torch.tensor([inf, -inf]), torch.tensor([inf, -inf]), atol=0.0, rtol=0.0).passed
    assert not compare_tensors(torch.tensor([inf]), torch.tensor([-inf]), atol=1.0, rtol=1.0).passed
    ints = compare_tensors(torch.tensor([1, 2, 3]), torch.tensor([1, 0, 0]), atol=0.0, rtol=0.0)
    assert (ints.passed, ints.max_abs_error, ints.first_mismatch) == (False, 2.0, (1,))


def tailed(model: torch.nn.Module, rate: float):
    """``open_runner`` giving the model's outputs with a little noise on every row (cosine about
    0.9998) and a lot on about ``rate`` of the rows (cosine about 0.95): a variant whose rare bad rows
    a worst-row gate finds or misses by the draw. Each row's noise depends only on that row's input."""

    def open_runner(pkg: CompiledPackage, device: str):
        def run(x):
            out = model(x).detach()
            for i in range(out.shape[0]):
                gen = torch.Generator().manual_seed(int(abs(float(x[i].double().sum())) * 1e6) % 2**31)
                bad = float(torch.rand(1, generator=gen)) < rate
                out[i] += torch.randn(3, generator=gen) * (0.3 if bad else 0.02) * out[i].norm() / 3**0.5
            return [out]

        return run

    return open_runner


def test_the_gates_verdict_holds_over_seeds_and_row_counts_where_the_worst_row_flips(tmp_path, profile, model):
    """The same variant, gated on the held-out inputs of five seeds and three sample counts: p5 (the
    default statistic) gives one verdict and values within 0.001; the worst row (the old gate's
    statistic) passes or fails by the draw."""

    def verdicts(statistic: str) -> list[tuple[bool, float]]:
        out = []
        for seed in range(5):
            for samples in (32, 64, 128):
                p = profile.model_copy(
                    update={
                        "check": profile.check.model_copy(update={"seed": seed}),
                        "accuracy": profile.accuracy.model_copy(update={"samples": samples, "statistic": statistic}),
                    }
                )
                units = [unit(tmp_path, DYNAMIC), unit(tmp_path, INT8)]
                outcome = gate_precisions(
                    p,
                    model,
                    units,
                    {},
                    held_out(p),
                    open_runner=tailed(model, 0.005),
                    timer=fake_clock({0: 2.0, 1: 1.0}),
                )
                out.append((outcome.results[0].kept, outcome.results[0].accuracy[0]["value"]))
        return out

    p5 = verdicts("p5")
    assert all(kept for kept, _ in p5) and max(v for _, v in p5) - min(v for _, v in p5) < 1e-3
    assert verdicts("p5") == p5  # run after run
    worst = {kept for kept, _ in verdicts("worst")}
    assert worst == {True, False}


def test_an_int8_fallback_that_spent_its_builds_says_so_and_records_each_try():
    from precompile.stages.gate import GateResult, with_fallback

    accuracy = [{"output": 0, "metric": "cosine", "statistic": "p5", "rows": 79, "threshold": 0.995, "value": 0.99}]
    failed = GateResult("int8-v0", "int8", "v0", accuracy, 64, reason="out0 cosine p5 0.9900 < 0.995 (accuracy gate)")
    tries = [{"fp32_layers": 1, "kept": False}, {"fp32_layers": 2, "kept": False}]
    ranked = [("a", 0.3), ("b", 0.2), ("c", 0.1)]
    result = with_fallback(failed, failed, ranked, 0.5, tries, {"layers": 8, "builds": 2})
    assert not result.kept and result.reason.endswith(
        "; still failing with 2 more layer(s) in fp32 after 2 build(s): 2 build(s), the limit (quantization.fallback)"
    )
    assert result.fallback["fp32_layers"] == ["a", "b"] and result.fallback["builds"] == tries
    assert result.fallback["before"] == accuracy and [s["layer"] for s in result.fallback["sensitivity"]] == [
        "a",
        "b",
        "c",
    ]
    assert result.to_dict()["fallback"] == result.fallback
