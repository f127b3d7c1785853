"""The call guards in process: value ranges of integer inputs, what counts as a plain tensor, the
refusal of a policy dim; and the build side that finds the tables integer inputs index.

Calls here are refused before compiled code runs; the ones that crashed the process before the
guards existed are also run in subprocesses by tests/test_fuzz_calls.py.
"""

from __future__ import annotations

import json
import shutil

import pytest
import torch
import torch.nn.functional as F

import loader
from loader import GuardError
from loader.errors import ArtifactError
from loader.manifest import parse_manifest
from precompile.analysis.value_ranges import index_tables, with_value_ranges
from precompile.errors import ProfileError
from precompile.pipeline import build
from precompile.profile import Profile
from precompile.stages.resolve import explain_eager_failure

from .conftest import CLASSIFIER_PROFILE, write_profile
from .test_fuzz_calls import Marked, Wrapper, _no_storage


@pytest.fixture(scope="module")
def classifier(classifier_artifact):
    return loader.load(classifier_artifact)


def ids_mask(batch=2, seq=6, value=None):
    ids = torch.randint(0, 50, (batch, seq), generator=torch.Generator().manual_seed(0))
    if value is not None:
        ids[1, 3] = value
    return ids, torch.ones(batch, seq, dtype=torch.bool)


# --- value ranges --------------------------------------------------------------------------------


def test_the_manifest_records_the_range_of_integer_inputs_only(classifier):
    ids, mask = classifier.manifest.inputs
    assert (ids.range.min, ids.range.max) == (0, 49)
    assert mask.range is None
    raw = json.loads((classifier.path / "manifest.json").read_text())
    assert raw["inputs"][0]["range"] == [0, 49] and "range" not in raw["inputs"][1]


@pytest.mark.parametrize("value", [50, -1, 1000, 10**11, -(2**63), 2**63 - 1])
def test_a_value_outside_the_range_is_refused_naming_input_value_and_range(classifier, value):
    with pytest.raises(GuardError) as e:
        classifier(*ids_mask(value=value))
    assert e.value.reason == "value_range"
    assert str(e.value) == f"input 'ids': value {value} at [1, 3] is outside the valid range [0, 49]"


def test_values_at_both_ends_of_the_range_are_served(classifier):
    ids, mask = ids_mask()
    ids[0, 0], ids[1, 5] = 0, 49
    assert classifier(ids, mask).shape == (2, 3)


def test_a_manifest_without_ranges_still_loads_and_serves(classifier_artifact, tmp_path):
    folder = tmp_path / "old"
    shutil.copytree(classifier_artifact, folder)
    raw = json.loads((folder / "manifest.json").read_text())
    for item in raw["inputs"]:
        item.pop("range", None)
    (folder / "manifest.json").write_text(json.dumps(raw))
    model = loader.load(folder)
    assert model.manifest.inputs[0].range is None
    assert model(*ids_mask()).shape == (2, 3)


@pytest.mark.parametrize(
    "edit, message",
    [
        (
            lambda m: m["inputs"][1].update(range=[0, 1]),
            r"inputs\[1\].range: a value range is for integer inputs, this one is bool",
        ),
        (lambda m: m["inputs"][0].update(range=[5, 1]), r"inputs\[0\].range: min 5 > max 1"),
        (lambda m: m["inputs"][0].update(range=[0, 2**60]), r"inputs\[0\].range\[1\]: 1152921504606846976 is outside"),
        (lambda m: m["inputs"][0].update(range=[0.5, 3]), r"inputs\[0\].range\[0\]: expected an integer, got float"),
        (lambda m: m["inputs"][0].update(range=[0]), r"inputs\[0\].range: expected \[min, max\]"),
        (
            lambda m: m.update(policy={"seq": "pad"}, pad_value={"ids": 50}, output_dims=[[None, None]]),
            r"pad_value.ids: 50 is outside the input's value range \[0, 49\]",
        ),
    ],
    ids=["bool", "reversed", "huge", "float", "one-number", "pad-outside"],
)
def test_a_bad_value_range_in_a_manifest_is_refused(classifier_artifact, edit, message):
    raw = json.loads((classifier_artifact / "manifest.json").read_text())
    edit(raw)
    with pytest.raises(ArtifactError, match=message):
        parse_manifest(json.dumps(raw))


