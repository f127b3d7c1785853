"""The benchmark harness (bench/): its request streams, hand-bucketing baseline and report.

The quick run compiles for a few minutes, so it runs only under ``make bench-quick``
(PRECOMPILE_BENCH_QUICK=1), which CI runs after ``make test``. No test asserts anything about timings.
"""

from __future__ import annotations

import contextlib
import importlib.util
import json
import os
from pathlib import Path

import pytest
import torch

from bench.cases import QUICK
from bench.peers import LABELS, TOLERANCE
from bench.peers import METHODS as PEERS
from bench.report import weighted_mean
from bench.steady import percentile
from bench.workload import all_buckets, bucket_for, cut, draw, inputs_for, pad, read_profile

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


@pytest.fixture(scope="module")
def quick_profile():
    return read_profile(QUICK.profile)


@pytest.fixture(scope="module")
def quick_model(quick_profile):
    spec = importlib.util.spec_from_file_location("bench_models", QUICK.profile.parent / "models.py")
    models = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(models)  # profiles/bench/models.py: seq2seq needs torch only
    return models.seq2seq(**quick_profile.model.kwargs)


def test_stream_is_deterministic_and_inside_the_declared_dims(quick_profile):
    first = draw(quick_profile, QUICK.profile, 200, seed=1)
    assert first == draw(quick_profile, QUICK.profile, 200, seed=1)
    assert first != draw(quick_profile, QUICK.profile, 200, seed=2)
    for sizes in first:
        for d, n in sizes.items():
            assert quick_profile.dims[d].min <= n <= quick_profile.dims[d].max


def test_stream_follows_the_distribution_counts(quick_profile):
    stream = draw(quick_profile, QUICK.profile, 4000, seed=3)
    hottest = sum(1 for s in stream if s == {"batch": 1, "seq": 16})
    assert 0.3 < hottest / len(stream) < 0.5  # 40 of the 100 counted calls


def test_a_request_goes_to_the_smallest_bucket_that_holds_it():
    buckets = {"batch": (1, 4), "seq": (8, 16)}
    assert bucket_for({"batch": 3, "seq": 9}, buckets) == {"batch": 4, "seq": 16}
    assert bucket_for({"batch": 1, "seq": 8}, buckets) == {"batch": 1, "seq": 8}
    with pytest.raises(ValueError, match="larger than the largest bucket"):
        bucket_for({"batch": 5, "seq": 8}, buckets)
    assert len(all_buckets(buckets, ["batch", "seq"], {})) == 4


def test_hand_bucketing_is_exact_on_the_masked_transformer(quick_profile, quick_model):
    sizes = {"batch": 3, "seq": 9}
    args = inputs_for(quick_profile, sizes, seed=0)
    padded = pad(quick_profile, args, bucket_for(sizes, QUICK.buckets))
    assert padded[0].shape == (4, 16, 64) and not padded[2][:, 9:].any()
    with torch.inference_mode():
        want = quick_model(*args)
        got = cut(quick_profile, quick_model(*padded), sizes)
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)


def test_percentile_interpolates_between_ranks():
    assert percentile([1, 2, 3, 4], 50) == 2.5
    assert percentile([5], 99) == 5
    assert percentile(list(range(101)), 99) == 99


def test_weighted_mean_takes_each_shape_median_weighted_by_its_traffic():
    a, b = {"batch": 1}, {"batch": 2}
    assert weighted_mean([a, a, a, b], [1.0, 2.0, 100.0, 10.0]) == (3 * 2.0 + 10.0) / 4


class DataDependent(torch.nn.Module):
    def forward(self, x):
        return x * 2 if x.sum() > 0 else x  # torch.export cannot trace a branch on a tensor's value


