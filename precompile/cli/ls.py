from __future__ import annotations

import click

from . import main, user_errors
from .inspect import _size


@main.command("ls")
@click.argument("url")
@user_errors
def ls_cmd(url: str) -> None:
    """List the models and versions published under an object store URL (see `precompile push`)."""
    from ..ship.remote import ls

    found = ls(url)
    if not found:
        click.echo(f"{url}: nothing published")
    for name, index in sorted(found.items()):
        click.echo(name)
        for entry in index.entries:
            signed = ", signed by " + ", ".join(k[:16] for k in entry.signed_by) if entry.signed_by else ""
            click.echo(f"  v{entry.version:<5} {_size(entry.size):>10}  {entry.digest[:16]}{signed}")
