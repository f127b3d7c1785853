"""What ``load()`` does before it opens any compiled code: resolve the path it was given (an artifact
folder or a pack) into a verified artifact folder, applying the caller's trust policy.

Order, cheapest refusal first, nothing unpacked or hashed for an artifact that will be refused:
manifest (parsed strictly) → signature → expiry, minimum version, rollback → host compatibility →
files (a folder: sizes and sha256, but for its variant packages with ``defer_packages``, which the
loaders hash as they open each one, ``Opened.package_sha256``; a pack: unpacked into the cache once,
then sizes and remembered hashes).

What the model will serve is fixed here too (``loader.weights``): a folder's weights are read into
private memory and hashed as they are read, so an operator who overwrites, truncates or rsyncs the
folder while it is served changes nothing the running model reads; a cache entry's weights are
mapped, since only this user can write there and the entry is read-only. (The compiled code is safe
either way: each package's library is copied into a private temporary folder when its variant is
opened, from a package the loaders hold open from the load on, ``loader.artifact.HeldFile``.)
With ``refuse_rollback`` the returned ``Opened`` holds the version ledger's lock until ``loaded()``
or ``close()``: use it as a context manager.
"""

from __future__ import annotations

import mmap
import os
from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path
from types import ModuleType
from typing import TYPE_CHECKING

from . import constants as C
from .artifact import is_url, manifest_digest, read_manifest_with_bytes, read_signature, verify_files
from .errors import LoaderError
from .host import HostFacts, check_compatible
from .manifest import Manifest, Variant
from .trust import KeySource, LedgerHold, VersionLedger, check_expiry, check_min_version, check_signature, public_keys
from .weights import MappedWeights, map_file, read_private

if TYPE_CHECKING:
    from .stores.opener import PackHead


