"""Artifacts in OCI registries: ``load("oci://registry.example.com/models/classifier:7")``.

An artifact is stored as an OCI artifact (the layout is in ``loader/constants.py``: an image manifest
of its own ``artifactType``, one layer per file, the signature beside the manifest), which ``oras pull``
writes back as the artifact folder. Reading one, cheapest refusal first:

- the OCI manifest (by tag or digest; pulled by digest, its bytes must hash to it) is parsed strictly:
  our artifactType, every layer a blob of a known digest and size named by its title, once;
- the artifact's ``manifest.json`` and ``signature.json`` layers are fetched (small) and judged
  (``admit``: trust, expiry, host) before any large blob is read; each layer's digest must be the
  sha256 the artifact's manifest records for that file, so the OCI manifest cannot swap a file;
- when the cache holds the artifact's digest already, nothing more is downloaded; else every blob is
  streamed into the cache's ``tmp/`` and hashed as it arrives: a blob whose bytes do not hash to its
  digest (changed in the registry's storage, or corrupt) is refused, and the entry is never made.

The registry is spoken to over its HTTP API (the OCI distribution spec) with the standard library:
plain HTTP for loopback registries and those named in ``PRECOMPILE_OCI_PLAIN_HTTP`` (comma separated
``host:port``), HTTPS otherwise; anonymous, or ``PRECOMPILE_OCI_USERNAME``/``PRECOMPILE_OCI_PASSWORD``
for Basic auth and registries' Bearer token exchange. ``precompile push``/``pull`` use the same client.
"""

from __future__ import annotations

import base64
import hashlib
import json
import os
import re
import shutil
import tempfile
import urllib.error
import urllib.parse
import urllib.request
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, BinaryIO, TypeVar

from .. import constants as C
from ..artifact import manifest_digest
from ..errors import ArtifactError, LoaderError
from ..manifest import Manifest, _Reader, parse_manifest
from .cache import Cache
from .pack import PackHead

PLAIN_HTTP_ENV = "PRECOMPILE_OCI_PLAIN_HTTP"
USERNAME_ENV = "PRECOMPILE_OCI_USERNAME"
PASSWORD_ENV = "PRECOMPILE_OCI_PASSWORD"
TIMEOUT = 30  # seconds per request without an answer
CHUNK = 1 << 20

T = TypeVar("T")

# registry[:port]/repository[:tag][@sha256:digest], as `docker pull` and `oras` take them.
_REGISTRY_RE = re.compile(r"^(?:[a-zA-Z0-9](?:[a-zA-Z0-9.-]*[a-zA-Z0-9])?|\[[0-9a-fA-F:]+\])(?::[0-9]{1,5})?$")
_REPOSITORY_RE = re.compile(r"^[a-z0-9]+(?:(?:[._]|__|-+)[a-z0-9]+)*(?:/[a-z0-9]+(?:(?:[._]|__|-+)[a-z0-9]+)*)*$")
_TAG_RE = re.compile(r"^[a-zA-Z0-9_][a-zA-Z0-9._-]{0,127}$")
DIGEST_RE = re.compile(r"^sha256:[0-9a-f]{64}$")


class OciError(ArtifactError):
    """A registry refused a request, or answered with something that is not ours."""


class MissingReferenceError(OciError):
    """The registry answered: no such repository, tag or blob."""


def is_reference(path: object) -> bool:
    """True for ``oci://...`` strings."""
    return isinstance(path, str) and path.startswith(C.OCI_SCHEME)


@dataclass(frozen=True)
class Reference:
    """``oci://registry/repository:tag`` (or ``@sha256:...``), parsed."""

    registry: str  # host[:port]
    repository: str
    tag: str | None
    digest: str | None

    @property
    def reference(self) -> str:
        """What ``/v2/<repository>/manifests/<reference>`` takes: the digest when given, else the tag."""
        return self.digest or self.tag or "latest"

    def with_digest(self, digest: str) -> Reference:
        return Reference(self.registry, self.repository, None, digest)

    def __str__(self) -> str:
        at = f"@{self.digest}" if self.digest else f":{self.tag}"
        return f"{C.OCI_SCHEME}{self.registry}/{self.repository}{at}"


