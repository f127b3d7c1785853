"""The profile's ``batching:`` section: validated with the profile, checked by the build against eager
on padded batches (refused when padding changes the outputs), recorded in the manifest, and used by
loader.Batcher to batch calls of different sequence lengths. Also: /v2 infer in the request metrics."""

from __future__ import annotations

import json
import re
import shutil

import pytest
import torch
from click.testing import CliRunner

import loader
from loader.errors import ArtifactError
from loader.manifest import parse_manifest
from loader.serving.batch_plan import BatchPlan, aim, batch_plan
from precompile.cli import main
from precompile.errors import ProfileError
from precompile.pipeline import build
from precompile.profile import load_profile
from precompile.serve.app import create_app
from precompile.serve.config import ServeConfig
from tests.conftest import ENCODER_PROFILE, write_profile
from tests.test_serve import AppClient, metrics

WAIT = 30.0


def with_batching(section: str, *, profile: str = ENCODER_PROFILE) -> str:
    head = profile.split("batching:")[0]
    return head + section


def problems(tmp_path, text: str) -> list[str]:
    with pytest.raises(ProfileError) as raised:
        load_profile(write_profile(tmp_path, text))
    return [f"{place}: {message}" for place, message in raised.value.problems]


# --- the section in the profile --------------------------------------------------------------------


@pytest.mark.parametrize(
    "section, expected",
    [
        ("batching: {dim: rows}", "batching.dim: unknown dim 'rows' (known: batch, seq)"),
        ("batching: {pad: [seq, sq]}", "batching.pad[1]: unknown dim 'sq' (known: batch, seq)"),
        (
            "batching: {pad: [batch]}",
            "batching.pad[0]: 'batch' is the batch dim; pad lists the other dims calls may differ in",
        ),
        ("batching: {pad: [seq], pad_value: {idz: 0}}", "batching.pad_value.idz: unknown input (inputs: ids, mask)"),
        (
            "batching: {pad_value: {mask: 0}}",
            "batching.pad_value.mask: input 'mask' has none of the padded dims (none listed)",
        ),
        ("batching: {pad: [seq], pad_value: {mask: 2}}", "batching.pad_value.mask: 2: a bool input pads with 0 or 1"),
        (
            "batching: {pad: [seq], pad_value: {ids: -1}}",
            "batching.pad_value.ids: -1 is outside inputs.ids.range [0, 49]: the loader refuses such values, widen the range to hold it",
        ),
        ("batching: {pad: [seq], mask: 0}", "batching.mask: unknown key"),
    ],
)
def test_mistakes_in_the_section_are_reported_at_their_place(tmp_path, section, expected):
    assert expected in problems(tmp_path, with_batching(section))


def test_the_batch_dim_must_be_on_every_input_and_output(tmp_path):
    text = (
        with_batching("batching: {pad: [seq]}")
        .replace(
            "  mask: {shape: [batch, seq], dtype: bool, range: [1, 1]}\n",
            "  mask: {shape: [batch, seq], dtype: bool, range: [1, 1]}\n  scale: {shape: [4], dtype: float32}\n",
        )
        .replace("  - {shape: [batch, 16]}", "  - {shape: [16]}")
    )
    assert problems(tmp_path, text) == [
        "batching.dim: input 'scale' (shape [4]) has 'batch' on no axis; every input needs it on exactly one axis",
        "batching.dim: outputs[1] (shape [16]) follows 'batch' on no axis; each caller's rows are cut from exactly one axis of every output",
    ]


def test_the_section_needs_outputs(tmp_path):
    text = with_batching("batching: {pad: [seq]}").replace(
        "outputs:\n  - {shape: [batch, seq, 16]}\n  - {shape: [batch, 16]}\n", ""
    )
    assert problems(tmp_path, text) == [
        "batching: needs `outputs:` to say which output axes follow the batch dim and the padded dims"
    ]


