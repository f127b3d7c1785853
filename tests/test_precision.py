"""Precision variants: bf16 and int8 builds under the accuracy gate, and the loader's choice of them.

Small builds, once per session: an encoder in fp32, bf16 and int8 (dynamic, torchao) with a
calibration file; the same encoder with a gate bf16 cannot pass; a conv net with batch norm and 1×1
convolutions in int8 (static, PT2E, calibrated), which the calibration test and the reorder test share;
a conv net with an outlier channel (the int8 fallback). The speed half of the gate is switched off (``accuracy.min_speedup: 0``) where a test
needs a variant kept whatever this shared machine's timing says.
"""

from __future__ import annotations

import json
import shutil
import textwrap
import time
from pathlib import Path

import pytest
import torch
from click.testing import CliRunner

import loader
import loader.model as loader_model
from loader.errors import ArtifactError, IncompatibleArtifactError
from loader.manifest import parse_manifest
from precompile.cli import main
from precompile.compare import reproduces
from precompile.errors import ProfileError
from precompile.pipeline import build
from precompile.profile import AccuracyRule, load_profile

from .conftest import builds

MODELS = Path(__file__).parent / "models" / "lowp.py"

ENCODER = """
name: lowp-encoder
model: {factory: "lowp:encoder"}
inputs:
  ids:  {shape: [batch, seq], dtype: int64, range: [0, 49]}
  mask: {shape: [batch, seq], dtype: bool, range: [1, 1]}
dims:
  batch: {min: 1, max: 8}
  seq:   {min: 2, max: 32}
plan: {max_specialized: 0}
"""


def write(folder: Path, text: str, name: str = "profile.yaml") -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    shutil.copy(MODELS, folder / "lowp.py")
    path = folder / name
    path.write_text(textwrap.dedent(text))
    return path


def calibration_jsonl(path: Path, count: int = 6) -> None:
    gen = torch.Generator().manual_seed(1)
    with path.open("w") as f:
        for k in range(count):
            batch, seq = 1 + k % 4, 4 + 3 * k
            ids = torch.randint(0, 50, (batch, seq), generator=gen)
            f.write(json.dumps({"ids": ids.tolist(), "mask": [[True] * seq] * batch}) + "\n")


@pytest.fixture(scope="session")
@builds
def lowp(tmp_path_factory, build_cache):
    """The encoder in fp32, bf16 and int8, gated on a calibration file, kept whatever their speed.
    Its fp32 and bf16 compiles are strict_gate's (the session's build cache)."""
    folder = tmp_path_factory.mktemp("lowp")
    calibration_jsonl(folder / "calib.jsonl")
    profile = write(
        folder,
        ENCODER
        + """
precision: [fp32, bf16, int8]
accuracy: {metric: cosine, threshold: 0.99, min_speedup: 0}
calibration: {file: calib.jsonl}
""",
    )
    return build(profile, folder / "artifact", cache=build_cache)


@pytest.fixture(scope="session")
@builds
def strict_gate(tmp_path_factory, build_cache):
    """bf16 under a gate it cannot pass (max abs error 0 on the float output)."""
    folder = tmp_path_factory.mktemp("strict")
    profile = write(
        folder, ENCODER + "precision: [bf16]\naccuracy: {metric: max_abs, threshold: 0.0, min_speedup: 0}\n"
    )
    return build(profile, folder / "artifact", cache=build_cache)


@pytest.fixture(scope="session")
@builds
def conv_int8(tmp_path_factory):
    """A conv net with 1×1 convolutions (``lowp.Pointwise``: a stem with batch norm, then 1×1 layers
    and a residual addition) in int8 (static) over dynamic sizes, its stem kept in fp32 and activations
    calibrated by percentile."""
    return build_int8_conv(tmp_path_factory.mktemp("conv"), "pointwise")


