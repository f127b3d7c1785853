"""The CLI is a thin skin: help for every command, exit codes, and readable output."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap

import pytest
from click.testing import CliRunner

from precompile import __version__
from precompile.cli import main

COMMANDS = main.list_commands(None)


def invoke(*args: str):
    return CliRunner().invoke(main, list(args), catch_exceptions=False)


@pytest.mark.parametrize("command", COMMANDS)
def test_every_command_has_help(command):
    result = invoke(command, "--help")
    assert result.exit_code == 0
    first_line = main.get_command(None, command).help.split("\n")[0]
    assert " ".join(first_line.split()) in " ".join(result.output.split())


def test_version():
    assert invoke("--version").output.strip() == f"precompile, version {__version__}"


def test_bad_flag_exits_2():
    assert invoke("build", "--no-such-flag", "x.yaml").exit_code == 2


def test_inspect_shows_inputs_ranges_and_files(classifier_artifact):
    result = invoke("inspect", str(classifier_artifact))
    assert result.exit_code == 0
    assert "tiny-classifier" in result.output
    assert "ids          int64     [batch, seq]" in result.output
    assert "seq          [2, 48]" in result.output
    assert "variants/dynamic.pt2" in result.output and "weights.safetensors" in result.output


def test_inspect_lists_the_outputs_and_the_dims_their_axes_follow(tagger_build, structured_artifact):
    result = invoke("inspect", str(tagger_build.path))
    assert result.exit_code == 0
    assert "outputs   (tuple)\n  output.0     [batch, seq, ·]\n  output.1     [batch, ·]\n" in result.output
    result = invoke("inspect", str(structured_artifact))
    names = json.loads((structured_artifact / "manifest.json").read_text())["output"]
    assert (
        result.exit_code == 0
        and f"outputs   ({names['kind']})" in result.output
        and "(axes not recorded)" in result.output
    )
    assert "  hidden " in result.output and "  pair.0 " in result.output and "  pair.1 " in result.output


def test_inspect_json_is_the_manifest(classifier_artifact):
    result = invoke("inspect", str(classifier_artifact), "--json")
    assert json.loads(result.output) == json.loads((classifier_artifact / "manifest.json").read_text())


def test_inspect_missing_artifact_is_a_clean_error(tmp_path):
    result = invoke("inspect", str(tmp_path / "nope"))
    assert result.exit_code == 1
    assert "no such artifact" in result.output and "Traceback" not in result.output


def test_inspect_reads_a_pack_without_unpacking_it(classifier_pack, classifier_artifact):
    result = invoke("inspect", str(classifier_pack), "--json")
    assert result.exit_code == 0
    assert (
        json.loads(result.output)["files"] == json.loads((classifier_artifact / "manifest.json").read_text())["files"]
    )


def test_build_in_a_pipe_says_when_each_stage_and_unit_starts(structured_cli_build):
    """No spinner is drawn in a pipe or a CI log: a line says what started, so a long compile is not
    silence until the variant finishes (the session's `precompile build` of the structured model)."""
    _, output = structured_cli_build
    lines = output.splitlines()
    started = next(i for i, line in enumerate(lines) if line.startswith("… variant  started   dynamic batch∈[1,32]"))
    finished = next(i for i, line in enumerate(lines) if line.startswith("✓ variant"))
    assert started < finished
    assert lines[0].startswith("… profile  started")


@pytest.mark.integration
def test_a_command_importing_transformers_prints_none_of_torchaos_noise(tmp_path):
    """A transformers model class imports torchao, which logs every CUDA extension it cannot load, and
    torch's pytree warns about torchao's enums: every command silences both (here doctor)."""
    (tmp_path / "with_hf.py").write_text(
        textwrap.dedent(
            """
            import torch
            from transformers import GPT2Model  # noqa: F401 (the modeling side: torchao comes with it)

            def linear():
                return torch.nn.Linear(4, 2)
            """
        )
    )
    profile = tmp_path / "profile.yaml"
    profile.write_text(
        textwrap.dedent(
            """
            name: with-hf
            model: {factory: "with_hf:linear"}
            inputs: {x: {shape: [batch, 4], dtype: float32}}
            dims: {batch: {min: 1, max: 4}}
            """
        )
    )
    env = {**os.environ, "OMP_WAIT_POLICY": "PASSIVE"}
    done = subprocess.run(
        [sys.executable, "-m", "precompile", "doctor", str(profile)], capture_output=True, text=True, env=env
    )
    assert done.returncode == 0, done.stderr
    assert "no problem found" in done.stdout
    assert "_C_mxfp8" not in done.stderr and "Failed to load" not in done.stderr
    assert "_pytree" not in done.stderr
