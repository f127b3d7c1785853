"""The CUDA target, as far as it can be checked without a GPU: profile options, manifest fields,
compatibility decisions from recorded device facts, the CPU side of a mixed artifact, and clear
errors on a host without CUDA. Tests that need a GPU are marked and skip elsewhere."""

from __future__ import annotations

import json
import shutil
import time
from dataclasses import replace

import pytest
import torch
from click.testing import CliRunner

import loader
from loader import IncompatibleArtifactError
from loader.cuda import CodeObject, CudaFacts, cuda_problems, derived_kernels, parse_device, runs_on
from loader.manifest import CudaInfo, parse_manifest
from precompile.cli import main
from precompile.errors import ProfileError
from precompile.pipeline import build
from precompile.profile import load_profile

from .conftest import STRUCTURED_PROFILE, write_profile

needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
no_cuda = pytest.mark.skipif(torch.cuda.is_available(), reason="checks the behaviour of a host without CUDA")

STRUCTURED = STRUCTURED_PROFILE

H100 = CudaInfo(torch_cuda="12.8", capability="9.0", archs=("9.0",), multi_arch=False, cuda_graphs=False)
H100_PTX = CudaInfo(torch_cuda="12.8", capability="9.0", archs=("9.0",), multi_arch=True, cuda_graphs=False)
A100_FACTS = CudaFacts("12.8", ((8, 0),), ("NVIDIA A100",))
H200_FACTS = CudaFacts("12.8", ((9, 0), (9, 0)), ("NVIDIA H200", "NVIDIA H200"))
B200_FACTS = CudaFacts("12.8", ((10, 0),), ("NVIDIA B200",))


def test_profile_accepts_cuda_options_and_target_lists(tmp_path):
    text = (
        STRUCTURED
        + "target: [cpu, cuda]\ncuda: {dtype: bfloat16, arch: ['9.0'], multi_arch: true, cuda_graphs: true}\n"
    )
    profile = load_profile(write_profile(tmp_path, text)).profile
    assert profile.targets == ("cpu", "cuda")
    assert profile.cuda.dtype == "bfloat16" and profile.cuda.cuda_graphs


def test_profile_refuses_bad_cuda_options(tmp_path):
    with pytest.raises(ProfileError, match="cuda.dtype: 'int8' is not one of"):
        load_profile(write_profile(tmp_path / "a", STRUCTURED + "cuda: {dtype: int8}\n"))
    with pytest.raises(ProfileError, match=r"cuda.arch\[0\]: 'sm90' is not a compute capability like '9.0'"):
        load_profile(write_profile(tmp_path / "b", STRUCTURED + "cuda: {arch: ['sm90']}\n"))


@pytest.mark.parametrize("device, parsed", [("cpu", ("cpu", None)), ("cuda", ("cuda", 0)), ("cuda:1", ("cuda", 1))])
def test_parse_device(device, parsed):
    assert parse_device(device) == parsed


@pytest.mark.parametrize("device", ["tpu", "cuda:x", "cpu:3"])
def test_parse_device_refuses_unknown_devices(device):
    with pytest.raises(IncompatibleArtifactError, match="expected 'cpu', 'cuda' or 'cuda:N'"):
        parse_device(device)


A100 = CudaInfo(torch_cuda="12.8", capability="8.0", archs=("8.0",), multi_arch=False, cuda_graphs=False)
A100_PTX = CudaInfo(torch_cuda="12.8", capability="8.0", archs=("8.0",), multi_arch=True, cuda_graphs=False)


def recorded(*kernels: str) -> CudaInfo:
    return CudaInfo(
        torch_cuda="13.0", capability="9.0", archs=("9.0",), multi_arch=True, cuda_graphs=False, kernels=kernels
    )


def test_sass_runs_on_same_major_and_newer_minor_only():
    assert runs_on(A100, (8, 0)) and runs_on(A100, (8, 6)) and runs_on(A100, (8, 9))
    assert not runs_on(A100, (7, 5))
    assert not runs_on(A100, (9, 0))  # SASS does not carry over to a new major