def build_int8_conv(folder: Path, factory: str):
    """``lowp:<factory>`` in int8 (static) over dynamic batch and image sizes, its stem kept in fp32."""
    profile = write(
        folder,
        f"""
        name: lowp-{factory}
        model: {{factory: "lowp:{factory}"}}
        inputs:
          x: {{shape: [batch, 3, size, size], dtype: float32}}
        dims:
          batch: {{min: 1, max: 4}}
          size:  {{min: 16, max: 48}}
        plan: {{max_specialized: 0}}
        precision: [int8]
        accuracy: {{metric: cosine, threshold: 0.98, min_speedup: 0}}
        calibration: {{samples: 8}}
        quantization: {{observer: percentile, keep: [first]}}
        """,
    )
    return build(profile, folder / "artifact")


def encoder_inputs(batch: int, seq: int, seed: int = 5):
    gen = torch.Generator().manual_seed(seed)
    return torch.randint(0, 50, (batch, seq), generator=gen), torch.ones(batch, seq, dtype=torch.bool)


def eager_encoder():
    return lowp_models().encoder()


def lowp_models():
    """tests/models/lowp.py, imported from its file (as the build imports a factory's module)."""
    import importlib.util

    spec = importlib.util.spec_from_file_location("lowp_eager", MODELS)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


# --- the build ---------------------------------------------------------------------------------


def test_build_keeps_each_precision_with_its_gate_record(lowp):
    by_id = {v.id: v for v in lowp.manifest.variants}
    assert set(by_id) == {"dynamic", "bf16-dynamic", "int8-dynamic"}
    assert by_id["dynamic"].precision == "fp32" and by_id["dynamic"].gate is None
    for vid, precision in (("bf16-dynamic", "bf16"), ("int8-dynamic", "int8")):
        v = by_id[vid]
        assert v.precision == precision
        assert v.embedded_constants  # frozen: oneDNN-prepacked weights live in the package
        gate = v.gate
        # bf16 and dynamic int8 calibrate on nothing: the gate scores every sample of the calibration file
        assert gate["kept"] and gate["against"] == "dynamic" and gate["samples"] == 6
        cosine, exact = gate["accuracy"]
        assert cosine["metric"] == "cosine" and 0.99 <= cosine["value"] <= 1.0 + 1e-9 and cosine["passed"]
        assert cosine["statistic"] == "p5" and cosine["rows"] == 13  # the file's 6 samples hold 13 rows (batch 1-4)
        assert exact == {
            "output": 1,
            "metric": "equal",
            "rows": 6,
            "threshold": 1.0,
            "value": 1.0,
            "passed": True,
        }  # ids.sum: integer
        assert gate["ms"] > 0 and gate["fp32_ms"] > 0 and gate["speedup"] == pytest.approx(gate["fp32_ms"] / gate["ms"])
    # The CPU features recorded are the build host's among those each precision's kernels may use.
    host = torch.cpu.get_capabilities()
    assert set(by_id["bf16-dynamic"].cpu_features) == {f for f in ("avx512_bf16", "amx_bf16") if host.get(f) is True}
    assert set(by_id["int8-dynamic"].cpu_features) == {
        f for f in ("avx512_vnni", "avx_vnni", "amx_int8") if host.get(f) is True
    }


OUTLIER = """
name: lowp-outlier
model: {factory: "lowp:outlier"}
inputs:
  x: {shape: [batch, 3, size, size], dtype: float32}
dims:
  batch: {min: 1, max: 2}
  size:  {min: 16, max: 32}
plan: {max_specialized: 0}
precision: [int8]
accuracy: {metric: cosine, threshold: 0.99, min_speedup: 0}
calibration: {samples: 8}
"""


@pytest.fixture(scope="session")
@builds
def outlier_int8(tmp_path_factory):
    """The conv net whose c2 reads an outlier channel (tests/models/lowp.py), in int8 with the
    fallback on (the default): every layer in int8 fails the gate, c2 kept in fp32 passes."""
    folder = tmp_path_factory.mktemp("outlier")
    result = CliRunner().invoke(main, ["build", str(write(folder, OUTLIER)), "-o", str(folder / "artifact")])
    assert result.exit_code == 0, result.output
    return parse_manifest((folder / "artifact" / "manifest.json").read_text()), result.output


