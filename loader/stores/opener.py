"""What ``loader.source.open_artifact`` reaches the stores through: a pack's head, a pack unpacked
into the cache, a URL or ``oci://`` reference fetched into it. The core imports this module only
when a path is not an artifact folder (the one import of ``loader.stores`` the layering contract
allows it), so a core vendored without the stores still opens folders.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from pathlib import Path
from typing import Any, TypeVar

from . import oci, remote
from .cache import Cache
from .pack import PackHead, read_head

T = TypeVar("T")

__all__ = ["PackHead", "open_cached", "open_url", "read_head"]


def open_url(
    url: str,
    open_pack: Callable[[Any], T],
    *,
    admit: Callable[[PackHead], Any],
    max_bytes: int | None,
    cache_dir: str | os.PathLike | None,
) -> T:
    """``loader.stores.oci.open_reference`` for an ``oci://`` reference, else
    ``loader.stores.remote.open_url``: the pack's head judged by ``admit`` as soon as it arrives,
    then ``open_pack`` of the downloaded pack or its cache entry's head."""
    opener = oci.open_reference if oci.is_reference(url) else remote.open_url
    return opener(url, open_pack, admit=admit, max_bytes=max_bytes, cache_dir=cache_dir)


def open_cached(head: PackHead, *, cache_dir: str | os.PathLike | None, verify: bool) -> tuple[Path, bool]:
    """The verified cache entry holding the pack's files, and whether this call unpacked it."""
    return Cache(cache_dir).open(head, verify=verify)