def parse_reference(text: str) -> Reference:
    """``oci://REGISTRY/REPO:TAG`` or ``oci://REGISTRY/REPO@sha256:DIGEST``; LoaderError saying what
    is wrong with any other string."""
    usage = "expected oci://REGISTRY[:PORT]/REPOSITORY:TAG (or @sha256:DIGEST)"
    if not is_reference(text):
        raise LoaderError(f"{text}: not an OCI reference; {usage}")
    rest = text[len(C.OCI_SCHEME) :]
    registry, _, path = rest.partition("/")
    if not _REGISTRY_RE.match(registry) or not path:
        raise LoaderError(f"{text}: no registry host in it; {usage}")
    digest = None
    if "@" in path:
        path, digest = path.split("@", 1)
        if not DIGEST_RE.match(digest):
            raise LoaderError(f"{text}: {digest!r} is not a sha256 digest (sha256: and 64 hex digits)")
    tag = None
    name, colon, maybe_tag = path.rpartition(":")
    if colon and "/" not in maybe_tag:
        path, tag = name, maybe_tag
        if not _TAG_RE.match(tag):
            raise LoaderError(f"{text}: {tag!r} is not a valid tag (letters, digits, . _ -; at most 128)")
    if not _REPOSITORY_RE.match(path):
        raise LoaderError(f"{text}: {path!r} is not a valid repository name (lowercase, digits, . _ - and /)")
    if tag is None and digest is None:
        raise LoaderError(f"{text}: no tag; {usage}")
    return Reference(registry, path, tag, digest)


# --- the registry's HTTP API ----------------------------------------------------------------------


def _plain_http(registry: str) -> bool:
    host = registry.rsplit(":", 1)[0] if not registry.startswith("[") else registry.split("]")[0][1:]
    named = {h.strip() for h in os.environ.get(PLAIN_HTTP_ENV, "").split(",") if h.strip()}
    return registry in named or host == "localhost" or host.startswith("127.") or host == "::1"


class _NoRedirectAuth(urllib.request.HTTPRedirectHandler):
    """Blob GETs may be redirected to a storage backend's signed URL: the registry's credentials stay
    with the registry."""

    def redirect_request(self, req, fp, code, msg, headers, newurl):  # noqa: ANN001 -- urllib's signature
        new = super().redirect_request(req, fp, code, msg, headers, newurl)
        if new is not None and urllib.parse.urlsplit(newurl).netloc != urllib.parse.urlsplit(req.full_url).netloc:
            new.remove_header("Authorization")
        return new


_opener = urllib.request.build_opener(_NoRedirectAuth)