def test_plain_ptx_is_jit_compiled_for_newer_gpus():
    assert runs_on(A100_PTX, (9, 0)) and runs_on(A100_PTX, (10, 0)) and runs_on(A100_PTX, (12, 0))
    assert not runs_on(A100_PTX, (7, 5))
    assert runs_on(recorded("compute_90"), (10, 0))


def test_hopper_kernels_run_on_hopper_only_even_with_ptx():
    """Triton compiles for sm_90a and Inductor's fatbin PTX is compute_90a: no newer GPU can JIT it."""
    assert derived_kernels(H100_PTX) == ("sm_90a", "compute_90a")
    assert derived_kernels(H100) == ("sm_90a",)
    for info in (H100, H100_PTX, recorded("compute_90a", "sm_90a")):
        assert runs_on(info, (9, 0))
        assert not runs_on(info, (10, 0)) and not runs_on(info, (12, 0)) and not runs_on(info, (8, 0))


def test_recorded_kernels_decide_over_what_the_build_gpu_suggests():
    assert runs_on(recorded("sm_90a", "compute_80"), (12, 0))  # the plain PTX covers newer GPUs
    family = recorded("sm_100f")
    assert runs_on(family, (10, 0)) and runs_on(family, (10, 3)) and not runs_on(family, (12, 0))
    assert not runs_on(recorded("sm_120a"), (12, 1))


@pytest.mark.parametrize("text", ["sm90", "compute_9", "sm_90b", "ptx_90"])
def test_a_malformed_kernel_target_is_refused(text):
    with pytest.raises(ValueError, match="is not a kernel target like sm_90a"):
        CodeObject.parse(text)


def test_compatibility_decisions_from_recorded_devices():
    assert cuda_problems(H100, 0, H200_FACTS) == []
    assert cuda_problems(H100, 1, H200_FACTS) == []
    (older,) = cuda_problems(H100, 0, A100_FACTS)
    assert "built on compute capability 9.0 and hold sm_90a (sm_90a: that GPU only)" in older
    assert "NVIDIA A100) is 8.0" in older
    (newer,) = cuda_problems(H100_PTX, 0, B200_FACTS)  # the PTX does not help: it is compute_90a
    assert "hold sm_90a, compute_90a" in newer and "NVIDIA B200) is 10.0" in newer and "multi_arch" not in newer
    (a100_only,) = cuda_problems(A100, 0, H200_FACTS)
    assert "or with cuda.multi_arch: true for newer GPUs" in a100_only
    assert cuda_problems(A100_PTX, 0, B200_FACTS) == []
    assert cuda_problems(H100, 2, H200_FACTS) == ["cuda: asked for cuda:2, this host has 2 GPU(s)"]
    assert "CPU-only build" in cuda_problems(H100, 0, CudaFacts(None))[0]
    assert "no CUDA GPU is visible" in cuda_problems(H100, 0, CudaFacts("12.8"))[0]
    assert "has no CUDA variants" in cuda_problems(None, 0, H200_FACTS)[0]


def mixed_artifact(src, dst):
    """A CPU artifact with a CUDA variant added, as a GPU build host writes one (the CPU package stands
    in for the CUDA one: this host never opens it)."""
    shutil.copytree(src, dst)
    manifest = json.loads((dst / "manifest.json").read_text())
    cpu = manifest["variants"][0]
    shutil.copy(dst / cpu["file"], dst / "variants" / "cuda-dynamic.pt2")
    manifest["files"]["variants/cuda-dynamic.pt2"] = manifest["files"][cpu["file"]]
    manifest["variants"].append({**cpu, "id": "cuda-dynamic", "file": "variants/cuda-dynamic.pt2", "device": "cuda"})
    manifest["cuda"] = {**{k: v for k, v in H100.to_dict().items()}, "device_name": "NVIDIA H100"}
    (dst / "manifest.json").write_text(json.dumps(manifest))
    return dst


