"""Host compatibility, fed with recorded facts of other machines, and `precompile verify`."""

from __future__ import annotations

import dataclasses
import hashlib
import json
import shutil
from pathlib import Path

import pytest
import torch
from click.testing import CliRunner
from safetensors.torch import load_file, save_file

import loader
import loader.host
import loader.model
from loader import IncompatibleArtifactError
from loader.artifact import read_manifest
from loader.host import HostFacts, compatibility_problems, host_facts
from precompile.cli import main
from precompile.ship.sign import sign

X86_BASE = {"sse", "sse2", "sse3", "ssse3", "sse4_1", "sse4_2", "popcnt", "avx", "bmi", "bmi2", "lzcnt"}
# Recorded from real machines (torch.cpu.get_capabilities() names; only the features that matter here).
HASWELL = HostFacts("2.13.0+cpu", "linux", "x86_64", "AVX2", frozenset(X86_BASE | {"avx2", "fma3", "f16c"}))
SKYLAKE_SP = HostFacts(
    "2.13.0+cpu",
    "linux",
    "x86_64",
    "AVX512",
    frozenset(X86_BASE | {"avx2", "fma3", "f16c", "avx512_f", "avx512_cd", "avx512_dq", "avx512_bw", "avx512_vl"}),
)
SAPPHIRE_RAPIDS = HostFacts(
    "2.13.0+cpu",
    "linux",
    "x86_64",
    "AVX512",
    SKYLAKE_SP.cpu_features | {"avx512_vnni", "avx512_bf16", "amx_tile", "amx_bf16", "amx_int8"},
)
GRAVITON3 = HostFacts(
    "2.13.0", "linux", "aarch64", "SVE256", frozenset({"neon", "fp16_arith", "bf16", "sve", "i8mm", "dot"})
)


def built_for(manifest, isa: str, capability: str = "AVX512", **target):
    return dataclasses.replace(
        manifest, target=dataclasses.replace(manifest.target, aoti_cpu_isa=isa, cpu_capability=capability, **target)
    )


@pytest.fixture(scope="module")
def manifest(classifier_artifact):
    m = read_manifest(classifier_artifact)
    return dataclasses.replace(
        m, torch_version="2.13.0+cpu", target=dataclasses.replace(m.target, platform="linux", machine="x86_64")
    )


def test_an_avx512_build_is_refused_on_an_avx2_host_with_what_it_needs(manifest):
    problems = compatibility_problems(built_for(manifest, "AVX512 AVX512_VNNI"), "cpu", HASWELL)
    assert problems == [
        "cpu: the code was compiled for AVX512 AVX512_VNNI and needs avx512_bw, avx512_dq, avx512_f, avx512_vl, "
        "avx512_vnni, which this CPU lacks (it offers AVX2); rebuild with cpu: {isa: [x86-64-v3, x86-64-v4]} for "
        "portable code, or for this CPU, e.g. on a build host with ATEN_CPU_CAPABILITY=avx2"
    ]


@pytest.mark.parametrize(
    "isa, host, ok",
    [
        ("AVX2", HASWELL, True),
        ("AVX2", SAPPHIRE_RAPIDS, True),
        ("AVX512", SKYLAKE_SP, True),
        ("AVX512 AVX512_VNNI", SKYLAKE_SP, False),
        ("AVX512 AVX512_VNNI AMX_TILE", SKYLAKE_SP, False),
        ("AVX512 AVX512_VNNI AMX_TILE", SAPPHIRE_RAPIDS, True),
        ("INVALID_VEC_ISA", HASWELL, True),
    ],
)
def test_the_instruction_set_check(manifest, isa, host, ok):
    assert (compatibility_problems(built_for(manifest, isa), "cpu", host) == []) is ok


def test_an_unknown_instruction_set_is_refused(manifest):
    (problem,) = compatibility_problems(built_for(manifest, "AVX10_2"), "cpu", SAPPHIRE_RAPIDS)
    assert "this loader does not know AVX10_2 and cannot tell whether this CPU runs it" in problem


def test_without_aoti_isa_the_cpu_capability_decides(manifest):
    assert compatibility_problems(built_for(manifest, "", "AVX512"), "cpu", HASWELL) == [
        "cpu: the code was compiled for AVX512, this CPU offers AVX2; rebuild on a host with AVX2"
    ]
    assert compatibility_problems(built_for(manifest, "", "AVX2"), "cpu", SKYLAKE_SP) == []


