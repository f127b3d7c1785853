from __future__ import annotations

from pathlib import Path

import click

from . import main, user_errors
from .inspect import _size


@main.command()
@click.argument("url")
@click.option(
    "--version", "version", type=click.IntRange(min=0), help="Version to pull [default: the latest published]."
)
@click.option(
    "-o",
    "--output",
    type=click.Path(dir_okay=False, path_type=Path),
    help="Pack file [default: NAME-VERSION.tar.zst here].",
)
@user_errors
def pull(url: str, version: int | None, output: Path | None) -> None:
    """Download a published pack from an object store (URL/NAME, or a pack's own URL).

    The pack is checked against the store's index and unpacked in memory to check every member
    before it is written; loader.load() also reads URLs directly, through its cache.
    """
    from ..ship.remote import pull as run_pull

    path, got = run_pull(url, version=version, output=output)
    click.echo(f"{path} (version {got}, {_size(path.stat().st_size)})")
