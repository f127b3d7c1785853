"""The caller's trust policy: signatures, expiry and rollback.

**Signatures.** ``signature.json`` sits beside ``manifest.json`` (and travels in packs right after it)::

    {"format": "precompile-signature", "format_version": 1, "algorithm": "ed25519",
     "key_id": "<sha256 of the signer's raw 32-byte public key, hex>",
     "manifest_sha256": "<sha256 of the canonical manifest, hex>",
     "signature": "<base64 of the 64-byte Ed25519 signature>"}

The signed message is ``SIGNING_CONTEXT + canonical_manifest(manifest_bytes)``: the manifest's JSON
with sorted keys and no whitespace (stable across formatting and loader versions), and the manifest pins
every other file's size and sha256, so one signature covers the whole artifact.
``load(..., trusted_keys=[...])`` refuses an unsigned artifact, a signature by any other key, one
that does not verify, and (through the sha256 checks) any file changed after signing.

**Expiry.** A manifest whose ``expires`` has passed is refused, always.

**Rollback.** ``load(..., min_version=N)`` refuses versions below N. ``load(..., refuse_rollback=True)``
also remembers, per artifact name, the highest version it loaded and its manifest digest, in
``${PRECOMPILE_STATE:-${XDG_STATE_HOME:-~/.local/state}/precompile}/versions/<name>.json``, and refuses
an older version, or another artifact under a version already seen (every release must bump
``--artifact-version``). Only loads that asked for the check record a version, and only once the model
is loaded, so an unchecked or failed load cannot lock a name at a bogus version. Check and record are
one step: a load holds ``versions/<name>.lock`` from the check until its version is recorded or the
load fails (``LedgerHold``), so of two concurrent loads of v5 and v3, or of two different builds of
v5, the second is checked against what the first recorded and refused. The state is not in the
cache: emptying the cache must not reset it. Like the cache, it must be this user's alone (see
``loader.fs.check_private``). Remove the file to accept an older version deliberately.

``cryptography`` is imported only when a signature is made or checked.
"""

from __future__ import annotations

import base64
import binascii
import datetime
import hashlib
import json
import os
import re
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Union

from . import constants as C
from .artifact import canonical_manifest, manifest_digest
from .errors import ArtifactError, LoaderError, import_extra
from .fs import FileLock, check_private, write_atomic
from .manifest import Manifest

SIGNING_CONTEXT = b"precompile-artifact-signature-v1\n"
HEX64 = re.compile(r"^[0-9a-f]{64}$")

KeySource = Union[str, bytes, os.PathLike, Any]  # a file, PEM or OpenSSH text, or a key object


class UntrustedArtifactError(ArtifactError):
    """The artifact fails the caller's trust policy: unsigned, signed by a key not trusted, a signature
    that does not verify, expired, or older than a version already loaded (a rollback)."""


@dataclass(frozen=True)
class PublicKey:
    key_id: str  # sha256 of the raw public key, hex
    raw: bytes  # the 32-byte Ed25519 public key
    source: str  # where it came from, for messages

    @property
    def short_id(self) -> str:
        return self.key_id[:16]


def key_id(raw: bytes) -> str:
    return hashlib.sha256(raw).hexdigest()


