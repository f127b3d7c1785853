"""precompile doctor, and build failures explained in the model's terms: each says the dim, the
cause and the fix."""

from __future__ import annotations

import re
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
from click.testing import CliRunner

from precompile.authoring.doctor import diagnose
from precompile.cli import main
from precompile.errors import ExportError, ModelError, ProfileError
from precompile.pipeline import build

from .test_init import folder_with_models

# Every doctor runs the model in eager and torch.export's draft_export (seconds each).
pytestmark = pytest.mark.integration


def profile(folder: Path, text: str) -> Path:
    folder_with_models(folder)
    path = folder / "profile.yaml"
    path.write_text(textwrap.dedent(text))
    return path


GPT2_PAST_TABLE = """
    name: gpt
    model: {factory: "hf_tiny:gpt2", outputs: [last_hidden_state]}
    inputs: {input_ids: {shape: [batch, seq], dtype: int64, range: [0, 99]}}
    dims: {batch: {min: 1, max: 4}, seq: {min: 8, max: 512}}
"""

VIT_RANGE = """
    name: vit
    model: {factory: "hf_tiny:vit", outputs: [last_hidden_state]}
    inputs: {pixel_values: {shape: [batch, 3, height, width], dtype: float32}}
    dims: {batch: {min: 1, max: 4}, height: {min: 16, max: 256}, width: {min: 16, max: 256}}
"""


# --- doctor --------------------------------------------------------------------------------------


def test_doctor_traces_a_range_past_the_position_table(tmp_path):
    report = diagnose(profile(tmp_path, GPT2_PAST_TABLE))
    seq = [f for f in report.errors if f.place == "dims.seq"]
    assert len(seq) == 1  # the eager IndexError at seq=512 is explained by the table, not listed twice
    assert "wpe.weight has 64 rows" in seq[0].message and "seq can be at most 64" in seq[0].message
    assert seq[0].fix.startswith("set dims.seq.max to 64")


def test_doctor_gives_builds_diagnosis_of_a_value_range_past_the_table(tmp_path):
    """Samples drawn from ``range: [0, 9]`` index past a 5-row table: doctor says what build says
    (the range, the table, narrow it), not that some dim's size fails."""
    path = profile(
        tmp_path,
        """
        name: past-values
        model: {factory: "hf_tiny:small_table"}
        inputs: {ids: {shape: [batch, seq], dtype: int64, range: [0, 9]}}
        dims: {batch: {min: 1, max: 4}, seq: {min: 2, max: 8}}
    """,
    )
    report = diagnose(path)
    with pytest.raises(ProfileError) as built:
        build(path, tmp_path / "out")
    assert [(f.place, f.message) for f in report.errors] == built.value.problems
    assert built.value.problems == [
        ("inputs.ids.range", "[0, 9] goes past the embedding table of 5 rows (valid 0..4): narrow it")
    ]


def test_doctor_names_the_sizes_a_model_fixes_with_the_line(tmp_path):
    report = diagnose(profile(tmp_path, VIT_RANGE))
    by_dim = {f.place: f for f in report.errors}
    assert set(by_dim) == {"dims", "dims.height", "dims.width"}  # the sample (64x64) fails too
    assert "the model fixes height to 32" in by_dim["dims.height"].message
    assert re.match(
        r"modeling_vit\.py:\d+ in forward: if height != self\.image_size\[0\]", by_dim["dims.height"].source
    )
    assert "write 32 for height in the input shapes" in by_dim["dims.height"].fix
    assert "the model fixes width to 32" in by_dim["dims.width"].message
    assert "height=64, the geometric mean of [16, 256]" in by_dim["dims"].message


def test_doctor_finds_a_data_dependent_branch_and_its_source(tmp_path):
    path = profile(
        tmp_path,
        """
        name: branchy
        model: {factory: "hf_tiny:branchy"}
        inputs: {x: {shape: [batch, 8], dtype: float32}}
        dims: {batch: {min: 1, max: 4}}
    """,
    )
    result = CliRunner().invoke(main, ["doctor", str(path)], catch_exceptions=False)
    assert result.exit_code == 1
    assert "model: forward() branches on tensor values" in result.output
    assert "at hf_tiny.py:" in result.output and "if x.sum() > 0:" in result.output
    assert "fix: rewrite the branch with torch.where or torch.cond" in result.output
    assert "Traceback" not in result.output


