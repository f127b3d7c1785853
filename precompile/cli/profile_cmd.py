from __future__ import annotations

from pathlib import Path

import click

from . import main, user_errors


@main.group("profile")
def profile_group() -> None:
    """Work on profiles: fold recorded serving traffic into them."""


@profile_group.command("merge")
@click.argument("profile", type=click.Path(dir_okay=False, path_type=Path))
@click.argument("recordings", nargs=-1, required=True, type=click.Path(dir_okay=False, path_type=Path))
@click.option(
    "-o",
    "--output",
    type=click.Path(dir_okay=False, path_type=Path),
    help="Write here (in the profile's folder) instead of editing PROFILE.",
)
@click.option(
    "--replace",
    is_flag=True,
    help="Drop the shapes PROFILE lists first: the distribution becomes the recorded traffic.",
)
@user_errors
def merge(profile: Path, recordings: tuple[Path, ...], output: Path | None, replace: bool) -> None:
    """Fold recorded traffic files into PROFILE's distribution.shapes.

    RECORDINGS are files written by `precompile serve --record` or loader.TrafficRecorder, one
    {"dims": {...}, "count": N} a line. Counts of equal shapes are summed; comments and formatting of
    PROFILE are kept.
    """
    from ..authoring.merge import merge_traffic

    result = merge_traffic(profile, list(recordings), output=output, replace=replace)
    click.echo(
        f"{result.path}: {result.calls} calls over {result.shapes} shapes from {len(recordings)} file(s) "
        f"({result.added} new, {result.updated} updated)"
    )
    if result.outside:
        click.echo(f"note: {result.outside} calls lie outside the profile's dim ranges; `precompile plan` shows them")
