"""The torch-free loader (``loader.load_native``): a process that never imports torch loads a real
artifact and serves it with numpy arrays, bit for bit what ``loader.load`` gives, with the same
checks, guards, dispatch, policies and stats; what it cannot run it refuses, saying to use torch."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import textwrap
import threading
import time
from pathlib import Path

import numpy as np
import pytest
import torch

import loader
from loader import ArtifactError, GuardError, IncompatibleArtifactError, UntrustedArtifactError
from loader.host import ISA_FEATURES
from loader.host import host_facts as torch_host_facts
from loader.manifest import Variant, parse_manifest
from loader.native.libs import cpu_capability, cpu_features, feature_name, find_torch, host_facts
from loader.threads import CpuAllowance, default_threads, openmp_env
from precompile.pipeline import build

from .conftest import builds, write_profile

ROOT = Path(__file__).resolve().parent.parent

# Shapes of the tagger (static 1x16 and 2x8, dynamic seq [4,16] and [17,32], batch [1,8]; batch
# split, seq padded): each static, each dynamic, a split, a pad and both at once.
TAGGER_CALLS = [(1, 16), (2, 8), (3, 10), (2, 16), (1, 17), (8, 32), (12, 20), (3, 2), (12, 3)]


def tagger_inputs(batch: int, seq: int, seed: int) -> tuple[np.ndarray, np.ndarray]:
    rng = np.random.default_rng(seed)
    return rng.integers(0, 50, (batch, seq)), np.ones((batch, seq), dtype=bool)


@pytest.fixture(scope="module")
def tagger(tagger_build):
    return loader.load_native(tagger_build.path)


@pytest.fixture(scope="module")
def tagger_torch(tagger_build):
    return loader.load(tagger_build.path)


@pytest.fixture(scope="module")
def classifier(classifier_artifact):
    return loader.load_native(classifier_artifact)


@pytest.fixture(scope="module")
def classifier_torch(classifier_artifact):
    return loader.load(classifier_artifact)


def copy_with(src: Path, dst: Path, edit) -> Path:
    """A copy of an artifact whose manifest ``edit`` changed (the files stay as they are)."""
    shutil.copytree(src, dst)
    manifest = json.loads((dst / "manifest.json").read_text())
    edit(manifest)
    (dst / "manifest.json").write_text(json.dumps(manifest, indent=2))
    return dst


# --- without torch ---------------------------------------------------------------------------------

NO_TORCH = r"""
import json, os, sys

class NoTorch:
    "What a serving image without torch's Python package looks like: importing it fails."
    def find_spec(self, name, path=None, target=None):
        if name == "torch" or name.startswith("torch."):
            raise ImportError(f"{name} is not importable here")
        return None

sys.meta_path.insert(0, NoTorch())
import numpy as np
import loader

artifact, out, threads = sys.argv[1], sys.argv[2], int(sys.argv[4])
model = loader.load_native(artifact, threads=threads)
model.warmup()
results, variants = {}, {}
for batch, seq in json.loads(sys.argv[3]):
    rng = np.random.default_rng(batch * 100 + seq)
    ids, mask = rng.integers(0, 50, (batch, seq)), np.ones((batch, seq), dtype=bool)
    (tags, pooled), variants[f"{batch}x{seq}"] = model.call_detailed(ids, mask)
    results[f"{batch}x{seq}/tags"], results[f"{batch}x{seq}/pooled"] = tags, pooled
