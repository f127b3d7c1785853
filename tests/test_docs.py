"""The documentation as a tested surface: every relative link and anchor resolves, docs/cli.md is what
the commands say, and the README's quickstart runs as written."""

from __future__ import annotations

import os
import re
import signal
import socket
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("**/*.md"))]

FENCE = re.compile(r"^\s*(```|~~~)")
LINK = re.compile(r"(?<!!)\[[^\]]*\]\(([^)\s]+)\)")
HEADING = re.compile(r"^(#{1,6})\s+(.*?)\s*#*\s*$")


def prose_lines(text: str) -> list[tuple[int, str]]:
    """(line number, line) of the text outside fenced code blocks."""
    out, fenced = [], False
    for number, line in enumerate(text.splitlines(), 1):
        if FENCE.match(line):
            fenced = not fenced
        elif not fenced:
            out.append((number, line))
    return out


def slug(heading: str) -> str:
    """GitHub's anchor for a heading: lower case, punctuation but '-' and '_' dropped, spaces to '-'."""
    text = re.sub(r"`|\*\*|\[([^\]]*)\]\([^)]*\)", r"\1", heading).strip().lower()
    return re.sub(r"[^\w\- ]", "", text).replace(" ", "-")


def anchors(page: Path) -> set[str]:
    """Every heading's anchor on ``page``, a repeated one numbered as GitHub does (-1, -2, ...)."""
    seen: dict[str, int] = {}
    for _, line in prose_lines(page.read_text()):
        m = HEADING.match(line)
        if m:
            base = slug(m.group(2))
            n = seen.get(base, 0)
            seen[base] = n + 1
            seen.setdefault(base if n == 0 else f"{base}-{n}", 1)
    return set(seen)


def links(page: Path) -> list[tuple[int, str]]:
    """(line number, target) of every link in the prose, inline code left out."""
    out = []
    for number, line in prose_lines(page.read_text()):
        for m in LINK.finditer(re.sub(r"`[^`]*`", "", line)):
            out.append((number, m.group(1)))
    return out


def dangling(page: Path, root: Path = ROOT) -> list[str]:
    """Each relative link on ``page`` whose file or anchor does not exist, as 'page:line: target: why'
    (paths relative to ``root``)."""
    problems = []
    for number, target in links(page):
        if re.match(r"^[a-z][a-z0-9+.-]*:", target):  # https:, mailto:: not ours to check
            continue
        path, _, anchor = target.partition("#")
        dest = (page.parent / path).resolve() if path else page
        where = f"{page.relative_to(root)}:{number}: {target}"
        if not dest.exists():
            problems.append(f"{where}: no such file")
        elif anchor and (dest.suffix != ".md" or anchor not in anchors(dest)):
            problems.append(f"{where}: no heading with that anchor in {dest.relative_to(root)}")
    return problems


def test_slugs_are_github_s():
    assert slug("Without torch: `loader.load_native`") == "without-torch-loaderload_native"
    assert slug("Serving without torch: `--runtime`") == "serving-without-torch---runtime"
    assert slug("Plans: compile for the traffic you have") == "plans-compile-for-the-traffic-you-have"


def test_the_link_check_finds_a_dangling_file_and_anchor(tmp_path):
    (tmp_path / "b.md").write_text("# B\n\n## A part\n")
    page = tmp_path / "a.md"
    page.write_text("[ok](b.md#a-part) [gone](c.md) [no anchor](b.md#nowhere)\n```\n[in code](x.md)\n```\n")
    assert dangling(page, tmp_path) == [
        "a.md:1: c.md: no such file",
        "a.md:1: b.md#nowhere: no heading with that anchor in b.md",
    ]


@pytest.mark.parametrize("page", PAGES, ids=lambda p: str(p.relative_to(ROOT)))
def test_every_relative_link_and_anchor_resolves(page):
    assert dangling(page) == []


def test_the_readme_links_every_topic_page():
    readme = {(ROOT / target.partition("#")[0]).resolve() for _, target in links(ROOT / "README.md")}
    pages = {p.resolve() for p in (ROOT / "docs").glob("*.md")}
    assert sorted(p.name for p in pages - readme) == []


def test_the_readme_is_a_page():
    assert len((ROOT / "README.md").read_text().splitlines()) <= 250


def test_the_cli_reference_is_generated_from_the_commands():
    """As `make docs` makes it: in a fresh interpreter, so that nothing another test of this process
    set (the environment, Click's state) reaches the page."""
    env = {k: v for k, v in os.environ.items() if k not in ("COLUMNS", "PYTHONPATH")}
    expected = subprocess.run(
        [sys.executable, str(ROOT / "scripts" / "gen_cli_docs.py")],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        check=True,
        timeout=120,
    ).stdout
    assert (ROOT / "docs" / "cli.md").read_text() == expected, "docs/cli.md is stale: run `make docs`"


# --- the README's quickstart, run as written ---------------------------------------------------

QUICKSTART = re.compile(r"^( *)<!-- quickstart(?:: (\S+))? -->\n\1```(\w*)\n(.*?)^\1```", re.M | re.S)


def quickstart_blocks() -> list[tuple[str | None, str, str]]:
    """(file to write or None, language, code) of each block the README marks ``<!-- quickstart -->``,
    in order."""
    text = (ROOT / "README.md").read_text()
    return [(m.group(2), m.group(3), textwrap.dedent(m.group(4))) for m in QUICKSTART.finditer(text)]


def test_the_quickstart_is_marked():
    blocks = quickstart_blocks()
    assert [(f, lang) for f, lang, _ in blocks] == [
        ("mymodels.py", "python"),
        (None, ""),
        (None, ""),
        (None, ""),
        (None, ""),
        (None, "python"),
    ]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.mark.slow
@pytest.mark.integration
def test_the_readme_quickstart_runs_as_written(tmp_path):
    """The five steps in a fresh folder: the model file, init, doctor, build, serve and curl, load.
    One change: the server's port is a free one instead of 8000 (other tests may hold 8000)."""
    port = str(free_port())
    env = dict(os.environ, PATH=f"{Path(sys.executable).parent}{os.pathsep}{os.environ['PATH']}")
    env.pop("PRECOMPILE_BUILD_CACHE", None)
    sessions = []
    try:
        for i, (file, lang, code) in enumerate(quickstart_blocks()):
            if file is not None:
                (tmp_path / file).write_text(code)
                continue
            code = code.replace("--port 8000", f"--port {port}").replace("localhost:8000", f"localhost:{port}")
            command = [sys.executable, "-c", code] if lang == "python" else ["bash", "-e", "-c", code]
            # A session of its own, the output to a file: the block's background server outlives the
            # block (holding no pipe open) and is ended with its session, below.
            log = tmp_path / f"block-{i}.log"
            with open(log, "wb") as out:
                proc = subprocess.Popen(
                    command, cwd=tmp_path, env=env, stdout=out, stderr=subprocess.STDOUT, start_new_session=True
                )
            sessions.append(proc.pid)
            proc.wait(timeout=900)
            text = log.read_text(errors="replace")
            assert proc.returncode == 0, f"quickstart block {i} failed:\n{code}\n--- output ---\n{text}"
            if "curl" in code:
                assert '"outputs"' in text, text
    finally:
        for pid in sessions:
            try:
                os.killpg(pid, signal.SIGTERM)
            except ProcessLookupError:
                pass
    assert (tmp_path / "tagger.yaml").is_file()
    assert (tmp_path / "artifacts" / "tagger" / "manifest.json").is_file()