def test_a_value_outside_the_range_is_422_over_http(classifier_artifact):
    from precompile.serve.app import create_app
    from precompile.serve.config import ServeConfig

    from .test_serve import AppClient, readiness

    with AppClient(create_app(ServeConfig(str(classifier_artifact), max_body_bytes=64 * 1024))) as client:
        assert readiness(client).status_code == 200  # the model loads in the background
        response = client.post("/predict", json={"inputs": {"ids": [[1, 2, -1]], "mask": [[True] * 3]}})
    assert response.status_code == 422
    assert response.json()["reason"] == "value_range"
    assert "input 'ids': value -1 at [0, 2] is outside the valid range [0, 49]" in response.json()["detail"]


# --- plain tensors only --------------------------------------------------------------------------


TENSOR_CASES = {
    "wrapper-subclass": (
        lambda t: Wrapper(t),
        "tensor_subclass",
        "a tests.test_fuzz_calls.Wrapper (a torch.Tensor subclass)",
    ),
    "python-subclass": (lambda t: t.as_subclass(Marked), "tensor_subclass", "a tests.test_fuzz_calls.Marked"),
    "neg-view": (lambda t: torch._neg_view(t), "neg_view", "a lazy negative view"),
    "conj-view": (lambda t: torch.complex(t.float(), t.float()).conj(), "conj_view", "a lazy conjugate view"),
    "meta": (lambda t: t.to("meta"), "meta", "a meta tensor has no data"),
    "sparse-coo": (lambda t: t.to_sparse(), "layout", "layout is sparse_coo"),
    "sparse-csr": (lambda t: t.to_sparse_csr(), "layout", "layout is sparse_csr"),
    "nested": (lambda t: torch.nested.nested_tensor([t[0], t[1, :3]]), "nested", "a nested tensor"),
    "quantized": (
        lambda t: torch.quantize_per_tensor(t.float(), 1.0, 0, torch.quint8),
        "quantized",
        "a quantized tensor",
    ),
    "storage-resized-away": (_no_storage, "no_storage", "tensor has no storage holding its 12 elements"),
    "not-a-tensor": (lambda t: t.tolist(), "not_a_tensor", "expected a torch.Tensor, got list"),
}


@pytest.mark.parametrize("case", sorted(TENSOR_CASES))
def test_only_plain_strided_tensors_with_storage_reach_compiled_code(classifier, case):
    make, reason, message = TENSOR_CASES[case]
    ids, mask = ids_mask()
    with pytest.raises(GuardError) as e:
        classifier(make(ids), mask)
    assert e.value.reason == reason
    assert str(e.value).startswith(f"input 'ids': {message}")


def test_mkldnn_tensors_are_refused_as_a_layout(structured_artifact):
    model = loader.load(structured_artifact)
    with pytest.raises(GuardError) as e:
        model(torch.randn(3, 8).to_mkldnn())
    assert e.value.reason == "layout" and "layout is _mkldnn" in str(e.value)


def test_parameters_and_tensors_that_require_grad_are_served(structured_artifact):
    model = loader.load(structured_artifact)
    x = torch.randn(3, 8)
    want = model(x)["hidden"]
    assert torch.equal(model(torch.nn.Parameter(x.clone()))["hidden"], want)
    assert torch.equal(model(x.clone().requires_grad_())["hidden"], want)


# --- policy dims ---------------------------------------------------------------------------------


def test_a_policy_dim_refusal_says_which_sizes_are_served(tagger_build):
    model = loader.load(tagger_build.path)
    with pytest.raises(GuardError) as e:
        model(torch.zeros(0, 8, dtype=torch.long), torch.ones(0, 8, dtype=torch.bool))
    assert e.value.reason == "out_of_range"
    assert str(e.value) == (
        "input 'ids': dim 'batch' (axis 0) is 0; the artifact serves any size ≥ 1 on that dim "
        "(the built range [1, 8], other sizes through its out_of_range policy)"
    )


