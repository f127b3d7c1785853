"""Traffic back into profiles: the recorder writes what a model saw, `precompile profile merge` folds
it into a profile's distribution without disturbing the rest of the file."""

from __future__ import annotations

import json
import os
import time

import pytest
import torch
from click.testing import CliRunner

import loader
from loader.serving.traffic import TrafficFileError, TrafficRecorder, read_histogram
from precompile.authoring.merge import MergeError, merge_traffic
from precompile.cli import main
from precompile.profile import load_profile
from precompile.traffic import read_distribution

from .conftest import write_profile


def call(model, batch, seq):
    model(torch.zeros(batch, seq, dtype=torch.int64), torch.ones(batch, seq, dtype=torch.bool))


def lines(path):
    return [json.loads(line) for line in path.read_text().splitlines()]


@pytest.fixture(scope="module")
def model(classifier_artifact):
    return loader.load(classifier_artifact)


# --- recording -------------------------------------------------------------------------------


def test_recorder_writes_the_histogram_most_frequent_first(model, tmp_path):
    model.reset_stats()
    for batch, seq in [(1, 8), (2, 16), (2, 16), (2, 16), (1, 8)]:
        call(model, batch, seq)
    path = tmp_path / "traffic.jsonl"
    with TrafficRecorder(model, path, interval=None):
        pass
    assert path.read_text() == (
        '{"dims": {"batch": 2, "seq": 16}, "count": 3}\n{"dims": {"batch": 1, "seq": 8}, "count": 2}\n'
    )


def test_recorder_writes_on_its_interval(model, tmp_path):
    model.reset_stats()
    path = tmp_path / "traffic.jsonl"
    recorder = TrafficRecorder(model, path, interval=0.05)
    try:
        call(model, 3, 5)
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline and not (path.exists() and lines(path)):
            time.sleep(0.02)
        assert lines(path) == [{"dims": {"batch": 3, "seq": 5}, "count": 1}]
    finally:
        recorder.close()


def test_recorder_adds_to_what_the_file_held(model, tmp_path):
    """A restarted process goes on counting."""
    path = tmp_path / "traffic.jsonl"
    path.write_text('{"dims": {"seq": 5, "batch": 3}, "count": 10}\n{"dims": {"batch": 8, "seq": 48}, "count": 1}\n')
    model.reset_stats()
    call(model, 3, 5)
    TrafficRecorder(model, path, interval=None).close()
    assert lines(path) == [
        {"dims": {"batch": 3, "seq": 5}, "count": 11},
        {"dims": {"batch": 8, "seq": 48}, "count": 1},
    ]


def test_recorder_path_takes_the_process_id(model, tmp_path):
    recorder = TrafficRecorder(model, tmp_path / "traffic-{pid}.jsonl", interval=None)
    recorder.close()
    assert recorder.path == tmp_path / f"traffic-{os.getpid()}.jsonl" and recorder.path.exists()


@pytest.mark.parametrize(
    "text, message",
    [
        ('{"dims": {"batch": 1}, "count": 2}\nnot json\n', ":2: not valid JSON"),
        ('{"dims": {"batch": 1}}\n', ':1: expected {"dims": {...}, "count": N}'),
        ('{"dims": {"batch": 1}, "count": -1}\n', ':1: "count" must be an integer >= 0, got -1'),
        ('{"dims": {"batch": "1"}, "count": 1}\n', ':1: dims.batch must be a size (an integer >= 0), got "1"'),
        (
            '{"dims": {"batch": 1}, "count": 1}\n\n{"dims": {"seq": 1}, "count": 1}\n',
            ":3: dims seq differ from the earlier lines' (batch)",
        ),
    ],
    ids=["json", "no-count", "negative", "string-size", "other-dims"],
)
def test_bad_traffic_lines_are_named_by_file_and_line(tmp_path, text, message):
    path = tmp_path / "t.jsonl"
    path.write_text(text)
    with pytest.raises(TrafficFileError) as info:
        read_histogram(path)
    assert str(info.value).startswith(str(path)) and message in str(info.value)