def test_every_mismatch_is_listed_at_once(manifest):
    problems = compatibility_problems(dataclasses.replace(manifest, torch_version="2.12.1"), "cuda", GRAVITON3)
    assert [p.split(":")[0] for p in problems] == ["device", "torch", "platform"]
    assert "the artifact has no CUDA variants" in problems[0]
    assert "install torch 2.12.x or rebuild the artifact" in problems[1]
    assert problems[2] == "platform: built for linux/x86_64, this host is linux/aarch64"


def test_a_cuda_load_is_checked_against_the_gpus(manifest):
    from loader.cuda import CudaFacts
    from loader.manifest import CudaInfo

    cuda = dataclasses.replace(
        manifest,
        cuda=CudaInfo(torch_cuda="12.8", capability="9.0", archs=("9.0",), multi_arch=False, cuda_graphs=False),
        variants=tuple(dataclasses.replace(v, device="cuda") for v in manifest.variants),
    )
    on = lambda facts: dataclasses.replace(HASWELL, cuda=facts)  # noqa: E731
    assert compatibility_problems(cuda, "cuda", on(CudaFacts("12.8", ((9, 0),), ("H100",)))) == []
    assert "CPU-only build" in compatibility_problems(cuda, "cuda:0", on(CudaFacts(None)))[0]
    (older,) = compatibility_problems(cuda, "cuda", on(CudaFacts("12.8", ((8, 0),), ("A100",))))
    assert older.startswith("cuda: the kernels were built on compute capability 9.0 and hold sm_90a")
    assert compatibility_problems(cuda, "cpu", on(CudaFacts(None))) == [
        "device: the artifact has cuda variants only, asked to load on cpu"
    ]


def test_this_host_runs_what_it_builds(classifier_artifact):
    assert compatibility_problems(read_manifest(classifier_artifact), "cpu", host_facts()) == []


def test_load_refuses_before_any_compiled_code_or_unpacking(
    classifier_artifact, classifier_pack, tmp_path, monkeypatch
):
    if read_manifest(classifier_artifact).target.aoti_cpu_isa in ("AVX2", "INVALID_VEC_ISA"):
        pytest.skip("built on an AVX2 host: an AVX2 host runs it")
    monkeypatch.setattr(
        loader.host, "host_facts", lambda: dataclasses.replace(HASWELL, torch_version=torch.__version__)
    )
    monkeypatch.setattr(loader.model, "open_package", lambda *a, **k: pytest.fail("compiled code opened"))
    monkeypatch.setattr(loader.model, "direct_opener", lambda *a, **k: pytest.fail("compiled code opened"))
    for path in (classifier_artifact, classifier_pack):
        with pytest.raises(
            IncompatibleArtifactError, match=r"cannot run on this host:\n  - cpu: the code was compiled for AVX512"
        ):
            loader.load(path, cache_dir=tmp_path / "cache")
    assert not (tmp_path / "cache").exists()


# --- precompile verify ---------------------------------------------------------------------------


def invoke(*args: str, env: dict | None = None):
    return CliRunner().invoke(main, list(args), catch_exceptions=False, env=env)


def copy(src: Path, dst: Path, edit=None) -> Path:
    shutil.copytree(src, dst)
    if edit is not None:
        manifest = json.loads((dst / "manifest.json").read_text())
        edit(manifest)
        (dst / "manifest.json").write_text(json.dumps(manifest, indent=2))
    return dst


def rows(output: str) -> dict[str, str]:
    out = {}
    for line in output.splitlines():
        parts = line.split(None, 2)
        if len(parts) >= 2 and parts[0] in ("manifest", "integrity", "signature", "expiry", "host", "run"):
            out[parts[0]] = parts[1]
    return out


def test_verify_passes_a_sound_artifact_and_recomputes_its_references(classifier_artifact, tmp_path):
    result = invoke("verify", str(classifier_artifact), "--run", env={"PRECOMPILE_CACHE": str(tmp_path)})
    assert result.exit_code == 0, result.output
    assert rows(result.output) == {
        "manifest": "ok",
        "integrity": "ok",
        "signature": "skip",
        "expiry": "ok",
        "host": "ok",
        "run": "ok",
    }
    assert "reference output(s) recomputed" in result.output


