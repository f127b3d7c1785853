from __future__ import annotations

from pathlib import Path

import click

from . import main, user_errors


@main.command()
@click.argument("artifact", type=click.Path(path_type=Path))
@click.option(
    "--key",
    "keys",
    multiple=True,
    type=click.Path(dir_okay=False, path_type=Path),
    help="Trusted public key; the artifact must be signed by one of them (repeatable).",
)
@click.option("--run", is_flag=True, help="Also load it and recompute its reference outputs here.")
@click.option("--device", help="Device to check and run on: cpu, cuda, cuda:N [default: the artifact's target].")
@user_errors
def verify(artifact: Path, keys: tuple[Path, ...], run: bool, device: str | None) -> None:
    """Check an artifact folder or pack: integrity, signature, expiry, this host, and with --run its outputs.

    Prints one line per check; exits 0 only when none fails (a skipped check does not fail).
    """
    from ..ship.verify import verify as run_verify

    checks = run_verify(artifact, keys=keys, run=run, device=device)
    width = max(len(c.name) for c in checks)
    for c in checks:
        click.echo(f"{c.name:<{width}}  {c.status:<4}  {c.detail}")
    failed = [c.name for c in checks if c.failed]
    if failed:
        raise click.ClickException(f"{artifact}: {len(failed)} check(s) failed: {', '.join(failed)}")