def test_a_model_that_does_not_export_to_onnx_is_a_failed_peer_with_its_reason(tmp_path):
    pytest.importorskip("onnxscript", reason="the bench extra is not installed")
    from bench.onnx_export import export_onnx
    from precompile.profile import Profile

    profile = Profile.model_validate(
        {
            "name": "t",
            "model": {"factory": "m:f"},
            "inputs": {"x": {"shape": ["batch", 4], "dtype": "float32"}},
            "dims": {"batch": {"min": 1, "max": 8}},
        }
    )
    result = export_onnx(DataDependent(), profile, tmp_path / "model.onnx")
    assert result["failed"].startswith("torch.onnx.export: TorchExportError")
    assert "data-dependent" in result["failed"] and "\n" not in result["failed"]
    assert not (tmp_path / "model.onnx").exists() and (tmp_path / "model.log").exists()


def synthetic_results() -> dict:
    """The shape of results.json, with made-up numbers (for the report alone)."""
    cold = {
        label: {
            "seconds": [s, s * 1.1],
            "median": s,
            "min": s,
            "max": s * 1.1,
            "marks": {"import torch": 1.0} if label == "import torch" else {"import torch": 1.0, "model ready": 1.1},
            "max_error": 0.0,
            "correct": True,
        }
        for label, s in [
            ("import torch", 1.0),
            ("eager", 1.3),
            ("precompile", 1.1),
            ("torch.compile cold", 20.0),
            ("torch.compile warm cache", 5.5),
            ("torch.compile Mega-Cache", 17.6),
            ("ONNX Runtime", 0.6),
            ("OpenVINO", 0.9),
        ]
    }
    cold["ONNX Runtime"]["marks"] = {"model ready": 0.5}  # a peer never imports torch
    cold["OpenVINO"]["precision"] = "bf16"
    cold["OpenVINO (f32)"] = {"failed": "it did not start"}
    methods = [
        "eager",
        "compile",
        "buckets-eager",
        "buckets-compile",
        "precompile-dynamic",
        "precompile-planned",
        "onnxruntime",
        "openvino",
    ]
    work = [4, 8, 16, 32, 64, 64]
    steady = {
        m: {
            "latency_ms": [w / (i + 1) for w in work],
            "p50_ms": 1.0,
            "p99_ms": 2.0,
            "mean_ms": 1.2,
            "requests_per_s": 833.3,
            "peak_rss_mb": 300.0,
            "ready_s": 0.5,
            "max_error": 1e-7,
            "max_abs_error": 2e-7,
        }
        for i, m in enumerate(methods)
    }
    steady["onnxruntime"]["latency_ms"] = [w / 3 for w in work]  # twice precompile-planned's (w / 6)
    steady["openvino"]["latency_ms"] = [w / 12 for w in work]  # half of it
    steady["openvino"]["precision"] = "bf16"
    steady["openvino-f32"] = {"failed": "torch.onnx.export: ConversionError"}
    steady["precompile-planned"]["calls_per_variant"] = {"static-0": 2, "dynamic": 4}
    build = {
        "wall_s": 30.0,
        "variants": [{"id": "dynamic", "kind": "dynamic", "dims": {}, "compile_s": 20.0}],
        "unpacked_bytes": 3_000_000,
        "packed_bytes": 1_000_000,
    }
    case = {
        "description": "a made-up model",
        "profile": "profiles/bench/quick.yaml",
        "exact_padding": True,
        "buckets": {"batch": [1, 4]},
        "cold_shape": {"batch": 1, "seq": 16},
        "builds": {"planned": build, "dynamic": build},
        "cold_start": cold,
        "overhead": {
            "variant": "dynamic",
            "raw_us": 100.0,
            "loader_us": 106.0,
            "overhead_us": 6.0,
            "select_us": 4.0,
            "shape": {"batch": 1},
        },
        "requests": [{"batch": w} for w in work],
        "work": work,
        "work_unit": "batch",
        "steady": steady,
        "seconds": 60.0,
    }
    machine = {
        "cpu": "a CPU",
        "cores": 2,
        "torch_threads": 2,
        "memory_gb": 24.0,
        "platform": "Linux",
        "cpu_capability": "AVX512",
        "versions": {"python": "3.11", "torch": torch.__version__},
        "date": "today",
    }
    return {
        "mode": "quick",
        "machine": machine,
        "sizes": {"runs": 2, "requests": 6, "warmup": 1},
        "cases": {"made-up": case},
        "seconds": 60.0,
    }