class Registry:
    """One registry's API, for one repository: ``Registry(reference)``."""

    def __init__(self, ref: Reference):
        self.ref = ref
        scheme = "http" if _plain_http(ref.registry) else "https"
        self.base = f"{scheme}://{ref.registry}/v2/{ref.repository}"
        self._auth: str | None = None
        user, password = os.environ.get(USERNAME_ENV), os.environ.get(PASSWORD_ENV)
        self._basic = (
            "Basic " + base64.b64encode(f"{user}:{password or ''}".encode()).decode() if user is not None else None
        )

    def request(
        self,
        method: str,
        url: str,
        *,
        what: str,
        headers: dict[str, str] | None = None,
        data: bytes | BinaryIO | None = None,
        ok: tuple[int, ...] = (200,),
        missing: str | None = None,
    ) -> Any:
        """The response to one request (a file-like object: read it, then close it). A 401 with a
        Bearer challenge is answered once with a token from the registry's realm. OciError naming
        ``what`` and the registry's own error code for anything but ``ok``; MissingReferenceError
        with ``missing`` for a 404 when it is given."""
        url = url if url.startswith(("http://", "https://")) else f"{self.base}{url}"
        for attempt in range(2):
            request = urllib.request.Request(url, data=data, method=method, headers=dict(headers or {}))
            if self._auth is not None or self._basic is not None:
                request.add_header("Authorization", self._auth or self._basic)
            try:
                response = _opener.open(request, timeout=TIMEOUT)
            except urllib.error.HTTPError as e:
                if e.code == 401 and attempt == 0 and self._authenticate(e.headers.get("WWW-Authenticate", "")):
                    e.close()
                    if hasattr(data, "seek"):
                        data.seek(0)
                    continue
                body = e.read(64 << 10)
                e.close()
                if e.code == 404 and missing is not None:
                    raise MissingReferenceError(f"{self.ref}: {missing}") from None
                raise OciError(f"{self.ref}: cannot {what}: the registry answered {e.code} {_codes(body)}") from None
            except (urllib.error.URLError, OSError) as e:
                reason = getattr(e, "reason", e)
                raise OciError(
                    f"{self.ref}: cannot {what}: {self.ref.registry} unreachable ({reason}); is it up?"
                ) from None
            if response.status not in ok:
                response.close()
                raise OciError(f"{self.ref}: cannot {what}: the registry answered {response.status}")
            return response
        raise OciError(f"{self.ref}: cannot {what}: the registry refused the credentials (401); check {USERNAME_ENV}")

    def _authenticate(self, challenge: str) -> bool:
        """A Bearer token for this repository from the challenge's realm (anonymous, or with the
        Basic credentials); False when the challenge is not one we can answer."""
        if not challenge.lower().startswith("bearer "):
            return False
        params = dict(re.findall(r'(\w+)="([^"]*)"', challenge))
        if "realm" not in params:
            return False
        query = {k: v for k, v in params.items() if k in ("service", "scope")}
        query.setdefault("scope", f"repository:{self.ref.repository}:pull,push")
        token_url = f"{params['realm']}?{urllib.parse.urlencode(query)}"
        request = urllib.request.Request(token_url, headers={"Authorization": self._basic} if self._basic else {})
        try:
            with _opener.open(request, timeout=TIMEOUT) as response:
                answer = json.loads(response.read(1 << 20))
        except (urllib.error.URLError, OSError, ValueError) as e:
            raise OciError(f"{self.ref}: cannot get a token from {params['realm']} ({e})") from None
        token = answer.get("token") or answer.get("access_token") if isinstance(answer, dict) else None
        if not isinstance(token, str):
            return False
        self._auth = f"Bearer {token}"
        return True

    # -- manifests

    def get_manifest(self) -> tuple[bytes, str]:
        """The OCI manifest the reference names and its digest; a manifest asked for by digest must
        hash to it."""
        what = f"read the manifest of {self.ref.reference}"
        missing = f"no such tag or manifest in {self.ref.registry}/{self.ref.repository}"
        headers = {"Accept": C.OCI_MANIFEST_MEDIA_TYPE}
        with self.request("GET", f"/manifests/{self.ref.reference}", what=what, headers=headers, missing=missing) as r:
            data = r.read(C.OCI_MAX_MANIFEST_BYTES + 1)
        if len(data) > C.OCI_MAX_MANIFEST_BYTES:
            raise OciError(f"{self.ref}: the manifest is larger than the {C.OCI_MAX_MANIFEST_BYTES} bytes allowed")
        digest = "sha256:" + hashlib.sha256(data).hexdigest()
        if self.ref.digest is not None and digest != self.ref.digest:
            raise OciError(f"{self.ref}: the registry sent a manifest that does not hash to the digest asked for")
        return data, digest

    def put_manifest(self, tag: str, data: bytes) -> str:
        """Put the OCI manifest ``data`` under ``tag``; its digest."""
        headers = {"Content-Type": C.OCI_MANIFEST_MEDIA_TYPE}
        self.request(
            "PUT", f"/manifests/{tag}", what=f"put the manifest {tag}", headers=headers, data=data, ok=(201,)
        ).close()
        return "sha256:" + hashlib.sha256(data).hexdigest()

    # -- blobs

    def has_blob(self, digest: str) -> bool:
        try:
            self.request("HEAD", f"/blobs/{digest}", what=f"look for blob {digest}", missing="").close()
        except MissingReferenceError:
            return False
        return True

    def upload_blob(self, digest: str, size: int, source: BinaryIO | bytes) -> None:
        """Upload one blob, monolithically (a POST for the session, then one PUT of its bytes)."""
        what = f"upload blob {digest}"
        with self.request("POST", "/blobs/uploads/", what=what, ok=(202,), data=b"") as r:
            location = r.headers.get("Location")
        if not location:
            raise OciError(f"{self.ref}: cannot {what}: the registry gave no upload location")
        location = urllib.parse.urljoin(self.base, location)
        sep = "&" if "?" in location else "?"
        headers = {"Content-Type": "application/octet-stream", "Content-Length": str(size)}
        url = f"{location}{sep}digest={urllib.parse.quote(digest)}"
        self.request("PUT", url, what=what, headers=headers, data=source, ok=(201,)).close()

    def download_blob(self, layer: Layer, out: BinaryIO) -> None:
        """Stream one blob into ``out``, hashed as it arrives: OciError when its bytes are not its
        digest's or its size's (the registry's copy was changed, or is corrupt)."""
        what = f"read {layer.title} (blob {layer.digest})"
        h, got = hashlib.sha256(), 0
        missing = f"blob {layer.digest} ({layer.title}) is missing from the registry"
        with self.request("GET", f"/blobs/{layer.digest}", what=what, missing=missing) as r:
            while chunk := r.read(min(CHUNK, layer.size - got + 1)):
                got += len(chunk)
                if got > layer.size:
                    break
                h.update(chunk)
                out.write(chunk)
        if got != layer.size or "sha256:" + h.hexdigest() != layer.digest:
            raise OciError(
                f"{self.ref}: {layer.title}: the registry's blob does not hash to its digest {layer.digest} "
                "(changed in the registry's storage, or corrupt); refusing it"
            )

    def read_blob(self, layer: Layer, limit: int) -> bytes:
        """A small blob (the artifact's manifest, its signature) in memory, checked like any blob."""
        if layer.size > limit:
            raise OciError(f"{self.ref}: {layer.title} is {layer.size} bytes, more than the {limit} allowed")
        buffer = _Buffer()
        self.download_blob(layer, buffer)
        return bytes(buffer.data)