# --- merging ---------------------------------------------------------------------------------

PROFILE = """\
# yaml-language-server: $schema=../schema.json
name: tiny-classifier                 # the artifact's name
model: {factory: "tiny:classifier", kwargs: {vocab: 50, width: 16}}
inputs:
  ids:  {shape: [batch, seq], dtype: int64, range: [0, 49]}   # token ids
  mask: {shape: [batch, seq], dtype: bool}
dims:
  batch: {min: 1, max: 8}
  seq:   {min: 2, max: 48}
distribution:
  shapes:
    - {batch: 1, seq: 8, count: 100}   # from the launch week
    - {batch: 4, seq: 32, count: 5}
check: {random_shapes: 6}
"""


def traffic(path, *entries):
    path.write_text("".join(json.dumps({"dims": {"batch": b, "seq": s}, "count": c}) + "\n" for b, s, c in entries))
    return path


def test_merge_sums_counts_and_keeps_the_rest_of_the_file(tmp_path):
    profile = write_profile(tmp_path, PROFILE)
    a = traffic(tmp_path / "a.jsonl", (1, 8, 10), (2, 16, 7))
    b = traffic(tmp_path / "b.jsonl", (2, 16, 3), (3, 3, 20))
    result = merge_traffic(profile, [a, b])
    assert (result.calls, result.shapes, result.added, result.updated) == (40, 3, 2, 1)
    assert profile.read_text() == PROFILE.replace(
        "    - {batch: 1, seq: 8, count: 100}   # from the launch week\n    - {batch: 4, seq: 32, count: 5}\n",
        "    - {batch: 1, seq: 8, count: 110}   # from the launch week\n"
        "    - {batch: 4, seq: 32, count: 5}\n"
        "    - {batch: 3, seq: 3, count: 20}\n"
        "    - {batch: 2, seq: 16, count: 10}\n",
    )
    assert read_distribution(load_profile(profile)) == {(1, 8): 110, (4, 32): 5, (3, 3): 20, (2, 16): 10}


def test_merge_leaves_the_comment_that_opens_the_next_section_in_place(tmp_path):
    text = PROFILE.replace("check: {random_shapes: 6}", "\n# Checks against eager\ncheck: {random_shapes: 6}")
    profile = write_profile(tmp_path, text)
    merge_traffic(profile, [traffic(tmp_path / "a.jsonl", (2, 16, 7))])
    assert profile.read_text() == text.replace("count: 5}\n", "count: 5}\n    - {batch: 2, seq: 16, count: 7}\n")


def test_merge_adds_a_distribution_when_there_is_none(tmp_path):
    text = PROFILE.split("distribution:")[0] + "check: {random_shapes: 6}\n"
    profile = write_profile(tmp_path, text)
    merge_traffic(profile, [traffic(tmp_path / "a.jsonl", (2, 16, 7))])
    assert profile.read_text() == text + "distribution:\n  shapes:\n    - {batch: 2, seq: 16, count: 7}\n"


def test_merge_output_writes_beside_and_leaves_the_profile(tmp_path):
    profile = write_profile(tmp_path, PROFILE)
    out = tmp_path / "profile.next.yaml"
    merge_traffic(profile, [traffic(tmp_path / "a.jsonl", (2, 16, 7))], output=out, replace=True)
    assert profile.read_text() == PROFILE
    assert read_distribution(load_profile(out)) == {(2, 16): 7}
    assert "# from the launch week" not in out.read_text() and "# token ids" in out.read_text()


def test_merge_output_elsewhere_is_refused(tmp_path):
    profile = write_profile(tmp_path / "p", PROFILE)
    with pytest.raises(MergeError, match="must be in the profile's folder"):
        merge_traffic(profile, [traffic(tmp_path / "a.jsonl", (2, 16, 7))], output=tmp_path / "elsewhere.yaml")


