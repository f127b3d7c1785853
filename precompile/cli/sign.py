from __future__ import annotations

from pathlib import Path

import click

from . import main, user_errors


@main.command()
@click.argument("artifact", type=click.Path(path_type=Path))
@click.option(
    "--key",
    "key",
    required=True,
    type=click.Path(dir_okay=False, path_type=Path),
    help="Ed25519 private key (`precompile keygen`).",
)
@user_errors
def sign(artifact: Path, key: Path) -> None:
    """Sign an artifact folder or pack: an Ed25519 signature over its manifest, which pins every file.

    The artifact is verified in full first; a pack is rewritten with the signature inside. Hosts
    refuse unsigned or changed artifacts with loader.load(path, trusted_keys=["KEY.pub"]).
    """
    from ..ship.sign import sign as run_sign

    key_id = run_sign(artifact, key)
    click.echo(f"{artifact}: signed with key {key_id[:16]}")
