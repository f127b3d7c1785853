"""Run Python as an install without the build side would: a ``sitecustomize`` put first on
PYTHONPATH installs a ``sys.meta_path`` finder that refuses the build side's packages (and
precompile's build modules), as if they were not installed. Child processes inherit it through
PYTHONPATH, so a server that re-executes itself stays blocked."""

from __future__ import annotations

import os
import sys
from pathlib import Path

# What the build extra adds beyond the serve extra (pydantic is FastAPI's), by import name.
BUILD_PACKAGES = ("yaml", "rich", "ruamel", "safetensors")
# What the runtime alone (no extra) leaves out: the build side and the server with its CLI.
NOT_RUNTIME = (*BUILD_PACKAGES, "pydantic", "click", "fastapi", "uvicorn", "prometheus_client", "grpc")
# What the CLI and the server may import of precompile: anything else is the build side. (version,
# quiet and options are a string, a logging call and a table of option names: no dependency at all.)
SERVING_MODULES = (
    "precompile.cli",
    "precompile.serve",
    "precompile.errors",
    "precompile.__main__",
    "precompile.version",
    "precompile.quiet",
    "precompile.options",
)

SITECUSTOMIZE = '''
import sys

BLOCKED = {blocked!r}
ALLOWED = {allowed!r}


class Blocker:
    """Refuses the build side, as an install without it would."""

    def find_spec(self, name, path=None, target=None):
        top = name.split(".")[0]
        if top in BLOCKED or (top == "precompile" and name != "precompile" and not name.startswith(ALLOWED)):
            raise ModuleNotFoundError(f"No module named {{name!r}} (blocked: not part of this install)", name=name)
        return None


sys.meta_path.insert(0, Blocker())
'''


def blocked_env(
    folder: Path, blocked: tuple[str, ...], *, allowed: tuple[str, ...] = SERVING_MODULES, env: dict | None = None
) -> dict[str, str]:
    """An environment whose Python processes cannot import ``blocked`` (top-level names) nor any
    precompile module outside ``allowed``."""
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "sitecustomize.py").write_text(SITECUSTOMIZE.format(blocked=tuple(blocked), allowed=tuple(allowed)))
    env = dict(os.environ if env is None else env)
    env["PYTHONPATH"] = os.pathsep.join([str(folder), str(Path(__file__).resolve().parent.parent)])
    env.setdefault("OMP_WAIT_POLICY", "PASSIVE")
    return env


def venv_bin(name: str) -> str:
    """The console script ``name`` of the Python running the tests."""
    return str(Path(sys.executable).parent / name)