def test_manifest_cuda_fields_round_trip(tmp_path, structured_artifact):
    path = mixed_artifact(structured_artifact, tmp_path / "mixed")
    manifest = parse_manifest((path / "manifest.json").read_bytes())
    assert manifest.cuda == CudaInfo("12.8", "9.0", ("9.0",), False, False, "NVIDIA H100")
    assert [(v.id, v.device) for v in manifest.variants] == [("dynamic", "cpu"), ("cuda-dynamic", "cuda")]
    assert parse_manifest(manifest.to_json()) == manifest


def test_manifest_records_kernel_targets_and_refuses_malformed_ones(tmp_path, structured_artifact):
    path = mixed_artifact(structured_artifact, tmp_path / "mixed")
    manifest = json.loads((path / "manifest.json").read_text())
    manifest["cuda"]["kernels"] = ["compute_90a", "sm_90a"]
    parsed = parse_manifest(json.dumps(manifest))
    assert parsed.cuda.kernels == ("compute_90a", "sm_90a")
    assert parse_manifest(parsed.to_json()) == parsed
    manifest["cuda"]["kernels"] = ["sm90"]
    with pytest.raises(loader.ArtifactError, match=r"cuda.kernels\[0\]: 'sm90' does not match"):
        parse_manifest(json.dumps(manifest))


def test_the_loader_refuses_a_newer_gpu_for_hopper_kernels_before_opening_code(tmp_path, structured_artifact):
    from loader.host import compatibility_problems, host_facts

    path = mixed_artifact(structured_artifact, tmp_path / "mixed")
    raw = json.loads((path / "manifest.json").read_text())
    raw["cuda"].update(multi_arch=True, kernels=["compute_90a", "sm_90a"])
    manifest = parse_manifest(json.dumps(raw))
    here = host_facts()

    def on(facts):
        return compatibility_problems(manifest, "cuda:0", replace(here, cuda=facts))

    assert on(H200_FACTS) == []
    (problem,) = on(B200_FACTS)
    assert "hold compute_90a, sm_90a (compute_90a, sm_90a: that GPU only)" in problem
    assert on(CudaFacts("13.0", ((12, 0),), ("NVIDIA RTX PRO 6000",)))


def test_mixed_artifact_serves_its_cpu_variants_on_cpu(tmp_path, structured_artifact):
    model = loader.load(mixed_artifact(structured_artifact, tmp_path / "mixed"), device="cpu")
    assert [v.id for v in model.variants] == ["dynamic"]
    assert model(torch.ones(3, 8))["hidden"].shape == (3, 4)


@no_cuda
def test_cuda_variants_on_a_host_without_cuda_are_refused_before_any_code_runs(tmp_path, structured_artifact):
    with pytest.raises(IncompatibleArtifactError, match="cuda") as info:
        loader.load(mixed_artifact(structured_artifact, tmp_path / "mixed"), device="cuda")
    assert "CPU-only build" in str(info.value) or "no CUDA GPU is visible" in str(info.value)


def test_manifest_with_cuda_variants_needs_a_cuda_section(tmp_path, structured_artifact):
    path = mixed_artifact(structured_artifact, tmp_path / "mixed")
    manifest = json.loads((path / "manifest.json").read_text())
    del manifest["cuda"]
    with pytest.raises(loader.ArtifactError, match="the artifact has CUDA variants but no cuda section"):
        parse_manifest(json.dumps(manifest))


@no_cuda
def test_cuda_only_build_without_a_gpu_says_so(tmp_path):
    path = write_profile(tmp_path, STRUCTURED + "target: cuda\n")
    result = CliRunner().invoke(main, ["build", str(path), "-o", str(tmp_path / "out")], catch_exceptions=False)
    assert result.exit_code == 1
    assert "target cuda needs a CUDA GPU on the build host" in result.output
    assert "pytorch/pytorch#153697" in result.output and "add cpu to target" in result.output
    assert not (tmp_path / "out").exists()


