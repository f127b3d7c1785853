"""The memory allocator a server runs on (loader.malloc, `precompile serve --malloc`): found where
installed, preloaded by the server's re-exec, the user's own choice kept, a wrong one refused in one
line. The real servers run on a real allocator: Debian's tcmalloc where installed, and the jemalloc
that the Ray wheel (a dev dependency) carries, given by path."""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys
from pathlib import Path

import httpx
import pytest

from loader.malloc import LIBRARIES, MallocError, find, in_use, malloc_env, resolve

from .test_serve_load import ROOT, free_port, serve_command

RAY = importlib.util.find_spec("ray")
JEMALLOC = Path(RAY.origin).parent / "core" / "libjemalloc.so" if RAY and RAY.origin else None


SERVE = (sys.executable, "-m", "precompile", "serve")
PAYLOAD = {"inputs": {"ids": [[3, 4, 5, 6, 7], [8, 9, 10, 11, 12]], "mask": [[True] * 5] * 2}}


def fake_library(folder: Path, name: str) -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / name
    path.write_bytes(b"\x7fELF" + bytes(60))
    return path


def test_auto_prefers_tcmalloc_and_falls_back_to_glibc(tmp_path):
    lib = tmp_path / "lib"
    assert resolve("auto", [lib]) is None and malloc_env("auto", {}, [lib]) == {}  # none installed: glibc's
    fake_library(lib, LIBRARIES["jemalloc"][0])
    assert resolve("auto", [lib]) is None  # jemalloc only when asked for: its defaults return buffers at once
    tcmalloc = fake_library(lib, LIBRARIES["tcmalloc"][0])
    env = malloc_env("auto", {"LD_PRELOAD": "/opt/other.so"}, [lib])
    assert env["LD_PRELOAD"] == f"{tcmalloc} /opt/other.so"  # first, the user's own preloads kept after it
    assert env["TCMALLOC_LARGE_ALLOC_REPORT_THRESHOLD"] == str(1 << 40)


def test_the_users_settings_and_allocator_are_kept(tmp_path):
    lib = tmp_path / "lib"
    jemalloc = fake_library(lib, LIBRARIES["jemalloc"][0])
    env = malloc_env("jemalloc", {"MALLOC_CONF": "narenas:2"}, [lib])
    assert env == {"LD_PRELOAD": str(jemalloc)}  # no decay setting over the user's own
    assert malloc_env("jemalloc", {}, [lib])["MALLOC_CONF"] == "dirty_decay_ms:-1,muzzy_decay_ms:-1"
    preloaded = {"LD_PRELOAD": "/usr/lib/libmimalloc.so.2"}
    assert malloc_env("auto", preloaded, [lib]) == {} and malloc_env("system", preloaded, [lib]) == {}
    with pytest.raises(MallocError, match="LD_PRELOAD already starts /usr/lib/libmimalloc.so.2"):
        malloc_env("jemalloc", preloaded, [lib])


def test_a_wrong_choice_says_what_to_do(tmp_path):
    with pytest.raises(MallocError, match="apt-get install libtcmalloc-minimal4"):
        resolve("tcmalloc", [tmp_path])
    with pytest.raises(MallocError, match="no such file"):
        resolve(str(tmp_path / "missing.so"))
    text = tmp_path / "notes.txt"
    text.write_text("not a library")
    with pytest.raises(MallocError, match="not a shared library"):
        resolve(str(text))


def test_in_use_reads_what_is_preloaded_and_mapped(tmp_path):
    maps = tmp_path / "maps"
    maps.write_text(
        "7f00-7f01 r-xp 00000000 fe:00 1   /usr/lib/x86_64-linux-gnu/libtcmalloc_minimal.so.4.5.10\n"
        "7f02-7f03 r-xp 00000000 fe:00 2   /usr/lib/x86_64-linux-gnu/libc.so.6\n"
    )
    assert in_use(maps, {}) == "system"  # mapped but not preloaded: a library, not the malloc
    mapped = tmp_path / "libtcmalloc_minimal.so.4"
    maps.write_text(f"7f00-7f01 r-xp 00000000 fe:00 1   {mapped}\n")
    mapped.write_bytes(b"")
    assert in_use(maps, {"LD_PRELOAD": str(mapped)}) == "tcmalloc"


