from __future__ import annotations

import json
from pathlib import Path

import click

from . import main, user_errors


@main.command()
@click.argument("profile", type=click.Path(dir_okay=False, path_type=Path))
@click.option("--json", "as_json", is_flag=True, help="Print the plan as JSON.")
@user_errors
def plan(profile: Path, as_json: bool) -> None:
    """Show the variants PROFILE's traffic calls for, without building anything."""
    from ..plan import format_plan, make_plan
    from ..profile import load_profile

    loaded = load_profile(profile)
    result = make_plan(loaded)
    if as_json:
        click.echo(json.dumps(result.to_dict(), indent=2))
    else:
        click.echo(format_plan(result, loaded.profile.name))