# --- the build checks the claim --------------------------------------------------------------------

LENGTH_MEAN_PROFILE = """
name: tiny-length-mean
model: {factory: "tiny:length_mean"}
inputs:
  ids:  {shape: [batch, seq], dtype: int64, range: [0, 49]}
  mask: {shape: [batch, seq], dtype: bool}
dims:
  batch: {min: 1, max: 8}
  seq:   {min: 2, max: 32}
outputs:
  - {shape: [batch, 3]}
batching:
  pad: [seq]
  pad_value: {mask: 0}
"""


def test_the_build_refuses_padding_that_changes_the_outputs(tmp_path):
    profile = write_profile(tmp_path, LENGTH_MEAN_PROFILE)
    with pytest.raises(ProfileError) as raised:
        build(profile, tmp_path / "artifact")
    [(place, message)] = raised.value.problems
    assert place == "batching.pad[0]"
    assert re.match(
        r"padding seq from \d+ to 32 \(pad values ids=0, mask=0\) changes output 0 \(outputs\[0\]: \['batch', 3\]\)",
        message,
    )
    assert "max abs error" in message and "its pad value must be 0 (batching.pad_value)" in message
    assert "remove 'seq' from batching.pad" in message
    assert not (tmp_path / "artifact").exists()


def test_the_cli_reports_the_refusal_without_a_traceback(tmp_path):
    profile = write_profile(tmp_path, LENGTH_MEAN_PROFILE)
    result = CliRunner().invoke(main, ["build", str(profile), "-o", str(tmp_path / "out")], catch_exceptions=False)
    assert result.exit_code == 1
    assert "batching.pad[0]: padding seq from" in result.output
    assert "Traceback" not in result.output


def test_the_build_refuses_batching_a_model_that_mixes_rows(tmp_path):
    profile = write_profile(
        tmp_path,
        """
        name: tiny-centered
        model: {factory: "tiny:batch_centered"}
        inputs:
          x: {shape: [batch, 8], dtype: float32}
        dims:
          batch: {min: 1, max: 8}
        outputs:
          - {shape: [batch, 4]}
        batching: {}
        """,
    )
    with pytest.raises(ProfileError) as raised:
        build(profile, tmp_path / "artifact")
    [(place, message)] = raised.value.problems
    assert place == "batching.dim"
    assert message.startswith("running 3 calls as one batch changes output 0")
    assert "does not treat the rows of 'batch' independently" in message


# --- the manifest records it -----------------------------------------------------------------------


@pytest.fixture(scope="module")
def encoder(encoder_artifact):
    return loader.load(encoder_artifact)


def test_the_manifest_records_the_checked_section(encoder):
    section = encoder.manifest.batching
    assert (section.dim, section.pad, section.pad_value) == ("batch", ("seq",), {"ids": 0.0, "mask": 0.0})
    assert section.checked["calls"] >= 6 and section.checked["max_abs_error"] < 1e-4
    plan = batch_plan(encoder)
    assert plan.pad_dims == ("seq",) and plan.pad_values == (0.0, 0.0)


def test_a_manifest_without_the_section_still_loads(encoder_artifact, tmp_path):
    old = tmp_path / "old"
    shutil.copytree(encoder_artifact, old)
    manifest = json.loads((old / "manifest.json").read_text())
    del manifest["batching"]
    (old / "manifest.json").write_text(json.dumps(manifest))
    model = loader.load(old)
    assert model.manifest.batching is None
    assert batch_plan(model).pad_dims == ()
    # ...and its calls batch only with calls of equal shape, as before the section existed.
    with loader.Batcher(model, max_delay_ms=300, wait_alone=True) as batcher:
        futures = [batcher.submit(*call(seed, seq)) for seed, seq in enumerate((12, 16, 12))]
        for f in futures:
            f.result(timeout=WAIT)
    assert sorted((s["dims"]["batch"], s["dims"]["seq"]) for s in model.stats()["shapes"]) == [(1, 16), (2, 12)]