def test_merge_refuses_traffic_of_another_model(tmp_path):
    profile = write_profile(tmp_path, PROFILE)
    other = tmp_path / "other.jsonl"
    other.write_text('{"dims": {"batch": 2}, "count": 4}\n')
    with pytest.raises(MergeError, match=r"other.jsonl:1: records dims batch; the profile's dims are batch, seq"):
        merge_traffic(profile, [other])
    assert profile.read_text() == PROFILE


def test_merge_keeps_shapes_outside_the_ranges_and_counts_them(tmp_path):
    profile = write_profile(tmp_path, PROFILE)
    result = merge_traffic(profile, [traffic(tmp_path / "a.jsonl", (2, 64, 9), (2, 16, 1))])
    assert result.outside == 9
    assert read_distribution(load_profile(profile))[(2, 64)] == 9


def test_merge_keeps_the_files_own_indentation(tmp_path):
    text = (
        'name: tiny-classifier\nmodel:\n    factory: "tiny:classifier"\n'
        "inputs:\n    x: {shape: [batch], dtype: float32}\ndims:\n    batch: {min: 1, max: 8}\n"
    )
    profile = write_profile(tmp_path, text)
    recorded = tmp_path / "a.jsonl"
    recorded.write_text('{"dims": {"batch": 2}, "count": 3}\n')
    merge_traffic(profile, [recorded])
    assert profile.read_text() == text + "distribution:\n    shapes:\n        - {batch: 2, count: 3}\n"


def test_cli_merge(tmp_path):
    profile = write_profile(tmp_path, PROFILE)
    a = traffic(tmp_path / "a.jsonl", (2, 16, 7), (2, 64, 1))
    result = CliRunner().invoke(main, ["profile", "merge", str(profile), str(a)], catch_exceptions=False)
    assert result.exit_code == 0
    assert f"{profile}: 8 calls over 2 shapes from 1 file(s) (2 new, 0 updated)" in result.output
    assert "1 calls lie outside the profile's dim ranges" in result.output


def test_cli_merge_bad_file_is_one_clear_error(tmp_path):
    profile = write_profile(tmp_path, PROFILE)
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"dims": {"batch": 1, "seq": 4}, "count": 1}\n{"dims": {"batch": 1, "seq": 4}, "count": 1.5}\n')
    result = CliRunner().invoke(main, ["profile", "merge", str(profile), str(bad)], catch_exceptions=False)
    assert result.exit_code == 1
    assert f'Error: {bad}:2: "count" must be an integer >= 0, got 1.5' in result.output
    assert "Traceback" not in result.output and profile.read_text() == PROFILE


def test_serve_record_merge_loop(model, tmp_path):
    """What serving records, merge reads: the profile's distribution then holds the served shapes."""
    model.reset_stats()
    for batch, seq in [(1, 12), (1, 12), (4, 30)]:
        call(model, batch, seq)
    recorded = tmp_path / "traffic.jsonl"
    TrafficRecorder(model, recorded, interval=None).close()
    profile = write_profile(tmp_path, PROFILE)
    merge_traffic(profile, [recorded], replace=True)
    assert read_distribution(load_profile(profile)) == {(1, 12): 2, (4, 30): 1}


def test_rewritten_files_are_not_private(model, tmp_path):
    """Written through temporary files (private by default), published readable like any file."""
    profile = write_profile(tmp_path, PROFILE)
    merge_traffic(profile, [traffic(tmp_path / "a.jsonl", (2, 16, 7))])
    recorded = tmp_path / "new.jsonl"
    TrafficRecorder(model, recorded, interval=None).close()
    assert profile.stat().st_mode & 0o777 == 0o644 and recorded.stat().st_mode & 0o777 == 0o644


def test_merge_help():
    result = CliRunner().invoke(main, ["profile", "merge", "--help"], catch_exceptions=False)
    assert result.exit_code == 0 and "Fold recorded traffic files into PROFILE's distribution.shapes." in result.output