def test_doctor_on_a_good_profile_exits_0_and_notes_aten_fallbacks(tmp_path):
    path = profile(
        tmp_path,
        """
        name: gpt
        model: {factory: "hf_tiny:gpt2", outputs: [last_hidden_state]}
        inputs: {input_ids: {shape: [batch, seq], dtype: int64, range: [0, 99]}}
        dims: {batch: {min: 1, max: 4}, seq: {min: 1, max: 64}}
    """,
    )
    result = CliRunner().invoke(main, ["doctor", str(path)], catch_exceptions=False)
    assert result.exit_code == 0, result.output
    assert "no problem found" in result.output
    assert "note: ops: without an Inductor kernel" in result.output


def test_doctor_stops_at_its_time_budget_and_says_so(tmp_path):
    """In a child process: the abandoned export thread must not outlive the test."""
    path = profile(
        tmp_path,
        """
        name: slow
        model: {factory: "hf_tiny:slow_to_trace"}
        inputs: {x: {shape: [batch, 8], dtype: float32}}
        dims: {batch: {min: 1, max: 4}}
    """,
    )
    run = subprocess.run(
        [sys.executable, "-m", "precompile", "doctor", str(path), "--max-seconds", "2"],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert run.returncode == 1
    assert "torch.export did not finish within 2 s; what it found so far is listed" in run.stdout
    assert "eager at 3 shape(s)" in run.stdout  # what ran before the budget is reported


# --- build errors --------------------------------------------------------------------------------


def test_build_refuses_a_range_past_the_position_table_before_compiling(tmp_path):
    with pytest.raises(ExportError) as e:
        build(profile(tmp_path, GPT2_PAST_TABLE), tmp_path / "out", jobs=1)
    text = str(e.value)
    assert "dims.seq: [8, 512] goes past what the model serves" in text
    assert "wpe.weight has 64 rows" in text and "set dims.seq.max to 64" in text
    assert not list(tmp_path.rglob("*.pt2"))


def test_an_index_error_at_the_sample_size_is_traced_to_the_dim_and_table(tmp_path):
    path = profile(tmp_path, GPT2_PAST_TABLE.replace("min: 8, max: 512", "min: 100, max: 4096"))
    with pytest.raises(ProfileError) as e:
        build(path, tmp_path / "out")
    [(place, message)] = e.value.problems
    assert place == "dims.seq" and "seq can be at most 64" in message
    assert "the eager sample at batch=2, seq=640 failed with IndexError" in message


def test_the_sample_size_the_build_chose_is_named_as_such_without_the_values_hint(tmp_path):
    with pytest.raises(ModelError) as e:
        build(profile(tmp_path, VIT_RANGE), tmp_path / "out")
    text = str(e.value)
    assert (
        "the sample size the build chose: batch=2, the geometric mean of [1, 4]; height=64, the geometric mean of [16, 256]"
        in text
    )
    assert "ValueError: Input image size (64*64) doesn't match model (32*32)" in text
    assert "range" not in text  # the values are not the cause: no hint about them
    assert "precompile doctor" in text


def test_the_values_hint_comes_when_values_index_past_a_table(tmp_path):
    path = profile(
        tmp_path,
        """
        name: small-table
        model: {factory: "hf_tiny:small_table"}
        inputs: {ids: {shape: [batch, seq], dtype: int64}}
        dims: {batch: {min: 1, max: 4}, seq: {min: 2, max: 8}}
    """,
    )
    with pytest.raises(ModelError) as e:
        build(path, tmp_path / "out")
    assert "IndexError" in str(e.value) and "the sample values (drawn from each integer input's `range`)" in str(
        e.value
    )


def test_an_export_failure_explains_first_and_quotes_torch_once_with_a_log(tmp_path):
    path = profile(
        tmp_path,
        VIT_RANGE.replace("height: {min: 16, max: 256}", "height: {min: 16, max: 64}").replace(
            "width: {min: 16, max: 256}", "width: {min: 16, max: 64}"
        ),
    )
    with pytest.raises(ExportError) as e:
        build(path, tmp_path / "out", jobs=1)
    text = str(e.value)
    assert text.index("what to change:") < text.index("torch says")
    log = Path(re.search(r"all of it in (\S+?)\):", text).group(1))
    assert "Traceback" in log.read_text()
    assert "Traceback" not in text