def test_report_writes_json_markdown_and_charts(tmp_path):
    pytest.importorskip("matplotlib", reason="the bench extra is not installed")
    from bench.report import write_all

    written = write_all(synthetic_results(), tmp_path)
    assert sorted(p.name for p in written) == ["README.md", "coldstart.png", "results.json", "steady.png"]
    assert json.loads((tmp_path / "results.json").read_text())["cases"]["made-up"]["work"] == [4, 8, 16, 32, 64, 64]
    md = (tmp_path / "README.md").read_text()
    assert "| torch.compile Mega-Cache | 17.60 |" in md
    assert "| precompile-planned | 1.00 | 2.00 |" in md
    assert "precompile is 2.00× faster than ONNX Runtime on made-up" in md
    assert "OpenVINO (bf16) is 2.00× faster than precompile on made-up" in md
    assert "OpenVINO (f32) did not run on made-up: torch.onnx.export: ConversionError" in md
    assert "| OpenVINO (f32) | failed: it did not start |" in md
    assert "| ONNX Runtime | 0.60 | 0.60–0.66 | -0.40 | – | 0.50 |" in md
    for chart in ("coldstart.png", "steady.png"):
        assert (tmp_path / chart).read_bytes().startswith(PNG_MAGIC)


@pytest.mark.skipif(
    not os.environ.get("PRECOMPILE_BENCH_QUICK"), reason="compiles for minutes: run by `make bench-quick`"
)
def test_quick_run_writes_results_and_every_method_matches_eager(tmp_path):
    for module in ("transformers", "matplotlib"):
        if importlib.util.find_spec(module) is None:
            pytest.fail(f"{module} is missing: `make bench-quick` installs the bench extra")
    from bench.__main__ import main

    assert main(["--quick", "--out", str(tmp_path)]) == 0
    results = json.loads((tmp_path / "results.json").read_text())
    case = results["cases"][QUICK.name]
    assert "failed" not in case["onnx"], case["onnx"]
    assert set(case["cold_start"]) == {
        "import torch",
        "eager",
        "precompile",
        "torch.compile cold",
        "torch.compile warm cache",
        "torch.compile Mega-Cache",
        *LABELS.values(),
    }
    assert all(r.get("correct") for r in case["cold_start"].values()), case["cold_start"]
    assert case["cold_start"]["OpenVINO (f32)"]["precision"] == "f32"
    steady_methods = {
        "eager",
        "compile",
        "buckets-eager",
        "buckets-compile",
        "precompile-dynamic",
        "precompile-planned",
        *PEERS,
    }
    assert set(case["steady"]) == steady_methods
    for method, r in case["steady"].items():
        assert len(r["latency_ms"]) == results["sizes"]["requests"], method
        # Against eager's outputs on the same inputs: float32 everywhere but OpenVINO's default
        # precision, bf16 on CPUs that have it.
        limit = TOLERANCE[r.get("precision", "f32")]
        assert r["max_error"] is not None and r["max_error"] < limit, (method, r["max_error"])
        assert r["max_abs_error"] is not None, method
    assert case["steady"]["onnxruntime"]["threads"] == case["steady"]["eager"]["threads"]
    assert case["steady"]["openvino-f32"]["precision"] == "f32"
    assert set(case["builds"]) == {"planned", "dynamic"}
    md = (tmp_path / "README.md").read_text()
    assert "| precompile |" in md and "| ONNX Runtime |" in md
    assert "than ONNX Runtime on seq2seq-quick" in md or "ONNX Runtime is" in md
    for chart in ("coldstart.png", "steady.png"):
        assert (tmp_path / chart).read_bytes().startswith(PNG_MAGIC)


