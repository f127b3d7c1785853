"""precompile init: from a model and a few example calls to a profile build accepts unchanged."""

from __future__ import annotations

import shutil
import sys
from pathlib import Path

import pytest
import torch
import yaml
from click.testing import CliRunner

import loader
from precompile.authoring.init import InitError, init_profile, parse_examples
from precompile.cli import main
from precompile.profile import load_profile
from precompile.stages.resolve import resolve_model

# init runs the model and torch.export (Dim.AUTO) on its example calls: seconds a test.
pytestmark = pytest.mark.integration

MODELS = Path(__file__).parent / "models" / "hf_tiny.py"

BERT_CALLS = [
    "input_ids=2x16:int64",
    "attention_mask=2x16:int64",
    "token_type_ids=2x16:int64",
    "input_ids=4x40 attention_mask=4x40 token_type_ids=4x40",
]


def folder_with_models(folder: Path) -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    shutil.copy(MODELS, folder / "hf_tiny.py")
    return folder


def init(folder: Path, factory: str, *examples: str, name: str = "profile.yaml"):
    args = ["init", factory, *(a for e in examples for a in ("--example", e)), "-o", str(folder / name)]
    return CliRunner().invoke(main, args, catch_exceptions=False)


@pytest.fixture(scope="session")
def bert_init(tmp_path_factory) -> Path:
    folder = folder_with_models(tmp_path_factory.mktemp("init-bert"))
    result = init(folder, "hf_tiny:bert", *BERT_CALLS)
    assert result.exit_code == 0, result.output
    return folder / "profile.yaml"


def test_examples_make_calls_a_repeated_name_or_semicolon_starts_the_next():
    calls = parse_examples(["ids=2x16:int64", "mask=2x16:bool", "ids=4x40 mask=4x40", "; ids=1x8"])
    assert [c.shapes for c in calls] == [
        {"ids": (2, 16), "mask": (2, 16)},
        {"ids": (4, 40), "mask": (4, 40)},
        {"ids": (1, 8)},
    ]
    assert calls[1].dtypes == {"ids": "int64", "mask": "bool"}  # a dtype given once holds


def test_a_malformed_example_is_a_clear_error():
    with pytest.raises(InitError, match=r"--example 'ids=2by16': expected NAME=SHAPE\[:DTYPE\]"):
        parse_examples(["ids=2by16"])
    with pytest.raises(InitError, match="unknown dtype 'int65'"):
        parse_examples(["ids=2x16:int65"])


def test_dims_ranges_and_values_come_from_the_model(bert_init):
    profile = load_profile(bert_init).profile  # build's own parser accepts it
    assert {n: s.shape for n, s in profile.inputs.items()} == {
        "input_ids": ["batch", "seq"],
        "attention_mask": ["batch", "seq"],
        "token_type_ids": ["batch", "seq"],
    }
    assert (profile.dims["seq"].min, profile.dims["seq"].max) == (
        16,
        64,
    )  # the smallest example; the position table's rows
    assert (profile.dims["batch"].min, profile.dims["batch"].max) == (1, 4)
    assert profile.inputs["input_ids"].range == (0, 99) and profile.inputs["token_type_ids"].range == (0, 1)
    mask = profile.inputs["attention_mask"]
    assert mask.range == (0, 1) and mask.sample_range() == (1, 1)  # calls may be padded, samples are not
    assert profile.model.outputs == ["last_hidden_state", "pooler_output"]
    assert [o.shape for o in profile.outputs] == [["batch", "seq", 32], ["batch", 32]]
    text = bert_init.read_text()
    seq_line = next(line for line in text.splitlines() if line.strip().startswith("seq:"))
    assert "embeddings.position_embeddings.weight has 64 rows" in seq_line  # the reason, as a comment


@pytest.mark.integration
def test_init_then_build_then_load_matches_eager(bert_init):
    out = bert_init.parent / "artifact"
    result = CliRunner().invoke(main, ["build", str(bert_init), "-o", str(out)], catch_exceptions=False)
    assert result.exit_code == 0, result.output
    model = loader.load(out)
    eager = resolve_model(load_profile(bert_init))
    ids = torch.randint(0, 100, (3, 50))
    mask, types = torch.ones(3, 50, dtype=torch.int64), torch.zeros(3, 50, dtype=torch.int64)
    got = model(input_ids=ids, attention_mask=mask, token_type_ids=types)
    with torch.no_grad():
        want = eager(ids, mask, types)
    assert set(got) == {"last_hidden_state", "pooler_output"}
    torch.testing.assert_close(got["last_hidden_state"], want["last_hidden_state"], atol=1e-4, rtol=1e-4)


