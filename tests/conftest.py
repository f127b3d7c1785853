"""Shared fixtures. AOTInductor compiles cost 5-30 s each on 2 cores, so every artifact the suite
needs is built once per session here and shared by the tests that read it."""

from __future__ import annotations

import os
import shutil
import textwrap
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
from click.testing import CliRunner

from precompile.cli import main
from precompile.pipeline import BuildResult, build

from . import compile_count

MODELS = Path(__file__).parent / "models" / "tiny.py"

# A developer's build cache must not let the suite's builds skip their compiles: tests that use the
# cache say so (the build_cache fixture).
os.environ.pop("PRECOMPILE_BUILD_CACHE", None)

if os.environ.get(compile_count.ENV):  # docs/testing.md: the compiles each file causes
    compile_count.install(tests=True)

CLASSIFIER_PROFILE = """
name: tiny-classifier
model: {factory: "tiny:classifier", kwargs: {vocab: 50, width: 16}}
inputs:
  ids:  {shape: [batch, seq], dtype: int64, range: [0, 49]}
  mask: {shape: [batch, seq], dtype: bool}
dims:
  batch: {min: 1, max: 8}
  seq:   {min: 2, max: 48}
check: {random_shapes: 6}
"""

STRUCTURED_PROFILE = """
name: tiny-structured
model: {factory: "tiny:structured"}
inputs:
  x: {shape: [batch, 8], dtype: float32}
dims:
  batch: {min: 1, max: 32}
"""


# --- tiers (markers registered in pyproject.toml; `make test-fast` runs `-m unit`) -----------------
#
# A test's tier is decided here, once, so that no file can drift into the wrong one:
# - `slow` or `integration` marked by its module (`pytestmark`) or itself stays so: a test that
#   compiles or exports a model, or starts a server or a child process, in its own body says so that way.
# - A test that uses a fixture building an artifact or starting a server (directly or through another
#   fixture: pytest lists the whole closure in ``item.fixturenames``) is `integration`. Such a fixture
#   says so where it is defined, with ``@builds`` under its ``@pytest.fixture``.
# - Every other test is `unit`: in process, no compile or export, no server, no child process.
# Deciding by fixtures, rather than by a mark on every test, keeps a new test that takes
# `classifier_artifact` (or a module's own building fixture) out of the quick tier without anyone
# remembering to mark it.
BUILDING_FIXTURES: set[str] = set()


def builds(fixture: Callable[..., Any]) -> Callable[..., Any]:
    """Declare a fixture that compiles an artifact or starts a server: every test using it, however
    indirectly, is `integration`. Fixtures are known by name, so a same-named fixture elsewhere is
    counted too (a test wrongly out of the quick tier is slower, never untested)."""
    BUILDING_FIXTURES.add(fixture.__name__)
    return fixture


# --- order: the longest files first ---------------------------------------------------------------
#
# `make test` hands whole files to its xdist workers (--dist loadfile) in collection order
# (--no-loadscope-reorder: xdist's own reorder sends the files with the most tests first, which left a
# 9-minute file of 17 tests to the end). Files known to take a minute or more, their compiles and
# servers included, go first, longest first (measured on 2026-12-03's 2-core host), so that the
# other worker drains the short files meanwhile and the run ends with both workers busy. A file
# missing here only runs later; a file that grows slow belongs on the list. test_convnets.py (368-512 s)
# was split in two on 2026-12-04 (docs/testing.md): its halves are placed by their share of it alone
# (85 s and 64 s of 208 s on their own).
LONGEST_FIRST = (
    "test_precision.py",
    "test_prepack.py",
    "test_convnets.py",
    "test_build.py",
    "test_shard.py",
    "test_ray_executor.py",
    "test_standalone.py",
    "test_api.py",
    "test_rayserve.py",
    "test_batching_section.py",
    "test_doctor.py",
    "test_hostile.py",
    "test_guards.py",
    "test_triton.py",
    "test_gpu_check.py",
    "test_build_cache.py",
    "test_bench.py",
    "test_serve_repository.py",
    "test_tune.py",
    "test_kserve.py",
    "test_threads.py",
)


def _file_rank(item: pytest.Item) -> int:
    name = item.path.name
    return LONGEST_FIRST.index(name) if name in LONGEST_FIRST else len(LONGEST_FIRST)


def pytest_collection_modifyitems(config, items) -> None:
    items.sort(key=_file_rank)  # stable: a file's tests keep their order, the other files theirs
    for item in items:
        if item.get_closest_marker("slow") or item.get_closest_marker("integration"):
            continue
        if BUILDING_FIXTURES.intersection(item.fixturenames):
            item.add_marker(pytest.mark.integration)
        else:
            item.add_marker(pytest.mark.unit)


def write_profile(folder: Path, text: str, name: str = "profile.yaml") -> Path:
    """Write a profile beside a copy of tests/models/tiny.py (its factories are importable as tiny:...)."""
    folder.mkdir(parents=True, exist_ok=True)
    shutil.copy(MODELS, folder / "tiny.py")
    path = folder / name
    path.write_text(textwrap.dedent(text))
    return path