np.savez(out, **results)
print(json.dumps({
    "torch": sorted(m for m in sys.modules if m == "torch" or m.startswith("torch.")),
    "variants": variants,
    "calls": model.stats()["calls"],
    "env": {k: os.environ.get(k) for k in ("OMP_WAIT_POLICY", "GOMP_SPINCOUNT", "OMP_NUM_THREADS")},
}))
"""


def test_a_process_without_torch_serves_what_the_torch_loader_serves(tagger_build, tagger_torch, tmp_path):
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "OMP_WAIT_POLICY", "OMP_NUM_THREADS")}
    out = tmp_path / "outputs.npz"
    threads = torch.get_num_threads()  # the same count as the torch loader here: it decides the sums' order
    proc = subprocess.run(
        [sys.executable, "-c", NO_TORCH, str(tagger_build.path), str(out), json.dumps(TAGGER_CALLS), str(threads)],
        capture_output=True,
        text=True,
        cwd=ROOT,
        env=env,
    )
    assert proc.returncode == 0, proc.stderr
    report = json.loads(proc.stdout.strip().splitlines()[-1])
    assert report["torch"] == []
    assert report["calls"] == len(TAGGER_CALLS)  # warm-up is not counted
    # OpenMP settings are read when libgomp loads: they were set before it did.
    assert report["env"] == {"OMP_WAIT_POLICY": "ACTIVE", "GOMP_SPINCOUNT": "10000", "OMP_NUM_THREADS": str(threads)}
    got = np.load(out)
    for batch, seq in TAGGER_CALLS:
        ids, mask = tagger_inputs(batch, seq, batch * 100 + seq)
        (tags, pooled), variant = tagger_torch.call_detailed(torch.from_numpy(ids), torch.from_numpy(mask))
        assert report["variants"][f"{batch}x{seq}"] == variant
        assert np.array_equal(got[f"{batch}x{seq}/tags"], tags.numpy()), (batch, seq)
        assert np.array_equal(got[f"{batch}x{seq}/pooled"], pooled.numpy()), (batch, seq)


DEFAULT_THREADS = {
    "native": "import os, loader; loader.load_native(__import__('sys').argv[1]); print(os.environ['OMP_NUM_THREADS'])",
    "torch": "import torch, loader; loader.load(__import__('sys').argv[1]); print(torch.get_num_threads())",
}


def test_the_default_thread_count_is_the_torch_loaders(classifier_artifact):
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "OMP_NUM_THREADS")}
    counts = {
        name: subprocess.run(
            [sys.executable, "-c", code, str(classifier_artifact)],
            capture_output=True,
            text=True,
            cwd=ROOT,
            env=env,
            check=True,
        ).stdout.split()[-1]
        for name, code in DEFAULT_THREADS.items()
    }
    assert counts["native"] == counts["torch"]


def test_import_loader_imports_neither_torch_nor_numpy():
    code = "import sys, loader; print(sorted({m.split('.')[0] for m in sys.modules} & {'torch', 'numpy'}))"
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT, env=env, check=True)
    assert out.stdout.strip() == "[]"


# --- the same results, the same dispatch ----------------------------------------------------------


@pytest.mark.parametrize("batch, seq", TAGGER_CALLS)
def test_outputs_are_bit_identical_to_the_torch_loader(tagger, tagger_torch, batch, seq):
    ids, mask = tagger_inputs(batch, seq, seed=seq)
    got, served = tagger.call_detailed(ids, mask)
    want, expected = tagger_torch.call_detailed(torch.from_numpy(ids), torch.from_numpy(mask))
    assert served == expected  # static, then the tightest dynamic range, then pad/split pieces
    assert isinstance(got, tuple) and len(got) == 2
    for a, b in zip(got, want):
        assert isinstance(a, np.ndarray) and a.dtype == b.numpy().dtype and np.array_equal(a, b.numpy())


def test_structured_outputs_keep_forward_structure(structured_artifact):
    native, reference = loader.load_native(structured_artifact), loader.load(structured_artifact)
    x = np.random.default_rng(3).standard_normal((5, 8)).astype(np.float32)
    got, want = native(x), reference(torch.from_numpy(x))
    assert set(got) == {"hidden", "pair"} and isinstance(got["pair"], tuple)
    assert np.array_equal(got["hidden"], want["hidden"].numpy())
    assert all(np.array_equal(a, b.numpy()) for a, b in zip(got["pair"], want["pair"]))


def test_stats_count_like_the_torch_loader(tagger_build):
    native, reference = loader.load_native(tagger_build.path), loader.load(tagger_build.path)
    native.warmup()
    reference.warmup()
    for batch, seq in TAGGER_CALLS:
        ids, mask = tagger_inputs(batch, seq, seed=1)
        native(ids, mask)
        reference(torch.from_numpy(ids), torch.from_numpy(mask))

    def counts(stats):
        return {
            **stats,
            "variants": {v: (s["calls"], s["pieces"], s["precision"]) for v, s in stats["variants"].items()},
        }

    assert counts(native.stats()) == counts(reference.stats())
    native.reset_stats()
    assert native.stats()["calls"] == 0


def test_weights_are_used_in_place_from_the_mapped_file(classifier):
    weights = classifier._weights
    name = max(weights.stored, key=lambda n: weights.stored[n].nbytes)
    stored = weights.stored[name]
    ids, mask = np.arange(10).reshape(2, 5), np.ones((2, 5), dtype=bool)
    before = classifier(ids, mask)
    saved = weights._mmap[stored.offset : stored.offset + stored.nbytes]
    try:
        weights._mmap[stored.offset : stored.offset + stored.nbytes] = bytes(stored.nbytes)
        assert not np.array_equal(classifier(ids, mask), before)  # no copy: the compiled code read the map
    finally:
        weights._mmap[stored.offset : stored.offset + stored.nbytes] = saved
    assert np.array_equal(classifier(ids, mask), before)


# --- the same guards -------------------------------------------------------------------------------

BAD_CALLS = {
    "dtype": lambda: ((np.zeros((2, 5), np.int32), np.ones((2, 5), bool)), {}),
    "rank": lambda: ((np.zeros((2, 5, 1), np.int64), np.ones((2, 5), bool)), {}),
    "out_of_range": lambda: ((np.zeros((2, 49), np.int64), np.ones((2, 49), bool)), {}),
    "dim_mismatch": lambda: ((np.zeros((2, 5), np.int64), np.ones((2, 6), bool)), {}),
    "value_range": lambda: ((np.array([[1, 2, 50, 3]]), np.ones((1, 4), bool)), {}),
    "missing_input": lambda: ((np.zeros((2, 5), np.int64),), {}),
    "unknown_input": lambda: ((), {"ids": np.zeros((2, 5), np.int64), "mask": np.ones((2, 5), bool), "x": 1}),
    "too_many_inputs": lambda: ((np.zeros((2, 5), np.int64),) * 3, {}),
}


@pytest.mark.parametrize("reason", sorted(BAD_CALLS))
def test_bad_calls_are_refused_with_the_torch_loaders_words(classifier, classifier_torch, reason):
    args, kwargs = BAD_CALLS[reason]()
    with pytest.raises(GuardError) as native:
        classifier(*args, **kwargs)
    as_tensors = lambda v: torch.from_numpy(v) if isinstance(v, np.ndarray) else v
    with pytest.raises(GuardError) as reference:
        classifier_torch(*map(as_tensors, args), **{k: as_tensors(v) for k, v in kwargs.items()})
    assert native.value.reason == reference.value.reason == reason
    assert str(native.value) == str(reference.value)


def test_a_static_size_is_refused_with_the_torch_loaders_words(structured_artifact):
    x = np.zeros((2, 7), np.float32)
    with pytest.raises(GuardError) as native:
        loader.load_native(structured_artifact)(x)
    with pytest.raises(GuardError) as reference:
        loader.load(structured_artifact)(torch.from_numpy(x))
    assert native.value.reason == "static_size" and str(native.value) == str(reference.value)


@pytest.mark.parametrize(
    "make, reason, message",
    [
        (
            lambda: np.zeros((5, 2), np.int64).T,
            "not_contiguous",
            r"not C-contiguous \(strides \(1, 2\)\).*np.ascontiguousarray",
        ),
        (
            lambda: np.frombuffer(bytes(81), np.int64, 10, offset=1).reshape(2, 5),
            "not_aligned",
            "not aligned to its 8-byte",
        ),
        (lambda: np.zeros((2, 5), ">i8"), "dtype", "dtype is int64 in big-endian byte order, the artifact needs int64"),
        (lambda: np.ma.masked_array(np.zeros((2, 5), np.int64)), "tensor_subclass", "numpy.ndarray subclass"),
        (lambda: torch.zeros(2, 5, dtype=torch.int64), "not_a_tensor", "expected a numpy.ndarray, got Tensor"),
        (lambda: [[1, 2, 3, 4, 5]] * 2, "not_a_tensor", "expected a numpy.ndarray, got list"),
    ],
)
def test_only_plain_contiguous_native_arrays_reach_compiled_code(classifier, make, reason, message):
    with pytest.raises(GuardError, match=message) as e:
        classifier(make(), np.ones((2, 5), bool))
    assert e.value.reason == reason


def test_a_read_only_memory_mapped_array_is_served(classifier, classifier_torch, tmp_path):
    path = tmp_path / "ids.npy"
    np.save(path, np.arange(10).reshape(2, 5))
    ids = np.load(path, mmap_mode="r")
    assert np.array_equal(
        classifier(ids, np.ones((2, 5), bool)),
        classifier_torch(torch.arange(10).reshape(2, 5), torch.ones(2, 5, dtype=torch.bool)).numpy(),
    )


# --- the same checks before any code is opened ------------------------------------------------------


def test_a_corrupt_file_is_refused_before_any_code_runs(classifier_artifact, tmp_path):
    path = tmp_path / "a"
    shutil.copytree(classifier_artifact, path)
    data = bytearray((path / "weights.safetensors").read_bytes())
    data[-1] ^= 1
    (path / "weights.safetensors").write_bytes(bytes(data))
    with pytest.raises(ArtifactError, match="weights.safetensors does not match its sha256"):
        loader.load_native(path)


def test_signatures_and_minimum_versions_apply(classifier_pack, signing_keys, tmp_path):
    from precompile.ship.sign import sign

    signed = tmp_path / "signed.tar.zst"
    shutil.copy(classifier_pack, signed)
    sign(signed, signing_keys[0])
    model = loader.load_native(signed, trusted_keys=[signing_keys[1]], cache_dir=tmp_path / "cache")
    assert model(np.zeros((1, 4), np.int64), np.ones((1, 4), bool)).shape == (1, 3)
    with pytest.raises(UntrustedArtifactError, match="not signed, and this loader only accepts artifacts signed"):
        loader.load_native(classifier_pack, trusted_keys=[signing_keys[1]], cache_dir=tmp_path / "cache")
    with pytest.raises(UntrustedArtifactError, match="is version 1, older than the minimum 2"):
        loader.load_native(signed, min_version=2, cache_dir=tmp_path / "cache")


def test_an_artifact_for_another_cpu_or_torch_is_refused(classifier_artifact, tmp_path):
    def edit(m):
        m["target"]["aoti_cpu_isa"] = "AVX512 AVX512_VNNI AMX_TILE"
        m["torch_version"] = "2.99.0"

    path = copy_with(classifier_artifact, tmp_path / "other", edit)
    if {"amx_tile", "amx_bf16", "amx_int8"} <= host_facts(find_torch()).cpu_features:
        pytest.skip("this CPU has AMX")
    with pytest.raises(IncompatibleArtifactError) as e:
        loader.load_native(path)
    text = str(e.value)
    assert "torch: built with 2.99.0, this host has 2.13" in text and "needs amx_bf16, amx_int8, amx_tile" in text


AVX2_HOST = """processor\t: 0
vendor_id\t: GenuineIntel
flags\t\t: fpu sse sse2 pni ssse3 fma sse4_1 sse4_2 avx f16c avx2 bmi1 abm sha_ni
"""


def test_cpu_features_are_read_from_the_kernel_under_torchs_names(tmp_path):
    (tmp_path / "cpuinfo").write_text(AVX2_HOST)
    features = cpu_features(tmp_path / "cpuinfo")
    assert {"avx2", "fma3", "f16c", "sse3", "bmi", "lzcnt", "sha"} <= features and "avx512_f" not in features
    assert cpu_capability(features, environ={}) == "AVX2"
    assert cpu_capability(features, environ={"ATEN_CPU_CAPABILITY": "default"}) == "DEFAULT"  # lowered, as torch does
    assert cpu_capability(features, environ={"ATEN_CPU_CAPABILITY": "avx512"}) == "AVX2"  # never raised
    assert feature_name("avx512f") == "avx512_f" and feature_name("avx512_vnni") == "avx512_vnni"


def test_openmp_settings_leave_the_users_own_alone():
    # sleep after a spin of about 0.1 ms; ACTIVE keeps a short spin where threads outnumber the CPUs
    short = {"OMP_WAIT_POLICY": "ACTIVE", "GOMP_SPINCOUNT": "10000"}
    assert openmp_env(2, environ={}) == {**short, "OMP_NUM_THREADS": "2"}
    assert openmp_env(2, environ={"OMP_WAIT_POLICY": "ACTIVE"}) == {
        "OMP_NUM_THREADS": "2"
    }  # the user's: no count added
    assert openmp_env(None, environ={"OMP_NUM_THREADS": "3"}) == short
    assert openmp_env(None, environ={"OMP_NUM_THREADS": "3", "OMP_WAIT_POLICY": "passive"}) == {
        "GOMP_SPINCOUNT": "10000"
    }
    assert openmp_env(None, environ={"OMP_NUM_THREADS": "3", "GOMP_SPINCOUNT": "0"}) == {"OMP_WAIT_POLICY": "ACTIVE"}
    # torch's own default (OMP_NUM_THREADS, else physical cores), cut to the CPUs the process gets
    assert default_threads(CpuAllowance(host=8, affinity=2, quota=None), environ={"OMP_NUM_THREADS": "6"}) == 2
    assert default_threads(CpuAllowance(host=8, affinity=8, quota=None), environ={"OMP_NUM_THREADS": "3"}) == 3


def test_host_facts_without_torch_agree_with_torchs():
    mine, torchs = host_facts(find_torch()), torch_host_facts()
    assert (mine.torch_version, mine.platform, mine.machine, mine.cpu_capability) == (
        torchs.torch_version,
        torchs.platform,
        torchs.machine,
        torchs.cpu_capability,
    )
    checked = {f for features in ISA_FEATURES.values() for f in features} | {"avx512_bf16", "avx_vnni", "amx_int8"}
    assert mine.cpu_features & checked == torchs.cpu_features & checked


# --- what it cannot run, it refuses ------------------------------------------------------------------


def test_a_cuda_only_artifact_is_refused_saying_to_use_torch(classifier_artifact, tmp_path):
    def edit(m):
        m["target"]["device"] = "cuda"
        for v in m["variants"]:
            v["device"] = "cuda"
        m["cuda"] = {
            "torch_cuda": "12.8",
            "capability": "9.0",
            "archs": ["9.0"],
            "multi_arch": False,
            "cuda_graphs": False,
            "device_name": "H100",
        }

    with pytest.raises(
        IncompatibleArtifactError,
        match=r"(?s)cuda variants only.*torch-free loader runs CPU variants only.*loader.load\(\)",
    ):
        loader.load_native(copy_with(classifier_artifact, tmp_path / "cuda", edit))


def test_bfloat16_inputs_are_refused_saying_to_use_torch(structured_artifact, tmp_path):
    path = copy_with(structured_artifact, tmp_path / "bf16", lambda m: m["inputs"][0].update(dtype="bfloat16"))
    with pytest.raises(
        IncompatibleArtifactError,
        match=r"input 'x' is bfloat16, which numpy has no dtype for; load it with loader.load\(\)",
    ):
        loader.load_native(path)


EXTERN_MODEL = '''
import torch

@torch.library.custom_op("precompile_test::scaled", mutates_args=())
def scaled(x: torch.Tensor) -> torch.Tensor:
    return x * 2.0

@scaled.register_fake
def _(x):
    return torch.empty_like(x)

class Extern(torch.nn.Module):
    """A graph with an op that has no C shim: AOTInductor runs it through torch's proxy executor."""
    def __init__(self):
        super().__init__()
        self.lin = torch.nn.Linear(4, 4)

    def forward(self, x):
        return scaled(self.lin(x))

