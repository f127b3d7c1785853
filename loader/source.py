"""What ``load()`` does before it opens any compiled code: resolve the path it was given (an artifact
folder or a pack) into a verified artifact folder, applying the caller's trust policy.

Order, cheapest refusal first, nothing unpacked or hashed for an artifact that will be refused:
manifest (parsed strictly) → signature → expiry, minimum version, rollback → host compatibility →
files (a folder: sizes and sha256; a pack: unpacked into the cache once, then sizes and remembered
hashes).
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Iterable

from .artifact import manifest_digest, read_manifest_with_bytes, read_signature, verify_files
from .cache import Cache
from .errors import LoaderError
from .host import check_compatible
from .manifest import Manifest
from .pack import read_head
from .trust import KeySource, VersionLedger, check_expiry, check_min_version, check_signature, public_keys


@dataclass
class Opened:
    root: Path  # a verified artifact folder: the one given, or a cache entry
    manifest: Manifest
    device: str
    digest: str
    packed: bool = False
    unpacked: bool = False  # this call unpacked the pack into the cache
    signed_by: str | None = None  # key id, when trusted_keys were checked
    _ledger: VersionLedger | None = field(default=None, repr=False)

    def loaded(self) -> None:
        """Call once the model is loaded: remembers its version when refuse_rollback asked for it."""
        if self._ledger is not None:
            self._ledger.record(self.manifest, self.digest)


def open_artifact(
    path: str | os.PathLike,
    *,
    device: str | None = None,
    verify: bool = True,
    trusted_keys: Iterable[KeySource] | None = None,
    min_version: int | None = None,
    refuse_rollback: bool = False,
    cache_dir: str | os.PathLike | None = None,
    state_dir: str | os.PathLike | None = None,
) -> Opened:
    """See ``loader.load``; returns the folder to open and what was checked."""
    if trusted_keys is not None and not verify:
        raise LoaderError("verify=False skips the sha256 checks a signature relies on; drop it or trusted_keys")
    keys = public_keys(trusted_keys) if trusted_keys is not None else None
    path = Path(path)
    head = None
    if path.is_file():
        head = read_head(path)
        manifest, manifest_bytes, signature, digest = head.manifest, head.manifest_bytes, head.signature, head.digest
    else:
        manifest, manifest_bytes = read_manifest_with_bytes(path)
        signature = read_signature(path) if keys is not None else None
        digest = manifest_digest(manifest_bytes)
    source = str(path)
    device = device or manifest.target.device
    signed_by = check_signature(manifest_bytes, signature, keys, source).key_id if keys is not None else None
    check_expiry(manifest, source)
    if min_version is not None:
        check_min_version(manifest, min_version, source)
    ledger = VersionLedger(state_dir) if refuse_rollback else None
    if ledger is not None:
        ledger.check(manifest, digest, source)
    check_compatible(manifest, device)
    if head is not None:
        root, unpacked = Cache(cache_dir).open(head, verify=verify)
    else:
        verify_files(path, manifest, hashes=verify)
        root, unpacked = path, False
    return Opened(root, manifest, device, digest, head is not None, unpacked, signed_by, ledger)