@dataclass
class Opened:
    root: Path  # a verified artifact folder: the one given, or a cache entry
    manifest: Manifest
    device: str
    digest: str
    packed: bool = False
    unpacked: bool = False  # this call unpacked the pack into the cache
    signed_by: str | None = None  # key id, when trusted_keys were checked
    _weights: mmap.mmap | None = field(default=None, repr=False)  # a folder's weights, read and hashed
    _hold: LedgerHold | None = field(default=None, repr=False)
    _unhashed: frozenset[str] = frozenset()  # variants' packages left for the opener to hash (defer_packages)

    def package_sha256(self, variant: Variant) -> str | None:
        """The sha256 a variant's package must be checked against as it is read to be opened, or None
        when it was checked already (a verified cache entry) or is not to be (``verify=False``)."""
        return self.manifest.files[variant.file].sha256 if variant.file in self._unhashed else None

    def weights(self) -> MappedWeights:
        """The weights to serve: the private copy read while verifying a folder, or a map of the
        cache entry's read-only file; checked against the constants the manifest lists."""
        path = str(self.root / C.WEIGHTS_FILE)
        weights = MappedWeights(path, buffer=self._weights if self._weights is not None else map_file(path))
        weights.check(self.manifest.constants)
        return weights

    def loaded(self) -> None:
        """Call once the model is loaded: records its version when refuse_rollback asked for it
        (UntrustedArtifactError if that conflicts with the ledger) and releases the ledger's lock."""
        if self._hold is not None:
            self._hold.record()

    def close(self) -> None:
        """Release the ledger's lock without recording (the load failed); harmless after loaded()."""
        if self._hold is not None:
            self._hold.release()

    def __enter__(self) -> Opened:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def open_artifact(
    path: str | os.PathLike | PackHead,
    *,
    device: str | None = None,
    verify: bool = True,
    trusted_keys: Iterable[KeySource] | None = None,
    min_version: int | None = None,
    refuse_rollback: bool = False,
    cache_dir: str | os.PathLike | None = None,
    state_dir: str | os.PathLike | None = None,
    max_bytes: int | None = None,
    host: HostFacts | None = None,
    defer_packages: bool = False,
) -> Opened:
    """See ``loader.load``; returns the folder to open and what was checked. A URL goes through
    ``loader.stores.remote`` (an ``oci://`` reference through ``loader.stores.oci``), which judges the
    pack's head as soon as it arrives (``admit``: the same checks as below, but the rollback ledger's)
    and comes back here with the downloaded pack or its cache entry's head; a pack is read and
    unpacked by ``loader.stores`` too (``_stores``). ``host``: the facts the compatibility check compares with (default:
    ``host.host_facts()``; the torch-free loader gathers its own). ``defer_packages``: a folder's
    variant packages are only size-checked here, each to be hashed when (and if) it is opened
    (``Opened.package_sha256``), so a load hashes only what it runs, when it runs it."""
    if trusted_keys is not None and not verify:
        raise LoaderError("verify=False skips the sha256 checks a signature relies on; drop it or trusted_keys")
    keys = public_keys(trusted_keys) if trusted_keys is not None else None
    if is_url(path):
        options = dict(device=device, verify=verify, trusted_keys=trusted_keys, min_version=min_version)
        options.update(refuse_rollback=refuse_rollback, cache_dir=cache_dir, state_dir=state_dir, host=host)
        options.update(defer_packages=defer_packages)

        def admit(head: PackHead) -> None:
            _admit(head.manifest, head.manifest_bytes, head.signature, keys, min_version, str(head.path))
            check_compatible(head.manifest, device or head.manifest.target.device, host)

        return _stores().open_url(
            str(path),
            lambda local: open_artifact(local, **options),
            admit=admit,
            max_bytes=max_bytes,
            cache_dir=cache_dir,
        )
    stored = not isinstance(path, (str, os.PathLike)) and isinstance(path, _stores().PackHead)
    head = path if stored else None  # a remote pack's cache entry (loader.stores.remote)
    path = head.path if head is not None else Path(path)
    if head is None and path.is_file():
        head = _stores().read_head(path)
    if head is not None:
        manifest, manifest_bytes, signature, digest = head.manifest, head.manifest_bytes, head.signature, head.digest
    else:
        manifest, manifest_bytes = read_manifest_with_bytes(path)
        signature = read_signature(path) if keys is not None else None
        digest = manifest_digest(manifest_bytes)
    source = str(path)
    device = device or manifest.target.device
    signed_by = _admit(manifest, manifest_bytes, signature, keys, min_version, source)
    hold = VersionLedger(state_dir).hold(manifest, digest, source) if refuse_rollback else None
    try:
        check_compatible(manifest, device, host)
        weights, unhashed = None, frozenset()
        if head is not None:
            root, unpacked = _stores().open_cached(head, cache_dir=cache_dir, verify=verify)
        else:
            if defer_packages and verify:
                unhashed = frozenset(v.file for v in manifest.variants)
            verify_files(path, manifest, hashes=verify, hashed_on_read={C.WEIGHTS_FILE, *unhashed})
            entry = manifest.files[C.WEIGHTS_FILE]
            weights = read_private(str(path / C.WEIGHTS_FILE), size=entry.size, sha256=entry.sha256 if verify else None)
            root, unpacked = path, False
    except BaseException:
        if hold is not None:
            hold.release()
        raise
    return Opened(root, manifest, device, digest, head is not None, unpacked, signed_by, weights, hold, unhashed)


def _admit(
    manifest: Manifest,
    manifest_bytes: bytes,
    signature: bytes | None,
    keys: list | None,
    min_version: int | None,
    source: str,
) -> str | None:
    """The refusals the manifest and signature decide alone: signature (returns the key id when
    ``keys`` are given), expiry, minimum version."""
    signed_by = check_signature(manifest_bytes, signature, keys, source).key_id if keys is not None else None
    check_expiry(manifest, source)
    if min_version is not None:
        check_min_version(manifest, min_version, source)
    return signed_by


def _stores() -> ModuleType:
    """``loader.stores.opener``: packs, their cache, URLs. The core's one import of the stores, made
    when a path is not an artifact folder (pyproject's import contract names it), so that a service
    vendoring the core without ``loader/stores/`` still opens folders."""
    from .stores import opener

    return opener
