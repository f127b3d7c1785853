"""Count the suite's AOTInductor compiles: ``PRECOMPILE_COUNT_COMPILES=FILE pytest ...`` appends one
line per compile to FILE, ``compile<TAB>the test<TAB>in-process or child<TAB>its wall seconds`` (a session fixture's
compile is its first test's; a child: a spawned compile worker, a CLI run as a process), and one
``hit<TAB>...`` per build-cache hit (a compile that was copied, not run). Wall time on a
shared host is noisy; the number of compiles a file causes is not (docs/testing.md counts them so).

The count is taken where the work is: ``torch._inductor.aoti_compile_and_package`` (every compile,
precompile's, the ISA probes' and a test's own) and ``precompile.build_cache.lookup``. Child
processes (the local executor's spawned workers, a CLI run as a process) are counted too: a
``sitecustomize`` put first on PYTHONPATH installs the same count in them, on import of either module,
so a process that never compiles never imports torch for it. A child started with PYTHONPATH removed
(a loader-only install's test) is not counted; none of those compiles.
"""

from __future__ import annotations

import functools
import importlib.abc
import importlib.util
import os
import sys
import tempfile
import time
from pathlib import Path

ENV = "PRECOMPILE_COUNT_COMPILES"
PID = "COMPILE_COUNT_PID"  # the test process's: a compile elsewhere is a child's (a spawned compile worker, a CLI)


def _record(kind: str, seconds: float | None = None) -> None:
    test = os.environ.get("PYTEST_CURRENT_TEST", "?").rsplit(" (", 1)[0]
    where = "in-process" if os.environ.get(PID) == str(os.getpid()) else "child"
    took = "" if seconds is None else f"\t{seconds:.1f}"
    with open(os.environ[ENV], "a") as f:  # one short write per line: concurrent appends stay whole
        f.write(f"{kind}\t{test}\t{where}{took}\n")


def _counting(module, name: str, kind: str, counts=None) -> None:
    """Replace ``module.name`` by a function that records ``kind`` and its seconds for each call (a
    call that fails too), or ``kind`` alone for each whose result ``counts``."""
    original = getattr(module, name)
    if getattr(original, "counted", False):
        return

    @functools.wraps(original)
    def counted(*args, **kwargs):
        if counts is not None:
            result = original(*args, **kwargs)
            if counts(result):
                _record(kind)
            return result
        start = time.perf_counter()
        try:
            return original(*args, **kwargs)
        finally:  # a compile that fails counts too
            _record(kind, time.perf_counter() - start)

    counted.counted = True
    setattr(module, name, counted)


PATCHES = {
    "torch._inductor": lambda m: _counting(m, "aoti_compile_and_package", "compile"),
    "precompile.build_cache": lambda m: _counting(m, "lookup", "hit", counts=lambda found: found is not None),
}


class _Finder(importlib.abc.MetaPathFinder):
    """Patch each module of PATCHES once it has been executed, wherever it is first imported."""

    def find_spec(self, name, path, target=None):
        if name not in PATCHES:
            return None
        sys.meta_path.remove(self)  # find the real spec without coming back here
        try:
            spec = importlib.util.find_spec(name)
        finally:
            sys.meta_path.insert(0, self)
        if spec is None or spec.loader is None:
            return spec
        exec_module = spec.loader.exec_module

        def exec_and_patch(module):
            exec_module(module)
            PATCHES[name](module)

        spec.loader.exec_module = exec_and_patch
        return spec


SITECUSTOMIZE = """import importlib.util
spec = importlib.util.spec_from_file_location("compile_count", {path!r})
module = importlib.util.module_from_spec(spec)
spec.loader.exec_module(module)
module.install()
"""


def install(*, tests: bool = False) -> None:
    """Count in this process (patching what is imported already, and the rest on import), and in
    every child that inherits the environment. ``tests``: this is a test process (pytest's, or an
    xdist worker's), so a compile in another is a child's."""
    if tests:
        os.environ[PID] = str(os.getpid())
    for name, patch in PATCHES.items():
        if name in sys.modules:
            patch(sys.modules[name])
    if not any(isinstance(f, _Finder) for f in sys.meta_path):
        sys.meta_path.insert(0, _Finder())
    if "COMPILE_COUNT_SITE" not in os.environ:
        site = Path(tempfile.mkdtemp(prefix="compile-count-"))
        (site / "sitecustomize.py").write_text(SITECUSTOMIZE.format(path=str(Path(__file__).resolve())))
        os.environ["COMPILE_COUNT_SITE"] = str(site)
        os.environ["PYTHONPATH"] = os.pathsep.join(filter(None, [str(site), os.environ.get("PYTHONPATH")]))
