from __future__ import annotations

import click

from . import main, user_errors


@main.command()
@click.argument("url")
@click.option("--version", "version", type=click.IntRange(min=1), required=True, help="The published version to serve.")
@click.option(
    "--pointer", default="current", show_default=True, help="The pointer object's name in the model's folder."
)
@user_errors
def promote(url: str, version: int, pointer: str) -> None:
    """Deploy a published version: point URL/current at it (one small object write).

    URL is a model's folder in a store (s3://releases/models/text-classifier, as `precompile push`
    wrote it). Servers following the pointer (`precompile serve URL/current --watch`) load the version
    at their next look, with all their checks and trust options; a server refuses an older version
    unless it runs with --allow-rollback.
    """
    from ..ship.remote import promote as run_promote

    pointer_url, pack_url = run_promote(url, version, pointer=pointer)
    click.echo(f"{pointer_url} -> {pack_url}")