def test_a_variant_failing_the_gate_is_dropped_with_its_reason(strict_gate):
    assert [v.id for v in strict_gate.manifest.variants] == ["dynamic"]
    (record,) = strict_gate.manifest.check.precision
    assert record["variant"] == "bf16-dynamic" and not record["kept"]
    assert record["reason"].startswith("out0 max_abs p5 ") and record["reason"].endswith("(accuracy gate)")
    assert not (strict_gate.path / "variants" / "bf16-dynamic.pt2").exists()
    text = CliRunner().invoke(main, ["inspect", str(strict_gate.path)]).output
    assert "precision variants the gate dropped" in text and "bf16-dynamic" in text


def test_int8_static_quantizes_a_conv_net_with_calibration(conv_int8):
    (v,) = [v for v in conv_int8.manifest.variants if v.precision == "int8"]
    assert v.gate["kept"] and v.gate["samples"] >= 1
    model = loader.load(conv_int8.path, precision="int8")
    x = torch.randn(2, 3, 40, 40, generator=torch.Generator().manual_seed(3))
    out, variant = model.call_detailed(x)
    assert variant == v.id
    with torch.no_grad():
        want = lowp_models().pointwise()(x)
    assert torch.nn.functional.cosine_similarity(out, want).min() > 0.98


def test_dynamic_int8_convolutions_reorder_no_weight_per_call(conv_int8, tmp_path):
    # Inductor packs a dynamic int8 convolution's weight for no input size (precompile.passes.prepack):
    # c3's then in a blocking oneDNN wants at no size, c4's and the shortcut's at some (they want two
    # over the range, one at 16² and one at 48², chosen per call, the residual addition fused into
    # one of them), and oneDNN re-lays them (s8 to s8) at every call.
    from .test_convnets import generated_code
    from .test_prepack import onednn_reorder_lines

    (v,) = [v for v in conv_int8.manifest.variants if v.precision == "int8"]
    assert v.gate["kept"]
    code = generated_code(conv_int8.path)
    assert "_layout_branch" in code and "_qconv2d_pointwise_binary" in code  # chosen per call, the addition too
    hint = [v.hint["batch"], 3, v.hint["size"], v.hint["size"]]
    shapes = [[1, 3, 16, 16], [4, 3, 48, 48], hint]
    lines, outputs = onednn_reorder_lines(conv_int8.path, "int8", shapes, tmp_path)
    assert len(lines) == 2 * len(shapes) + 1
    amx = "amx_int8" in loader_model.host_cpu_features()
    for call, found in lines.items():
        relaid = [line for line in found if "src:s8" in line]
        # Never oneDNN's generic reorder (Inductor's copy packed for no size, ~5-10 ms a call for a
        # 1024×256 weight). On an AMX host the AMX kernel wants, at some sizes, another blocking than the
        # one qconv_prepack reports for them (its query knows neither the u8 output nor the ReLU: c2,
        # AcdB16a4b asked for, AcdB32a4b run at 2-4×48²), and oneDNN re-lays that weight with its jitted
        # reorder (10-90 µs): a known gap of the probe (precompile.passes.prepack), bounded here.
        assert not [line for line in relaid if ",simple:any," in line], call
        if not amx:
            assert not relaid, call
    model = lowp_models().pointwise()
    for shape, got in zip(shapes, outputs):
        x = torch.randn(shape, generator=torch.Generator().manual_seed(sum(shape)))
        with torch.no_grad():
            want = model(x)
        assert torch.nn.functional.cosine_similarity(got, want).min() > 0.98


# --- loading -----------------------------------------------------------------------------------


