from __future__ import annotations

import json

import click

from . import main


@main.command()
def schema() -> None:
    """Print the JSON Schema of profiles (profiles/schema.json is this output)."""
    from ..profile import json_schema

    click.echo(json.dumps(json_schema(), indent=2))
