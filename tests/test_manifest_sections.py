"""Every section of the manifest has its own parser: a malformed field anywhere, in a real built
manifest, is refused by ``loader.load()`` as an ``ArtifactError`` naming the section and the field,
never a KeyError, TypeError or AttributeError on the way (before the parsers were split, a bad
``check.measure`` or ``check.references`` entry loaded and failed later, where it was read)."""

from __future__ import annotations

import json
import os
import shutil
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

import loader
from loader import ArtifactError
from loader.manifest import CheckRecord, Measurement, Reference, parse_manifest
from loader.serving.batch_plan import batch_plan

WEIGHTS = "weights.safetensors"
# What the build's measurement writes for a static variant it keeps (padding a batch to it pays).
MEASURED = {
    "variant": "static-1",
    "dims": {"batch": 2, "seq": 8},
    "static_ms": 1.0,
    "dynamic_ms": 3.0,
    "against": "dynamic-0",
    "speedup": 3.0,
    "kept": True,
}
# A batching section the tagger's shapes allow, so that its fields can be corrupted one by one too.
BATCHING = {"dim": "batch", "pad": ["seq"], "pad_value": {"ids": 0, "mask": 0}, "checked": {"samples": 3}}
CUDA = {
    "torch_cuda": "12.8",
    "capability": "9.0",
    "archs": ["9.0"],
    "multi_arch": False,
    "cuda_graphs": False,
    "device_name": "H200",
}


def _set(path: str, value: Any) -> Callable[[dict], None]:
    """An edit that sets the field at ``path`` (dots and [i] as in the error messages)."""

    def edit(m: dict) -> None:
        keys = [int(k) if k.isdigit() else k for k in path.replace("[", ".").replace("]", "").split(".")]
        for k in keys[:-1]:
            m = m[k]
        m[keys[-1]] = value

    return edit


def _drop(path: str) -> Callable[[dict], None]:
    def edit(m: dict) -> None:
        keys = [int(k) if k.isdigit() else k for k in path.replace("[", ".").replace("]", "").split(".")]
        for k in keys[:-1]:
            m = m[k]
        del m[keys[-1]]

    return edit


def _first_constant(m: dict) -> str:
    return next(iter(m["constants"]))


