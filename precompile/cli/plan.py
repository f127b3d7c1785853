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
    from ..profile import load_profile
    from ..stages.plan import format_plan, make_plan

    loaded = load_profile(profile)
    result = make_plan(loaded)
    candidates = loaded.profile.compile.candidates()
    if as_json:
        click.echo(json.dumps({**result.to_dict(), "compile_candidates": candidates}, indent=2))
        return
    click.echo(format_plan(result, loaded.profile.name))
    if len(candidates) > 1:
        click.echo(f"  tuning: each variant compiled {len(candidates)} ways, the fastest on its traffic kept:")
        for i, options in enumerate(candidates):
            click.echo(f"    candidate {i}: " + (", ".join(f"{k}={v}" for k, v in options.items()) or "defaults"))
