"""Profile validation: every kind of mistake is reported at its place, through the CLI, exit 1."""

from __future__ import annotations

import json
from pathlib import Path

import jsonschema
import pytest
import torch
import yaml
from click.testing import CliRunner

from precompile.cli import main
from precompile.errors import ProfileError
from precompile.profile import json_schema, load_profile
from precompile.samples import make_inputs

from .conftest import write_profile

ROOT = Path(__file__).resolve().parent.parent

GOOD = """
name: ok
model: {factory: "tiny:classifier"}
inputs:
  ids:  {shape: [batch, seq], dtype: int64, range: [0, 49]}
  mask: {shape: [batch, seq], dtype: bool}
dims:
  batch: {min: 1, max: 8}
  seq:   {min: 2, max: 48}
"""


def problems(tmp_path: Path, text: str) -> list[str]:
    with pytest.raises(ProfileError) as info:
        load_profile(write_profile(tmp_path, text))
    return [f"{place}: {msg}" for place, msg in info.value.problems]


def test_good_profile_loads(tmp_path):
    loaded = load_profile(write_profile(tmp_path, GOOD))
    assert list(loaded.profile.inputs) == ["ids", "mask"]
    assert loaded.profile.hint("seq") >= 2


def test_unknown_dim_names_place_and_known_dims(tmp_path):
    text = GOOD.replace("mask: {shape: [batch, seq]", "mask: {shape: [batch, sq]")
    assert "inputs.mask.shape[1]: unknown dim 'sq' (known: batch, seq)" in problems(tmp_path, text)


def test_min_greater_than_max(tmp_path):
    assert "dims.seq: min 60 > max 48" in problems(tmp_path, GOOD.replace("{min: 2, max: 48}", "{min: 60, max: 48}"))


def test_dim_used_by_no_input(tmp_path):
    text = GOOD + "  extra: {min: 1, max: 4}\n"
    assert "dims.extra: declared but used in no input shape" in problems(tmp_path, text)


MASKED = GOOD.replace(
    "mask: {shape: [batch, seq], dtype: bool}",
    "mask: {shape: [batch, seq], dtype: int64, range: [0, 1], sample: {range: [1, 1]}}",
)


def test_samples_have_their_own_range_inside_the_valid_one(tmp_path):
    loaded = load_profile(write_profile(tmp_path, MASKED))
    spec = loaded.profile.inputs["mask"]
    assert spec.range == (0, 1) and spec.sample_range() == (1, 1)
    _, mask = make_inputs(loaded.profile, {"batch": 3, "seq": 7}, seed=0)
    assert mask.dtype == torch.int64 and bool((mask == 1).all())


def test_a_sample_range_outside_the_valid_range_is_refused(tmp_path):
    text = MASKED.replace("sample: {range: [1, 1]}", "sample: {range: [1, 2]}")
    assert "inputs.mask.sample.range: [1, 2] goes outside inputs.mask.range [0, 1], the values every call may hold" in (
        problems(tmp_path, text)
    )
    text = MASKED.replace("sample: {range: [1, 1]}", "sample: {range: [1, 0]}")
    assert "inputs.mask.sample.range: low 1 > high 0" in problems(tmp_path, text)
    text = MASKED.replace("sample: {range: [1, 1]}", "sample: {range: [0.5, 1]}")
    assert "inputs.mask.sample.range: [0.5, 1]: an int64 input's samples are whole numbers" in problems(tmp_path, text)


def test_unknown_dtype(tmp_path):
    found = problems(tmp_path, GOOD.replace("dtype: int64", "dtype: int65"))
    assert any(p.startswith("inputs.ids.dtype: 'int65' is not one of") for p in found), found


def test_unknown_key_is_refused(tmp_path):
    assert "model.factroy: unknown key" in problems(tmp_path, GOOD.replace("{factory:", "{factroy: x, factory:"))


