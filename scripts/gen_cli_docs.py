"""docs/cli.md from the Click commands themselves: `make docs` writes it, tests/test_docs.py keeps the
committed file equal to what this prints.

Every command's (and subcommand's) ``--help``, rendered at a fixed width so that the page does not
depend on the terminal it was made in. Run it where every extra is installed (`make venv`): a command
whose extra is missing renders as its stand-in.
"""

from __future__ import annotations

import sys

import click

from precompile.cli import main

WIDTH = 100
HEADER = """\
# Command-line reference

Every `precompile` command and its options, as `precompile COMMAND --help` prints them. Generated
from the commands by `make docs` (scripts/gen_cli_docs.py); edit the commands' docstrings and
options, not this file. A command runs only with its extra installed (`serve`: the `serve` extra;
`inspect`, `cache`, `export`: either; every other command: the `build` extra).
"""


def _help(command: click.Command, path: list[str], parent: click.Context | None) -> tuple[str, click.Context]:
    ctx = click.Context(command, info_name=path[-1], parent=parent, terminal_width=WIDTH, max_content_width=WIDTH)
    return command.get_help(ctx), ctx


def _walk(command: click.Command, path: list[str], parent: click.Context | None, out: list[str]) -> None:
    text, ctx = _help(command, path, parent)
    if path[1:]:
        out += [f"{'#' * min(len(path), 4)} `{' '.join(path)}`", ""]
    out += ["```", text.rstrip(), "```", ""]
    if isinstance(command, click.Group):
        for name in command.list_commands(ctx):
            sub = command.get_command(ctx, name)
            if sub is not None and not sub.hidden:
                _walk(sub, [*path, name], ctx, out)


def _summary(group: click.Group) -> list[str]:
    """One line per command: its name and the first line of its help."""
    ctx = click.Context(group, info_name="precompile")
    rows = ["| command | what it does |", "|---|---|"]
    for name in group.list_commands(ctx):
        command = group.get_command(ctx, name)
        rows.append(f"| [`precompile {name}`](#precompile-{name}) | {command.get_short_help_str(limit=200)} |")
    return rows


def render() -> str:
    """The whole page."""
    out = [HEADER, *_summary(main), "", "## `precompile`", ""]
    _walk(main, ["precompile"], None, out)
    return "\n".join(out).rstrip("\n") + "\n"


if __name__ == "__main__":
    sys.stdout.write(render())