class _Buffer:
    def __init__(self) -> None:
        self.data = bytearray()

    def write(self, chunk: bytes) -> None:
        self.data += chunk


def _codes(body: bytes) -> str:
    """The registry's error codes (``MANIFEST_UNKNOWN: manifest unknown``), from its JSON error body."""
    try:
        errors = json.loads(body).get("errors") or []
        return "; ".join(f"{e.get('code')}: {e.get('message')}" for e in errors if isinstance(e, dict))[:300]
    except (ValueError, AttributeError):
        return ""


# --- the OCI manifest of an artifact: untrusted input, parsed strictly -------------------------------


@dataclass(frozen=True)
class Layer:
    title: str  # the file's path in the artifact folder
    media_type: str
    digest: str  # sha256:<hex>
    size: int

    @property
    def sha256(self) -> str:
        return self.digest.split(":", 1)[1]


@dataclass(frozen=True)
class ArtifactLayers:
    """What an artifact's OCI manifest says: its layers by title."""

    digest: str  # of the OCI manifest
    layers: dict[str, Layer]


def parse_oci_manifest(data: bytes, where: str, digest: str) -> ArtifactLayers:
    """The layers of an OCI manifest ``precompile push`` wrote; OciError naming what is wrong."""
    r = _Reader(where)
    try:
        raw = json.loads(data)
    except (ValueError, RecursionError) as e:
        raise OciError(f"{where}: the manifest is not valid JSON ({e})") from None
    if not isinstance(raw, dict):
        raise OciError(f"{where}: the manifest is not a JSON object")
    artifact_type = raw.get("artifactType")
    if artifact_type != C.OCI_ARTIFACT_TYPE:
        kind = f"artifactType {artifact_type!r}" if artifact_type else f"mediaType {raw.get('mediaType')!r}"
        raise OciError(
            f"{where}: not a precompile artifact ({kind}; expected artifactType {C.OCI_ARTIFACT_TYPE}); "
            "push one with `precompile push ARTIFACT oci://...`"
        )
    if raw.get("schemaVersion") != 2 or raw.get("mediaType") != C.OCI_MANIFEST_MEDIA_TYPE:
        raise r.fail("mediaType", f"expected {C.OCI_MANIFEST_MEDIA_TYPE}, schemaVersion 2")
    layers: dict[str, Layer] = {}
    for i, value in enumerate(r.list(raw.get("layers"), "layers", max_len=4096)):
        at = f"layers[{i}]"
        entry = r.obj(value, at, {"mediaType", "digest", "size", "annotations"}, optional={"annotations"})
        annotations = r.mapping(entry.get("annotations", {}), f"{at}.annotations")
        title = r.str(annotations.get(C.OCI_TITLE_ANNOTATION), f"{at}.annotations.{C.OCI_TITLE_ANNOTATION}")
        if title in layers:
            raise r.fail(at, f"{title!r} appears twice")
        layers[title] = Layer(
            title=title,
            media_type=r.str(entry["mediaType"], f"{at}.mediaType"),
            digest=r.str(entry["digest"], f"{at}.digest", DIGEST_RE),
            size=r.int(entry["size"], f"{at}.size"),
        )
    if C.MANIFEST_FILE not in layers:
        raise r.fail("layers", f"no {C.MANIFEST_FILE} layer")
    return ArtifactLayers(digest, layers)


def check_layers(layers: ArtifactLayers, manifest: Manifest, where: str) -> None:
    """Every file the artifact's manifest lists is a layer with its size and sha256, and no layer is
    anything else: what is downloaded is exactly what the signed manifest pins."""
    for title, layer in layers.layers.items():
        if title in (C.MANIFEST_FILE, C.SIGNATURE_FILE):
            continue
        entry = manifest.files.get(title)
        if entry is None:
            raise OciError(f"{where}: layer {title!r} is not a file the artifact's manifest lists")
        if layer.size != entry.size or layer.sha256 != entry.sha256:
            raise OciError(f"{where}: layer {title!r} is not the file the artifact's manifest pins (size, sha256)")
    missing = sorted(manifest.files.keys() - layers.layers.keys())
    if missing:
        raise OciError(f"{where}: {missing[0]} is listed in the artifact's manifest but is no layer")