def test_a_vision_worker_answers_as_the_method_in_process_on_the_allocator_asked(
    classifier_artifact, classifier_profile, tmp_path
):
    import loader
    from bench.vision import process_env
    from bench.vision_worker import Worker, WorkerFailed
    from loader.malloc import resolve
    from precompile.profile import load_profile
    from precompile.samples import make_inputs
    from precompile.stages.resolve import resolve_model

    malloc = "tcmalloc" if resolve("auto") is not None else "system"  # as `precompile serve` would run it here
    shapes = [{"batch": 2, "seq": 7}, {"batch": 1, "seq": 5}, {"batch": 9, "seq": 5}]  # the last outside the range
    loaded = load_profile(classifier_profile)
    inputs = make_inputs(loaded.profile, shapes[1], seed=101)
    with torch.no_grad():
        wants = {
            "precompile": loader.load(classifier_artifact, precision="fp32")(*inputs),
            "eager": resolve_model(loaded)(*inputs),
        }
    for method, allocator in (("precompile", malloc), ("eager", "system")):
        worker = Worker(
            method, profile=classifier_profile, shapes=shapes, folder=tmp_path, env=process_env(allocator),
            artifact=classifier_artifact,
        )  # fmt: skip
        try:
            assert worker.ready["malloc"] == allocator
            torch.testing.assert_close(torch.from_numpy(worker.output(1)), wants[method])
            times = worker.time(0, 3)
            assert len(times) == 3 and all(t > 0 for t in times)
            with pytest.raises(WorkerFailed, match="batch") if method == "precompile" else contextlib.nullcontext():
                worker.output(2)  # the artifact refuses a size it was not built for, and goes on answering
            assert worker.time(1, 1)
        finally:
            worker.close()
        assert worker.proc.returncode == 0


def test_the_spin_bench_times_each_case_and_spin_count_in_a_process_of_its_own(classifier_artifact):
    from bench import spin

    assert spin.cases(2, 10) == [(0, 0), (2, 0), (2, 10)] and spin.cases(0, 10) == [(0, 0)]
    rows = spin.measure(classifier_artifact, seconds=0.05, rounds=1, busy=0, nice=10)
    assert [(r["busy"], r["nice"], r["spin"]) for r in rows] == [(0, 0, 0), (0, 0, 10000)]
    from loader.artifact import read_manifest

    (v, *_) = [v for v in read_manifest(classifier_artifact).variants if v.kind == "dynamic" and v.precision == "fp32"]
    smallest, hint = "x".join(str(r.min) for r in v.dims.values()), "x".join(str(n) for n in v.hint.values())
    for r in rows:
        assert "failed" not in r, r.get("failed")
        assert list(r["p50_ms"]) == list(dict.fromkeys([smallest, hint])) and all(ms > 0 for ms in r["p50_ms"].values())
    said = spin.report(rows + [{"round": 0, "busy": 1, "nice": 10, "spin": 0, "failed": "boom"}])
    assert f"quiet                    GOMP_SPINCOUNT=0      {smallest}:" in said
    assert "1 busy loop(s), nice 10  GOMP_SPINCOUNT=0      failed: boom" in said


def test_the_ab_bench_times_each_side_under_its_own_checkout_in_turn(classifier_artifact, tmp_path):
    from bench import ab
    from loader.artifact import read_manifest

    (v, *_) = [v for v in read_manifest(classifier_artifact).variants if v.kind == "dynamic" and v.precision == "fp32"]
    shapes = [{d: r.min for d, r in v.dims.items()}, {d: r.max for d, r in v.dims.items()}]
    here = Path(__file__).resolve().parent.parent
    result = ab.measure([(here, classifier_artifact), (here, classifier_artifact)], shapes, rounds=2, seconds=0.05)
    assert [len(s["rounds_ms"]) for s in result["sides"]] == [2, 2]
    assert all(len(r) == 2 and min(r) > 0 for s in result["sides"] for r in s["rounds_ms"])
    assert result["sides"][0]["ratio_to_first"] == 1.0 and result["sides"][1]["ratio_to_first"] > 0
    said = ab.report(result)
    assert ",".join(f"{d}={n}" for d, n in shapes[1].items()) in said and said.count("×") == 2
    with pytest.raises(SystemExit, match=f"{tmp_path} is no checkout of precompile"):
        ab.measure([(tmp_path, classifier_artifact)], shapes[:1], rounds=1, seconds=0.05)
    (tmp_path / "loader").mkdir()
    (tmp_path / "loader" / "__init__.py").write_text("def load(*args, **kwargs):\n    raise ValueError('too old')\n")
    with pytest.raises(SystemExit, match=f"(?s){classifier_artifact} under {tmp_path} failed.*too old"):
        ab.measure([(tmp_path, classifier_artifact)], shapes[:1], rounds=1, seconds=0.05)