@pytest.fixture(scope="session", autouse=True)
def compile_in_the_test_process():
    """A build that is not given ``jobs`` compiles its variants one after the other in the test's
    process, as ``--jobs 1`` does, instead of one spawned worker per variant up to the CPUs (the local
    executor's default, 2 here). Each such worker imports torch and warms Inductor up again, about 6 s
    of CPU, while the suite's other xdist worker holds the other core anyway: the gray net's fixture
    (tests/test_prepack.py) takes 31 s of CPU so, 44 s with its two workers. The spawned
    path stays tested by the builds that ask for ``jobs=2`` (tagger_build, tests/test_build.py,
    tests/test_api.py); a CLI run as a child process keeps the default."""
    from precompile.executors import local

    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(local, "default_jobs", lambda tasks: 1)
        yield


@pytest.fixture(scope="session")
def inductor_defaults() -> dict[str, Any]:
    import torch._inductor.config

    return torch._inductor.config.get_config_copy()


@pytest.fixture(autouse=True)
def inductor_config_restored(compile_in_the_test_process, inductor_defaults):
    """Inductor's global config as it was at the start of the session after every test. An int8
    (dynamic) unit's torchao quantization sets some of it for the rest of the process
    (coordinate_descent_tuning, force_fuse_int_mm_with_mul): compiled in the test's process, it would
    change every later compile of the worker, and their build-cache keys (the strict gate's bf16 build
    then compiled again instead of reusing the lowp fixture's)."""
    yield
    import torch._inductor.config

    if torch._inductor.config.get_config_copy() != inductor_defaults:
        torch._inductor.config.load_config(inductor_defaults)


@pytest.fixture(autouse=True)
def background_openers_done():
    """No model's background opener (``load(open="background")``: its other variants and the rest
    of its warm-up) runs on into the next test: a test that changes files under a model it loaded,
    or counts threads, mapped libraries or time, sees only its own."""
    yield
    import loader.opening

    assert loader.opening.wait_openers(300), "a background opener still runs 5 minutes after its test"


@pytest.fixture(scope="session")
def build_cache(tmp_path_factory) -> Path:
    """The session's build cache (``precompile.build_cache``): builds that compile what another
    build of the session compiled already (the same model from another source) pass it. Under
    pytest-xdist, one folder for every worker: each session fixture compiles once for them all."""
    base = tmp_path_factory.getbasetemp()
    folder = (base.parent if os.environ.get("PYTEST_XDIST_WORKER") else base) / "build-cache"
    folder.mkdir(exist_ok=True)
    return folder


@pytest.fixture(scope="session")
@builds
def classifier_build(tmp_path_factory, build_cache) -> tuple[Path, BuildResult]:
    """(the output given, the result) of ``precompile.build(<the profile's path>, output)``: the
    artifact most tests read, and tests/test_api.py's build from a path. The CLI's happy path is
    structured_cli_build's. Its compile goes into the session's build cache."""
    folder = tmp_path_factory.mktemp("classifier")
    out = folder / "artifact"
    return out, build(write_profile(folder, CLASSIFIER_PROFILE), out, cache=build_cache)


@pytest.fixture(scope="session")
def classifier_artifact(classifier_build) -> Path:
    return classifier_build[1].path


@pytest.fixture(scope="session")
def classifier_profile(classifier_artifact) -> Path:
    return classifier_artifact.parent / "profile.yaml"


@pytest.fixture(scope="session")
@builds
def structured_cli_build(tmp_path_factory, build_cache) -> tuple[Path, str]:
    """Built through the CLI in a pipe (CliRunner's output is no terminal): (artifact, what the command
    printed), so tests/test_cli.py reads the lines of this build instead of compiling its own. Its
    compile goes into the session's build cache."""
    folder = tmp_path_factory.mktemp("structured")
    profile = write_profile(folder, STRUCTURED_PROFILE)
    out = folder / "artifact"
    args = ["build", str(profile), "-o", str(out), "--cache", str(build_cache)]
    result = CliRunner().invoke(main, args, catch_exceptions=False)
    assert result.exit_code == 0, result.output
    return out, result.output


@pytest.fixture(scope="session")
def structured_artifact(structured_cli_build) -> Path:
    return structured_cli_build[0]


TAGGER_PROFILE = """
name: tiny-tagger
model: {factory: "tiny:tagger"}
inputs:
  ids:  {shape: [batch, seq], dtype: int64, range: [0, 49]}
  mask: {shape: [batch, seq], dtype: bool, range: [1, 1]}
dims:
  batch: {min: 1, max: 8}
  seq:   {min: 4, max: 32}
distribution:
  shapes:
    - {batch: 1, seq: 16, count: 500}
    - {batch: 2, seq: 8, count: 300}
    - {batch: 4, seq: 24, count: 100}
    - {batch: 12, seq: 16, count: 30}
    - {batch: 1, seq: 2, count: 20}
outputs:
  - {shape: [batch, seq, 3]}
  - {shape: [batch, 3]}
plan:
  max_specialized: 2
  coverage: 0.9
  ranges: {seq: [16]}
policy:
  out_of_range: {batch: split, seq: pad}
  pad_value: {mask: 0}
"""


