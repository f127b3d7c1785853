from __future__ import annotations

from pathlib import Path

import click

from . import main, user_errors
from .inspect import _size


@main.command()
@click.argument("artifact", type=click.Path(path_type=Path))
@click.option(
    "-o",
    "--output",
    type=click.Path(dir_okay=False, path_type=Path),
    help="Pack file [default: ARTIFACT.tar.zst beside the folder].",
)
@click.option("--level", type=click.IntRange(1, 19), default=3, show_default=True, help="zstandard compression level.")
@click.option(
    "--threads",
    type=click.IntRange(0, 256),
    default=0,
    show_default=True,
    help="Compression threads (0: one, and the same bytes on every machine).",
)
@user_errors
def pack(artifact: Path, output: Path | None, level: int, threads: int) -> None:
    """Write an artifact folder as one zstandard-compressed file that loader.load() accepts.

    Every file is checked against the manifest while it is packed; a signature (`precompile sign`)
    travels inside. On the host, the pack is unpacked once into the local cache.
    """
    from ..ship.pack import pack as run_pack

    path = run_pack(artifact, output, level=level, threads=threads)
    click.echo(f"{path} ({_size(path.stat().st_size)})")
