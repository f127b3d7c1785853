from __future__ import annotations

from pathlib import Path

import click

from . import main, user_errors
from .inspect import _size


@main.command()
@click.argument("url")
@click.option(
    "--version", "version", type=click.IntRange(min=0), help="Version to pull [default: the latest published]."
)
@click.option(
    "-o",
    "--output",
    type=click.Path(path_type=Path),
    help="Pack file [default: NAME-VERSION.tar.zst here]; for oci://, a new folder.",
)
@user_errors
def pull(url: str, version: int | None, output: Path | None) -> None:
    """Download a published pack from an object store (URL/NAME, or a pack's own URL).

    The pack is checked against the store's index and unpacked in memory to check every member
    before it is written; loader.load() also reads URLs directly, through its cache.

    URL oci://REGISTRY/REPO:TAG (or @sha256:DIGEST) pulls an artifact pushed to an OCI registry into
    the folder -o (default NAME-TAG here), every blob checked against its digest.
    """
    if url.startswith("oci://"):
        if version is not None:
            raise click.ClickException(f"{url}: the reference names one artifact; drop --version")
        from ..ship.oci import pull as pull_oci

        folder, got = pull_oci(url, output)
        click.echo(f"{folder} (version {got})")
        return
    from ..ship.remote import pull as run_pull

    path, got = run_pull(url, version=version, output=output)
    click.echo(f"{path} (version {got}, {_size(path.stat().st_size)})")