def test_auto_serves_the_kept_precisions_fp32_serves_fp32(lowp):
    ids, mask = encoder_inputs(3, 17)
    want_logits, want_sum = eager_encoder()(ids, mask)
    auto = loader.load(lowp.path)
    assert auto.precision.order[-1] == "fp32" and set(auto.precision.order) == {"fp32", "bf16", "int8"}
    (logits, total), variant = auto.call_detailed(ids, mask)
    fastest = min((v for v in lowp.manifest.variants if v.precision != "fp32"), key=lambda v: v.gate["ms"])
    assert variant == fastest.id  # the twin the gate measured fastest on this variant's traffic
    assert torch.nn.functional.cosine_similarity(logits, want_logits).min() > 0.99
    assert torch.equal(total, want_sum)
    fp32 = loader.load(lowp.path, precision="fp32")
    assert [v.id for v in fp32.variants] == ["dynamic"]  # the others are not even opened
    (logits, total), variant = fp32.call_detailed(ids, mask)
    assert variant == "dynamic" and torch.allclose(logits, want_logits, atol=1e-5)
    for precision in ("bf16", "int8"):
        model = loader.load(lowp.path, precision=precision)
        assert model.precision.order == (precision, "fp32")
        assert model.call_detailed(ids, mask)[1] == f"{precision}-dynamic"
        stats = model.stats()
        assert stats["variants"][f"{precision}-dynamic"] == {
            "calls": 1,
            "pieces": 1,
            "seconds": pytest.approx(stats["variants"][f"{precision}-dynamic"]["seconds"]),
            "precision": precision,
        }
        assert stats["precision"]["served"] == [precision, "fp32"]


def test_a_host_without_the_features_gets_fp32(lowp, monkeypatch):
    recorded = {f for v in loader.load(lowp.path, warmup=False).manifest.variants for f in v.cpu_features}
    if not recorded - {"avx2", "avx512_f"}:  # built where bf16 and VNNI are emulated: nothing for a host to lack
        pytest.skip(
            f"the build host's bf16 and int8 kernels need no CPU feature beyond avx2 (recorded: {sorted(recorded)})"
        )
    monkeypatch.setattr(loader_model, "host_cpu_features", lambda: frozenset({"avx2", "avx512_f"}))
    model = loader.load(lowp.path)
    assert model.precision.order == ("fp32",)
    assert "this CPU lacks" in model.precision.skipped["bf16"]
    assert [v.id for v in model.variants] == ["dynamic"]
    assert model.call_detailed(*encoder_inputs(1, 5))[1] == "dynamic"
    with pytest.raises(IncompatibleArtifactError, match="need CPU features .* that this host lacks"):
        loader.load(lowp.path, precision="bf16")


def test_a_wrong_precision_request_is_refused_before_loading(lowp, classifier_artifact):
    with pytest.raises(ValueError, match="precision='fp16': expected one of auto, fp32, bf16, int8"):
        loader.load(lowp.path, precision="fp16")
    with pytest.raises(IncompatibleArtifactError, match="no int8 variants .*build with precision: \\[fp32, int8\\]"):
        loader.load(classifier_artifact, precision="int8")
    assert loader.load(classifier_artifact).precision.order == ("fp32",)  # auto on an fp32-only artifact


def test_verify_run_checks_every_precision(lowp):
    result = CliRunner().invoke(main, ["verify", str(lowp.path), "--run"])
    assert result.exit_code == 0, result.output
    assert "3 reference output(s) recomputed (fp32, bf16, int8)" in result.output


def _copy_with(lowp, folder: Path, edit) -> Path:
    """The lowp artifact copied to ``folder``, its int8 reference's accuracy record edited."""
    shutil.copytree(lowp.path, folder)
    manifest = json.loads((folder / "manifest.json").read_text())
    edit(next(e for e in manifest["check"]["references"] if e["variant"] == "int8-dynamic")["accuracy"][0])
    (folder / "manifest.json").write_text(json.dumps(manifest))
    return folder


