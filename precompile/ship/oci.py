"""Publishing artifacts to OCI registries and fetching them back: ``precompile push ART oci://...``,
``precompile pull oci://...``.

The layout and the reading belong to the loader (``loader/constants.py``, ``loader.stores.oci``); this is
the writing: one blob per file, uploaded only when the registry does not hold its digest yet (a HEAD
first), so a version that keeps its predecessor's weights uploads no weights; then the empty config;
then the manifest under the tag. Pushing the same artifact to the same tag again uploads nothing.
"""

from __future__ import annotations

import hashlib
import json
import os
import tempfile
from dataclasses import dataclass
from pathlib import Path

from loader import constants as C
from loader.artifact import manifest_digest, read_manifest_with_bytes, read_signature, sha256_file, verify_files
from loader.stores.oci import Registry, parse_reference
from loader.stores.oci import pull as pull_reference
from loader.stores.pack import unpack

from ..errors import PrecompileError


@dataclass(frozen=True)
class OciPushed:
    reference: str  # oci://registry/repo:tag
    digest: str  # of the OCI manifest: pull by oci://registry/repo@<digest>
    uploaded: int  # bytes of blobs uploaded
    reused: int  # bytes of blobs the registry held already


@dataclass(frozen=True)
class _Blob:
    title: str
    media_type: str
    digest: str
    size: int
    path: Path | None  # None: ``data``
    data: bytes = b""


def push(artifact: str | os.PathLike, reference: str) -> OciPushed:
    """Publish an artifact folder (or a pack, unpacked on the way) as the OCI artifact ``reference``
    (``oci://REGISTRY/REPO:TAG``). Every file is checked against the manifest first: nothing corrupt
    is published."""
    ref = parse_reference(reference)
    if ref.tag is None:
        raise PrecompileError(f"{reference}: push to a tag (oci://REGISTRY/REPO:TAG), not a digest")
    artifact = Path(artifact)
    if artifact.is_file():
        with tempfile.TemporaryDirectory(prefix="precompile-push-") as scratch:
            folder = Path(scratch) / "artifact"
            folder.mkdir()
            unpack(artifact, folder)
            return _push_folder(folder, ref, reference)
    return _push_folder(artifact, ref, reference)


def _push_folder(folder: Path, ref, reference: str) -> OciPushed:
    manifest, manifest_bytes = read_manifest_with_bytes(folder)
    verify_files(folder, manifest)
    blobs = [
        _Blob(
            C.MANIFEST_FILE,
            C.OCI_LAYER_MEDIA_TYPES[C.MANIFEST_FILE],
            _digest(manifest_bytes),
            len(manifest_bytes),
            None,
            manifest_bytes,
        )
    ]
    signature = read_signature(folder)
    if signature is not None:
        blobs.append(
            _Blob(
                C.SIGNATURE_FILE,
                C.OCI_LAYER_MEDIA_TYPES[C.SIGNATURE_FILE],
                _digest(signature),
                len(signature),
                None,
                signature,
            )
        )
    for rel, entry in sorted(manifest.files.items()):
        media_type = C.OCI_LAYER_MEDIA_TYPES.get(rel, C.OCI_FILE_MEDIA_TYPE)
        blobs.append(_Blob(rel, media_type, f"sha256:{entry.sha256}", entry.size, folder / rel))
    registry = Registry(ref)
    config = _Blob(
        "", C.OCI_EMPTY_MEDIA_TYPE, _digest(C.OCI_EMPTY_CONFIG), len(C.OCI_EMPTY_CONFIG), None, C.OCI_EMPTY_CONFIG
    )
    uploaded = reused = 0
    for blob in [config, *blobs]:
        if registry.has_blob(blob.digest):
            reused += blob.size
            continue
        if blob.path is None:
            registry.upload_blob(blob.digest, blob.size, blob.data)
        else:
            if sha256_file(blob.path) != blob.digest.split(":", 1)[1]:
                raise PrecompileError(f"{blob.path}: changed while it was being pushed; push again")
            with open(blob.path, "rb") as source:
                registry.upload_blob(blob.digest, blob.size, source)
        uploaded += blob.size
    document = {
        "schemaVersion": 2,
        "mediaType": C.OCI_MANIFEST_MEDIA_TYPE,
        "artifactType": C.OCI_ARTIFACT_TYPE,
        "config": _descriptor(config),
        "layers": [_descriptor(b) for b in blobs],
        "annotations": {
            C.OCI_NAME_ANNOTATION: manifest.name,
            C.OCI_VERSION_ANNOTATION: str(manifest.version),
            C.OCI_DIGEST_ANNOTATION: manifest_digest(manifest_bytes),
        },
    }
    data = json.dumps(document, indent=2, sort_keys=True).encode() + b"\n"
    digest = registry.put_manifest(ref.tag, data)
    return OciPushed(str(ref), digest, uploaded, reused)


def pull(reference: str, output: str | os.PathLike | None = None) -> tuple[Path, int]:
    """Download the OCI artifact ``reference`` names into a new folder (default: ``NAME-VERSION``
    here), every blob checked; returns (folder, version)."""
    ref = parse_reference(reference)
    target = Path(output) if output is not None else Path(f"{ref.repository.rsplit('/', 1)[-1]}-{ref.tag or 'pulled'}")
    remote = pull_reference(reference, target)
    return target, remote.manifest.version


def _digest(data: bytes) -> str:
    return "sha256:" + hashlib.sha256(data).hexdigest()


def _descriptor(blob: _Blob) -> dict:
    descriptor = {"mediaType": blob.media_type, "digest": blob.digest, "size": blob.size}
    if blob.title:
        descriptor["annotations"] = {C.OCI_TITLE_ANNOTATION: blob.title}
    else:
        descriptor["data"] = "e30="  # the empty config inline, as the OCI image spec suggests
    return descriptor
