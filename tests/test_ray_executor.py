"""`precompile build --executor ray` against a real local Ray cluster started by this module: a head
and one more worker node, each a `ray start --block` process of ours, on loopback addresses only
(tests/ray_cluster.py says why those are 127.0.0.2 and .3)."""

from __future__ import annotations

import sys
import textwrap
from pathlib import Path

import pytest
import torch
from click.testing import CliRunner

import loader
from precompile.cli import main
from precompile.errors import CompileError, ModelError, PrecompileError
from precompile.pipeline import build

from .conftest import CLASSIFIER_PROFILE, builds, write_profile
from .ray_cluster import LocalRayCluster, free_port

ray = pytest.importorskip("ray")

HEAD_IP, WORKER_IP = "127.0.0.2", "127.0.0.3"

# Factories that behave differently inside a Ray worker (the driver resolves the model too, for the
# checks): each logs its worker's pid to `log`, then dies or raises as its name says.
FLAKY = """
import os, sys
import tiny

def _in_ray_worker():
    return sys.argv[0].endswith("default_worker.py")

def _log(log):
    with open(log, "a") as f:
        f.write(f"{os.getpid()}\\n")

def dies_once(log, **kwargs):
    if _in_ray_worker():
        _log(log)
        if len(open(log).read().split()) == 1:
            os._exit(1)
    return tiny.classifier(**kwargs)

def always_dies(log, **kwargs):
    if _in_ray_worker():
        _log(log)
        os._exit(1)
    return tiny.classifier(**kwargs)

def raises_in_worker(log, **kwargs):
    if _in_ray_worker():
        _log(log)
        raise ValueError("this model cannot be built here")
    return tiny.classifier(**kwargs)
"""


@pytest.fixture(scope="module")
@builds
def ray_cluster(tmp_path_factory):
    """A head and a worker node of 1 CPU each; yields the head's address."""
    with LocalRayCluster(tmp_path_factory.mktemp("ray"), nodes=2, cpus=1) as address:
        try:
            yield address
        finally:
            if ray.is_initialized():
                ray.shutdown()


def flaky_profile(folder: Path, factory: str) -> tuple[Path, Path]:
    """The conftest classifier profile, built through ``flaky:<factory>``; returns (profile, pid log)."""
    log = folder / "attempts.log"
    text = CLASSIFIER_PROFILE.replace(
        'model: {factory: "tiny:classifier", kwargs: {vocab: 50, width: 16}}',
        f'model: {{factory: "flaky:{factory}", kwargs: {{log: "{log}", vocab: 50, width: 16}}}}',
    )
    profile = write_profile(folder, text)
    (folder / "flaky.py").write_text(textwrap.dedent(FLAKY))
    return profile, log


def attempts(log: Path) -> list[str]:
    return log.read_text().split() if log.exists() else []


@pytest.fixture(scope="module")
@builds
def ray_build(ray_cluster, tmp_path_factory):
    """The classifier built on the cluster through the CLI, its worker dying on the first try."""
    folder = tmp_path_factory.mktemp("ray-build")
    profile, log = flaky_profile(folder, "dies_once")
    out = folder / "artifact"
    result = CliRunner().invoke(
        main,
        ["build", str(profile), "-o", str(out), "--executor", "ray", "--address", ray_cluster],
        catch_exceptions=False,
    )
    assert result.exit_code == 0, result.output
    return out, log, result.output


def test_a_ray_build_matches_a_local_build(ray_build, classifier_artifact):
    out, _, output = ray_build
    remote, local = loader.load(out), loader.load(classifier_artifact)
    strip = lambda m: [(v.id, v.kind, v.dims, v.hint, v.constants, v.device, v.dtype) for v in m.variants]  # noqa: E731
    assert strip(remote.manifest) == strip(local.manifest)
    for batch, seq in [(1, 2), (3, 17), (8, 48)]:
        ids, mask = torch.randint(0, 50, (batch, seq)), torch.rand(batch, seq) > 0.3
        assert torch.equal(remote(ids, mask), local(ids, mask))
    assert f"on {HEAD_IP}" in output or f"on {WORKER_IP}" in output  # the progress line says where it compiled
    assert "ray: 2 node(s), 2 CPU(s)" in output


def test_a_unit_whose_worker_dies_is_retried(ray_build):
    _, log, _ = ray_build
    first, second = attempts(log)  # the first worker died in the factory, a fresh one compiled the unit
    assert first != second


def test_a_unit_failing_every_time_is_reported_by_name(ray_cluster, tmp_path):
    from precompile.executors.ray import RayExecutor

    profile, log = flaky_profile(tmp_path, "always_dies")
    with pytest.raises(
        CompileError, match=r"variant dynamic batch.*: its Ray task failed 2 time\(s\): WorkerCrashedError"
    ):
        build(profile, tmp_path / "artifact", executor=RayExecutor(ray_cluster, retries=1))
    assert len(attempts(log)) == 2
    assert not (tmp_path / "artifact").exists()


def test_a_user_error_is_not_retried(ray_cluster, tmp_path):
    from precompile.executors.ray import RayExecutor

    profile, log = flaky_profile(tmp_path, "raises_in_worker")
    with pytest.raises(ModelError, match="this model cannot be built here"):
        build(profile, tmp_path / "artifact", executor=RayExecutor(ray_cluster, retries=2))
    assert len(attempts(log)) == 1


def test_an_unreachable_address_is_named(classifier_profile):
    address = f"{HEAD_IP}:{free_port()}"  # nothing listens there
    result = CliRunner().invoke(main, ["build", str(classifier_profile), "--executor", "ray", "--address", address])
    assert result.exit_code == 1
    assert f"--address {address}: no Ray cluster answers there" in result.output


def test_without_ray_the_error_says_what_to_install(classifier_profile, monkeypatch):
    monkeypatch.setitem(sys.modules, "ray", None)  # `import ray` fails as it does where it is not installed
    result = CliRunner().invoke(main, ["build", str(classifier_profile), "--executor", "ray"])
    assert result.exit_code == 1
    assert "--executor ray needs Ray on this host and the cluster's: pip install 'precompile[ray]'" in result.output


def test_address_needs_the_ray_executor(classifier_profile):
    result = CliRunner().invoke(main, ["build", str(classifier_profile), "--address", "127.0.0.2:6379"])
    assert result.exit_code == 1
    assert "--address is an option of the Ray executor: use it with --executor ray" in result.output


def test_the_local_executor_is_the_default(tmp_path):
    from precompile.executors import executor_named
    from precompile.executors.local import LocalExecutor

    assert isinstance(executor_named("local"), LocalExecutor)
    with pytest.raises(PrecompileError, match="--ray-cpus is an option of the Ray executor"):
        executor_named("local", cpus=4)
    with pytest.raises(PrecompileError, match="--executor dask: unknown"):
        executor_named("dask")
