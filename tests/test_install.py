"""A real install: the wheel a fresh checkout builds (its packages, entry point and extras), and the
runtime working where nothing of the build side or the server can be imported."""

from __future__ import annotations

import email
import importlib.metadata
import re
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

from precompile.cli import COMMANDS, EXTRA_MODULES, main
from tests.isolation import NOT_RUNTIME, blocked_env

# Builds the wheel and installs it into fresh virtual environments.
pytestmark = pytest.mark.integration

ROOT = Path(__file__).resolve().parent.parent


@pytest.fixture(scope="module")
def wheel(tmp_path_factory) -> Path:
    """The wheel of the checkout's committed and new files (what a fresh clone holds), built offline."""
    src, out = tmp_path_factory.mktemp("src"), tmp_path_factory.mktemp("dist")
    files = subprocess.run(
        ["git", "ls-files", "-co", "--exclude-standard", "-z"], cwd=ROOT, capture_output=True, check=True
    ).stdout
    for rel in filter(None, files.decode().split("\0")):
        if (ROOT / rel).is_file():
            (src / rel).parent.mkdir(parents=True, exist_ok=True)
            (src / rel).write_bytes((ROOT / rel).read_bytes())
    subprocess.run(
        [
            sys.executable,
            "-m",
            "pip",
            "wheel",
            "--no-deps",
            "--no-build-isolation",
            "--no-index",
            "-q",
            "-w",
            str(out),
            str(src),
        ],
        check=True,
        capture_output=True,
    )
    (found,) = out.glob("precompile-*.whl")
    return found


def metadata(wheel: Path) -> tuple[list[str], email.message.Message, str]:
    with zipfile.ZipFile(wheel) as z:
        names = z.namelist()
        info = next(n for n in names if n.endswith(".dist-info/METADATA"))
        entry_points = next(n for n in names if n.endswith(".dist-info/entry_points.txt"))
        return names, email.message_from_bytes(z.read(info)), z.read(entry_points).decode()


def requirements(meta: email.message.Message) -> dict[str | None, set[str]]:
    """Distribution names required, per extra (None: the base install), self-references followed."""
    out: dict[str | None, set[str]] = {}
    for line in meta.get_all("Requires-Dist"):
        name = re.match(r"[A-Za-z0-9._-]+", line).group(0).lower().replace("_", "-")
        extra = m.group(1) if (m := re.search(r'extra == "([^"]+)"', line)) else None
        includes = re.match(r"precompile\[([^\]]+)\]", line)
        out.setdefault(extra, set()).update({f"[{includes.group(1)}]"} if includes else {name})
    for deps in out.values():
        while refs := {d for d in deps if d.startswith("[")}:
            deps -= refs
            for ref in refs:
                deps |= out[ref.strip("[]")]
    return out


def test_the_wheel_holds_the_runtime_the_cli_and_the_server_and_nothing_else(wheel):
    names, meta, entry_points = metadata(wheel)
    packages = {n.split("/")[0] for n in names if not n.split("/")[0].endswith(".dist-info")}
    assert packages == {"loader", "precompile"}
    for module in (
        "loader/__init__.py",
        "loader/model.py",
        "precompile/cli/__init__.py",
        "precompile/cli/serve.py",
        "precompile/serve/app.py",
        "precompile/standalone/shim.cpp",  # compiled by compile: {standalone: true}
    ):
        assert module in names
    assert re.search(r"^precompile = precompile\.cli:main$", entry_points, re.M)
    assert meta["Name"] == "precompile" and meta["Requires-Python"] == ">=3.10"


