from __future__ import annotations

from pathlib import Path

import click

from . import main, user_errors


@main.command()
@click.argument("profile", type=click.Path(dir_okay=False, path_type=Path))
@click.option("-o", "--output", type=click.Path(file_okay=False, path_type=Path), help="Artifact folder [default: artifacts/<name>].")
@user_errors
def build(profile: Path, output: Path | None) -> None:
    """Build the artifact PROFILE describes: export, compile, check against eager, write."""
    from ..build import build as run_build
    from ..progress import RichProgress

    result = run_build(profile, output, progress=RichProgress())
    click.echo(str(result.path))