def _int8_build_value(lowp) -> float:
    entry = next(e for e in lowp.manifest.check.references if e.variant == "int8-dynamic")
    assert entry.accuracy[0].metric == "cosine" and entry.accuracy[0].build_value is not None
    return entry.accuracy[0].build_value


def test_verify_run_passes_a_reference_row_below_the_threshold_that_the_build_host_reached_too(lowp, tmp_path):
    # The gate judges held-out rows by their p5; this one input's worst row may lie below the threshold
    # on a healthy artifact, on the host that built it: what counts is that this host reaches it too.
    built = _int8_build_value(lowp)
    assert -1.0 <= built <= 1.0
    copy = _copy_with(lowp, tmp_path / "artifact", lambda a: a.update(threshold=built + 1e-3))
    result = CliRunner().invoke(main, ["verify", str(copy), "--run"])
    assert result.exit_code == 0, result.output
    assert "3 reference output(s) recomputed (fp32, bf16, int8)" in result.output


def test_verify_run_fails_a_host_computing_worse_than_the_build_host(lowp, tmp_path):
    built = _int8_build_value(lowp)
    # As if the build host had matched fp32 exactly on this input: this host's error is then beyond the margin.
    copy = _copy_with(lowp, tmp_path / "artifact", lambda a: a.update(threshold=built + 1e-3, build_value=1.0))
    result = CliRunner().invoke(main, ["verify", str(copy), "--run"])
    assert result.exit_code != 0
    line = next(x for x in result.output.splitlines() if x.startswith("run"))
    assert "int8-dynamic" in line and "output 0: cosine" in line and "on this host" in line
    assert "the build host reached 1 on this input" in line and f"the gate asks ≥ {built + 1e-3}" in line
    assert "this host computes something else than the build host did" in line


def test_verify_run_judges_an_old_manifest_without_build_values_by_the_threshold(lowp, tmp_path):
    old = _copy_with(lowp, tmp_path / "old", lambda a: a.pop("build_value"))
    result = CliRunner().invoke(main, ["verify", str(old), "--run"])
    assert result.exit_code == 0, result.output  # the gate's threshold, 0.99, is met
    unreachable = _copy_with(lowp, tmp_path / "unreachable", lambda a: (a.pop("build_value"), a.update(threshold=1.5)))
    result = CliRunner().invoke(main, ["verify", str(unreachable), "--run"])
    assert result.exit_code != 0
    assert "int8-dynamic" in result.output and "the build's gate asks ≥ 1.5" in result.output


def test_a_reference_passes_at_the_threshold_or_near_the_build_hosts_value():
    cosine = AccuracyRule(metric="cosine", threshold=0.99)
    assert reproduces(cosine, 0.995, None) and not reproduces(cosine, 0.98, None)  # an old manifest: the threshold
    assert reproduces(cosine, 0.98, 0.98) and reproduces(cosine, 0.976, 0.98)  # error 0.024 ≤ 1.25 × 0.02
    assert not reproduces(cosine, 0.97, 0.98)
    max_abs = AccuracyRule(metric="max_abs", threshold=0.1)
    assert reproduces(max_abs, 0.12, 0.1) and not reproduces(max_abs, 0.13, 0.1)


def test_inspect_shows_precision_and_gate(lowp):
    text = CliRunner().invoke(main, ["inspect", str(lowp.path)]).output
    assert "int8-dynamic" in text and " int8 " in text
    assert "gate: out0 cosine" in text and "vs fp32" in text


def test_manifest_refuses_inconsistent_precision_fields(lowp):
    raw = json.loads((lowp.path / "manifest.json").read_text())
    fp32 = next(v for v in raw["variants"] if v["id"] == "dynamic")
    fp32["cpu_features"] = ["avx512_bf16"]
    with pytest.raises(ArtifactError, match="an fp32 variant has no cpu_features or gate"):
        parse_manifest(json.dumps(raw))
    raw = json.loads((lowp.path / "manifest.json").read_text())
    next(v for v in raw["variants"] if v["id"] == "int8-dynamic")["precision"] = "int4"
    with pytest.raises(ArtifactError, match="precision"):
        parse_manifest(json.dumps(raw))