# --- reading an artifact --------------------------------------------------------------------------


@dataclass(frozen=True)
class RemoteArtifact:
    """An artifact's OCI manifest and its head (manifest and signature), read from the registry."""

    ref: Reference  # by digest: what was read, whatever the tag points at later
    registry: Registry
    layers: ArtifactLayers
    manifest: Manifest
    manifest_bytes: bytes
    signature: bytes | None
    digest: str  # of the artifact's manifest (its cache entry)

    def head(self, path: Path) -> PackHead:
        return PackHead(path, self.manifest, self.manifest_bytes, self.signature, self.digest)

    def download(self, folder: Path) -> None:
        """Write every file into the empty ``folder``: the artifact folder, each blob checked."""
        for title, layer in sorted(self.layers.layers.items()):
            target = folder / title
            target.parent.mkdir(mode=0o755, parents=True, exist_ok=True)
            flags = os.O_WRONLY | os.O_CREAT | os.O_EXCL | getattr(os, "O_NOFOLLOW", 0)
            with os.fdopen(os.open(target, flags, 0o644), "wb") as out:
                if title == C.MANIFEST_FILE:
                    out.write(self.manifest_bytes)
                elif title == C.SIGNATURE_FILE and self.signature is not None:
                    out.write(self.signature)
                else:
                    self.registry.download_blob(layer, out)


def read_artifact(reference: str) -> RemoteArtifact:
    """The OCI manifest ``reference`` names and the artifact's manifest and signature (small blobs);
    nothing else is downloaded."""
    ref = parse_reference(reference)
    registry = Registry(ref)
    data, digest = registry.get_manifest()
    where = str(ref)
    layers = parse_oci_manifest(data, where, digest)
    manifest_bytes = registry.read_blob(layers.layers[C.MANIFEST_FILE], C.MAX_MANIFEST_BYTES)
    manifest = parse_manifest(manifest_bytes, source=f"{where}: {C.MANIFEST_FILE}")
    check_layers(layers, manifest, where)
    signature_layer = layers.layers.get(C.SIGNATURE_FILE)
    signature = registry.read_blob(signature_layer, C.MAX_SIGNATURE_BYTES) if signature_layer else None
    pinned = ref.with_digest(digest)
    return RemoteArtifact(
        pinned, Registry(pinned), layers, manifest, manifest_bytes, signature, manifest_digest(manifest_bytes)
    )


def identity(reference: str) -> tuple[str, ...]:
    """What tells a watcher (``Live.watch``, ``precompile serve oci://...:TAG --watch``) that the tag
    moved: the digest of the manifest it names now. One small request; no blob is read."""
    _, digest = Registry(parse_reference(reference)).get_manifest()
    return ("oci", digest)


def open_reference(
    reference: str,
    open_head: Callable[[PackHead], T],
    *,
    admit: Callable[[PackHead], Any] | None = None,
    max_bytes: int | None = None,
    cache_dir: str | os.PathLike | None = None,
) -> T:
    """Open the artifact ``reference`` names through ``open_head`` (``open_artifact`` of a cache
    entry's head): its head judged by ``admit`` first, then its files downloaded into the cache
    unless the cache holds its digest already. ``max_bytes`` bounds the sum of its blobs."""
    remote = read_artifact(reference)
    cache = Cache(cache_dir)
    head = remote.head(cache.entry_path(remote.digest))
    if admit is not None:
        admit(head)
    total = sum(layer.size for layer in remote.layers.layers.values())
    if max_bytes is not None and total > max_bytes:
        raise ArtifactError(f"{reference}: {total} bytes of blobs, more than max_bytes={max_bytes}; refusing it")
    cache.open(head, fill=remote.download)
    return open_head(head)


def pull(reference: str, output: str | os.PathLike) -> RemoteArtifact:
    """Download the artifact ``reference`` names into the folder ``output`` (which must not exist),
    every blob checked against its digest and the artifact's manifest; moved into place only whole."""
    output = Path(output)
    if os.path.lexists(output):
        raise LoaderError(f"{output}: already exists; pull into a new folder")
    remote = read_artifact(reference)
    output.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{output.name}.", dir=output.parent))
    try:
        remote.download(tmp)
        os.rename(tmp, output)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return remote
