"""``precompile keygen`` and ``precompile sign``: Ed25519 keys, and a signature of the manifest
(``loader.trust``'s format) written into an artifact folder or a pack."""

from __future__ import annotations

import os
import tempfile
from pathlib import Path
from typing import Any

from loader import constants as C
from loader.artifact import read_manifest_with_bytes, verify_files
from loader.stores.pack import replace_head, unpack, verify_pack, write_pack
from loader.trust import key_id, make_signature

from ..errors import PrecompileError
from .pack import atomic_output


def keygen(prefix: str | os.PathLike, *, force: bool = False) -> tuple[Path, Path, str]:
    """Make an Ed25519 key pair: ``PREFIX.key`` (private, mode 0600) and ``PREFIX.pub`` (PEM).

    Returns both paths and the key id (sha256 of the raw public key) that signatures name.
    """
    from cryptography.hazmat.primitives import serialization
    from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey

    prefix = Path(prefix)
    private_path, public_path = prefix.with_name(prefix.name + ".key"), prefix.with_name(prefix.name + ".pub")
    for path in (private_path, public_path):
        if path.exists() and not force:
            raise PrecompileError(f"{path}: exists; refusing to overwrite a key (choose another -o, or --force)")
    key = Ed25519PrivateKey.generate()
    private_pem = key.private_bytes(
        serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption()
    )
    public_pem = key.public_key().public_bytes(
        serialization.Encoding.PEM, serialization.PublicFormat.SubjectPublicKeyInfo
    )
    try:
        prefix.parent.mkdir(parents=True, exist_ok=True)
        fd = os.open(private_path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        with os.fdopen(fd, "wb") as f:
            f.write(private_pem)
        os.chmod(private_path, 0o600)
        public_path.write_bytes(public_pem)
    except OSError as e:
        raise PrecompileError(f"{prefix}: cannot write the key pair ({e.strerror})") from None
    return private_path, public_path, key_id(key.public_key().public_bytes_raw())


def load_private_key(path: str | os.PathLike) -> Any:
    """An Ed25519 private key from a PEM (PKCS#8) or OpenSSH file; PrecompileError otherwise."""
    from cryptography.hazmat.primitives import serialization
    from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey

    path = Path(path)
    try:
        data = path.read_bytes()
    except OSError as e:
        raise PrecompileError(f"--key {path}: cannot read ({e.strerror})") from None
    try:
        if b"OPENSSH PRIVATE KEY" in data:
            key = serialization.load_ssh_private_key(data, password=None)
        else:
            key = serialization.load_pem_private_key(data, password=None)
    except TypeError:
        raise PrecompileError(
            f"--key {path}: the key is encrypted; give an unencrypted key (keep it in your CI's secret store)"
        ) from None
    except ValueError as e:
        if b"PUBLIC KEY" in data or data.lstrip().startswith(b"ssh-ed25519"):
            raise PrecompileError(
                f"--key {path}: a public key; signing needs the private one (the .key file)"
            ) from None
        raise PrecompileError(f"--key {path}: not a PEM or OpenSSH private key ({e})") from None
    if not isinstance(key, Ed25519PrivateKey):
        raise PrecompileError(
            f"--key {path}: a {type(key).__name__}; signatures use Ed25519 keys (`precompile keygen`)"
        )
    return key


def sign(artifact: str | os.PathLike, key_path: str | os.PathLike) -> str:
    """Sign an artifact folder or a pack with the private key at ``key_path``; return the key id.

    The artifact is verified in full first (never sign what you have not checked). A folder gets a
    ``signature.json``; a pack is rewritten with it, replacing any earlier signature.
    """
    artifact = Path(artifact)
    key = load_private_key(key_path)
    if artifact.is_dir():
        manifest, manifest_bytes = read_manifest_with_bytes(artifact)
        verify_files(artifact, manifest, hashes=True)
        _write_file(artifact / C.SIGNATURE_FILE, make_signature(manifest_bytes, key))
    elif artifact.is_file():
        head = verify_pack(artifact)
        signature = make_signature(head.manifest_bytes, key)
        with atomic_output(artifact) as out:
            if not replace_head(artifact, out, signature):
                _repack(artifact, out, signature)
    else:
        raise PrecompileError(f"{artifact}: no such artifact folder or pack")
    return key_id(key.public_key().public_bytes_raw())


def _repack(pack_path: Path, out: Any, signature: bytes) -> None:
    with tempfile.TemporaryDirectory(prefix=".repack-", dir=pack_path.parent) as tmp:
        unpack(pack_path, tmp)
        write_pack(tmp, out, signature=signature)


def _write_file(path: Path, data: bytes) -> None:
    with atomic_output(path) as out:
        out.write(data)
