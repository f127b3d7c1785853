"""int8 static (PT2E) options, stage by stage on the tiny conv net of tests/models/lowp.py: what the
quantizer receives, which layers stay fp32 in the exported graph, how the percentile observer clips.
No compile here (seconds); tests/test_precision.py builds the conv net in int8 with these options."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest
import torch

from precompile.errors import CompileError
from precompile.profile import read_profile
from precompile.stages import quantize
from precompile.tracing import export_model

# Quantizes exported programs with PT2E (export, prepare, calibrate, convert): seconds a test.
pytestmark = pytest.mark.integration

MODELS = Path(__file__).parent / "models" / "lowp.py"
PROFILE = {
    "name": "lowp-conv",
    "model": {"factory": "lowp:convnet"},
    "inputs": {"x": {"shape": ["batch", 3, "size", "size"], "dtype": "float32"}},
    "dims": {"batch": {"min": 1, "max": 4}, "size": {"min": 16, "max": 48}},
    "precision": ["int8"],
}
RANGES = {"batch": (1, 4), "size": (16, 48)}


def convnet() -> torch.nn.Module:
    spec = importlib.util.spec_from_file_location("lowp_quantize", MODELS)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module.convnet()


@pytest.fixture(scope="module")
def exported():
    """The conv net (conv-bn-relu, conv-relu, mean, linear) exported with dynamic batch and size, its profile."""
    profile = read_profile(PROFILE).profile
    return export_model(convnet(), profile, RANGES, {"batch": 2, "size": 32}), profile


def images(count: int, seed: int) -> list[tuple[torch.Tensor]]:
    gen = torch.Generator().manual_seed(seed)
    return [
        (torch.rand(1 + k % 2, 3, 24 + 8 * (k % 3), 24 + 8 * (k % 3), generator=gen) * 2 - 1,) for k in range(count)
    ]


def int8_inputs(graph: torch.fx.GraphModule) -> dict[str, bool]:
    """Per convolution or linear node of ``graph``: whether its activation and weight arrive dequantized
    from int8 (the pattern Inductor lowers to oneDNN's int8 kernels), i.e. whether it runs in int8."""
    out = {}
    for node in graph.graph.nodes:
        name = getattr(node.target, "__name__", "")
        if node.op == "call_function" and name.split(".")[0] in quantize.QUANTIZABLE:
            out[node.name] = all(isinstance(a, torch.fx.Node) and "dequantize" in str(a.target) for a in node.args[:2])
    return out


def spec(profile, **changes):
    return profile.quantization.model_copy(update=changes)


def test_the_quantizer_gets_per_channel_int8_weights_and_the_chosen_activation_observer(exported):
    ep, profile = exported
    for observer, wanted in (
        ("histogram", "HistogramObserver"),
        ("minmax", "MinMaxObserver"),
        ("percentile", "Percentile"),
    ):
        quantizer = quantize.static_quantizer(spec(profile, observer=observer), ep.module())
        config = quantizer.global_config
        assert config.weight.qscheme == torch.per_channel_symmetric and config.weight.ch_axis == 0
        assert config.weight.dtype == torch.int8 and config.input_activation.dtype == torch.uint8
        from torchao.quantization.pt2e.quantize_pt2e import prepare_pt2e

        prepared = prepare_pt2e(ep.module(), quantizer)
        observers = {type(m).__name__ for _, m in prepared.named_modules() if "activation_post_process" in _}
        assert observers == {"PerChannelMinMaxObserver", wanted}, observer  # weights, activations


def test_every_layer_runs_in_int8_by_default(exported):
    ep, profile = exported
    converted = quantize.static_int8(ep.module(), profile.quantization, images(4, seed=1))
    assert profile.quantization.keep == [] and list(int8_inputs(converted).values()) == [True, True, True]


def test_kept_layers_stay_fp32_in_the_exported_graph(exported):
    ep, profile = exported
    assert quantize.quantizable_layers(ep.module()) == ["c1", "c2", "fc"]
    model = convnet()
    x = images(1, seed=9)[0][0]
    for keep, wanted in ((["first", "last"], [False, True, False]), (["c2"], [True, False, True])):
        converted = quantize.static_int8(ep.module(), spec(profile, keep=keep), images(4, seed=1))
        again = export_model(converted, profile, RANGES, {"batch": 2, "size": 32})  # what Inductor compiles
        assert list(int8_inputs(again.module()).values()) == wanted, keep
        assert torch.nn.functional.cosine_similarity(again.module()(x), model(x)).min() > 0.99


def test_an_unknown_layer_to_keep_is_named_with_the_models_layers(exported):
    ep, profile = exported
    with pytest.raises(CompileError) as info:
        quantize.static_int8(ep.module(), spec(profile, keep=["first", "head"]), images(1, seed=1))
    assert str(info.value) == (
        "quantization.keep: the model has no module 'head' (its convolution and linear layers: c1, c2, fc)"
    )


def test_the_percentile_observer_clips_outliers_that_minmax_keeps():
    percentile = quantize._OBSERVERS["percentile"]()(dtype=torch.uint8, quant_min=0, quant_max=255)
    minmax = quantize._OBSERVERS["minmax"]()(dtype=torch.uint8, quant_min=0, quant_max=255)
    x = torch.rand(100_000, generator=torch.Generator().manual_seed(0))
    x[:3] = 50.0  # three outliers in 100,000 values in [0, 1)
    for observer in (percentile, minmax):
        observer(x)
    (p_scale, _), (m_scale, _) = percentile.calculate_qparams(), minmax.calculate_qparams()
    assert float(m_scale) == pytest.approx(50 / 255, rel=1e-3)
    assert float(p_scale) * 255 == pytest.approx(1.0, abs=0.05)  # the range ends near 1, the outliers clipped


# --- what the gate scores: held-out inputs ------------------------------------------------------


def test_the_gates_inputs_are_held_out_from_calibration_and_follow_the_traffic(exported):
    from precompile.calibration import calibration_inputs, gate_inputs
    from precompile.profile import LoadedProfile

    _, profile = exported
    loaded = LoadedProfile(profile=profile, path=Path("lowp.yaml"))
    traffic = {(1, 16): 3, (2, 24): 1, (4, 48): 2}  # (batch, size): count
    calibration = calibration_inputs(loaded, traffic)
    held = gate_inputs(loaded, traffic, {"batch": (1, 2), "size": (16, 48)})
    assert len(held) == profile.accuracy.samples == 64 and len(calibration) == profile.calibration.samples
    assert {(s["batch"], s["size"]) for s, _ in held} == {(1, 16), (2, 24)}  # the traffic inside the ranges
    seen = [x for _, (x,) in calibration]
    assert not any(x.shape == y.shape and torch.equal(x, y) for _, (y,) in held for x in seen)
    again = gate_inputs(loaded, traffic, {"batch": (1, 2), "size": (16, 48)})
    assert all(torch.equal(a[1][0], b[1][0]) for a, b in zip(held, again))  # the same draw, build after build


def test_a_calibration_files_every_fourth_sample_is_held_out_for_the_gate(tmp_path):
    import json

    from precompile.calibration import calibration_inputs, gate_inputs
    from precompile.profile import load_profile

    gen = torch.Generator().manual_seed(0)
    lines = [json.dumps({"x": (torch.rand(1, 3, 16, 16, generator=gen)).tolist()}) for _ in range(8)]
    (tmp_path / "calib.jsonl").write_text("\n".join(lines) + "\n")
    import yaml

    (tmp_path / "p.yaml").write_text(yaml.safe_dump({**PROFILE, "calibration": {"file": "calib.jsonl"}}))
    loaded = load_profile(tmp_path / "p.yaml")
    calibration = calibration_inputs(loaded, {})
    held = gate_inputs(loaded, {}, RANGES)
    assert len(calibration) == 6 and len(held) == 2
    values = [json.loads(line)["x"] for line in lines]
    assert [x.tolist() for _, (x,) in held] == [values[3], values[7]]
    assert [x.tolist() for _, (x,) in calibration] == [v for i, v in enumerate(values) if i % 4 != 3]
