from __future__ import annotations

from pathlib import Path

import click

from . import main, user_errors


@main.command()
@click.argument("profile", type=click.Path(dir_okay=False, path_type=Path))
@click.option(
    "--max-seconds",
    type=click.FloatRange(min=1),
    default=300,
    show_default=True,
    help="Stop torch.export after this long and report what it found so far.",
)
@user_errors
def doctor(profile: Path, max_seconds: float) -> None:
    """Find every reason PROFILE will not build, at once, without compiling.

    Runs forward() at the build's sample size and at every range's ends, then torch.export's
    draft_export for the declared ranges, and says in the profile's terms which dims the model fixes
    or bounds (with the source line), where it branches on tensor values, and which ops Inductor has
    no kernel for. Exit code 1 when a problem is found.
    """
    from ..authoring.doctor import diagnose
    from ..progress import RichProgress

    report = diagnose(profile, max_seconds=max_seconds, progress=RichProgress())
    click.echo(report.format())
    if report.errors or not report.finished:
        raise SystemExit(1)