def public_key(item: KeySource, where: str = "trusted key") -> PublicKey:
    """Read an Ed25519 public key: a path to a ``.pub`` file (PEM or OpenSSH), PEM or OpenSSH text,
    or a ``cryptography`` Ed25519PublicKey."""
    import_extra("cryptography", "an Ed25519 key")
    from cryptography.hazmat.primitives import serialization
    from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PublicKey

    if isinstance(item, Ed25519PublicKey):
        raw = item.public_bytes_raw()
        return PublicKey(key_id(raw), raw, where)
    if isinstance(item, (str, bytes)) and _looks_like_key_text(item):
        data, source = item.encode() if isinstance(item, str) else item, where
    elif isinstance(item, (str, os.PathLike)):
        source = os.fspath(item)
        try:
            with open(source, "rb") as f:
                data = f.read(64 * 1024)
        except OSError as e:
            raise LoaderError(f"{where}: {source}: cannot read ({e.strerror})") from None
    else:
        raise LoaderError(
            f"{where}: expected a path, PEM or OpenSSH text, or an Ed25519PublicKey, got {type(item).__name__}"
        )
    try:
        if data.lstrip().startswith(b"ssh-ed25519"):
            key = serialization.load_ssh_public_key(data.strip())
        else:
            key = serialization.load_pem_public_key(data)
    except (ValueError, TypeError) as e:
        raise LoaderError(f"{where}: {source}: not a PEM or OpenSSH public key ({e})") from None
    if not isinstance(key, Ed25519PublicKey):
        raise LoaderError(
            f"{where}: {source}: a {type(key).__name__}, not an Ed25519 public key (make one with `precompile keygen`)"
        )
    raw = key.public_bytes_raw()
    return PublicKey(key_id(raw), raw, source)


def _looks_like_key_text(item: str | bytes) -> bool:
    head = (item.encode() if isinstance(item, str) else item).lstrip()[:16]
    return head.startswith(b"-----BEGIN") or head.startswith(b"ssh-ed25519")


def public_keys(items: Iterable[KeySource]) -> list[PublicKey]:
    if isinstance(items, (str, bytes, os.PathLike)):
        raise LoaderError("trusted_keys: expected a list of keys, got a single one (wrap it in a list)")
    keys = [public_key(item, f"trusted_keys[{i}]") for i, item in enumerate(items)]
    if not keys:
        raise LoaderError("trusted_keys is empty: no artifact could be trusted (pass None to skip signature checks)")
    return keys


# --- signatures --------------------------------------------------------------------------------


@dataclass(frozen=True)
class Signature:
    key_id: str
    manifest_sha256: str
    signature: bytes


def make_signature(manifest_bytes: bytes, private_key: Any) -> bytes:
    """signature.json bytes for the manifest ``manifest_bytes``, signed with a ``cryptography``
    Ed25519PrivateKey."""
    raw = private_key.public_key().public_bytes_raw()
    document = {
        "format": C.SIGNATURE_FORMAT,
        "format_version": C.SIGNATURE_FORMAT_VERSION,
        "algorithm": "ed25519",
        "key_id": key_id(raw),
        "manifest_sha256": manifest_digest(manifest_bytes),
        "signature": base64.b64encode(private_key.sign(SIGNING_CONTEXT + canonical_manifest(manifest_bytes))).decode(),
    }
    return (json.dumps(document, indent=2) + "\n").encode()


def parse_signature(data: bytes, source: str) -> Signature:
    """Strictly parse signature.json; UntrustedArtifactError naming the problem."""

    def fail(what: str) -> UntrustedArtifactError:
        return UntrustedArtifactError(f"{source}: {what}")

    try:
        raw = json.loads(data)
    except (ValueError, RecursionError) as e:
        raise fail(f"not valid JSON ({e})") from None
    keys = {"format", "format_version", "algorithm", "key_id", "manifest_sha256", "signature"}
    if not isinstance(raw, dict) or set(raw) != keys:
        found = sorted(raw) if isinstance(raw, dict) else type(raw).__name__
        raise fail(f"expected an object with exactly the keys {sorted(keys)}, got {found}")
    if raw["format"] != C.SIGNATURE_FORMAT or raw["format_version"] != C.SIGNATURE_FORMAT_VERSION:
        raise fail(
            f"format {raw['format']!r} version {raw['format_version']!r} is not one this loader reads "
            f"({C.SIGNATURE_FORMAT!r} version {C.SIGNATURE_FORMAT_VERSION})"
        )
    if raw["algorithm"] != "ed25519":
        raise fail(f"algorithm {raw['algorithm']!r} is not supported (only 'ed25519')")
    for name in ("key_id", "manifest_sha256"):
        if not isinstance(raw[name], str) or not HEX64.match(raw[name]):
            raise fail(f"{name}: expected 64 lowercase hex digits")
    try:
        sig = base64.b64decode(raw["signature"], validate=True) if isinstance(raw["signature"], str) else b""
    except (binascii.Error, ValueError):
        sig = b""
    if len(sig) != 64:
        raise fail("signature: expected the base64 of 64 bytes")
    return Signature(raw["key_id"], raw["manifest_sha256"], sig)