def model():
    torch.manual_seed(0)
    return Extern()
'''

EXTERN_PROFILE = """
name: tiny-extern
model: {factory: "extern_model:model"}
inputs:
  x: {shape: [batch, 4], dtype: float32}
dims:
  batch: {min: 1, max: 4}
check: {random_shapes: 1}
"""


@pytest.fixture(scope="module")
@builds
def extern_artifact(tmp_path_factory) -> Path:
    folder = tmp_path_factory.mktemp("extern")
    (folder / "extern_model.py").write_text(textwrap.dedent(EXTERN_MODEL))
    return build(write_profile(folder, EXTERN_PROFILE), folder / "artifact").path


def test_a_variant_needing_the_proxy_executor_is_recorded_and_refused(extern_artifact, tmp_path):
    manifest = json.loads((extern_artifact / "manifest.json").read_text())
    assert all("proxy executor" in v["needs_torch"] for v in manifest["variants"])
    with pytest.raises(
        IncompatibleArtifactError, match=r"variant '.*' cannot run without torch: .*proxy executor.*loader.load\(\)"
    ):
        loader.load_native(extern_artifact)
    assert loader.load(extern_artifact)(torch.ones(2, 4)).shape == (2, 4)  # which the torch loader runs

    # An artifact whose build did not record it (an older build): the package itself is looked at.
    older = copy_with(extern_artifact, tmp_path / "older", lambda m: [v.pop("needs_torch") for v in m["variants"]])
    with pytest.raises(
        IncompatibleArtifactError,
        match="cannot run without torch: it runs ops that have no C shim through torch's proxy executor",
    ):
        loader.load_native(older)


def test_a_variant_the_c_path_runs_records_nothing(classifier_artifact):
    manifest = json.loads((classifier_artifact / "manifest.json").read_text())
    assert all("needs_torch" not in v for v in manifest["variants"])


def test_needs_torch_round_trips_through_the_manifest(classifier_artifact):
    manifest = parse_manifest((classifier_artifact / "manifest.json").read_bytes())
    v = manifest.variants[0]
    marked = Variant(**{**v.__dict__, "needs_torch": "it runs ops that have no C shim"})
    assert marked.to_dict()["needs_torch"] == "it runs ops that have no C shim"
    assert "needs_torch" not in v.to_dict()
    again = parse_manifest(json.dumps({**manifest.to_dict(), "variants": [marked.to_dict()]}))
    assert again.variants[0].needs_torch == "it runs ops that have no C shim"


def test_a_closed_model_refuses_calls(structured_artifact):
    model = loader.load_native(structured_artifact)
    x = np.zeros((1, 8), np.float32)
    model(x)
    model.close()
    with pytest.raises(RuntimeError, match="the model was closed"):
        model(x)


def test_calls_from_two_threads_run_side_by_side(tagger_build):
    """A variant's container has a model instance per CPU (loader.threads.concurrent_runners): a
    short call made while another thread's long call is in the compiled code runs at once beside it.
    With one instance (as before) it waited for the long call to end."""
    from loader.threads import concurrent_runners

    if concurrent_runners() < 2:
        pytest.skip("this process gets one CPU")
    model = loader.load_native(tagger_build.path, threads=1, open="eager")
    dynamic = next(v for v in model.variants if v.kind == "dynamic")
    container = model._runners[dynamic.id].container  # below the guards: the long call's size is no served shape
    long = [np.ascontiguousarray(a) for a in tagger_inputs(16384, 32, seed=1)]
    short = [np.ascontiguousarray(a) for a in tagger_inputs(1, 32, seed=2)]
    container.run(short)
    took = {}

    def long_call():
        start = time.perf_counter()
        container.run(long)
        took["long"] = time.perf_counter() - start

    caller = threading.Thread(target=long_call)
    caller.start()
    while container._in_flight._count == 0:  # the long call is on its way into the compiled code
        time.sleep(0.0005)
    time.sleep(0.002)
    start = time.perf_counter()
    container.run(short)
    took["short"] = time.perf_counter() - start
    caller.join()
    # Waiting, the short call would take what was left of the long one: most of it.
    assert took["short"] < took["long"] / 4, took