def test_verify_a_signed_pack_with_its_key(classifier_pack, signing_keys, tmp_path):
    packed = tmp_path / "a.tar.zst"
    shutil.copy(classifier_pack, packed)
    sign(packed, signing_keys[0])
    result = invoke(
        "verify", str(packed), "--key", str(signing_keys[1]), "--run", env={"PRECOMPILE_CACHE": str(tmp_path / "c")}
    )
    assert result.exit_code == 0, result.output
    assert rows(result.output)["signature"] == "ok" and "signed by trusted key" in result.output


def test_verify_fails_an_unsigned_artifact_when_given_a_key(classifier_artifact, signing_keys):
    result = invoke("verify", str(classifier_artifact), "--key", str(signing_keys[1]))
    assert result.exit_code == 1
    assert rows(result.output)["signature"] == "FAIL"
    assert "Error: " in result.output and "1 check(s) failed: signature" in result.output


def test_verify_reports_a_corrupt_file_and_does_not_run_it(classifier_artifact, tmp_path):
    folder = copy(classifier_artifact, tmp_path / "a")
    package = folder / "variants" / "dynamic.pt2"
    data = bytearray(package.read_bytes())
    data[len(data) // 2] ^= 1
    package.write_bytes(bytes(data))
    result = invoke("verify", str(folder), "--run")
    assert result.exit_code == 1
    assert rows(result.output) == {
        "manifest": "ok",
        "integrity": "FAIL",
        "signature": "skip",
        "expiry": "ok",
        "host": "ok",
        "run": "skip",
    }
    assert "variants/dynamic.pt2 does not match its sha256" in result.output


def test_verify_reports_every_failing_check(classifier_artifact, tmp_path):
    folder = copy(
        classifier_artifact,
        tmp_path / "a",
        lambda m: m.update(torch_version="2.1.0", expires="2021-01-01T00:00:00+00:00"),
    )
    result = invoke("verify", str(folder))
    assert rows(result.output)["host"] == "FAIL" and rows(result.output)["expiry"] == "FAIL"
    assert "2 check(s) failed: expiry, host" in result.output


def test_verify_an_unreadable_manifest(tmp_path):
    (tmp_path / "manifest.json").write_text("{")
    result = invoke("verify", str(tmp_path))
    assert result.exit_code == 1
    assert rows(result.output) == {
        "manifest": "FAIL",
        "integrity": "skip",
        "signature": "skip",
        "expiry": "skip",
        "host": "skip",
        "run": "skip",
    }


def _rewrite_references(folder: Path, change) -> None:
    path = folder / "references.safetensors"
    tensors = load_file(path)
    change(tensors)
    save_file(tensors, str(path))
    manifest = json.loads((folder / "manifest.json").read_text())
    data = path.read_bytes()
    manifest["files"]["references.safetensors"] = {"size": len(data), "sha256": hashlib.sha256(data).hexdigest()}
    (folder / "manifest.json").write_text(json.dumps(manifest, indent=2))


def test_verify_run_catches_outputs_that_differ_from_the_references(classifier_artifact, tmp_path):
    if "references.safetensors" not in read_manifest(classifier_artifact).files:
        pytest.skip("this build writes no references")
    folder = copy(classifier_artifact, tmp_path / "a")
    _rewrite_references(folder, lambda t: t.update({k: v + 1 for k, v in t.items() if "/out/" in k}))
    result = invoke("verify", str(folder), "--run")
    assert result.exit_code == 1
    assert rows(result.output)["run"] == "FAIL"
    assert "differs from the reference by up to 1.00e+00" in result.output


def test_verify_run_without_references_runs_every_variant(classifier_artifact, tmp_path):
    def drop(manifest):
        manifest["files"].pop("references.safetensors", None)
        manifest.setdefault("check", {}).pop("references", None)

    folder = copy(classifier_artifact, tmp_path / "a", drop)
    result = invoke("verify", str(folder), "--run")
    assert result.exit_code == 0, result.output
    assert "no reference outputs for cpu in this artifact; ran each of 1 variant(s) on its hint shape" in result.output