def check_signature(manifest_bytes: bytes, signature: bytes | None, keys: list[PublicKey], source: str) -> PublicKey:
    """Return the trusted key that signed the manifest ``manifest_bytes`` (already accepted by
    ``parse_manifest``); UntrustedArtifactError otherwise."""
    import_extra("cryptography", "checking a signature")
    from cryptography.exceptions import InvalidSignature
    from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PublicKey

    trusted = ", ".join(k.short_id for k in keys)
    if signature is None:
        raise UntrustedArtifactError(
            f"{source}: not signed, and this loader only accepts artifacts signed by key(s) {trusted} "
            "(sign with `precompile sign ARTIFACT --key KEY`)"
        )
    sig = parse_signature(signature, f"{source}: {C.SIGNATURE_FILE}")
    key = next((k for k in keys if k.key_id == sig.key_id), None)
    if key is None:
        raise UntrustedArtifactError(
            f"{source}: signed by key {sig.key_id[:16]}, which is not trusted here (trusted: {trusted})"
        )
    if sig.manifest_sha256 != manifest_digest(manifest_bytes):
        raise UntrustedArtifactError(
            f"{source}: {C.SIGNATURE_FILE} was made for another manifest (the manifest changed after signing, or "
            "the signature was copied from another artifact)"
        )
    try:
        Ed25519PublicKey.from_public_bytes(key.raw).verify(
            sig.signature, SIGNING_CONTEXT + canonical_manifest(manifest_bytes)
        )
    except InvalidSignature:
        raise UntrustedArtifactError(
            f"{source}: the signature does not verify with key {key.short_id} (forged, or the manifest was changed "
            "after signing)"
        ) from None
    return key


# --- expiry and versions -----------------------------------------------------------------------


def check_expiry(manifest: Manifest, source: str, now: datetime.datetime | None = None) -> None:
    if manifest.expires is None:
        return
    now = now or datetime.datetime.now(datetime.timezone.utc)
    if now >= datetime.datetime.fromisoformat(manifest.expires):
        raise UntrustedArtifactError(
            f"{source}: {manifest.name} version {manifest.version} expired at {manifest.expires}; ship a newer build"
        )


def check_min_version(manifest: Manifest, min_version: int, source: str) -> None:
    if manifest.version < min_version:
        raise UntrustedArtifactError(
            f"{source}: {manifest.name} is version {manifest.version}, older than the minimum {min_version} asked for"
        )


def default_state_root() -> Path:
    env = os.environ.get(C.STATE_ENV)
    if env:
        return Path(env).expanduser()
    xdg = os.environ.get("XDG_STATE_HOME")
    return (Path(xdg).expanduser() if xdg else Path.home() / ".local" / "state") / "precompile"


