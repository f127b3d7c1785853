from __future__ import annotations

from pathlib import Path

import click

from . import main, user_errors


@main.command()
@click.argument("profile", type=click.Path(dir_okay=False, path_type=Path))
@click.option("-o", "--output", type=click.Path(file_okay=False, path_type=Path), help="Artifact folder [default: artifacts/<name>].")
@click.option("--artifact-version", "version", type=click.IntRange(min=1), default=1, show_default=True, help="Release number of this artifact name; loaders can refuse older ones.")
@click.option("--expires", metavar="ISO-DATETIME", help="Refuse to load after this moment, e.g. 2027-01-01T00:00:00+00:00.")
@click.option("-j", "--jobs", type=click.IntRange(min=1), help="Variants compiled at once, each in its own process [default: one per core].")
@user_errors
def build(profile: Path, output: Path | None, version: int, expires: str | None, jobs: int | None) -> None:
    """Build the artifact PROFILE describes: export, compile, check against eager, write."""
    from ..build import build as run_build
    from ..progress import RichProgress

    result = run_build(profile, output, progress=RichProgress(), version=version, expires=expires, jobs=jobs)
    click.echo(str(result.path))