@pytest.mark.parametrize(
    "change, expected",
    [
        (lambda b: b.update(dim="rows"), "batching.dim: 'rows' is not a dim of this artifact"),
        (
            lambda b: b.update(pad=["batch"]),
            "batching.pad[0]: 'batch' is not a dim of this artifact other than the batch dim",
        ),
        (
            lambda b: b["pad_value"].pop("mask"),
            "batching.pad_value: must give a value for exactly the inputs ['ids', 'mask']",
        ),
        (
            lambda b: b["pad_value"].update(ids=50),
            "batching.pad_value.ids: 50 is outside the input's value range [0, 49]",
        ),
        (lambda b: b.update(extra=1), "batching: unknown key(s) ['extra']"),
    ],
)
def test_the_loader_refuses_a_bad_section(encoder_artifact, change, expected):
    manifest = json.loads((encoder_artifact / "manifest.json").read_text())
    change(manifest["batching"])
    with pytest.raises(ArtifactError, match=re.escape(expected)):
        parse_manifest(json.dumps(manifest))


# --- the Batcher uses it ---------------------------------------------------------------------------


def call(seed: int, seq: int, batch: int = 1) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, 50, (batch, seq), generator=g)
    mask = torch.rand(batch, seq, generator=g) < 0.8
    mask[:, 0] = True  # every row has a real token
    return ids, mask


def test_calls_of_different_lengths_batch_together_and_get_their_own_results(encoder):
    calls = [call(1, 12), call(2, 16, batch=2), call(3, 5)]
    expected = [encoder(*args) for args in calls]
    encoder.reset_stats()
    with loader.Batcher(encoder, max_batch=8, max_delay_ms=300, wait_alone=True) as batcher:
        futures = [batcher.submit(*args) for args in calls]
        got = [f.result(timeout=WAIT)[0] for f in futures]
        stats = batcher.stats()
    for (ids, _), out, want in zip(calls, got, expected):
        tokens, pooled = out
        assert tokens.shape == (ids.shape[0], ids.shape[1], 16) and pooled.shape == (ids.shape[0], 16)
        torch.testing.assert_close(tokens, want[0], rtol=1e-4, atol=1e-5)
        torch.testing.assert_close(pooled, want[1], rtol=1e-4, atol=1e-5)
    # One batch of 4 rows ran, every call padded to the longest (16); the model saw that shape.
    assert stats["shapes"] == [{"dims": {"batch": 4, "seq": 16}, "count": 1}]
    assert stats["batching"]["batch_sizes"] == {"4": 1}
    assert stats["batching"]["padded_calls"] == 2


def test_calls_in_different_dynamic_ranges_are_not_padded_together(encoder):
    """seq 12 lies in the variant for 2..16, seq 20 in the one for 17..32: padding 12 to 20 would move
    it onto code compiled for long sequences, so each runs in its own range."""
    calls = [call(4, 12), call(5, 20), call(6, 9), call(7, 24)]
    expected = [encoder(*args) for args in calls]
    encoder.reset_stats()
    with loader.Batcher(encoder, max_delay_ms=300, wait_alone=True) as batcher:
        got = [f.result(timeout=WAIT)[0] for f in [batcher.submit(*args) for args in calls]]
    for out, want in zip(got, expected):
        torch.testing.assert_close(out[0], want[0], rtol=1e-4, atol=1e-5)
    assert sorted((s["dims"]["batch"], s["dims"]["seq"]) for s in encoder.stats()["shapes"]) == [(2, 12), (2, 24)]