def test_serve_labels_latency_with_the_precision(lowp):
    from precompile.serve.app import create_app
    from precompile.serve.config import ServeConfig
    from tests.test_serve import AppClient, metrics

    ids, mask = encoder_inputs(2, 6)
    with AppClient(create_app(ServeConfig(str(lowp.path), precision="int8"))) as c:
        deadline = time.monotonic() + 60
        while c.get("/readyz").status_code != 200 and time.monotonic() < deadline:  # loads in the background
            time.sleep(0.1)
        response = c.post("/predict", json={"inputs": {"ids": ids.tolist(), "mask": mask.tolist()}})
        assert response.status_code == 200, response.text
        assert response.json()["variant"] == "int8-dynamic"
        samples = metrics(c)
    assert samples[("precompile_predict_seconds_count", (("precision", "int8"), ("variant", "int8-dynamic")))] == 1


def test_auto_ranks_each_variants_twins_by_their_own_measurement():
    from loader.manifest import DimRange, Variant
    from loader.precision import choose

    def v(vid, precision="fp32", ms=None, lo=1, hi=8):
        gate = None if precision == "fp32" else {"against": vid.split("-", 1)[1], "ms": ms, "speedup": 2.0}
        features = ("avx512_vnni",) if precision == "int8" else ("avx512_bf16",) if precision == "bf16" else ()
        return Variant(
            vid,
            "dynamic",
            f"variants/{vid}.pt2",
            {"seq": DimRange(lo, hi)},
            {"seq": lo},
            (),
            precision=precision,
            cpu_features=features,
            gate=gate,
        )

    variants = [
        v("short", hi=32),
        v("long", lo=33, hi=128),
        v("int8-short", "int8", 1.0, hi=32),
        v("bf16-short", "bf16", 1.5, hi=32),
        v("int8-long", "int8", 30.0, lo=33, hi=128),
        v("bf16-long", "bf16", 20.0, lo=33, hi=128),
    ]
    tiers = choose(variants, "auto", frozenset({"avx512_vnni", "avx512_bf16"}), "x").tiers(variants)
    assert [[t.id for t in tier] for tier in tiers] == [
        ["int8-short", "bf16-long"],
        ["bf16-short", "int8-long"],
        ["short", "long"],
    ]
    tiers = choose(variants, "bf16", frozenset({"avx512_vnni", "avx512_bf16"}), "x").tiers(variants)
    assert [[t.id for t in tier] for tier in tiers] == [["bf16-short", "bf16-long"], ["short", "long"]]
    tiers = choose(variants, "auto", frozenset({"avx512_vnni"}), "x").tiers(variants)  # no bf16 on this CPU
    assert [[t.id for t in tier] for tier in tiers] == [["int8-short", "int8-long"], ["short", "long"]]


# --- the profile -------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "extra, place, message",
    [
        ("precision: [fp32, fp8]", "precision[1]", "is not one of"),
        ("precision: fp32", "precision", "expected a list (e.g. [fp32, int8]) or a mapping per target"),
        ("target: cuda\nprecision: [bf16]", "precision", "for CUDA set cuda.dtype"),
        ("target: [cpu, cuda]\nprecision: {cpu: [int8], cuda: [bf16]}", "precision.cuda", "list only fp32 here"),
        ("precision: {cuda: [fp32]}", "precision.cuda", "cuda is not a target"),
        ("accuracy: {metric: cosine, threshold: 1.5}", "accuracy.threshold", "can never pass"),
        ("accuracy: {metric: max_abs, threshold: -1}", "accuracy.threshold", "threshold ≥ 0"),
        ("accuracy: {metric: top2}", "accuracy.metric", "is not one of"),
        ("calibration: {file: calib.npy}", "calibration.file", "give a .safetensors or .jsonl file"),
        ("calibration: {file: missing.jsonl}", "calibration.file", "file not found"),
        ("calibration: {samples: 0}", "calibration.samples", "greater than or equal to 1"),
        ("quantization: {int8: fast}", "quantization.int8", "is not one of"),
        ("quantization: {observer: mean}", "quantization.observer", "is not one of"),
        ("quantization: {keep: first}", "quantization.keep", "list"),
    ],
)
def test_profile_errors_name_the_place(tmp_path, extra, place, message):
    path = write(tmp_path, ENCODER + extra + "\n")
    with pytest.raises(ProfileError) as info:
        load_profile(path)
    assert any(p == place and message in m for p, m in info.value.problems), info.value.problems