# --- the build: tables, derived and declared ranges ----------------------------------------------


class Indexes(torch.nn.Module):
    """One integer input per way of indexing a table, and one that indexes nothing."""

    def __init__(self):
        super().__init__()
        self.words = torch.nn.Embedding(10, 4)
        self.small = torch.nn.Embedding(5, 4)
        self.register_buffer("grid", torch.randn(3, 7))

    def forward(self, flat, picks, where, twice, plain):
        a = self.words(flat.reshape(2, -1)).sum()  # through a view
        b = self.grid.index_select(1, picks).sum()  # along axis 1: 7
        c = torch.gather(self.grid, 0, where.unsqueeze(0).expand(3, -1)).sum()  # axis 0: 3
        d = (self.words(twice) + F.embedding(twice, self.small.weight)).sum()  # the smaller table: 5
        return a + b + c + d + plain.float().sum()


INDEXES_PROFILE = Profile.model_validate(
    {
        "name": "indexes",
        "model": {"factory": "x:y"},
        "inputs": {
            "flat": {"shape": [4], "dtype": "int64"},
            "picks": {"shape": [2], "dtype": "int64"},
            "where": {"shape": [2], "dtype": "int64"},
            "twice": {"shape": [2], "dtype": "int32", "range": [0, 4]},
            "plain": {"shape": [2], "dtype": "int64"},
        },
    }
)


def test_the_build_finds_the_tables_integer_inputs_index():
    args = (
        torch.tensor([1, 2, 3, 4]),
        torch.tensor([0, 6]),
        torch.tensor([0, 2]),
        torch.tensor([1, 4], dtype=torch.int32),
        torch.tensor([7, 8]),
    )
    ep = torch.export.export(Indexes(), args, strict=False)
    tables = index_tables(ep, INDEXES_PROFILE)
    assert {name: (t.rows, t.op) for name, t in tables.items()} == {
        "flat": (10, "embedding"),
        "picks": (7, "index_select"),
        "where": (3, "gather"),
        "twice": (5, "embedding"),
    }


def test_undeclared_ranges_come_from_the_tables_and_an_unguarded_input_is_a_warning(tmp_path):
    from precompile.analysis.value_ranges import IndexTable
    from precompile.profile import LoadedProfile

    loaded = LoadedProfile(profile=INDEXES_PROFILE, path=tmp_path / "p.yaml")
    tables = {"flat": IndexTable(10, "embedding"), "twice": IndexTable(5, "embedding")}
    out, notes = with_value_ranges(loaded, tables)
    ranges = {name: spec.range for name, spec in out.profile.inputs.items()}
    assert ranges == {"flat": (0, 9), "picks": None, "where": None, "twice": (0, 4), "plain": None}
    warnings = [text for level, text in notes if level == "warning"]
    assert len(warnings) == 3 and warnings[0].startswith("inputs.picks: an int64 input with no range")
    assert "its values are not checked at the call" in warnings[0]


def test_a_declared_range_past_the_table_is_a_profile_error_before_compiling(tmp_path):
    profile = write_profile(tmp_path, CLASSIFIER_PROFILE.replace("range: [0, 49]", "range: [0, 50]"))
    with pytest.raises(ProfileError) as e:
        build(profile, tmp_path / "out")
    assert e.value.problems == [
        ("inputs.ids.range", "[0, 50] goes past the embedding table of 50 rows (valid 0..49): narrow it")
    ]
    assert not (tmp_path / "out").exists()


def test_a_range_past_the_table_is_named_even_when_samples_stay_inside(tmp_path):
    """The samples need not hit the bad values: every variant's export is checked before its compile."""
    from precompile.executors.worker import compile_unit
    from precompile.profile import load_profile
    from precompile.stages.plan import make_plan
    from precompile.stages.resolve import resolve_model
    from precompile.units import CompileTask

    loaded = load_profile(write_profile(tmp_path, CLASSIFIER_PROFILE.replace("range: [0, 49]", "range: [-1, 49]")))
    with pytest.raises(ProfileError, match=r"inputs.ids.range: \[-1, 49\] goes past the embedding table of 50 rows"):
        compile_unit(
            loaded, resolve_model(loaded), CompileTask(make_plan(loaded).variants[0], 0, {}, "v.pt2"), tmp_path
        )
    assert not list(tmp_path.rglob("*.pt2"))