def test_unknown_inductor_option(tmp_path):
    text = GOOD + "compile:\n  inductor: {freezng: true}\n"
    found = problems(tmp_path, text)
    assert any(p.startswith("compile.inductor.freezng: unknown Inductor option in torch") for p in found), found


def test_managed_inductor_option_is_refused(tmp_path):
    text = GOOD + "compile:\n  inductor: {aot_inductor.package_constants_in_so: true}\n"
    found = problems(tmp_path, text)
    assert found[0].startswith("compile.inductor.aot_inductor.package_constants_in_so: set by precompile")


def test_inductor_option_of_wrong_type(tmp_path):
    text = GOOD + "compile:\n  inductor: {freezing: yes please}\n"
    assert "compile.inductor.freezing: expected bool, got str 'yes please'" in problems(tmp_path, text)


def test_missing_weights_file(tmp_path):
    text = GOOD.replace('{factory: "tiny:classifier"}', '{factory: "tiny:classifier", weights: nope.safetensors}')
    found = problems(tmp_path, text)
    assert found == [f"model.weights: file not found: {tmp_path / 'nope.safetensors'}"]


def test_several_problems_are_reported_together(tmp_path):
    text = GOOD.replace("{min: 2, max: 48}", "{min: 60, max: 48}").replace(
        "[batch, seq], dtype: bool", "[batch, sq], dtype: bool"
    )
    assert len(problems(tmp_path, text)) == 2


def test_yaml_syntax_error_names_line(tmp_path):
    found = problems(tmp_path, "name: x\nmodel: {factory: [\n")
    assert found[0].startswith("line ")


def test_cli_prints_one_block_and_exits_1(tmp_path):
    path = write_profile(tmp_path, GOOD.replace("[batch, seq], dtype: bool", "[batch, sq], dtype: bool"))
    result = CliRunner().invoke(main, ["build", str(path), "-o", str(tmp_path / "out")], catch_exceptions=False)
    assert result.exit_code == 1
    assert "inputs.mask.shape[1]: unknown dim 'sq' (known: batch, seq)" in result.output
    assert "Traceback" not in result.output
    assert not (tmp_path / "out").exists()


def test_factory_that_cannot_be_imported(tmp_path):
    path = write_profile(tmp_path, GOOD.replace("tiny:classifier", "tinyy:classifier"))
    result = CliRunner().invoke(main, ["build", str(path)], catch_exceptions=False)
    assert result.exit_code == 1
    assert "model.factory: cannot import 'tinyy': ModuleNotFoundError: No module named 'tinyy'" in result.output


def test_factory_that_raises(tmp_path):
    path = write_profile(tmp_path, GOOD.replace("tiny:classifier", "tiny:broken"))
    result = CliRunner().invoke(main, ["build", str(path)], catch_exceptions=False)
    assert result.exit_code == 1
    assert "tiny:broken(**{}) raised RuntimeError: factory exploded" in result.output


def test_factory_returning_something_else(tmp_path):
    path = write_profile(tmp_path, GOOD.replace("tiny:classifier", "tiny:not_a_module"))
    result = CliRunner().invoke(main, ["build", str(path)], catch_exceptions=False)
    assert "model.factory: tiny:not_a_module returned int, not a torch.nn.Module" in result.output


def test_schema_file_is_generated_from_the_models():
    on_disk = json.loads((ROOT / "profiles" / "schema.json").read_text())
    assert on_disk == json_schema(), "profiles/schema.json is stale: run `make schema`"


def test_cli_schema_prints_the_schema():
    result = CliRunner().invoke(main, ["schema"], catch_exceptions=False)
    assert json.loads(result.output) == json_schema()


@pytest.mark.parametrize("path", sorted((ROOT / "profiles").rglob("*.yaml")), ids=lambda p: p.name)
def test_example_profiles_are_valid(path):
    jsonschema.validate(yaml.safe_load(path.read_text()), json_schema())
    load_profile(path)