def mapped_allocators(pid: int) -> set[str]:
    names = {line.rsplit("/", 1)[-1] for line in Path(f"/proc/{pid}/maps").read_text().splitlines() if "/" in line}
    return {n for n in names if n.startswith(("libtcmalloc", "libjemalloc"))}


def server_pid(port: int) -> int:
    """The pid of the server listening on ``port`` (the process the test started, after its re-exec)."""
    out = subprocess.run(["ss", "-Htlnp", f"sport = :{port}"], capture_output=True, text=True, check=True).stdout
    return int(out.split("pid=", 1)[1].split(",", 1)[0])


@pytest.mark.skipif(
    JEMALLOC is None or not JEMALLOC.is_file(), reason="the Ray wheel's libjemalloc.so is not installed"
)
def test_serve_runs_on_the_allocator_it_is_given(classifier_artifact, tmp_path):
    """`--malloc PATH`: the server re-executes itself with the library preloaded and its settings set,
    answers as on glibc, and says so; `--malloc system` runs on glibc's even where tcmalloc is installed."""
    log = tmp_path / "serve.log"
    with serve_command(classifier_artifact, "--malloc", str(JEMALLOC), log=log) as port:
        pid = server_pid(port)
        environ = dict(
            line.split("=", 1) for line in Path(f"/proc/{pid}/environ").read_text().split("\0") if "=" in line
        )
        assert mapped_allocators(pid) == {"libjemalloc.so"}
        assert environ["MALLOC_CONF"] == "dirty_decay_ms:-1,muzzy_decay_ms:-1"
        jemalloc_answer = httpx.post(f"http://127.0.0.1:{port}/predict", json=PAYLOAD).json()
    assert "memory allocator: jemalloc (preloaded)" in log.read_text()
    with serve_command(classifier_artifact, "--malloc", "system", log=log) as port:
        assert mapped_allocators(server_pid(port)) == set()
        glibc_answer = httpx.post(f"http://127.0.0.1:{port}/predict", json=PAYLOAD).json()
    assert "memory allocator: glibc's malloc" in log.read_text()
    assert jemalloc_answer == glibc_answer


def test_serve_auto_takes_tcmalloc_where_installed(classifier_artifact):
    tcmalloc = find("tcmalloc")
    with serve_command(classifier_artifact) as port:
        mapped = mapped_allocators(server_pid(port))
    assert mapped == ({tcmalloc.resolve().name} if tcmalloc else set()), f"tcmalloc installed at {tcmalloc}"


def test_serve_refuses_an_allocator_it_cannot_preload(classifier_artifact, tmp_path):
    text = tmp_path / "notes.txt"
    text.write_text("not a library")
    for choice, message in ((str(text), "not a shared library"), (str(tmp_path / "gone.so"), "no such file")):
        command = [*SERVE, str(classifier_artifact), "--port", str(free_port()), "--malloc", choice]
        result = subprocess.run(
            command,
            cwd=ROOT,
            capture_output=True,
            text=True,
            timeout=120,
        )
        assert result.returncode == 1 and "Traceback" not in result.stderr
        assert result.stderr.strip() == f"Error: --malloc {choice}: {message}" + (
            " (no ELF header)"
            if message == "not a shared library"
            else "; give auto, tcmalloc, jemalloc, system or a library's path"
        )


def test_python_m_loader_malloc_prints_the_library_to_preload():
    """`LD_PRELOAD=$(python -m loader.malloc) python app.py`: a program that calls loader.load picks the
    same allocator as the server, and loader.malloc.in_use() in it says so."""
    path = subprocess.run(
        [sys.executable, "-m", "loader.malloc"], capture_output=True, text=True, check=True
    ).stdout.strip()
    assert path == (str(find("tcmalloc")) if find("tcmalloc") else "")
    if JEMALLOC is None or not JEMALLOC.is_file():
        pytest.skip("the Ray wheel's libjemalloc.so is not installed")
    env = {**os.environ, "LD_PRELOAD": str(JEMALLOC)}
    out = subprocess.run(
        [sys.executable, "-c", "from loader.malloc import in_use; print(in_use())"],
        env=env,
        capture_output=True,
        text=True,
        check=True,
    )
    assert out.stdout.strip() == "jemalloc"
