from __future__ import annotations

from pathlib import Path

import click

from . import main, user_errors


@main.command()
@click.option(
    "-o",
    "--output",
    "prefix",
    type=click.Path(path_type=Path),
    default=Path("signing"),
    show_default=True,
    help="Writes PREFIX.key and PREFIX.pub.",
)
@click.option("--force", is_flag=True, help="Overwrite existing key files.")
@user_errors
def keygen(prefix: Path, force: bool) -> None:
    """Make an Ed25519 key pair for signing artifacts: PREFIX.key (private) and PREFIX.pub.

    Keep the .key in your CI's secret store and sign with `precompile sign ARTIFACT --key PREFIX.key`;
    give the .pub to serving hosts: loader.load(path, trusted_keys=["PREFIX.pub"]).
    """
    from ..ship.sign import keygen as run_keygen

    private, public, key_id = run_keygen(prefix, force=force)
    click.echo(f"private key  {private}  (secret: mode 0600)")
    click.echo(f"public key   {public}")
    click.echo(f"key id       {key_id[:16]}")
