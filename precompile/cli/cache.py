from __future__ import annotations

import click

from . import main, user_errors
from .inspect import _size


@main.group()
def cache() -> None:
    """Show or empty the local cache of unpacked packs ($PRECOMPILE_CACHE, default ~/.cache/precompile)."""


@cache.command("ls")
@user_errors
def ls() -> None:
    """List the cached artifacts: name, version, size, manifest digest, build date."""
    from loader.stores.cache import Cache

    store = Cache()
    entries = store.entries()
    total = sum(e.size for e in entries)
    click.echo(f"{store.root}: {len(entries)} artifact(s), {_size(total)}")
    for e in entries:
        m = e.manifest
        name, version, built = (m.name, f"v{m.version}", m.created) if m else ("(unreadable)", "", "")
        click.echo(f"  {name:<24} {version:<5} {_size(e.size):>10}  {e.digest[:16]}  {built}")


@cache.command()
@user_errors
def clear() -> None:
    """Remove every cached artifact (processes serving from one keep working)."""
    from loader.stores.cache import Cache

    store = Cache()
    removed, freed = store.clear()
    click.echo(f"{store.root}: removed {removed} artifact(s), {_size(freed)}")