def test_padding_aims_at_a_static_shape_only_where_it_was_measured_to_pay():
    plan = BatchPlan("batch", statics={(16,): [4]}, pad_to={(16,): {4: (2.0, 4.0)}}, others=("seq",), pad_dims=("seq",))
    reach = ((2, 16),)
    assert aim(plan, (16,), 4, 8, reach) == ((16,), 4)  # the static shape itself
    assert aim(plan, (14,), 3, 8, reach) == ((16,), 4)  # 2 ms ≤ 4 ms × (3×14)/(4×16)
    assert aim(plan, (8,), 3, 8, reach) == ((8,), 3)  # 2 ms > 4 ms × (3×8)/(4×16): run as it is
    assert aim(plan, (14,), 3, 3, reach) == ((14,), 3)  # never beyond the batch limit
    assert aim(plan, (14,), 3, 8, ((2, 15),)) == ((14,), 3)  # nor outside the range the batch was gathered in
    unmeasured = BatchPlan("batch", statics={(16,): [4]}, others=("seq",), pad_dims=("seq",))
    assert aim(unmeasured, (14,), 3, 8, reach) == ((14,), 3)


# --- /v2 infer is counted like /predict -------------------------------------------------------------


def test_v2_infer_is_counted_in_the_request_metrics(classifier_artifact):
    live = loader.Live(classifier_artifact)

    def infer(ids: list, mask: list) -> dict:
        return {
            "inputs": [
                {
                    "name": "ids",
                    "shape": [len(ids), len(ids[0])],
                    "datatype": "INT64",
                    "data": [v for row in ids for v in row],
                },
                {
                    "name": "mask",
                    "shape": [len(mask), len(mask[0])],
                    "datatype": "BOOL",
                    "data": [v for row in mask for v in row],
                },
            ]
        }

    url = "/v2/models/tiny-classifier/infer"
    try:
        with AppClient(create_app(ServeConfig(str(classifier_artifact)), live=live)) as c:
            for seq in (9, 12):
                assert c.post(url, json=infer([[1] * seq], [[True] * seq])).status_code == 200
            assert c.post(url, json=infer([[99] * 9], [[True] * 9])).status_code == 400  # ids past the table
            assert c.post(url, content=b"nope").status_code == 400
            assert c.post("/v2/models/other/infer", json=infer([[1] * 9], [[True] * 9])).status_code == 404
            assert c.post("/predict", json={"inputs": {"ids": [[1] * 9], "mask": [[True] * 9]}}).status_code == 200
            m = metrics(c)
    finally:
        live.close()
    assert m[("precompile_requests_total", (("code", "200"),))] == 3
    assert m[("precompile_requests_total", (("code", "400"),))] == 2
    assert m[("precompile_requests_total", (("code", "404"),))] == 1
    assert m[("precompile_rejections_total", (("reason", "value_range"),))] == 1
    assert m[("precompile_rejections_total", (("reason", "invalid_body"),))] == 1
    assert sum(v for (name, _), v in m.items() if name == "precompile_predict_seconds_count") == 3
    assert m[("precompile_shape_calls_total", (("shape", "batch=1,seq=9-16"),))] == 3


def test_the_load_generators_request_is_a_valid_v2_infer_call(encoder_artifact, encoder):
    """bench/serve_load.py pre-encodes one raw HTTP request; the server must read it as the call it means."""
    from bench.serve_load import infer_request
    from precompile.serve.oip import parse_infer_request

    raw = infer_request(json.loads((encoder_artifact / "manifest.json").read_text()), {"batch": 1, "seq": 16}, port=1)
    head, body = raw.split(b"\r\n\r\n", 1)
    headers = dict(line.split(": ", 1) for line in head.decode().split("\r\n")[1:])
    assert head.startswith(b"POST /v2/models/tiny-encoder/infer HTTP/1.1") and int(headers["Content-Length"]) == len(
        body
    )
    parsed = parse_infer_request(body, headers["Inference-Header-Content-Length"], encoder.manifest)
    assert parsed.binary_all and parsed.inputs["ids"].shape == (1, 16) and bool(parsed.inputs["mask"].all())
    encoder(**parsed.inputs)  # within every guard