@pytest.fixture(scope="session")
@builds
def tagger_build(tmp_path_factory, build_cache):
    """A planned artifact: 2 static variants, 2 dynamic ones over seq [4,16] and [17,32], pad and
    split policies. Compiled with 2 jobs, so the parallel path is exercised; its compiles go into the
    session's build cache (the second xdist worker wanting it copies them)."""
    folder = tmp_path_factory.mktemp("tagger")
    return build(write_profile(folder, TAGGER_PROFILE), folder / "artifact", jobs=2, cache=build_cache)


ENCODER_PROFILE = """
name: tiny-encoder
model: {factory: "tiny:encoder"}
inputs:
  ids:  {shape: [batch, seq], dtype: int64, range: [0, 49]}
  mask: {shape: [batch, seq], dtype: bool, range: [1, 1]}
dims:
  batch: {min: 1, max: 8}
  seq:   {min: 2, max: 32}
outputs:
  - {shape: [batch, seq, 16]}
  - {shape: [batch, 16]}
plan:
  ranges: {seq: [16]}             # two dynamic variants: seq 2..16 and 17..32
check: {random_shapes: 1}
batching:
  pad: [seq]
  pad_value: {mask: 0}
"""


@pytest.fixture(scope="session")
@builds
def encoder_artifact(tmp_path_factory, build_cache) -> Path:
    """Two dynamic variants with a batching section (pad seq): tests/test_batching_section.py reads
    its manifest, tests/test_serve_native.py batches it without torch. Its compiles go into the
    session's build cache, so the two files' workers compile it once."""
    folder = tmp_path_factory.mktemp("encoder")
    return build(write_profile(folder, ENCODER_PROFILE), folder / "artifact", cache=build_cache).path


def artifact_version(src: Path, dst: Path, version: int) -> Path:
    """A copy of an artifact released under another version number: same compiled files, so it loads
    without a second compile (the manifest lists the files, not itself)."""
    import json

    shutil.copytree(src, dst)
    manifest = json.loads((dst / "manifest.json").read_text())
    manifest["version"] = version
    (dst / "manifest.json").write_text(json.dumps(manifest, indent=2) + "\n")
    return dst


@pytest.fixture(scope="session")
def classifier_versions(classifier_artifact, tmp_path_factory) -> list[Path]:
    """The classifier as versions 1 to 4 (for hot swap)."""
    folder = tmp_path_factory.mktemp("versions")
    return [classifier_artifact] + [artifact_version(classifier_artifact, folder / f"v{n}", n) for n in (2, 3, 4)]


@pytest.fixture(scope="session")
@builds
def classifier_workers(classifier_artifact):
    """`precompile serve CLASSIFIER --workers 2 --grpc-port G` as a process, for the tests that read
    what its workers answer and change nothing (tests/test_workers.py, tests/test_serve_load.py): one
    start instead of one each. Yields (HTTP port, gRPC port)."""
    from .test_serve_load import free_port, serve_command

    grpc_port = free_port()
    with serve_command(classifier_artifact, "--workers", "2", "--grpc-port", str(grpc_port)) as port:
        yield port, grpc_port


@pytest.fixture(scope="session")
@builds
def classifier_batched(classifier_artifact):
    """`precompile serve CLASSIFIER --batch --max-delay-ms 20 --grpc-port G` as a process, for the Open
    Inference Protocol tests over HTTP (tests/test_oip.py) and gRPC (tests/test_grpc.py), which count
    what their own calls add. Yields (HTTP port, gRPC port)."""
    from .test_serve_load import free_port, serve_command

    grpc_port = free_port()
    with serve_command(classifier_artifact, "--batch", "--max-delay-ms", "20", "--grpc-port", str(grpc_port)) as port:
        yield port, grpc_port


# --- shipping (packs, signatures, cache): built from the session artifacts, no compile of their own ---


@pytest.fixture(scope="session")
def signing_keys(tmp_path_factory) -> tuple[Path, Path]:
    """An Ed25519 key pair made by `precompile keygen`: (private .key, public .pub)."""
    from precompile.ship.sign import keygen

    private, public, _ = keygen(tmp_path_factory.mktemp("keys") / "release")
    return private, public


@pytest.fixture(scope="session")
def classifier_pack(classifier_artifact, tmp_path_factory) -> Path:
    """The classifier artifact as an unsigned pack (`precompile pack`)."""
    from precompile.ship.pack import pack

    return pack(classifier_artifact, tmp_path_factory.mktemp("packs") / "classifier.tar.zst")
