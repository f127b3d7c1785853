"""Sharded builds: `precompile build --shard K/N` parts and `precompile assemble`, and the example CI
workflow (.github/workflows/sharded-build.yml) whose `run:` steps are executed here as a runner would,
with the object store a real `rclone serve s3` on loopback."""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
import torch
import yaml
from click.testing import CliRunner

import loader
from precompile.cli import main
from precompile.errors import PrecompileError
from precompile.shard import PartError, assemble, parse_shard, share
from precompile.units import CompileTask, VariantPlan
from tests.conftest import builds, write_profile
from tests.test_remote import BUCKET, s3, store_env  # noqa: F401  (fixtures: the S3 server)

ROOT = Path(__file__).resolve().parent.parent
WORKFLOW = ROOT / ".github" / "workflows" / "sharded-build.yml"

PROFILE = """
name: tiny-sharded
model: {factory: "tiny:classifier", kwargs: {vocab: 50, width: 16}}
inputs:
  ids:  {shape: [batch, seq], dtype: int64, range: [0, 49]}
  mask: {shape: [batch, seq], dtype: bool}
dims:
  batch: {min: 1, max: 4}
  seq:   {min: 2, max: 32}
plan: {max_specialized: 1, ranges: {seq: [16]}}
distribution:
  shapes: [{batch: 1, seq: 8, count: 10}, {batch: 2, seq: 24, count: 3}]
check: {random_shapes: 1}
"""


# --- the workflow's steps, run as a runner would ---------------------------------------------------


def workflow() -> dict:
    return yaml.safe_load(WORKFLOW.read_text())


def expand(text: str, context: dict[str, str]) -> str:
    """GitHub's ${{ ... }} expressions, from ``context`` (matrix.shard, inputs.version, secrets.X, vars.X)."""

    def value(m: re.Match) -> str:
        key = m.group(1).strip()
        if key not in context:
            raise KeyError(f"the test gives no value for ${{{{ {key} }}}}")
        return context[key]

    return re.sub(r"\$\{\{\s*([^}]+?)\s*\}\}", value, text)


def run_job(name: str, cwd: Path, context: dict[str, str], extra_env: dict[str, str] | None = None) -> None:
    """Every `run:` step of job ``name`` except the install ones (this venv is the install), in bash,
    with the workflow's and the step's env; `uses:` steps (checkout, artifacts) are folder moves here."""
    wf = workflow()
    env = {**os.environ, **(extra_env or {})}
    env["PATH"] = f"{Path(sys.executable).parent}{os.pathsep}{env['PATH']}"
    env.update({k: expand(str(v), context) for k, v in wf["env"].items()})
    for step in wf["jobs"][name]["steps"]:
        if "run" not in step or step.get("name") == "install":
            continue
        step_env = {k: expand(str(v), context) for k, v in step.get("env", {}).items()}
        result = subprocess.run(
            ["bash", "-euo", "pipefail", "-c", expand(step["run"], context)],
            cwd=cwd,
            env={**env, **step_env},
            capture_output=True,
            text=True,
            timeout=600,
        )
        assert result.returncode == 0, f"step {step.get('name')!r} failed:\n{result.stdout}\n{result.stderr}"


@pytest.fixture(scope="session")
@builds
def parts(tmp_path_factory) -> Path:
    """The compile job of the workflow, once per shard of its matrix, side by side as a runner pool
    runs a matrix (each job writes only its own part): the parts, in a CI checkout."""
    checkout = tmp_path_factory.mktemp("checkout")
    write_profile(checkout / "profiles", PROFILE)

    def compile_job(shard: int) -> None:
        context = {"inputs.profile": "profiles/profile.yaml", "inputs.version": "3", "matrix.shard": str(shard)}
        run_job("compile", checkout, context)

    shards = workflow()["jobs"]["compile"]["strategy"]["matrix"]["shard"]
    with ThreadPoolExecutor(len(shards)) as pool:
        list(pool.map(compile_job, shards))  # a failed job's assertion is raised here
    return checkout


def test_the_workflow_compiles_shards_then_assembles_signs_and_pushes(parts, s3, tmp_path):  # noqa: F811
    # The release job in its own copy of the checkout, with the parts "downloaded" into it.
    checkout = tmp_path / "release"
    shutil.copytree(parts, checkout)
    result = CliRunner().invoke(main, ["keygen", "-o", str(tmp_path / "release")])
    assert result.exit_code == 0, result.output
    context = {
        "inputs.profile": "profiles/profile.yaml",
        "inputs.version": "3",
        "secrets.PRECOMPILE_SIGNING_KEY": (tmp_path / "release.key").read_text().strip(),
        "vars.ARTIFACT_STORE": f"s3://{BUCKET}",
    }
    run_job("release", checkout, context, {"AWS_ENDPOINT_URL": s3.endpoint})
    assert not (checkout / "release.key").exists()
    model = loader.load(f"s3://{BUCKET}/tiny-sharded/3.tar.zst", trusted_keys=[tmp_path / "release.pub"])
    assert model.manifest.version == 3
    ids, mask = torch.randint(0, 50, (2, 20)), torch.ones(2, 20, dtype=torch.bool)
    sys.path.insert(0, str(checkout / "profiles"))
    try:
        import tiny

        want = tiny.classifier(vocab=50, width=16)(ids, mask)
    finally:
        sys.path.remove(str(checkout / "profiles"))
    # The factory seeds its weights: eager here is the model the build compiled.
    assert torch.allclose(model(ids, mask), want, atol=1e-4)