def test_an_eager_failure_with_ranges_inside_the_tables_is_left_as_it_is(tmp_path):
    from precompile.profile import load_profile
    from precompile.stages.resolve import resolve_model

    loaded = load_profile(write_profile(tmp_path, CLASSIFIER_PROFILE))
    assert explain_eager_failure(loaded, resolve_model(loaded), {"batch": 2, "seq": 4}) is None


@pytest.mark.parametrize(
    "inputs, policy, problem",
    [
        (
            {"ids": {"shape": ["n"], "dtype": "int64", "range": [0, 9.5]}},
            {},
            ("inputs.ids.range", "[0, 9.5]: an int64 input's range needs whole numbers"),
        ),
        (
            {"ids": {"shape": ["n"], "dtype": "uint8", "range": [-1, 9]}},
            {},
            ("inputs.ids.range", "[-1, 9] goes past what uint8 values can be here ([0, 255])"),
        ),
        (
            {"ids": {"shape": ["n"], "dtype": "int64", "range": [0, 2**60]}},
            {},
            (
                "inputs.ids.range",
                "[0, 1.15292e+18] goes past what int64 values can be here ([-9007199254740992, 9007199254740992])",
            ),
        ),
        (
            {"ids": {"shape": ["n"], "dtype": "int64", "range": [1, 9]}},
            {"out_of_range": {"n": "pad"}},
            ("policy.pad_value.ids", "0 is outside inputs.ids.range [1, 9]"),
        ),
    ],
    ids=["fraction", "uint8-negative", "past-json", "pad-default-outside"],
)
def test_integer_ranges_are_checked_in_the_profile(inputs, policy, problem):
    from precompile.profile import semantic_problems

    profile = Profile.model_validate(
        {
            "name": "p",
            "model": {"factory": "x:y"},
            "inputs": inputs,
            "dims": {"n": {"min": 2, "max": 8}},
            "outputs": [{"shape": ["n"]}],
            "policy": policy,
        }
    )
    assert problem in semantic_problems(profile)


@pytest.mark.integration
def test_an_undeclared_range_comes_from_the_embedding_table(tmp_path, build_cache):
    from precompile.progress import Progress

    class Notes(Progress):
        def __init__(self):
            self.lines = []

        def note(self, text):
            self.lines.append(text)

    progress = Notes()
    profile = write_profile(tmp_path, CLASSIFIER_PROFILE.replace(", range: [0, 49]", ""))
    result = build(profile, tmp_path / "out", progress=progress, cache=build_cache)  # the classifier's compile
    assert result.manifest.inputs[0].range is not None
    assert (result.manifest.inputs[0].range.min, result.manifest.inputs[0].range.max) == (0, 49)
    assert "inputs.ids: values guarded to [0, 49], the embedding table of 50 rows (valid 0..49)" in progress.lines
    with pytest.raises(GuardError, match="value 50 at"):
        loader.load(result.path)(*ids_mask(value=50))


def test_warmup_calls_stay_inside_the_value_ranges(classifier_artifact, tmp_path):
    """Warm-up inputs must pass the value guard: 0 is outside a range like MiniLM's [1000, 29999]."""
    copy = tmp_path / "artifact"
    shutil.copytree(classifier_artifact, copy)
    manifest = json.loads((copy / "manifest.json").read_text())
    for spec in manifest["inputs"]:
        if spec["name"] == "ids":
            spec["range"] = [5, 49]
    (copy / "manifest.json").write_text(json.dumps(manifest))
    model = loader.load(copy)
    model.warmup()
    with pytest.raises(GuardError, match="value 0 at"):
        model(torch.zeros(1, 4, dtype=torch.long), torch.ones(1, 4, dtype=torch.bool))
