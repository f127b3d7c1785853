from __future__ import annotations

from pathlib import Path

import click

from . import artifact_options, main, user_errors


@main.command()
@click.argument("parts", nargs=-1, required=True, type=click.Path(file_okay=False, path_type=Path))
@artifact_options
@click.option(
    "--profile",
    type=click.Path(dir_okay=False, path_type=Path),
    help="The profile the parts were built from [default: the path recorded in the parts].",
)
@user_errors
def assemble(
    parts: tuple[Path, ...], output: Path | None, profile: Path | None, version: int, expires: str | None
) -> None:
    """Join the PARTS of a sharded build (`precompile build --shard K/N`) into one artifact.

    Checks that the parts come from the same profile, model weights and torch, and that shards 1..N
    are all there once; then tunes, gates, checks every variant against eager and writes the artifact
    atomically, as a single-host build would.
    """
    from ..progress import RichProgress
    from ..shard import assemble as run_assemble

    result = run_assemble(
        list(parts), output, profile=profile, progress=RichProgress(), version=version, expires=expires
    )
    click.echo(str(result.path))