def test_a_model_output_with_a_cache_keeps_its_tensors_and_the_table_bounds_seq(tmp_path):
    """GPT-2 reads its position table with arange(seq): export proves no bound, the graph does."""
    folder = folder_with_models(tmp_path)
    result = init(folder, "hf_tiny:gpt2", "input_ids=2x16:int64", "input_ids=3x24")
    assert result.exit_code == 0, result.output
    profile = load_profile(folder / "profile.yaml").profile
    assert profile.model.outputs == ["last_hidden_state"]  # the DynamicCache is dropped
    assert profile.dims["seq"].max == 64
    assert "wpe.weight has 64 rows" in (folder / "profile.yaml").read_text()


def test_a_size_the_model_fixes_is_written_static_and_said(tmp_path):
    folder = folder_with_models(tmp_path)
    calls = parse_examples(["pixel_values=2x3x32x32", "pixel_values=4x3x48x48"])
    result = init_profile("hf_tiny:vit", calls, output=folder / "vit.yaml")
    (folder / "vit.yaml").write_text(result.text)
    profile = load_profile(folder / "vit.yaml").profile
    assert profile.inputs["pixel_values"].shape == ["batch", 3, 32, 32]
    fixed = [n for n in result.notes if "the model fixes it to 32" in n]
    assert len(fixed) == 2 and "inputs.pixel_values.shape[2]" in fixed[0]
    assert any("example call 2" in n and "doesn't match model" in n for n in result.notes)


def test_an_input_forward_does_not_take_is_refused_without_traceback(tmp_path):
    folder = folder_with_models(tmp_path)
    result = init(folder, "hf_tiny:bert", "input_idz=2x16:int64", "input_idz=4x40")
    assert result.exit_code == 1
    assert "forward() takes no 'input_idz'" in result.output and "Traceback" not in result.output
    assert not (folder / "profile.yaml").exists()


def test_examples_or_traffic_are_needed():
    result = CliRunner().invoke(main, ["init", "hf_tiny:bert"], catch_exceptions=False)
    assert result.exit_code == 2 and "give --example calls or --traffic FILE" in result.output


def test_traffic_gives_the_calls_and_the_distribution(tmp_path):
    folder = folder_with_models(tmp_path)
    (folder / "traffic.jsonl").write_text(
        '{"inputs": {"input_ids": "2x16:int64"}, "count": 30}\n{"inputs": {"input_ids": [1, 40]}, "count": 5}\n'
    )
    args = ["init", "hf_tiny:gpt2", "--traffic", str(folder / "traffic.jsonl"), "-o", str(folder / "p.yaml")]
    result = CliRunner().invoke(main, args, catch_exceptions=False)
    assert result.exit_code == 0, result.output
    raw = yaml.safe_load((folder / "p.yaml").read_text())
    assert raw["distribution"]["shapes"] == [{"batch": 2, "seq": 16, "count": 30}, {"batch": 1, "seq": 40, "count": 5}]
    load_profile(folder / "p.yaml")


def test_a_profile_written_away_from_its_module_says_where_the_module_is_looked_for(tmp_path, monkeypatch):
    monkeypatch.delitem(sys.modules, "hf_tiny", raising=False)  # an earlier build in this process imported it
    models = folder_with_models(tmp_path / "models")
    elsewhere = tmp_path / "profiles"
    elsewhere.mkdir()
    result = CliRunner().invoke(
        main,
        ["init", "hf_tiny:bert", "--example", "input_ids=2x16:int64", "-o", str(elsewhere / "bert.yaml")],
        catch_exceptions=False,
    )
    assert result.exit_code == 1 and "Traceback" not in result.output
    assert (
        "cannot import 'hf_tiny'" in result.output
        and f"the folder the profile is written to ({elsewhere})" in result.output
    )
    assert not (elsewhere / "bert.yaml").exists() and models.is_dir()
