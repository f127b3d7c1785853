"""precompile.build, the Python API: a profile as a path, a dict or a Profile; the model as the
profile's factory, an ExportedProgram or a saved .pt2 program. Every artifact is loaded through the
real loader and compared with eager."""

from __future__ import annotations

import subprocess
import sys
import textwrap

import pytest
import torch
import yaml
from click.testing import CliRunner
from torch.export import Dim

import loader
import precompile
from precompile.cli import main
from precompile.errors import ProfileError
from precompile.pipeline import build as pipeline_build
from precompile.profile import Profile

from .conftest import CLASSIFIER_PROFILE as PROFILE
from .conftest import write_profile
from .models import tiny

# precompile.build from every kind of source: most of these compile, the rest export.
pytestmark = pytest.mark.integration


def as_dict(text: str = PROFILE) -> dict:
    return yaml.safe_load(textwrap.dedent(text))


def without_model(profile: dict) -> dict:
    return {k: v for k, v in profile.items() if k != "model"}


def eager_model() -> torch.nn.Module:
    return tiny.classifier(vocab=50, width=16).eval()  # seeded: the weights the profile's factory makes


def exported(model: torch.nn.Module, *, dynamic: bool = True):
    ids, mask = torch.randint(0, 50, (3, 10)), torch.ones(3, 10, dtype=torch.bool)
    if not dynamic:
        return torch.export.export(model, (ids, mask))
    batch, seq = Dim("batch", min=1, max=8), Dim("seq", min=2, max=48)
    return torch.export.export(model, (ids, mask), dynamic_shapes=({0: batch, 1: seq}, {0: batch, 1: seq}))


def assert_matches_eager(path, model: torch.nn.Module) -> None:
    artifact = loader.load(path)
    for batch, seq in [(1, 2), (3, 17), (8, 48)]:
        ids = torch.randint(0, 50, (batch, seq))
        mask = torch.rand(batch, seq) > 0.3
        torch.testing.assert_close(artifact(ids, mask), model(ids, mask), atol=1e-5, rtol=1e-5)


def test_precompile_build_is_the_pipeline_build_and_import_precompile_stays_light():
    assert precompile.build is pipeline_build
    code = "import sys, precompile; print(sorted(m for m in ('torch', 'pydantic', 'precompile.pipeline') if m in sys.modules))"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]"


def test_build_from_a_path(classifier_build):
    out, result = classifier_build  # the session's classifier: precompile.build(its profile's path, out)
    assert result.path == out and result.manifest.name == "tiny-classifier"
    assert_matches_eager(result.path, eager_model())


# The forms below build the session classifier's model again: each passes the session's build cache,
# so what each form exports is checked, and the compile the classifier's build made is reused.


def test_build_from_a_dict_with_its_folder(tmp_path, build_cache):
    write_profile(tmp_path, PROFILE)  # tiny.py beside it: the factory is imported from the folder
    result = precompile.build(as_dict(), tmp_path / "out", folder=tmp_path, cache=build_cache)
    assert_matches_eager(result.path, eager_model())


def test_build_from_a_profile_object(tmp_path, monkeypatch, build_cache):
    write_profile(tmp_path, PROFILE)
    monkeypatch.chdir(tmp_path)  # a Profile's folder defaults to the current directory
    result = precompile.build(Profile.model_validate(as_dict()), tmp_path / "out", cache=build_cache)
    assert_matches_eager(result.path, eager_model())


def test_build_from_an_exported_program(tmp_path, build_cache):
    model = eager_model()
    result = precompile.build(without_model(as_dict()), tmp_path / "out", program=exported(model), cache=build_cache)
    assert_matches_eager(result.path, model)


def test_build_from_a_saved_program_in_compile_workers(tmp_path):
    """Two variants and two jobs: each compiles in a worker process, which reads the .pt2 file."""
    model = eager_model()
    torch.export.save(exported(model), tmp_path / "model.pt2")
    profile = {**without_model(as_dict()), "plan": {"ranges": {"seq": [16]}}}
    result = precompile.build(profile, tmp_path / "out", program=tmp_path / "model.pt2", jobs=2)
    assert len(result.manifest.variants) == 2
    assert_matches_eager(result.path, model)