class VersionLedger:
    """The highest version of each artifact name this host loaded with ``refuse_rollback=True``."""

    def __init__(self, root: str | os.PathLike | None = None):
        self.root = Path(root) if root is not None else default_state_root()

    def path(self, name: str) -> Path:
        # Names match [a-z0-9][a-z0-9._-]*, safe as file names, but may be longer than one allows.
        stem = name if len(name) <= 200 else hashlib.sha256(name.encode()).hexdigest()
        return self.root / C.VERSIONS_DIR / f"{stem}.json"

    def hold(self, manifest: Manifest, digest: str, source: str) -> LedgerHold:
        """Lock ``manifest.name``'s record and check this load against it; the caller records or
        releases the hold once the load succeeded or failed. UntrustedArtifactError on a rollback."""
        path = self.path(manifest.name)
        try:
            for folder in (self.root, path.parent):  # 0755 whatever the umask: check_private refuses more
                folder.mkdir(mode=0o755, parents=True, exist_ok=True)
            fix = f"set {C.STATE_ENV} to a folder of your own"
            check_private(self.root, "the precompile state folder", fix, follow=True)
            check_private(path.parent, "the folder of version records", fix)
            lock = FileLock(path.with_suffix(".lock"))
            lock.acquire()
        except OSError as e:
            raise LoaderError(
                f"{path}: cannot use the version records ({e.strerror}); set {C.STATE_ENV} to a writable folder"
            ) from None
        try:
            self.check(manifest, digest, source)
        except BaseException:
            lock.release()
            raise
        return LedgerHold(self, manifest, digest, source, lock)

    def check(self, manifest: Manifest, digest: str, source: str) -> None:
        """UntrustedArtifactError if loading this would be a rollback (see ``hold`` for the locked form)."""
        seen = self.seen(manifest.name)
        if seen is None:
            return
        version, seen_digest = seen
        if manifest.version < version:
            raise UntrustedArtifactError(
                f"{source}: {manifest.name} version {manifest.version} is older than version {version}, already loaded "
                f"on this host (a rollback); ship version {version} or newer, or delete {self.path(manifest.name)} to "
                "allow it"
            )
        if manifest.version == version and digest != seen_digest:
            raise UntrustedArtifactError(
                f"{source}: {manifest.name} version {version} was already loaded on this host with other content "
                f"(manifest sha256 {seen_digest[:16]}, this one {digest[:16]}); build each release with a new "
                "--artifact-version"
            )

    def seen(self, name: str) -> tuple[int, str] | None:
        """(version, manifest digest) last recorded for ``name``, or None."""
        path = self.path(name)
        try:
            check_private(path, "a version record", f"delete it and set {C.STATE_ENV} to a folder of your own")
            data = json.loads(path.read_bytes())
            version, digest = data["version"], data["digest"]
            if data["name"] != name or type(version) is not int or not HEX64.match(digest):
                raise ValueError("unexpected content")
        except FileNotFoundError:
            return None
        except (OSError, ValueError, KeyError, TypeError) as e:
            # Failing closed: a damaged record must not silently turn the protection off.
            raise LoaderError(
                f"{path}: unreadable version record ({e}); delete it to reset the rollback check for {name!r}"
            ) from None
        return version, digest

    def _write(self, manifest: Manifest, digest: str) -> None:
        path = self.path(manifest.name)
        text = json.dumps(
            {
                "name": manifest.name,
                "version": manifest.version,
                "digest": digest,
                "recorded": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
            }
        )
        try:
            write_atomic(path, text.encode())
        except OSError as e:
            raise LoaderError(
                f"{path}: cannot record version {manifest.version} of {manifest.name!r} ({e.strerror}); set "
                f"{C.STATE_ENV} to a writable folder"
            ) from None


class LedgerHold:
    """One load's place in the ledger: the name's lock, held from the check until ``record()`` or
    ``release()``. Also a context manager that releases it."""

    def __init__(self, ledger: VersionLedger, manifest: Manifest, digest: str, source: str, lock: FileLock):
        self.ledger, self.manifest, self.digest, self.source = ledger, manifest, digest, source
        self._lock: FileLock | None = lock

    def record(self) -> None:
        """Remember this version (the load succeeded), then release the lock. Checked again first:
        a record written meanwhile by something that did not take the lock is a conflict, not a
        silent no-op."""
        if self._lock is None:
            raise LoaderError(f"{self.source}: the version check was already released; check again before recording")
        try:
            self.ledger.check(self.manifest, self.digest, self.source)
            if self.ledger.seen(self.manifest.name) != (self.manifest.version, self.digest):
                self.ledger._write(self.manifest, self.digest)
        finally:
            self.release()

    def release(self) -> None:
        lock, self._lock = self._lock, None
        if lock is not None:
            lock.release()

    def __enter__(self) -> LedgerHold:
        return self

    def __exit__(self, *exc: object) -> None:
        self.release()
