"""Portable CPU artifacts: a profile's ``cpu.isa`` builds every CPU variant once per x86-64 level, the
compiler told exactly that level; the loader serves the best one the host runs.

One build per session (a small classifier, one dynamic variant, for x86-64-v3 and x86-64-v4). This
host has AVX-512; the AVX2 host is this one with its AVX-512 features hidden from the loader, the way
tests/test_precision.py hides bf16 and VNNI: the v3 code then really runs here, and is checked
against eager.
"""

from __future__ import annotations

import dataclasses
import json
import re
import shutil
import subprocess
import zipfile
from pathlib import Path

import numpy as np
import pytest
import torch

import loader
import loader.host
import loader.model as loader_model
import loader.native.model as native_model
from loader.errors import ArtifactError, IncompatibleArtifactError
from loader.host import HostFacts
from loader.isa import LEVELS, choose_isa, missing_features
from loader.manifest import parse_manifest
from precompile.errors import PrecompileError, ProfileError
from precompile.pipeline import build
from precompile.profile import load_profile

from .conftest import builds, write_profile

PROFILE = """
name: portable
model: {factory: "tiny:classifier", kwargs: {vocab: 50, width: 64}}
inputs:
  ids:  {shape: [batch, seq], dtype: int64, range: [0, 49]}
  mask: {shape: [batch, seq], dtype: bool}
dims:
  batch: {min: 1, max: 4}
  seq:   {min: 2, max: 16}
plan: {max_specialized: 0}
check: {random_shapes: 2}
cpu: {isa: [x86-64-v3, x86-64-v4]}
"""

AVX512 = re.compile(r"^avx512|^amx|^avx10")
# Mnemonics of AVX-512 extensions beyond x86-64-v4 (VNNI, BF16, IFMA, VBMI/VBMI2, BITALG, VPOPCNTDQ,
# FP16, VP2INTERSECT): what -march=native on this EPYC would allow and x86-64-v4 does not.
BEYOND_V4 = re.compile(
    r"^(vpdpbusds?|vpdpwssds?|vcvtne2ps2bf16|vcvtneps2bf16|vdpbf16ps|vpmadd52[lh]uq|vpermb|vpermi2b|vpermt2b|"
    r"vpmultishiftqb|vpcompress[bw]|vpexpand[bw]|vpshl?dv?[wdq]|vpshrdv?[wdq]|vpopcnt[bwdq]|vpshufbitqmb|"
    r"vp2intersect[dq]|v\w+ph|v\w+sh)$"
)
LEGACY_PREFIXES = {0x66, 0x67, 0xF2, 0xF3, 0x2E, 0x3E, 0x26, 0x64, 0x65, 0x36}
INSTRUCTION = re.compile(r"^\s*[0-9a-f]+:\s+((?:[0-9a-f]{2} )+)\s*(\S+)\s*(.*)$")


@pytest.fixture(scope="session")
@builds
def portable(tmp_path_factory):
    """The build checks each variant against eager on this host, so a v4 variant is built only where
    AVX-512 runs: on an AVX2-only host (an AMD EPYC before Zen 4) the tests of the built artifact are
    skipped, saying so; those that need no build (refusals, the loader's choice) still run."""
    lacking = missing_features("x86-64-v4", loader.host.cpu_features())
    if lacking:
        pytest.skip(f"this host lacks {', '.join(lacking)}: x86-64-v4 variants cannot be built and checked here")
    folder = tmp_path_factory.mktemp("portable")
    return build(write_profile(folder, PROFILE), folder / "artifact")