def test_the_extras_mean_something(wheel):
    needs = requirements(metadata(wheel)[1])
    assert needs[None] == {"torch", "numpy"}  # the runtime alone
    assert needs["packs"] == {"zstandard", "cryptography"}
    assert needs["serve"] == {
        "zstandard",
        "cryptography",
        "click",
        "fastapi",
        "uvicorn",
        "prometheus-client",
        "grpcio",
        "protobuf",
        "httptools",
    }
    assert {"click", "pydantic", "pyyaml", "rich", "ruamel.yaml", "safetensors"} <= needs["build"]
    assert not needs["build"] & {"fastapi", "uvicorn"} and not needs["serve"] & {
        "pyyaml",
        "rich",
        "pydantic",
        "safetensors",
    }
    assert needs["kserve"] == {"zstandard", "cryptography", "kserve"}
    assert needs["rayserve"] == {"zstandard", "cryptography", "ray"}
    assert needs["oci"] == {"zstandard", "cryptography"}  # the registry client is the standard library's
    assert needs["build"] | needs["serve"] | needs["kserve"] | needs["rayserve"] <= needs["dev"]
    # The CLI's table of what each extra brings matches the wheel's (import names to distributions).
    providers = importlib.metadata.packages_distributions()
    for extra, modules in EXTRA_MODULES.items():
        for module in modules:
            dists = {d.lower().replace("_", "-") for d in providers[module.split(".")[0]]}
            assert dists & needs[extra], f"{module} is not in the {extra} extra"


def run_python(code: str, env: dict) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=300)


def test_the_runtime_loads_and_calls_an_artifact_without_the_build_side_or_the_server(
    classifier_artifact, classifier_pack, tmp_path
):
    env = blocked_env(tmp_path / "site", NOT_RUNTIME, allowed=())
    code = f"""
import sys, torch, loader
for name in ("yaml", "click", "pydantic"):
    try:
        __import__(name)
    except ImportError:
        pass
    else:
        sys.exit(f"{{name}} is importable: the blocker does not work")
model = loader.load({str(classifier_artifact)!r})
packed = loader.load({str(classifier_pack)!r}, cache_dir={str(tmp_path / "cache")!r})
ids, mask = torch.randint(0, 50, (3, 11)), torch.ones(3, 11, dtype=torch.bool)
torch.testing.assert_close(model(ids, mask), packed(ids, mask))
print(sorted(m for m in sys.modules if m.split(".")[0] in {NOT_RUNTIME!r} or m.startswith("precompile")))
"""
    result = run_python(code, env)
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == "[]"


def test_a_pack_without_the_packs_extra_is_a_one_line_error(classifier_pack, tmp_path):
    env = blocked_env(tmp_path / "site", ("zstandard",), allowed=())
    code = f"""
import loader
try:
    loader.load({str(classifier_pack)!r}, cache_dir={str(tmp_path / "cache")!r})
except loader.LoaderError as e:
    print(e)
"""
    result = run_python(code, env)
    assert result.returncode == 0, result.stderr
    assert (
        result.stdout.strip()
        == "a pack (.tar.zst) needs zstandard, which is not installed: pip install 'precompile[packs]'"
    )


def test_a_command_whose_extra_is_missing_says_which_to_install(tmp_path):
    env = blocked_env(tmp_path / "site", ("yaml", "rich", "ruamel", "safetensors"))
    for args in (["build", "profile.yaml"], ["init", "--help"], ["plan", "x.yaml", "--json"]):
        result = subprocess.run(
            [sys.executable, "-m", "precompile", *args], env=env, capture_output=True, text=True, timeout=300
        )
        assert result.returncode == 1
        assert result.stderr.strip() == (
            f"Error: precompile {args[0]} needs the build extra (yaml, rich, ruamel.yaml, safetensors not installed): "
            "pip install 'precompile[build]'"
        )
    listing = subprocess.run(
        [sys.executable, "-m", "precompile", "--help"], env=env, capture_output=True, text=True, timeout=300
    )
    assert listing.returncode == 0 and "build     (needs pip install 'precompile[build]')" in listing.stdout
    assert "serve     Serve ARTIFACT over HTTP" in listing.stdout


def test_the_command_without_click_names_the_extras(tmp_path):
    env = blocked_env(tmp_path / "site", NOT_RUNTIME)
    result = subprocess.run(
        [sys.executable, "-m", "precompile", "--help"], env=env, capture_output=True, text=True, timeout=300
    )
    assert result.returncode == 1
    assert result.stderr.strip() == (
        "precompile: the command line needs the serve or the build extra: "
        "pip install 'precompile[serve]' (to serve) or 'precompile[build]' (to build)"
    )


def test_every_command_is_listed_and_registers_itself():
    assert main.list_commands(None) == sorted(COMMANDS)
    for name in COMMANDS:
        assert main.get_command(None, name).name == name