def test_parts_share_the_units_and_assemble_into_the_full_artifact(parts, tmp_path):
    records = [json.loads((parts / "parts" / f"part-{k}" / "part.json").read_text()) for k in (1, 2)]
    units = records[0]["units"]
    built = [sorted(b["file"] for b in r["built"]) for r in records]
    assert records[1]["units"] == units and len(units) == 3  # one static and two dynamic variants
    assert sorted(built[0] + built[1]) == units and not set(built[0]) & set(built[1])
    result = assemble(
        [parts / "parts" / "part-2", parts / "parts" / "part-1"],
        tmp_path / "artifact",
        profile=parts / "profiles" / "profile.yaml",
    )
    assert sorted(v.file.split("/")[-1] for v in result.manifest.variants) == units
    check = CliRunner().invoke(main, ["verify", str(result.path), "--run"])
    assert check.exit_code == 0, check.output


def copy_part(parts: Path, k: int, dest: Path) -> Path:
    out = dest / f"part-{k}"
    shutil.copytree(parts / "parts" / f"part-{k}", out)
    return out


def edit(part: Path, change) -> None:
    record = json.loads((part / "part.json").read_text())
    change(record)
    (part / "part.json").write_text(json.dumps(record))


def test_a_missing_or_doubled_shard_is_named(parts, tmp_path):
    profile = parts / "profiles" / "profile.yaml"
    with pytest.raises(PartError, match="shard\\(s\\) 1/2 missing"):
        assemble([parts / "parts" / "part-2"], tmp_path / "a", profile=profile)
    with pytest.raises(PartError, match="shard 2/2 given twice"):
        assemble([parts / "parts" / "part-2", copy_part(parts, 2, tmp_path)], tmp_path / "a", profile=profile)
    assert not (tmp_path / "a").exists()


def test_parts_of_other_builds_are_refused(parts, tmp_path):
    profile = parts / "profiles" / "profile.yaml"
    one = copy_part(parts, 1, tmp_path)
    edit(one, lambda r: r.update(model_sha256="0" * 64))
    with pytest.raises(PartError, match="different builds: their model weights differ"):
        assemble([one, parts / "parts" / "part-2"], tmp_path / "a", profile=profile)
    one = copy_part(parts, 1, tmp_path / "x")
    edit(one, lambda r: r.update(torch_version="2.99.0"))
    with pytest.raises(PartError, match="torch version differ"):
        assemble([one, parts / "parts" / "part-2"], tmp_path / "a", profile=profile)
    (tmp_path / "artifact").mkdir()
    (tmp_path / "artifact" / "manifest.json").write_text("{}")
    with pytest.raises(PartError, match="an artifact, not a build part"):
        assemble([tmp_path / "artifact"], tmp_path / "a", profile=profile)


def test_a_profile_changed_since_the_parts_is_refused(parts, tmp_path):
    checkout = tmp_path / "checkout"
    shutil.copytree(parts, checkout)
    profile = checkout / "profiles" / "profile.yaml"
    profile.write_text(profile.read_text().replace("count: 10", "count: 11"))
    with pytest.raises(PartError, match="is not the profile the parts were built from"):
        assemble([checkout / "parts" / "part-1", checkout / "parts" / "part-2"], tmp_path / "a", profile=profile)


def test_a_missing_package_is_named(parts, tmp_path):
    one = copy_part(parts, 1, tmp_path)
    for f in (one / "variants").iterdir():
        f.unlink()
    with pytest.raises(PartError, match="variants/.* is missing"):
        assemble([one, parts / "parts" / "part-2"], tmp_path / "a", profile=parts / "profiles" / "profile.yaml")


def test_cli_errors(parts, tmp_path):
    result = CliRunner().invoke(main, ["build", str(parts / "profiles" / "profile.yaml"), "--shard", "3/2"])
    assert result.exit_code != 0 and "expected K/N with 1 ≤ K ≤ N" in result.output
    result = CliRunner().invoke(
        main,
        [
            "assemble",
            str(parts / "parts" / "part-1"),
            "-o",
            str(tmp_path / "a"),
            "--profile",
            str(parts / "profiles" / "profile.yaml"),
        ],
    )
    assert result.exit_code == 1 and "shard(s) 2/2 missing" in result.output and "Traceback" not in result.output


# --- the share ---------------------------------------------------------------------------------------


def fake_tasks(count: int) -> list[CompileTask]:
    vp = VariantPlan("v", "dynamic", {"n": (1, 2)}, {"n": 2})
    return [CompileTask(vp, 0, {}, f"u{i:02d}.pt2") for i in range(count)]


@pytest.mark.parametrize("n", [1, 2, 3, 5, 8])
def test_shares_partition_the_units_whatever_their_order(n):
    tasks = fake_tasks(7)
    shares = [share(tasks, k, n) for k in range(1, n + 1)]
    assert sorted(t.file for s in shares for t in s) == sorted(t.file for t in tasks)
    assert max(len(s) for s in shares) - min(len(s) for s in shares) <= 1
    assert [share(list(reversed(tasks)), k, n) for k in range(1, n + 1)] == shares


@pytest.mark.parametrize("text", ["0/2", "3/2", "1", "a/b", "1/0", ""])
def test_parse_shard_refuses(text):
    with pytest.raises(PrecompileError, match="expected K/N"):
        parse_shard(text)