def eager_classifier():
    import importlib.util

    spec = importlib.util.spec_from_file_location("tiny_eager", Path(__file__).parent / "models" / "tiny.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module.classifier(vocab=50, width=64)


def inputs(batch: int, seq: int, seed: int = 3):
    gen = torch.Generator().manual_seed(seed)
    return torch.randint(0, 50, (batch, seq), generator=gen), torch.ones(batch, seq, dtype=torch.bool)


def hide(monkeypatch, features: frozenset[str]) -> None:
    """Make the loaders see a CPU with only ``features`` (torch's and the torch-free one's facts)."""
    real = loader.host.host_facts()
    fake = dataclasses.replace(real, cpu_features=features, cpu_capability="AVX2")
    for module in (loader.host, loader_model):
        monkeypatch.setattr(module, "host_facts", lambda: fake)
    monkeypatch.setattr(native_model, "host_facts", lambda torch: fake)


def without_avx512() -> frozenset[str]:
    return frozenset(f for f in loader.host.host_facts().cpu_features if not AVX512.match(f))


def instructions(package: Path) -> list[tuple[bytes, str, str]]:
    """(bytes, mnemonic, operands) of every instruction objdump finds in the package's shared library."""
    if shutil.which("objdump") is None:
        pytest.fail("objdump (binutils) is needed to read the compiled code")
    with zipfile.ZipFile(package) as z:
        member = next(n for n in z.namelist() if n.endswith(".so"))
        library = package.with_suffix(".so")
        library.write_bytes(z.read(member))
    listing = subprocess.run(["objdump", "-d", "-w", str(library)], capture_output=True, text=True, check=True).stdout
    out = []
    for line in listing.splitlines():
        m = INSTRUCTION.match(line)
        if m:
            out.append((bytes.fromhex(m.group(1).replace(" ", "")), m.group(2), m.group(3)))
    return out


def avx512_in(found: list[tuple[bytes, str, str]]) -> list[str]:
    """The instructions that need AVX-512: EVEX-encoded (0x62 after the legacy prefixes; in 64-bit
    mode 0x62 is nothing else), or naming zmm, mask or upper-16 vector registers."""
    hits = []
    for raw, mnemonic, operands in found:
        body = raw.lstrip(bytes(LEGACY_PREFIXES))
        if (body[:1] == b"\x62" and mnemonic != "(bad)") or re.search(
            r"%zmm|%k[0-7]|%[xy]mm(1[6-9]|2\d|3[01])\b", operands
        ):
            hits.append(f"{mnemonic} {operands}")
    return hits


# --- the build ---------------------------------------------------------------------------------


def test_each_variant_is_built_once_per_isa_with_its_features(portable):
    by_id = {v.id: v for v in portable.manifest.variants}
    assert set(by_id) == {"dynamic-v3", "dynamic-v4"}
    for vid, isa in (("dynamic-v3", "x86-64-v3"), ("dynamic-v4", "x86-64-v4")):
        assert by_id[vid].isa == isa
        assert by_id[vid].cpu_features == LEVELS[isa]
        assert not by_id[vid].embedded_constants  # no freezing: nothing packed for the build host's CPU
    assert "avx512_f" in LEVELS["x86-64-v4"] and "avx512_f" not in LEVELS["x86-64-v3"]
    raw = json.loads((portable.path / "manifest.json").read_text())
    assert [v["isa"] for v in raw["variants"]] == ["x86-64-v3", "x86-64-v4"]


def test_the_avx2_variant_holds_no_avx512_instruction(portable):
    v3 = instructions(portable.path / "variants" / "dynamic-v3.pt2")
    v4 = instructions(portable.path / "variants" / "dynamic-v4.pt2")
    assert len(v3) > 1000
    assert avx512_in(v3) == []
    assert any("%ymm" in operands for _, _, operands in v3)  # vectorized, with AVX2
    assert avx512_in(v4)  # the scan finds AVX-512 where there is some


def test_the_avx512_variant_holds_nothing_beyond_x86_64_v4(portable):
    found = instructions(portable.path / "variants" / "dynamic-v4.pt2")
    assert sorted({m for _, m, _ in found if BEYOND_V4.match(m)}) == []


def test_each_package_records_the_vector_isa_of_its_level(portable):
    from loader.aoti import open_package

    isas = {
        v.id: open_package(str(portable.path / v.file)).get_metadata()["AOTI_CPU_ISA"]
        for v in portable.manifest.variants
    }
    # AVX512, not the AVX512 AVX512_VNNI (and -mavx512bf16) Inductor picks at 512 bits on this EPYC.
    assert isas == {"dynamic-v3": "AVX2", "dynamic-v4": "AVX512"}


def test_the_pinned_vector_isa_is_the_levels_alone():
    from torch._inductor import config, cpu_vec_isa

    from precompile.cpu_isa import pinned_vector_isa

    with config.patch({"cpp.simdlen": 512}):
        with pinned_vector_isa("x86-64-v4"):
            picked = cpu_vec_isa.pick_vec_isa()
            assert (str(picked), picked.build_arch_flags()) == (
                "avx512",
                "-mavx512f -mavx512dq -mavx512vl -mavx512bw -mfma",
            )
        if {"avx512_vnni", "avx512_bf16"} & loader.host.host_facts().cpu_features:
            assert cpu_vec_isa.pick_vec_isa().build_arch_flags() != picked.build_arch_flags()  # what pinning avoids
    with config.patch({"cpp.simdlen": 256}), pinned_vector_isa("x86-64-v3"):
        assert cpu_vec_isa.pick_vec_isa().build_arch_flags() == "-mavx2 -mfma -mf16c"


def test_inspect_names_each_variants_isa(portable):
    from click.testing import CliRunner

    from precompile.cli import main

    result = CliRunner().invoke(main, ["inspect", str(portable.path)], catch_exceptions=False)
    assert result.exit_code == 0, result.output
    assert re.search(r"dynamic-v3 .*\[x86-64-v3\]", result.output)
    assert re.search(r"dynamic-v4 .*\[x86-64-v4\]", result.output)


def test_every_unit_of_a_level_compiles_for_it_unfrozen(tmp_path):
    from precompile.stages.plan import make_plan
    from precompile.stages.targets import compile_tasks, expand_precisions, expand_targets

    text = PROFILE + "precision: [fp32, bf16]\ncompile: {tune: {preset: cpu}}\n"
    profile = load_profile(write_profile(tmp_path, text)).profile
    variants = expand_precisions(
        expand_targets(make_plan(load_profile(tmp_path / "profile.yaml")), ("cpu",), profile), profile
    )
    tasks = compile_tasks(variants, profile.compile.candidates())
    assert sorted({t.vp.id for t in tasks}) == ["bf16-dynamic-v3", "bf16-dynamic-v4", "dynamic-v3", "dynamic-v4"]
    for t in tasks:  # the preset's freezing candidate and bf16's freezing too: no prepacking for the build host
        width = {"x86-64-v3": 256, "x86-64-v4": 512}[t.vp.isa]
        assert (t.options["cpp.march"], t.options["cpp.simdlen"], t.options["freezing"]) == (t.vp.isa, width, False)


def test_a_levels_tuning_trials_record_the_options_it_compiled_with(tmp_path):
    from precompile.stages.targets import compile_tasks
    from precompile.stages.tune import tune_variants
    from precompile.units import CompiledPackage, CompiledUnit, CompiledUnits, VariantPlan

    profile = load_profile(write_profile(tmp_path, PROFILE)).profile
    vp = VariantPlan(
        "dynamic-v3", "dynamic", {"batch": (1, 4), "seq": (2, 16)}, {"batch": 2, "seq": 8}, isa="x86-64-v3"
    )
    candidates = [{}, {"freezing": True}, {"max_autotune": True}]
    tasks = compile_tasks([vp], candidates)
    assert [t.candidate for t in tasks] == [0, 2]  # {freezing: true} compiles as {} for a level: once
    units = []
    for t in tasks:
        (tmp_path / t.file).write_bytes(b"")
        units.append(CompiledUnit(vp, CompiledPackage(tmp_path / t.file, {}, {}), 1.0, t.candidate))
    result = tune_variants(
        profile,
        torch.nn.Identity(),
        [vp],
        CompiledUnits(tuple(units)),
        candidates,
        {},
        open_runner=lambda package, device: None,
        measure_unit=lambda runner, unit, shapes: (1.0 + unit.candidate, 0.0),
        measure_first=lambda runner, unit, fresh: None,
    )
    assert [(t.options["freezing"], t.options["cpp.march"]) for t in result.trials] == [(False, "x86-64-v3")] * 3
    assert result.trials[1].error == "compiles as candidate 0 for x86-64-v3"
    assert [u.candidate for u in result.kept] == [0]


def test_a_build_host_without_a_level_is_refused_before_compiling(tmp_path, monkeypatch):
    import precompile.stages.targets as targets

    monkeypatch.setattr(targets, "cpu_features", without_avx512)
    with pytest.raises(
        PrecompileError, match=r"cpu\.isa\[1\]: x86-64-v4 needs avx512_f, avx512_bw, .*which this build host"
    ):
        build(write_profile(tmp_path, PROFILE), tmp_path / "out")
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize(
    "isa, message",
    [
        ("[]", "cpu.isa: name at least one instruction set"),
        ("[x86-64-v3, x86-64-v3]", "cpu.isa[1]: x86-64-v3 is listed twice"),
        ("[x86-64-v5]", "cpu.isa[0]: 'x86-64-v5' is not one of: 'native', 'x86-64-v3' or 'x86-64-v4'"),
    ],
)
def test_a_bad_isa_list_is_the_profiles_error(tmp_path, isa, message):
    path = write_profile(tmp_path, PROFILE.replace("[x86-64-v3, x86-64-v4]", isa))
    with pytest.raises(ProfileError) as e:
        load_profile(path)
    assert message in str(e.value)


def test_the_default_is_native(tmp_path):
    assert load_profile(
        write_profile(tmp_path, PROFILE.replace("cpu: {isa: [x86-64-v3, x86-64-v4]}", ""))
    ).profile.cpu.isa == ["native"]


# --- the loader --------------------------------------------------------------------------------


def test_the_avx512_host_serves_the_v4_variants(portable):
    model = loader.load(portable.path)
    assert model.cpu_isa == "x86-64-v4"
    assert [v.id for v in model.variants] == ["dynamic-v4"]
    ids, mask = inputs(2, 7)
    got, variant = model.call_detailed(ids, mask)
    assert variant == "dynamic-v4"
    with torch.no_grad():
        torch.testing.assert_close(got, eager_classifier().eval()(ids, mask), atol=1e-4, rtol=1e-4)


def test_an_avx2_host_serves_the_v3_variants_and_they_match_eager(portable, monkeypatch):
    eager = eager_classifier().eval()
    hide(monkeypatch, without_avx512())
    model = loader.load(portable.path)
    assert model.cpu_isa == "x86-64-v3"
    assert [v.id for v in model.variants] == ["dynamic-v3"]
    for batch, seq in ((1, 2), (3, 9), (4, 16)):
        ids, mask = inputs(batch, seq)
        got, variant = model.call_detailed(ids, mask)
        assert variant == "dynamic-v3"
        with torch.no_grad():
            torch.testing.assert_close(got, eager(ids, mask), atol=1e-4, rtol=1e-4)
    with pytest.raises(IncompatibleArtifactError, match="cpu_isa='x86-64-v4': this CPU cannot run it .*lacks avx512_f"):
        loader.load(portable.path, cpu_isa="x86-64-v4")


def test_the_torch_free_loader_chooses_the_same_way(portable, monkeypatch):
    ids, mask = inputs(2, 5)
    want = loader.load(portable.path, cpu_isa="x86-64-v3")(ids, mask).numpy()
    assert loader.load_native(portable.path).cpu_isa == "x86-64-v4"
    hide(monkeypatch, without_avx512())
    model = loader.load_native(portable.path)
    assert model.cpu_isa == "x86-64-v3"
    assert np.allclose(model(ids.numpy(), mask.numpy()), want, atol=1e-5)


def test_a_host_with_neither_is_refused_naming_both(portable, monkeypatch):
    hide(monkeypatch, frozenset({"sse3", "ssse3", "sse4_1", "sse4_2", "popcnt", "avx"}))
    with pytest.raises(IncompatibleArtifactError) as e:
        loader.load(portable.path)
    text = str(e.value)
    assert "cpu: the artifact has code for x86-64-v4, x86-64-v3; this CPU runs none of them" in text
    assert "it offers no x86-64 level from x86-64-v3 up" in text
    assert "x86-64-v3: it lacks avx2, bmi, bmi2, f16c, fma3, lzcnt" in text
    with pytest.raises(IncompatibleArtifactError, match="runs none of them"):
        loader.load_native(portable.path)


def test_asking_for_an_isa_the_artifact_lacks_is_refused(portable, classifier_artifact):
    with pytest.raises(
        IncompatibleArtifactError, match=r"cpu_isa='native': the artifact has code for x86-64-v4, x86-64-v3 only"
    ):
        loader.load(portable.path, cpu_isa="native")
    assert loader.load(portable.path, cpu_isa="x86-64-v3").cpu_isa == "x86-64-v3"
    assert loader.load(classifier_artifact).cpu_isa is None  # no ISA levels: served as always


# --- choosing, on recorded hosts ----------------------------------------------------------------


CASCADE_LAKE = frozenset(LEVELS["x86-64-v4"]) | {"avx512_vnni"}
HASWELL = frozenset(LEVELS["x86-64-v3"])


def test_choice_on_recorded_hosts(portable):
    variants = portable.manifest.variants
    assert choose_isa(variants, "auto", CASCADE_LAKE, None, "a").isa == "x86-64-v4"
    assert choose_isa(variants, "auto", HASWELL, None, "a").isa == "x86-64-v3"
    assert loader.host.compatibility_problems(portable.manifest, "cpu", host(HASWELL)) == []
    problems = loader.host.compatibility_problems(portable.manifest, "cpu", host(frozenset({"sse3"})))
    assert len(problems) == 1 and "runs none of them" in problems[0]


def host(features: frozenset[str]) -> HostFacts:
    real = loader.host.host_facts()
    return dataclasses.replace(real, cpu_features=features)


# --- the manifest --------------------------------------------------------------------------------


def manifest_with(portable, **change) -> str:
    raw = json.loads((portable.path / "manifest.json").read_text())
    raw["variants"][0].update(change)
    return json.dumps(raw)


def test_a_variant_with_an_isa_must_list_its_features(portable):
    with pytest.raises(ArtifactError, match=r"variants\[0\]\.cpu_features: a variant compiled for x86-64-v3 lists"):
        parse_manifest(manifest_with(portable, cpu_features=[]))
    with pytest.raises(ArtifactError, match=r"variants\[0\]\.isa: 'X86' does not match"):
        parse_manifest(manifest_with(portable, isa="X86"))


def test_a_manifest_without_isas_still_loads(portable):
    raw = json.loads((portable.path / "manifest.json").read_text())
    for v in raw["variants"]:
        del v["isa"], v["cpu_features"]
    assert {v.isa for v in parse_manifest(json.dumps(raw)).variants} == {None}
