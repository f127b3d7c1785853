"""The CUDA target, as far as it can be checked without a GPU: profile options, manifest fields,
compatibility decisions from recorded device facts, the CPU side of a mixed artifact, and clear
errors on a host without CUDA. Tests that need a GPU are marked and skip elsewhere."""

from __future__ import annotations

import json
import shutil

import pytest
import torch
from click.testing import CliRunner

import loader
from loader import IncompatibleArtifactError
from loader.cuda import CudaFacts, cuda_problems, parse_device, runs_on
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
    text = STRUCTURED + "target: [cpu, cuda]\ncuda: {dtype: bfloat16, arch: ['9.0'], multi_arch: true, cuda_graphs: true}\n"
    profile = load_profile(write_profile(tmp_path, text)).profile
    assert profile.targets == ("cpu", "cuda")
    assert profile.cuda.dtype == "bfloat16" and profile.cuda.cuda_graphs


def test_profile_refuses_bad_cuda_options(tmp_path):
    with pytest.raises(ProfileError, match="cuda.dtype: 'int8' is not one of"):
        load_profile(write_profile(tmp_path / "a", STRUCTURED + "cuda: {dtype: int8}\n"))
    with pytest.raises(ProfileError, match=r"cuda.arch\[0\]: 'sm90' is not a compute capability like '9.0'"):
        load_profile(write_profile(tmp_path / "b", STRUCTURED + "cuda: {arch: ['sm90']}\n"))


@pytest.mark.parametrize(
    "device, parsed", [("cpu", ("cpu", None)), ("cuda", ("cuda", 0)), ("cuda:1", ("cuda", 1))]
)
def test_parse_device(device, parsed):
    assert parse_device(device) == parsed


@pytest.mark.parametrize("device", ["tpu", "cuda:x", "cpu:3"])
def test_parse_device_refuses_unknown_devices(device):
    with pytest.raises(IncompatibleArtifactError, match="expected 'cpu', 'cuda' or 'cuda:N'"):
        parse_device(device)


def test_sass_runs_on_same_major_and_newer_minor_only():
    assert runs_on(H100, (9, 0))
    assert not runs_on(H100, (8, 0))
    assert not runs_on(H100, (10, 0))  # SASS does not carry over to a new major
    assert runs_on(H100_PTX, (10, 0))  # PTX is compiled by the driver for newer GPUs
    assert not runs_on(H100_PTX, (8, 6))


def test_compatibility_decisions_from_recorded_devices():
    assert cuda_problems(H100, 0, H200_FACTS) == []
    assert cuda_problems(H100, 1, H200_FACTS) == []
    (older,) = cuda_problems(H100, 0, A100_FACTS)
    assert "built for compute capability 9.0 (SASS only)" in older and "NVIDIA A100) is 8.0" in older
    (newer,) = cuda_problems(H100, 0, B200_FACTS)
    assert "or with cuda.multi_arch: true for newer GPUs" in newer
    assert cuda_problems(H100_PTX, 0, B200_FACTS) == []
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
def test_mixed_build_without_a_gpu_builds_the_cpu_target(tmp_path, capsys):
    from precompile.progress import Progress

    notes = []

    class Record(Progress):
        def note(self, text):
            notes.append(text)

    path = write_profile(tmp_path, STRUCTURED.replace("max: 32", "max: 4") + "target: [cpu, cuda]\ncheck: {random_shapes: 1}\n")
    result = build(path, tmp_path / "out", progress=Record(), jobs=1)
    assert any("target cuda needs a CUDA GPU" in n and "building cpu only" in n for n in notes)
    assert {v.device for v in result.manifest.variants} == {"cpu"} and result.manifest.cuda is None


@needs_cuda
def test_cuda_build_load_and_graphs(tmp_path):
    path = write_profile(tmp_path, STRUCTURED + "target: cuda\ncuda: {cuda_graphs: true}\ndistribution: {shapes: [{batch: 4, count: 9}]}\n")
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
def test_graphed_variant_serves_concurrent_callers_their_own_results(tmp_path):
    from concurrent.futures import ThreadPoolExecutor

    path = write_profile(tmp_path, STRUCTURED + "target: cuda\ncuda: {cuda_graphs: true}\ndistribution: {shapes: [{batch: 4, count: 9}]}\n")
    model = loader.load(build(path, tmp_path / "out", jobs=1).path, device="cuda:0")
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