@no_cuda
def test_mixed_build_without_a_gpu_builds_the_cpu_target(tmp_path, capsys, structured_artifact, build_cache):
    from precompile.progress import Progress

    notes = []

    class Record(Progress):
        def note(self, text):
            notes.append(text)

    path = write_profile(tmp_path, STRUCTURED + "target: [cpu, cuda]\ncheck: {random_shapes: 1}\n")
    # The CPU variant is structured_artifact's: copied from the session's build cache.
    result = build(path, tmp_path / "out", progress=Record(), jobs=1, cache=build_cache)
    assert any("target cuda needs a CUDA GPU" in n and "building cpu only" in n for n in notes)
    assert {v.device for v in result.manifest.variants} == {"cpu"} and result.manifest.cuda is None


@needs_cuda
def test_cuda_build_load_and_graphs(tmp_path):
    path = write_profile(
        tmp_path,
        STRUCTURED + "target: cuda\ncuda: {cuda_graphs: true}\ndistribution: {shapes: [{batch: 4, count: 9}]}\n",
    )
    result = build(path, tmp_path / "out", jobs=1)
    model = loader.load(result.path, device="cuda:0")
    model.warmup()
    x = torch.randn(4, 8, device="cuda")
    out, variant = model.call_detailed(x)
    assert variant == "cuda-static-0" and out["hidden"].device.type == "cuda"
    with pytest.raises(loader.GuardError, match="tensor is on cpu, the model runs on cuda:0"):
        model(x.cpu())


class _SlowGraph:
    """Stands in for a CUDA graph on CPU buffers: replay reads the input buffer, yields to other
    threads (as a GPU replay runs while the host goes on), then writes the output buffer."""

    def __init__(self, inputs, outputs):
        self.inputs, self.outputs = inputs, outputs

    def replay(self):
        import time

        value = self.inputs[0].clone()
        time.sleep(0.001)
        self.outputs[0].copy_(value * 2)


def test_graph_replays_from_concurrent_callers_never_exchange_results():
    """One graph has one set of buffers: without the lock, a caller gets another caller's result."""
    import threading
    from concurrent.futures import ThreadPoolExecutor

    from loader.cuda import GraphedRunner

    graphed = GraphedRunner.__new__(GraphedRunner)
    graphed.inputs, graphed.outputs = [torch.zeros(4)], [torch.zeros(4)]
    graphed.device = torch.device("cpu")
    graphed.graph = _SlowGraph(graphed.inputs, graphed.outputs)
    graphed._lock, graphed._done = threading.Lock(), None

    def call(i):
        (out,) = graphed.run([torch.full((4,), float(i))])
        return i, out

    with ThreadPoolExecutor(8) as pool:
        results = list(pool.map(call, range(200)))
    wrong = [i for i, out in results if not torch.equal(out, torch.full((4,), 2.0 * i))]
    assert wrong == []


@needs_cuda
@pytest.mark.parametrize("warm", [True, False], ids=["graphed", "single-threaded-without-warmup"])
def test_a_static_variant_serves_concurrent_callers_their_own_results(tmp_path, warm):
    from concurrent.futures import ThreadPoolExecutor

    path = write_profile(
        tmp_path,
        STRUCTURED + "target: cuda\ncuda: {cuda_graphs: true}\ndistribution: {shapes: [{batch: 4, count: 9}]}\n",
    )
    model = loader.load(build(path, tmp_path / "out", jobs=1).path, device="cuda:0")
    if warm:
        model.warmup()
    inputs = [torch.randn(4, 8, device="cuda") for _ in range(16)]
    want = [model.run_variant("cuda-dynamic", x)["hidden"] for x in inputs]

    def call(i):
        out, variant = model.call_detailed(inputs[i % 16])
        return i, variant, out["hidden"]

    with ThreadPoolExecutor(8) as pool:
        results = list(pool.map(call, range(400)))
    assert {v for _, v, _ in results} == {"cuda-static-0"}
    assert all(torch.allclose(out, want[i % 16], atol=1e-4) for i, _, out in results)