# case id -> (edit, the place the error must name)
CASES: dict[str, tuple[Callable[[dict], None], str]] = {
    # the document and its header
    "format_version-a-string": (_set("format_version", "1"), "format_version"),
    "name-an-int": (_set("name", 5), "name"),
    "name-uppercase": (_set("name", "Tiny Tagger"), "name"),
    "torch_version-null": (_set("torch_version", None), "torch_version"),
    "precompile_version-a-list": (_set("precompile_version", []), "precompile_version"),
    "created-an-object": (_set("created", {}), "created"),
    "version-a-string": (_set("version", "2"), "version"),
    "expires-an-int": (_set("expires", 5), "expires"),
    # target
    "target-device-unknown": (_set("target.device", "tpu"), "target.device"),
    "target-cpu_capability-int": (_set("target.cpu_capability", 1), "target.cpu_capability"),
    "target-aoti_cpu_isa-null": (_set("target.aoti_cpu_isa", None), "target.aoti_cpu_isa"),
    "target-platform-list": (_set("target.platform", []), "target.platform"),
    "target-machine-missing": (_drop("target.machine"), "target"),
    "target-extra-key": (_set("target.gpu", "x"), "target"),
    # dims
    "dims-a-list": (_set("dims", []), "dims"),
    "dims-seq-a-list": (_set("dims.seq", [4, 32]), "dims.seq"),
    "dims-seq-min-a-string": (_set("dims.seq.min", "4"), "dims.seq[0]"),
    "dims-seq-min-above-max": (_set("dims.seq.min", 40), "dims.seq"),
    "dims-name-not-an-identifier": (_set("dims.not-a-name", {"min": 1, "max": 2}), "dims.not-a-name"),
    # inputs
    "inputs-an-object": (_set("inputs", {}), "inputs"),
    "inputs-name-an-int": (_set("inputs[0].name", 3), "inputs[0].name"),
    "inputs-dtype-unknown": (_set("inputs[0].dtype", "float128"), "inputs[0].dtype"),
    "inputs-shape-unknown-dim": (_set("inputs[0].shape[1]", "width"), "inputs[0].shape[1]"),
    "inputs-shape-negative": (_set("inputs[0].shape[1]", -3), "inputs[0].shape[1]"),
    "inputs-range-a-string": (_set("inputs[0].range", "all"), "inputs[0].range"),
    # output
    "output-kind-unknown": (_set("output.kind", "set"), "output.kind"),
    "output-items-a-string": (_set("output.items", "x"), "output.items"),
    "output-item-an-int": (_set("output.items[0]", 3), "output.items[0]"),
    # files
    "files-size-a-string": (lambda m: m["files"][WEIGHTS].update(size="1"), f"files.{WEIGHTS}.size"),
    "files-sha256-short": (lambda m: m["files"][WEIGHTS].update(sha256="abc"), f"files.{WEIGHTS}.sha256"),
    "files-entry-a-list": (lambda m: m["files"].update({WEIGHTS: []}), f"files.{WEIGHTS}"),
    "files-without-weights": (lambda m: m["files"].pop(WEIGHTS), "files"),
    # constants
    "constants-dtype-unknown": (lambda m: m["constants"][_first_constant(m)].update(dtype="x"), "constants.{c}.dtype"),
    "constants-shape-negative": (
        lambda m: m["constants"][_first_constant(m)].update(shape=[-1]),
        "constants.{c}.shape[0]",
    ),
    "constants-entry-null": (lambda m: m["constants"].update({_first_constant(m): None}), "constants.{c}"),
    # variants
    "variants-empty": (_set("variants", []), "variants"),
    "variant-id-not-an-id": (_set("variants[0].id", "Bad Id"), "variants[0].id"),
    "variant-kind-unknown": (_set("variants[0].kind", "frozen"), "variants[0].kind"),
    "variant-file-an-int": (_set("variants[0].file", 3), "variants[0].file"),
    "variant-dims-missing-one": (_drop("variants[0].dims.seq"), "variants[0].dims"),
    "variant-dims-a-string": (_set("variants[0].dims.seq", "16"), "variants[0].dims.seq"),
    "variant-hint-a-string": (_set("variants[0].hint.seq", "16"), "variants[0].hint.seq"),
    "variant-constants-an-int": (_set("variants[0].constants", 5), "variants[0].constants"),
    "variant-constant-an-int": (_set("variants[0].constants[0]", 5), "variants[0].constants[0]"),
    "variant-device-unknown": (_set("variants[0].device", "tpu"), "variants[0].device"),
    "variant-dtype-unknown": (_set("variants[0].dtype", "x"), "variants[0].dtype"),
    "variant-constant_prefix-an-int": (_set("variants[0].constant_prefix", 1), "variants[0].constant_prefix"),
    "variant-embedded_constants-a-string": (
        _set("variants[0].embedded_constants", "yes"),
        "variants[0].embedded_constants",
    ),
    "variant-precision-unknown": (_set("variants[0].precision", "fp8"), "variants[0].precision"),
    "variant-fp32-with-a-gate": (_set("variants[0].gate", {"kept": True}), "variants[0]"),
    # a dynamic variant's warm-up shapes (variants[2]: dynamic-0, batch [1,8], seq [4,16])
    "variant-warm-an-object": (_set("variants[2].warm", {}), "variants[2].warm"),
    "variant-warm-too-many": (_set("variants[2].warm", [{"batch": 1, "seq": 4}] * 65), "variants[2].warm"),
    "variant-warm-missing-a-dim": (_set("variants[2].warm", [{"batch": 1}]), "variants[2].warm[0]"),
    "variant-warm-a-string-size": (_set("variants[2].warm", [{"batch": "1", "seq": 4}]), "variants[2].warm[0].batch"),
    "variant-warm-outside-its-range": (_set("variants[2].warm", [{"batch": 1, "seq": 30}]), "variants[2].warm[0].seq"),
    "variant-warm-on-a-static-variant": (_set("variants[0].warm", [{"batch": 1, "seq": 16}]), "variants[0].warm"),
    # check
    "check-a-list": (_set("check", []), "check"),
    "check-extra-key": (_set("check.surprise", 1), "check"),
    "check-shapes-a-string": (_set("check.shapes", "10"), "check.shapes"),
    "check-max_abs_error-negative": (_set("check.max_abs_error", -1), "check.max_abs_error"),
    "check-plan-an-int": (_set("check.plan", 3), "check.plan"),
    "check-tuning-of-ints": (_set("check.tuning", [1]), "check.tuning[0]"),
    "check-precision-a-string": (_set("check.precision", "x"), "check.precision"),
    # check.references
    "references-an-object": (_set("check.references", {}), "check.references"),
    "reference-a-string": (_set("check.references[0]", "x"), "check.references[0]"),
    "reference-without-variant": (_drop("check.references[0].variant"), "check.references[0]"),
    "reference-unknown-variant": (_set("check.references[0].variant", "gone"), "check.references[0].variant"),
    "reference-dims-a-string": (_set("check.references[0].dims.seq", "4"), "check.references[0].dims.seq"),
    "reference-dims-unknown-dim": (_set("check.references[0].dims.width", 4), "check.references[0].dims.width"),
    "reference-inputs-of-ints": (_set("check.references[0].inputs", [1]), "check.references[0].inputs[0]"),
    "reference-outputs-a-string": (_set("check.references[0].outputs", "x"), "check.references[0].outputs"),
    "reference-tolerance-a-single": (
        _set("check.references[0].tolerance[0]", [1e-5]),
        "check.references[0].tolerance[0]",
    ),
    "reference-tolerance-negative": (
        _set("check.references[0].tolerance[0]", [-1, 0]),
        "check.references[0].tolerance[0][0]",
    ),
    "reference-tolerance-one-short": (
        lambda m: m["check"]["references"][0]["tolerance"].pop(),
        "check.references[0].tolerance",
    ),
    "reference-device-unknown": (_set("check.references[0].device", "tpu"), "check.references[0].device"),
    "reference-accuracy-metric-an-int": (
        _set("check.references[0].accuracy", [{"metric": 3, "threshold": 1}]),
        "check.references[0].accuracy[0].metric",
    ),
    "reference-accuracy-one-short": (
        _set("check.references[0].accuracy", [{"metric": "cosine", "threshold": 0.99}]),
        "check.references[0].accuracy",
    ),
    # build_value: what the variant reached on the reference input on the build host (verify --run)
    "reference-build_value-a-string": (
        _set("check.references[0].accuracy[0].build_value", "0.99"),
        "check.references[0].accuracy[0].build_value",
    ),
    "reference-build_value-nan": (
        _set("check.references[0].accuracy[0].build_value", float("nan")),
        "check.references[0].accuracy[0].build_value",
    ),
    "reference-build_value-a-cosine-above-one": (
        _set("check.references[0].accuracy[0].build_value", 1.5),
        "check.references[0].accuracy[0].build_value",
    ),
    "reference-build_value-a-negative-max_abs": (
        _set("check.references[0].accuracy[0]", {"metric": "max_abs", "threshold": 0.1, "build_value": -0.5}),
        "check.references[0].accuracy[0].build_value",
    ),
    "reference-build_value-of-an-equal-output": (
        _set("check.references[0].accuracy[0]", {"metric": "equal", "threshold": 1.0, "build_value": 1.0}),
        "check.references[0].accuracy[0].build_value",
    ),
    # check.measure: what the batcher decides padding on
    "measure-an-object": (_set("check.measure", {}), "check.measure"),
    "measure-entry-a-list": (_set("check.measure[0]", []), "check.measure[0]"),
    "measure-without-kept": (_drop("check.measure[0].kept"), "check.measure[0]"),
    "measure-variant-an-int": (_set("check.measure[0].variant", 3), "check.measure[0].variant"),
    "measure-dims-a-list": (_set("check.measure[0].dims", []), "check.measure[0].dims"),
    "measure-static_ms-a-string": (_set("check.measure[0].static_ms", "fast"), "check.measure[0].static_ms"),
    "measure-dynamic_ms-negative": (_set("check.measure[0].dynamic_ms", -1), "check.measure[0].dynamic_ms"),
    "measure-against-null": (_set("check.measure[0].against", None), "check.measure[0].against"),
    "measure-speedup-null": (_set("check.measure[0].speedup", None), "check.measure[0].speedup"),
    "measure-kept-a-string": (_set("check.measure[0].kept", "yes"), "check.measure[0].kept"),
    # policy, pad_value, output_dims
    "policy-a-list": (_set("policy", []), "policy"),
    "policy-unknown": (_set("policy.seq", "stretch"), "policy.seq"),
    "policy-unknown-dim": (_set("policy.width", "pad"), "policy.width"),
    "pad_value-a-string": (_set("pad_value.mask", "zero"), "pad_value.mask"),
    "pad_value-unknown-input": (_set("pad_value.extra", 0), "pad_value.extra"),
    "pad_value-outside-the-range": (_set("pad_value.ids", -5), "pad_value.ids"),
    "output_dims-a-string": (_set("output_dims", "x"), "output_dims"),
    "output_dims-one-short": (lambda m: m["output_dims"].pop(), "output_dims"),
    "output_dims-unknown-dim": (_set("output_dims[0][1]", "width"), "output_dims[0][1]"),
    # cuda
    "cuda-a-string": (_set("cuda", "x"), "cuda"),
    "cuda-capability-a-word": (_set("cuda", {**CUDA, "capability": "nine"}), "cuda.capability"),
    "cuda-archs-of-ints": (_set("cuda", {**CUDA, "archs": [9]}), "cuda.archs[0]"),
    "cuda-multi_arch-a-string": (_set("cuda", {**CUDA, "multi_arch": "no"}), "cuda.multi_arch"),
    # batching (inserted valid by the fixture)
    "batching-a-list": (_set("batching", []), "batching"),
    "batching-dim-unknown": (_set("batching.dim", "width"), "batching.dim"),
    "batching-pad-of-ints": (_set("batching.pad", [1]), "batching.pad[0]"),
    "batching-pad_value-a-list": (_set("batching.pad_value", []), "batching.pad_value"),
    "batching-pad_value-a-string": (_set("batching.pad_value.mask", "zero"), "batching.pad_value.mask"),
    "batching-checked-a-list": (_set("batching.checked", []), "batching.checked"),
}


