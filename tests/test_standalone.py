"""Standalone CPU variants (``compile: {standalone: true}``, ``precompile.standalone``): the tiny
encoder (masked attention, a feed-forward block, layer norms) compiled with no extern kernel left and
linked without libtorch is served by the torch-free loader in a process that has loaded OpenMP and
the artifact's own shim, never libc10 or libtorch_cpu, and gives what ``loader.load`` gives on
torch's libraries (within float tolerance: its exp is the shim's, not SLEEF's)."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import textwrap
import zipfile
from pathlib import Path

import numpy as np
import pytest
import torch

import loader
from loader import ArtifactError
from loader import constants as C
from loader.manifest import parse_manifest
from precompile import standalone
from precompile.pipeline import build
from precompile.progress import Progress

from .conftest import builds, write_profile

ROOT = Path(__file__).resolve().parent.parent
SHAPES = [(1, 2), (2, 8), (3, 13), (4, 24)]

PROFILE = """
name: tiny-encoder-standalone
model: {factory: "tiny:encoder"}
inputs:
  ids:  {shape: [batch, seq], dtype: int64, range: [0, 49]}
  mask: {shape: [batch, seq], dtype: bool}
dims:
  batch: {min: 1, max: 8}
  seq:   {min: 2, max: 32}
compile: {standalone: true}
check: {random_shapes: 1}
"""


def encoder_inputs(batch: int, seq: int) -> tuple[np.ndarray, np.ndarray]:
    rng = np.random.default_rng(batch * 100 + seq)
    mask = np.ones((batch, seq), dtype=bool)
    mask[0, seq // 2 + 1 :] = False
    return rng.integers(0, 50, (batch, seq)), mask


@pytest.fixture(scope="module")
@builds
def artifact(tmp_path_factory) -> Path:
    folder = tmp_path_factory.mktemp("standalone")
    return build(write_profile(folder, PROFILE), folder / "artifact").path


def test_the_build_says_each_variant_is_standalone(artifact, tmp_path):
    manifest = json.loads((artifact / C.MANIFEST_FILE).read_text())
    (variant,) = manifest["variants"]
    assert variant["shim"] == C.STANDALONE_SHIM and "not_standalone" not in variant
    assert C.STANDALONE_SHIM in manifest["files"]  # hashed (and signed with the manifest)
    with zipfile.ZipFile(artifact / variant["file"]) as z:
        (member,) = [n for n in z.namelist() if n.endswith(".so")]
        (tmp_path / "variant.so").write_bytes(z.read(member))
    needed = subprocess.run(["readelf", "-d", str(tmp_path / "variant.so")], capture_output=True, text=True).stdout
    assert "libgomp" in needed and "libtorch" not in needed and "libc10" not in needed


def test_the_gemm_micro_kernels_are_one_vector_wide(artifact):
    """A wider register block (8x48 on AVX-512) keeps a copy of its accumulators in memory under the
    build's GCC, one store per FMA (precompile.standalone.single_vector_blocks); a one-vector block
    does not."""
    manifest = json.loads((artifact / C.MANIFEST_FILE).read_text())
    lanes = 16 if manifest["target"]["cpu_capability"] == "AVX512" else 8  # fp32 lanes of one vector
    (variant,) = manifest["variants"]
    with zipfile.ZipFile(artifact / variant["file"]) as z:
        source = "".join(z.read(n).decode() for n in z.namelist() if n.endswith(".cpp"))
    blocks = {(int(m), int(n)) for m, n in re.findall(r"micro_gemm_kernel<(\d+), (\d+), accum", source)}
    assert blocks and {n for _, n in blocks} == {lanes}, sorted(blocks)


def test_only_the_standalone_compile_narrows_the_blocks():
    import torch._inductor.compile_fx  # noqa: F401  (before cpp_micro_gemm, which alone is a circular import)
    from torch._inductor.codegen.cpp_micro_gemm import CppMicroGemmFP32Vec, micro_gemm_configs

    def widths() -> set[int]:
        return {c.register_blocking.block_n for c in micro_gemm_configs[CppMicroGemmFP32Vec]}

    before = widths()
    with standalone.single_vector_blocks():
        narrowed = widths()
    assert 48 in before and 48 not in narrowed and 16 in narrowed and widths() == before


CHILD = textwrap.dedent(
    """
    import json, sys
    import numpy as np
    sys.modules["torch"] = None  # importing torch would fail
    from pathlib import Path
    import loader

    artifact, inputs, out = sys.argv[1:4]
    model = loader.load_native(artifact, threads=1)
    got = {}
    for k, (ids, mask) in enumerate(np.load(inputs, allow_pickle=True)):
        got[f"states{k}"], got[f"pooled{k}"] = model(ids, mask)
    np.savez(out, **got)
    maps = Path("/proc/self/maps").read_text()
    print(json.dumps({
        "torch": sorted(m for m in sys.modules if m.startswith("torch") and sys.modules[m] is not None),
        "libs": sorted({line.split(maxsplit=5)[5].removesuffix(" (deleted)").rsplit("/", 1)[-1]
                        for line in maps.splitlines()
                        if "libtorch" in line or "libc10" in line or "aoti_shim" in line}),
    }))
    """
)


def run_torch_free(child: str, artifact: Path, inputs: np.ndarray, folder: Path) -> tuple[object, np.lib.npyio.NpzFile]:
    """``child`` run on ``artifact`` and ``inputs`` in a fresh process where importing torch fails:
    the JSON its last line prints and the outputs it saved."""
    np.save(folder / "inputs.npy", inputs, allow_pickle=True)
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_WAIT_POLICY": "PASSIVE"}
    done = subprocess.run(
        [sys.executable, "-c", child, str(artifact), str(folder / "inputs.npy"), str(folder / "out.npz")],
        capture_output=True,
        text=True,
        env=env,
        timeout=120,
    )
    assert done.returncode == 0, done.stderr
    return json.loads(done.stdout.strip().splitlines()[-1]), np.load(folder / "out.npz")


def test_served_without_torch_libraries_as_the_torch_loader_serves_it(artifact, tmp_path):
    inputs = np.empty(len(SHAPES), dtype=object)
    inputs[:] = [encoder_inputs(b, s) for b, s in SHAPES]
    seen, got = run_torch_free(CHILD, artifact, inputs, tmp_path)
    assert seen == {"torch": [], "libs": ["aoti_shim.so"]}  # the shim; neither torch's package nor its libraries
    on_torch = loader.load(artifact)  # the same library, on libtorch_cpu's shim
    for k, (ids, mask) in enumerate(inputs):
        for name, want in zip(("states", "pooled"), on_torch(torch.from_numpy(ids), torch.from_numpy(mask))):
            assert got[f"{name}{k}"].shape == tuple(want.shape)
            np.testing.assert_allclose(got[f"{name}{k}"], want.numpy(), rtol=1e-5, atol=1e-6)


def test_a_shim_the_files_do_not_list_is_refused(artifact):
    manifest = json.loads((artifact / C.MANIFEST_FILE).read_text())
    manifest["variants"][0]["shim"] = "standalone/other.so"
    with pytest.raises(ArtifactError, match=r"variants\[0\]\.shim: 'standalone/other.so' is not listed in files"):
        parse_manifest(json.dumps(manifest))


def test_a_changed_shim_is_refused(artifact, tmp_path):
    copy = tmp_path / "copy"
    subprocess.run(["cp", "-r", str(artifact), str(copy)], check=True)
    shim = copy / C.STANDALONE_SHIM
    shim.write_bytes(shim.read_bytes() + b"\0")
    with pytest.raises(ArtifactError, match="aoti_shim.so"):
        loader.load_native(copy, verify=False)


def test_a_missing_symbol_is_named(artifact, tmp_path):
    """A library that calls what the shim lacks (an extern kernel) is not standalone, and says which."""
    source = tmp_path / "needs.cpp"
    source.write_text(
        'extern "C" int aoti_torch_cpu_bmm_out(void*, void*, void*);\n'
        'extern "C" int run(void) { return aoti_torch_cpu_bmm_out(0, 0, 0); }\n'
    )
    lib = tmp_path / "m.so"
    subprocess.run(["g++", "-shared", "-fPIC", "-o", str(lib), str(source)], check=True)
    fake = tmp_path / "fake.pt2"
    with zipfile.ZipFile(fake, "w") as z:
        z.write(lib, "fake/data/aotinductor/model/m.so")
    assert (
        standalone.problem(fake, artifact / C.STANDALONE_SHIM)
        == "its compiled code calls aoti_torch_cpu_bmm_out of libtorch (an extern kernel)"
    )


MIXED_CHILD = textwrap.dedent(
    """
    import json, sys
    import numpy as np
    sys.modules["torch"] = None
    import loader
    from loader import LoaderError

    standalone, other, order, inputs = sys.argv[1:5]
    ids, mask = np.load(inputs, allow_pickle=True)[0]
    first, second = (standalone, other) if order == "standalone-first" else (other, standalone)
    loader.load_native(first)
    try:
        model = loader.load_native(second)
    except LoaderError as e:
        print(json.dumps({"refused": str(e)}))
        sys.exit(0)
    if second == standalone:
        np.savez(sys.argv[5], *model(ids, mask))
    print(json.dumps({"served": True, "libtorch": "/libtorch_cpu.so" in open("/proc/self/maps").read()}))
    """
)


@pytest.mark.parametrize("order", ["standalone-first", "torch-first"])
def test_one_provider_of_the_shim_per_process(artifact, classifier_artifact, tmp_path, order):
    """After a standalone variant, a variant that needs libtorch_cpu is refused in that process (its
    calls would bind to precompile's shim); after torch's libraries, standalone variants run on them."""
    inputs = np.empty(1, dtype=object)
    inputs[:] = [encoder_inputs(3, 13)]
    np.save(tmp_path / "inputs.npy", inputs, allow_pickle=True)
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_WAIT_POLICY": "PASSIVE"}
    args = [str(artifact), str(classifier_artifact), order, str(tmp_path / "inputs.npy"), str(tmp_path / "out.npz")]
    done = subprocess.run(
        [sys.executable, "-c", MIXED_CHILD, *args], capture_output=True, text=True, env=env, timeout=120
    )
    assert done.returncode == 0, done.stderr
    seen = json.loads(done.stdout.strip().splitlines()[-1])
    if order == "standalone-first":
        assert "cannot run beside them" in seen["refused"]
        return
    assert seen == {"served": True, "libtorch": True}
    got = np.load(tmp_path / "out.npz")
    ids, mask = inputs[0]
    want = loader.load(artifact)(torch.from_numpy(ids), torch.from_numpy(mask))
    for k, w in enumerate(want):
        np.testing.assert_array_equal(got[f"arr_{k}"], w.numpy())  # the same library on the same libtorch


CONVNET = """
name: gray-standalone
model: {factory: "tiny:gray_net"}
inputs: {x: {shape: [batch, 1, height, width], dtype: float32}}
dims: {batch: {min: 1, max: 2}, height: {min: 8, max: 12}, width: {min: 8, max: 12}}
plan: {max_specialized: 0}
compile: {standalone: true}
check: {random_shapes: 1}
"""


@pytest.mark.integration
def test_a_variant_that_cannot_be_standalone_is_built_as_usual_and_says_why(tmp_path):
    """Convolutions have no C++ template: they stay extern kernels, so the variant is
    compiled the usual way, the manifest says why, and the torch-free loader serves it on torch's
    libraries (no shim left in the artifact)."""
    messages = []

    class Notes(Progress):
        def note(self, text: str) -> None:
            messages.append(text)

    out = build(write_profile(tmp_path, CONVNET), tmp_path / "artifact", progress=Notes()).path
    (variant,) = parse_manifest((out / C.MANIFEST_FILE).read_text()).variants
    assert variant.shim is None
    # The first such call is named: the convolution, or where the build put a convolution in a layout
    # branch (prepack, on hosts whose oneDNN lays its weights out per call), the branch's handle copy.
    assert re.fullmatch(
        r"its compiled code calls aoti_torch_(cpu_\w*convolution\w*|assign_tensors_out) of libtorch \(an extern kernel\)",
        variant.not_standalone,
    ), variant.not_standalone
    assert not (out / C.STANDALONE_SHIM).exists()
    assert any(f"variant {variant.id}: not standalone" in m for m in messages)
    x = np.random.default_rng(0).standard_normal((2, 1, 10, 9)).astype(np.float32)
    np.testing.assert_array_equal(loader.load_native(out)(x), loader.load(out)(torch.from_numpy(x)).numpy())


ROUTED_CONVNET = """
name: excite-standalone
model: {factory: "tiny:excite_net"}
inputs: {x: {shape: [batch, 3, height, width], dtype: float32}}
dims: {batch: {min: 1, max: 2}, height: {min: 16, max: 48}, width: {min: 16, max: 48}}
plan: {max_specialized: 0}
compile: {standalone: true, conv_routes: [conv1x1_as_gemm, depthwise_as_loops, stem_as_loops]}
check: {random_shapes: 1}
"""

CONVNET_CHILD = textwrap.dedent(
    """
    import json, sys
    import numpy as np
    sys.modules["torch"] = None  # importing torch would fail
    from pathlib import Path
    import loader

    artifact, inputs, out = sys.argv[1:4]
    model = loader.load_native(artifact)
    np.savez(out, *[model(x) for x in np.load(inputs, allow_pickle=True)])
    maps = Path("/proc/self/maps").read_text()
    print(json.dumps(sorted({line.removesuffix(" (deleted)").rsplit("/", 1)[-1] for line in maps.splitlines()
                             if "libtorch" in line or "libc10" in line or "libdnnl" in line or "aoti_shim" in line})))
    """
)


@pytest.mark.integration
def test_a_convnet_with_every_convolution_routed_is_standalone(tmp_path):
    """Its stem, depthwise and 1×1 convolutions as generated loops and GEMM templates
    (``compile.conv_routes``), the squeeze-and-excite's one-pixel ones as dense layers: nothing of
    oneDNN's left, so the torch-free loader serves it on the artifact's shim alone, as eager computes it."""
    out = build(write_profile(tmp_path, ROUTED_CONVNET), tmp_path / "artifact").path
    (variant,) = parse_manifest((out / C.MANIFEST_FILE).read_text()).variants
    assert variant.shim == C.STANDALONE_SHIM and variant.not_standalone is None
    rng = np.random.default_rng(3)
    shapes = [(1, 3, 16, 16), (2, 3, 48, 31), (1, 3, 27, 40)]
    inputs = np.empty(len(shapes), dtype=object)
    inputs[:] = [rng.standard_normal(s).astype(np.float32) for s in shapes]
    seen, got = run_torch_free(CONVNET_CHILD, out, inputs, tmp_path)
    assert seen == ["aoti_shim.so"]  # neither libtorch, libc10 nor oneDNN
    from .models import tiny

    eager = tiny.excite_net()
    for k, x in enumerate(inputs):
        with torch.no_grad():
            want = eager(torch.from_numpy(x)).numpy()
        assert got[f"arr_{k}"].shape == want.shape
        np.testing.assert_allclose(got[f"arr_{k}"], want, rtol=1e-4, atol=1e-5)


SHIM_CHILD = textwrap.dedent(
    """
    import ctypes, sys
    lib = ctypes.CDLL(sys.argv[1])  # libtorch_cpu's or the artifact's shim, alone in its process
    blob = (ctypes.c_float * 16)(*range(16))
    sizes, strides = (ctypes.c_int64 * 2)(2, 3), (ctypes.c_int64 * 2)(1, 2)  # a transposed view
    handle, data = ctypes.c_void_p(), ctypes.c_void_p()
    f32, cpu = lib.aoti_torch_dtype_float32(), lib.aoti_torch_device_type_cpu()
    args = (ctypes.c_void_p(ctypes.addressof(blob)), ctypes.c_int64(2), sizes, strides, ctypes.c_int64(5))
    assert lib.aoti_torch_create_tensor_from_blob(*args, f32, cpu, 0, ctypes.byref(handle)) == 0
    assert lib.aoti_torch_get_data_ptr(handle, ctypes.byref(data)) == 0
    print((data.value - ctypes.addressof(blob)) // ctypes.sizeof(ctypes.c_float))
    """
)


@pytest.mark.integration
def test_the_shim_places_a_view_into_its_storage_as_torch_does(tmp_path):
    """``create_tensor_from_blob`` with a storage offset: data is where the storage begins and the view
    starts that many elements in (AOTInductor hands a frozen constant that shares a storage so), in
    the artifact's shim as in libtorch_cpu's."""
    libraries = [
        standalone.build_shim(tmp_path / "aoti_shim.so"),
        Path(torch.__file__).parent / "lib" / "libtorch_cpu.so",
    ]
    starts = []
    for library in libraries:
        done = subprocess.run(
            [sys.executable, "-c", SHIM_CHILD, str(library)], capture_output=True, text=True, timeout=60
        )
        assert done.returncode == 0, done.stderr
        starts.append(int(done.stdout))
    assert starts == [5, 5]


LEFT_CHILD = textwrap.dedent(
    """
    import gc, json, os, sys
    import torch
    from loader.aoti import open_package
    runner = open_package(sys.argv[1], standalone=True)
    del runner
    gc.collect()
    print(json.dumps(sorted(p for p in os.listdir(os.environ["TMPDIR"]) if p.startswith("aotinductor_"))))
    """
)


def test_opening_a_standalone_package_leaves_no_folder_behind(artifact, tmp_path):
    """torch's package loader extracts a package into a folder of the temporary directory and removes
    it when the runner goes; an attempt that fails (a standalone library opened before libtorch's
    symbols are global) leaves its folder. Told the package is standalone (as the build, the tune
    stage and ``loader.load`` now tell it), the first attempt is the one that succeeds: a fresh
    process, whose libtorch is not global yet, leaves nothing in its temporary directory."""
    (v,) = parse_manifest((artifact / "manifest.json").read_text()).variants
    assert v.shim is not None
    temp = tmp_path / "tmp"
    temp.mkdir()
    env = {**os.environ, "PYTHONPATH": str(ROOT), "TMPDIR": str(temp)}
    done = subprocess.run(
        [sys.executable, "-c", LEFT_CHILD, str(artifact / v.file)],
        capture_output=True, text=True, env=env, timeout=120,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr[-2000:]
    assert json.loads(done.stdout.strip().splitlines()[-1]) == []