class _SlowRunner:
    """A package runner with one set of work buffers, as a single-threaded AOTInductor runner has: a
    call writes its input into the buffer, yields to other threads, then reads the buffer back."""

    def __init__(self):
        self.buffer = torch.zeros(4)

    def run(self, tensors):
        self.buffer.copy_(tensors[0])
        time.sleep(0.001)
        return [self.buffer * 2]

    def get_constant_fqns(self):
        return []


@pytest.fixture
def guard_record(monkeypatch):
    """The devices CudaRunner makes current, recorded (this host has no GPU to switch to)."""
    import contextlib

    import loader.cuda

    entered = []

    @contextlib.contextmanager
    def guard(device):
        entered.append(device)
        yield

    monkeypatch.setattr(loader.cuda, "device_guard", guard)
    return entered


def test_a_single_threaded_cuda_runner_takes_turns_without_warmup(guard_record):
    from concurrent.futures import ThreadPoolExecutor

    from loader.cuda import CudaRunner

    runner = CudaRunner(_SlowRunner(), 0, single_threaded=True)  # as load() opens a static variant for graphs

    def call(i):
        (out,) = runner.run([torch.full((4,), float(i))])
        return i, out

    with ThreadPoolExecutor(8) as pool:
        results = list(pool.map(call, range(200)))
    assert [i for i, out in results if not torch.equal(out, torch.full((4,), 2.0 * i))] == []


def test_a_cuda_runner_launches_on_its_own_device_not_the_current_one(guard_record):
    from loader.cuda import CudaRunner

    runner = CudaRunner(_SlowRunner(), 1)
    runner.run([torch.ones(4)])
    runner.run([torch.ones(4)])
    assert guard_record == [torch.device("cuda", 1)] * 2


def ptx_fixture(target: str) -> str:
    """The head of a PTX file as Triton writes it (LLVM's NVPTX back-end)."""
    return (
        "//\n// Generated by LLVM NVPTX Back-End\n//\n\n"
        f".version 8.7\n.target {target}\n.address_size 64\n\n"
        "\t// .globl\ttriton_poi_fused_add_0 // -- Begin function triton_poi_fused_add_0\n"
        ".visible .entry triton_poi_fused_add_0(\n\t.param .u64 .ptr .global .align 1 triton_poi_fused_add_0_param_0\n)\n"
    )


# cuobjdump --list-elf --list-ptx of a fatbin Inductor built with nvcc -fatbin on a Hopper (CUDA 13).
CUOBJDUMP_HOPPER = "ELF file    1: cukxyz7a2b.1.sm_90a.cubin\nPTX file    1: cukxyz7a2b.1.sm_90a.ptx\n"
# ... of a binary holding SASS for 8.0 and only SASS (no PTX inside).
CUOBJDUMP_SASS_ONLY = (
    "ELF file    1: kernels.1.sm_80.cubin\n"
    "cuobjdump info    : No PTX file found to extract from 'kernels.fatbin'.  You may try --extract-ptx\n"
)


def test_ptx_and_cuobjdump_listings_give_the_kernel_targets():
    from precompile.cuda_targets import cuobjdump_targets, ptx_targets

    assert ptx_targets(ptx_fixture("sm_90a")) == {"compute_90a"}
    assert ptx_targets(ptx_fixture("sm_80")) == {"compute_80"}
    assert ptx_targets("// .target sm_90a in a comment\n.version 8.7\n") == set()
    assert cuobjdump_targets(CUOBJDUMP_HOPPER) == {"sm_90a", "compute_90a"}
    assert cuobjdump_targets(CUOBJDUMP_SASS_ONLY) == {"sm_80"}
    assert cuobjdump_targets(
        "ELF file    1: _core.abi3.1.sm_75.cubin\nELF file    2: _core.abi3.2.sm_120.cubin\nPTX file    1: _core.abi3.1.sm_120.ptx\n"
    ) == {"sm_75", "sm_120", "compute_120"}