@pytest.fixture(scope="module")
def tagger_manifest(tagger_build) -> dict:
    """The tagger's manifest (static and dynamic variants, measurements, references, pad and split
    policies), with a batching section and, on its first reference, an accuracy rule per output."""
    m = json.loads((tagger_build.path / "manifest.json").read_text())
    assert m["check"]["references"] and m["policy"] and m["output_dims"]
    m["batching"] = BATCHING
    m["check"]["measure"] = [MEASURED]  # the suite's builds skip timing
    outputs = m["check"]["references"][0]["outputs"]
    m["check"]["references"][0]["accuracy"] = [{"metric": "cosine", "threshold": 0.99} for _ in outputs]
    return m


def _artifact_with(src: Path, dst: Path, manifest: dict) -> Path:
    """``src``'s files hard-linked at ``dst`` (no copy of the compiled code), under ``manifest``."""
    shutil.copytree(src, dst, copy_function=os.link)
    (dst / "manifest.json").unlink()  # a link to the original: never write through it
    (dst / "manifest.json").write_text(json.dumps(manifest))
    return dst


def test_the_untouched_manifest_loads_with_its_sections_typed(tagger_build, tagger_manifest, tmp_path):
    model = loader.load(_artifact_with(tagger_build.path, tmp_path / "a", tagger_manifest))
    check = model.manifest.check
    assert isinstance(check, CheckRecord)
    assert all(isinstance(e, Measurement) for e in check.measure) and check.measure
    assert all(isinstance(e, Reference) for e in check.references) and check.references
    assert {e.variant for e in check.references} <= {v.id for v in model.variants}
    assert model.manifest.batching is not None and model.manifest.batching.pad == ("seq",)
    assert batch_plan(model).pad_to == {(8,): {2: (1.0, 3.0)}}  # the batcher reads the typed measurement
    assert json.loads(model.manifest.to_json())["check"] == tagger_manifest["check"]  # written back as read


