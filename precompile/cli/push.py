from __future__ import annotations

from pathlib import Path

import click

from . import main, user_errors
from .inspect import _size


@main.command()
@click.argument("artifact", type=click.Path(path_type=Path))
@click.argument("url")
@click.option(
    "--level",
    type=click.IntRange(1, 19),
    default=3,
    show_default=True,
    help="zstandard level when ARTIFACT is a folder.",
)
@user_errors
def push(artifact: Path, url: str, level: int) -> None:
    """Publish an artifact (a folder, packed on the way, or a pack) to an object store.

    Writes URL/NAME/VERSION.tar.zst and records it in URL/NAME/index.json; URL is any fsspec URL
    (s3://bucket/models with the s3 extra). A published version never changes: the same content
    again is a no-op, other content is refused.

    URL oci://REGISTRY/REPO:TAG pushes it to an OCI registry instead, one blob per file: blobs the
    registry holds already (weights another version shares) are not uploaded again.
    """
    if url.startswith("oci://"):
        from ..ship.oci import push as push_oci

        done = push_oci(artifact, url)
        click.echo(
            f"{done.reference}@{done.digest} ({_size(done.uploaded)} uploaded, {_size(done.reused)} already there)"
        )
        return
    from ..ship.remote import push as run_push

    pushed = run_push(artifact, url, level=level)
    if pushed.published:
        click.echo(f"{pushed.url} ({_size(pushed.size)})")
    else:
        click.echo(f"{pushed.url}: already published with the same content; nothing to do")