def fake_package(path, members: dict[str, bytes]):
    import zipfile

    with zipfile.ZipFile(path, "w") as z:
        z.writestr("model/data/aotinductor/model/model.wrapper.so", b"\x7fELF")
        for name, data in members.items():
            z.writestr(f"model/data/aotinductor/model/{name}", data)
    return path


def fake_cuobjdump(tmp_path, listing: str):
    """A stand-in for cuobjdump (this host has none) that prints a listing recorded from the real one."""
    (tmp_path / "listing.txt").write_text(listing)
    tool = tmp_path / "cuobjdump"
    tool.write_text(f"#!/bin/sh\ncat {tmp_path / 'listing.txt'}\n")
    tool.chmod(0o755)
    return str(tool)


def test_the_build_records_what_every_package_holds(tmp_path):
    from precompile.cuda_targets import package_kernels, with_kernel_targets

    a = fake_package(tmp_path / "a.pt2", {"k1.fatbin": b"fatbin", "k2.fatbin": b"fatbin"})
    b = fake_package(tmp_path / "b.pt2", {"k3.fatbin": b"fatbin"})
    extern_only = fake_package(tmp_path / "c.pt2", {})
    tool = fake_cuobjdump(tmp_path, CUOBJDUMP_HOPPER)
    assert package_kernels(a, tool).kernels == {"sm_90a", "compute_90a"} and package_kernels(a, tool).files == 2
    out = with_kernel_targets(H100_PTX, [a, b, extern_only], tool)
    assert out.kernels == ("compute_90a", "sm_90a")
    assert not runs_on(out, (10, 0))
    ptx_only = fake_package(tmp_path / "d.pt2", {"k.ptx": ptx_fixture("sm_90a").encode()})
    assert with_kernel_targets(H100_PTX, [ptx_only], None).kernels == ("compute_90a",)


def test_without_cuobjdump_nothing_is_recorded_and_the_loader_derives(tmp_path):
    from precompile.cuda_targets import with_kernel_targets

    a = fake_package(tmp_path / "a.pt2", {"k1.cubin": b"cubin"})
    out = with_kernel_targets(H100_PTX, [a], "/nonexistent/cuobjdump")
    assert out.kernels == () and derived_kernels(out) == ("sm_90a", "compute_90a")
    assert with_kernel_targets(None, [a]) is None


def test_the_build_reads_kernels_with_the_cuobjdump_beside_nvcc_off_path(tmp_path, monkeypatch):
    """A toolkit named by CUDA_HOME but not on PATH (/usr/local/cuda/bin often is not): its cuobjdump
    reads the kernels, as Inductor finds its nvcc (precompile.cuda_toolchain)."""
    from precompile.cuda_targets import with_kernel_targets

    kit = tmp_path / "cuda"
    (kit / "bin").mkdir(parents=True)
    (kit / "bin" / "nvcc").write_text("#!/bin/sh\n")
    (kit / "bin" / "nvcc").chmod(0o755)
    (kit / "bin" / "cuobjdump").symlink_to(fake_cuobjdump(tmp_path, CUOBJDUMP_HOPPER))
    monkeypatch.delenv("CUDACXX", raising=False)
    monkeypatch.setenv("CUDA_HOME", str(kit))
    monkeypatch.setenv("PATH", "/usr/bin:/bin")
    a = fake_package(tmp_path / "a.pt2", {"k1.fatbin": b"fatbin"})
    assert with_kernel_targets(H100_PTX, [a]).kernels == ("compute_90a", "sm_90a")