def test_the_cli_builds_from_a_saved_program(tmp_path, build_cache):
    model = eager_model()
    torch.export.save(exported(model), tmp_path / "model.pt2")
    (tmp_path / "profile.yaml").write_text(yaml.safe_dump(without_model(as_dict())))
    args = [
        "build",
        str(tmp_path / "profile.yaml"),
        "--program",
        str(tmp_path / "model.pt2"),
        "-o",
        str(tmp_path / "out"),
        "--cache",
        str(build_cache),
    ]
    result = CliRunner().invoke(main, args, catch_exceptions=False)
    assert result.exit_code == 0, result.output
    assert "exported program" in result.output  # the resolve stage's line: where the model came from
    assert_matches_eager(tmp_path / "out", model)


def test_a_factory_returning_a_loaded_program_builds(tmp_path, build_cache):
    """``torch.export.load(...).module()`` refuses eval(): the build takes it as it is."""
    model = eager_model()
    torch.export.save(exported(model), tmp_path / "model.pt2")
    (tmp_path / "saved.py").write_text(
        "import torch\n\ndef program():\n    return torch.export.load(__file__.replace('saved.py', 'model.pt2')).module()\n"
    )
    profile = {**as_dict(), "model": {"factory": "saved:program"}}
    result = precompile.build(profile, tmp_path / "out", folder=tmp_path, cache=build_cache)
    assert_matches_eager(result.path, model)


def test_a_bad_dict_is_refused_as_the_same_file_is(tmp_path):
    bad = as_dict()
    bad["inputs"]["mask"]["shape"] = ["batch", "sq"]
    bad["dims"]["seq"]["min"] = 600
    path = tmp_path / "bad.yaml"
    path.write_text(yaml.safe_dump(bad))
    with pytest.raises(ProfileError) as from_file:
        precompile.build(path, tmp_path / "out")
    with pytest.raises(ProfileError) as from_dict:
        precompile.build(bad, tmp_path / "out")
    assert from_dict.value.problems == from_file.value.problems
    assert ("inputs.mask.shape[1]", "unknown dim 'sq' (known: batch, seq)") in from_dict.value.problems
    assert str(from_dict.value).splitlines()[1:] == str(from_file.value).splitlines()[1:]
    assert not (tmp_path / "out").exists()


def test_a_profile_without_a_factory_needs_a_program(tmp_path):
    with pytest.raises(ProfileError) as info:
        precompile.build(without_model(as_dict()), tmp_path / "out")
    assert info.value.problems[0][0] == "model.factory"
    assert "exported program" in info.value.problems[0][1]


def test_a_program_that_fixes_a_dynamic_dim_is_refused_naming_the_input_and_dim(tmp_path):
    with pytest.raises(ProfileError) as info:
        precompile.build(without_model(as_dict()), tmp_path / "out", program=exported(eager_model(), dynamic=False))
    places = dict(info.value.problems)
    assert "the program fixes batch to 3" in places["inputs.ids.shape[0]"]
    assert "Dim('seq', min=2, max=48)" in places["inputs.mask.shape[1]"]
    assert not (tmp_path / "out").exists()


def test_a_program_narrower_than_the_profile_is_refused(tmp_path):
    model = eager_model()
    ids, mask = torch.randint(0, 50, (3, 10)), torch.ones(3, 10, dtype=torch.bool)
    batch, seq = Dim("batch", min=1, max=4), Dim("seq", min=2, max=48)
    ep = torch.export.export(model, (ids, mask), dynamic_shapes=({0: batch, 1: seq}, {0: batch, 1: seq}))
    with pytest.raises(ProfileError) as info:
        precompile.build(without_model(as_dict()), tmp_path / "out", program=ep)
    assert dict(info.value.problems)["inputs.ids.shape[0]"].startswith(
        "the program serves batch in [1, 4], the profile declares [1, 8]"
    )