@pytest.fixture
def classifier_onnx(classifier_profile, tmp_path) -> Path:
    """The tests' classifier exported to ONNX (``bench.onnx_export``), for ONNX Runtime's side."""
    pytest.importorskip("onnxruntime", reason="the bench extra is not installed")
    pytest.importorskip("onnxscript", reason="the bench extra is not installed")
    from bench.onnx_export import export_onnx
    from precompile.profile import load_profile
    from precompile.stages.resolve import resolve_model

    loaded = load_profile(classifier_profile)
    said = export_onnx(resolve_model(loaded), loaded.profile, tmp_path / "model.onnx")
    assert "failed" not in said, said
    return tmp_path / "model.onnx"


def test_the_ab_bench_times_onnx_runtime_as_a_last_side_at_the_artifact_s_shapes(
    classifier_artifact, classifier_onnx, tmp_path
):
    from bench import ab
    from loader.artifact import read_manifest

    (v, *_) = [v for v in read_manifest(classifier_artifact).variants if v.kind == "dynamic" and v.precision == "fp32"]
    shapes = [{d: r.min for d, r in v.dims.items()}, {d: r.max for d, r in v.dims.items()}]
    first = read_manifest(classifier_artifact).inputs[0]
    shape, dtype, _ = ab.onnx_feeds(classifier_artifact, shapes)[1][first.name]
    assert (shape, dtype) == ([shapes[1].get(s, s) for s in first.shape], first.dtype)
    here = Path(__file__).resolve().parent.parent
    result = ab.measure([(here, classifier_artifact)], shapes, rounds=2, seconds=0.05, onnx=classifier_onnx)
    assert [s["artifact"] for s in result["sides"]] == [str(classifier_artifact), str(classifier_onnx)]
    assert all(len(r) == 2 and min(r) > 0 for s in result["sides"] for r in s["rounds_ms"])
    assert "onnxruntime: model.onnx" in ab.report(result)
    with pytest.raises(SystemExit, match="no such file"):
        ab.measure([(here, classifier_artifact)], shapes, rounds=1, seconds=0.05, onnx=tmp_path / "none.onnx")


def test_the_first_call_bench_times_onnx_runtime_s_first_call_at_the_artifact_s_unseen_shapes(
    classifier_artifact, classifier_onnx
):
    from bench import firstcall
    from loader.malloc import resolve

    rows = firstcall.measure(
        [classifier_artifact], shapes=2, repeat=3, warmups=("auto",), onnx=[classifier_onnx],
        env=firstcall.serving_process_env("auto"),
    )  # fmt: skip
    ours = [r for r in rows if r["warmup"] == "auto"]
    peer = [r for r in rows if r["warmup"] == "onnxruntime"]
    assert ours and all("failed" not in r for r in rows), rows
    # Each engine as it is served: the artifact on `precompile serve`'s allocator, ONNX Runtime on glibc's.
    assert {r["malloc"] for r in ours} == {"tcmalloc" if resolve("auto") is not None else "system"}
    assert {r["malloc"] for r in peer} == {"system"}
    assert [r["dims"] for r in peer] == [r["dims"] for r in ours]  # the same unseen shapes
    assert all(r["threads"] == ours[0]["threads"] and r["warmed"] == ours[0]["warmed"] for r in peer)
    assert all(r["ratio"] == pytest.approx(r["first_ms"] / r["steady_ms"]) for r in peer)
    assert "[warm-up: onnxruntime]" in firstcall.summary(rows)