@pytest.mark.parametrize("case", list(CASES))
def test_a_malformed_field_is_refused_naming_its_section_and_field(tagger_build, tagger_manifest, tmp_path, case):
    edit, place = CASES[case]
    m = json.loads(json.dumps(tagger_manifest))
    place = place.format(c=_first_constant(m))
    edit(m)
    folder = _artifact_with(tagger_build.path, tmp_path / "a", m)
    with pytest.raises(ArtifactError) as refused:
        loader.load(folder)
    assert f"manifest.json: {place}: " in str(refused.value)


def test_the_build_side_record_is_checked_as_the_loader_checks_it():
    """``CheckRecord.from_dict`` (what the build assembles) refuses what ``parse_manifest`` would."""
    with pytest.raises(ArtifactError, match=r"check\.measure\[0\]\.kept: expected true or false"):
        CheckRecord.from_dict(
            {
                "measure": [
                    {
                        "variant": "s",
                        "dims": {},
                        "static_ms": 1,
                        "dynamic_ms": 2,
                        "against": "d",
                        "speedup": 2,
                        "kept": 1,
                    }
                ]
            }
        )
    assert not CheckRecord.from_dict({}) and CheckRecord.from_dict({}).to_dict() == {}


def test_parse_manifest_names_the_field_without_a_folder(tagger_manifest):
    m = json.loads(json.dumps(tagger_manifest))
    del m["check"]["measure"][0]["static_ms"]
    with pytest.raises(ArtifactError, match=r"^manifest\.json: check\.measure\[0\]: missing key\(s\) \['static_ms'\]"):
        parse_manifest(json.dumps(m))