def test_precisions_always_start_with_fp32(tmp_path):
    profile = load_profile(write(tmp_path, ENCODER + "precision: [int8, bf16]\n")).profile
    assert profile.precisions("cpu") == ("fp32", "int8", "bf16")
    profile = load_profile(write(tmp_path, ENCODER + "target: [cpu, cuda]\nprecision: {cpu: [int8]}\n")).profile
    assert profile.precisions("cpu") == ("fp32", "int8") and profile.precisions("cuda") == ("fp32",)


def test_a_bad_calibration_file_fails_before_compiling(tmp_path):
    (tmp_path / "calib.jsonl").write_text(json.dumps({"ids": [[1, 2, 3]], "tokens": [[True] * 3]}) + "\n")
    path = write(tmp_path, ENCODER + "precision: [int8]\ncalibration: {file: calib.jsonl}\n")
    result = CliRunner().invoke(main, ["build", str(path), "-o", str(tmp_path / "out")])
    assert result.exit_code == 1
    assert "calibration.file" in result.output and "missing ['mask'], unknown ['tokens']" in result.output
    assert "✓ variant" not in result.output  # nothing compiled
    assert not (tmp_path / "out").exists()


def test_calibration_values_must_respect_the_declared_ranges(tmp_path):
    (tmp_path / "calib.jsonl").write_text(json.dumps({"ids": [[1, 2, 99]], "mask": [[True] * 3]}) + "\n")
    path = write(tmp_path, ENCODER + "precision: [int8]\ncalibration: {file: calib.jsonl}\n")
    with pytest.raises(ProfileError, match=r"input 'ids' holds values in \[1, 99\], outside its range \[0.0, 49.0\]"):
        from precompile.calibration import calibration_inputs
        from precompile.traffic import read_distribution

        loaded = load_profile(path)
        calibration_inputs(loaded, read_distribution(loaded))


# --- the int8 fallback ----------------------------------------------------------------------------


def test_int8_failing_the_gate_keeps_its_most_sensitive_layer_in_fp32_and_passes(outlier_int8):
    manifest, output = outlier_int8
    output = " ".join(output.split())  # the console wraps lines at its width
    (v,) = [v for v in manifest.variants if v.precision == "int8"]
    gate = v.gate
    assert gate["kept"] and gate["fallback"]["fp32_layers"] == ["c2"]
    assert gate["fallback"]["sensitivity"][0]["layer"] == "c2"  # the layer reading the outlier channel, first
    (before,) = gate["fallback"]["before"]  # every layer int8: the gate failed
    assert before["statistic"] == "p5" and before["value"] < 0.99 and not before["passed"]
    first, last = gate["fallback"]["builds"][0], gate["fallback"]["builds"][-1]
    assert first["fp32_layers"] == 1 and last["kept"]
    (accuracy,) = gate["accuracy"]
    assert accuracy["statistic"] == "p5" and accuracy["value"] >= 0.99 and accuracy["rows"] >= 64
    # what the build says: the first gate's failure, then what it kept and the cosine it reached
    assert (
        "int8-dynamic: out0 cosine p5 0.9" in output
        and "< 0.99 on 99 held-out rows (accuracy gate): int8 again" in output
    )
    assert "int8-dynamic: int8 fallback kept 1 layer in fp32 (c2), 1 build: out0 cosine p5" in output
    assert "→ kept" in output
