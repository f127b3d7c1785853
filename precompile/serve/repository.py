"""The models the routes look up by name: a repository (``precompile serve REPO``), or the one
artifact ``precompile serve ARTIFACT`` serves (``OneModel``), behind the same interface.

REPO is one of::

    a folder of artifacts and packs    repo/classifier/  repo/tagger.tar.zst     (named by their manifests)
    a folder of model folders          repo/<name>/<version>.tar.zst, as `precompile push` lays out a
                                       file:// store, or repo/<name>/<any>/ artifact folders
    a store prefix                     s3://bucket/models/: what `precompile push` wrote (<name>/index.json)

Each model's versions follow the policy (``--versions``: ``latest:N``, default ``latest:1``, or listed
versions ``3,5``). Each served version is a ``Service`` (service.py): its own ``loader.Live`` built
from the server's config with the version's path, so every trust option applies to every version; its
own batcher; its metrics under the label ``model``. A request that names no version goes to the newest
ready one. A model that cannot be read or loaded is reported in the index (UNAVAILABLE, with the
reason) and never stops the others; a new version that fails leaves the older one serving.

Confinement: whatever a scan finds must lie under REPO once every symbolic link and pointer file is
followed (``reload.reload_target``, the rule /v1/reload applies under --reload-root). The repository
extension's load names a model, never a path, so neither a request nor a link planted in the folder
reaches beyond it.

``--watch`` scans REPO again every ``--watch-interval``: a new version is loaded, and the one it
replaces under the policy is dropped once the new one is ready (requests in flight finish on it);
each version's Live also follows its own path. With ``--allow-repository-control``,
``POST /v2/repository/models/{name}/load`` scans that model again (retrying failed versions) and
``.../unload`` drops its versions, which --watch then leaves alone until the next load.
"""

from __future__ import annotations

import contextlib
import logging
import threading
from collections.abc import Awaitable, Callable, Iterable
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

from fastapi import Request
from fastapi.responses import JSONResponse, Response

from loader import LoaderError
from loader import constants as C
from loader.manifest import Manifest
from loader.serving.live import SwapError, read_served_manifest
from loader.stores import remote

from .codec import MIN_BODY_BYTES, body_limit
from .config import ServeConfig
from .errors import Code, Refused
from .metrics import Metrics
from .reload import reload_target
from .service import Service, answer, count_refusal, refusal_response

log = logging.getLogger("precompile.serve")

READY, LOADING, UNAVAILABLE = "READY", "LOADING", "UNAVAILABLE"  # the repository extension's states


class RepositoryError(LoaderError):
    """REPO cannot be read as a repository, or a version policy is malformed (a user error)."""


# --- which versions ------------------------------------------------------------------------------

MAX_VERSION_DIGITS = 18  # every such number is an int64, as the manifest's version is


def _decimal(text: str) -> bool:
    """Whether ``text`` is a version number as written in a path or an option: ASCII digits only, at
    most MAX_VERSION_DIGITS of them. ``str.isdigit`` alone takes "²" (which ``int`` then refuses)
    and "１" or "١" (which ``int`` reads as 1)."""
    return 0 < len(text) <= MAX_VERSION_DIGITS and text.isascii() and text.isdigit()


def parse_version(text: str) -> int:
    """A requested version (the ``{version}`` of a path, a gRPC ``model_version``) as its number;
    Refused (INVALID_ARGUMENT) for anything but ASCII digits: no sign, no other script's digits."""
    if not _decimal(text):
        raise Refused(
            Code.INVALID_ARGUMENT,
            f"version {text[:40]!r} is not a version number: write it in ASCII digits (1, 2, ...), "
            f"at most {MAX_VERSION_DIGITS} of them",
            "invalid_version",
        )
    return int(text)


@dataclass(frozen=True)
class VersionPolicy:
    """Which of a model's versions are served: the newest ``latest``, or those ``listed``."""

    latest: int | None = 1
    listed: tuple[int, ...] = ()

    @classmethod
    def parse(cls, text: str) -> VersionPolicy:
        """``latest:N`` or a comma-separated list of versions (``3,5``)."""
        text = text.strip()
        if text.startswith("latest:"):
            n = text.removeprefix("latest:")
            if not _decimal(n) or int(n) < 1:
                raise RepositoryError(f"--versions {text}: latest:N needs a whole number N >= 1, e.g. latest:2")
            return cls(latest=int(n))
        parts = [p.strip() for p in text.split(",")]
        if not all(_decimal(p) and int(p) >= 1 for p in parts):
            raise RepositoryError(f"--versions {text}: expected latest:N or versions such as 3,5")
        return cls(latest=None, listed=tuple(sorted({int(p) for p in parts})))

    def select(self, versions: Iterable[int]) -> list[int]:
        found = sorted(set(versions))
        if self.latest is not None:
            return found[-self.latest :]
        return [v for v in found if v in self.listed]


# --- what REPO holds ----------------------------------------------------------------------------


@dataclass(frozen=True)
class Scanned:
    """What one look at REPO found: each model's versions and where each lies, the models that
    cannot be served at all, with the reason, and the artifacts there that could not be read."""

    versions: dict[str, dict[int, str]]
    broken: dict[str, str]
    unreadable: frozenset[str] = frozenset()  # resolved paths (a store's: none, its broken are by model)

    @property
    def names(self) -> set[str]:
        return set(self.versions) | set(self.broken)


def is_repository(path: str) -> bool:
    """Whether ``precompile serve PATH`` serves a repository: a folder that is not an artifact, or a
    store prefix (a URL ending in ``/``). Anything else is served as one artifact, as always."""
    if remote.is_url(path):
        return path.endswith("/")
    p = Path(path)
    return p.is_dir() and not (p / C.MANIFEST_FILE).exists()


def scan(root: str) -> Scanned:
    """The models under ``root`` (see the module docstring); RepositoryError when it cannot be read."""
    if remote.is_url(root):
        broken: dict[str, str] = {}
        indexes = remote.list_models(root, broken=broken)
        base = root.rstrip("/")
        versions = {n: {e.version: f"{base}/{n}/{e.file}" for e in ix.entries} for n, ix in indexes.items()}
        return Scanned(versions, broken)
    return _scan_folder(Path(root))


def _scan_folder(root: Path) -> Scanned:
    versions: dict[str, dict[int, str]] = {}
    broken: dict[str, str] = {}
    unreadable: set[str] = set()

    def add(path: Path, folder: str | None) -> None:
        key = folder if folder is not None else path.name.removesuffix(C.PACK_SUFFIX)
        try:
            target = reload_target(str(path), served=str(root), root=str(root), what="the repository")
            manifest = read_served_manifest(target)
        except LoaderError as e:
            broken.setdefault(key, str(e))
            with contextlib.suppress(OSError, RuntimeError):
                unreadable.add(str(path.resolve()))
            return
        if folder is not None and manifest.name != folder:
            broken.setdefault(key, f"{path}: artifact {manifest.name!r} in the folder of model {folder!r}")
            return
        versions.setdefault(manifest.name, {}).setdefault(manifest.version, target)  # the first, in name order

    try:
        entries = sorted(root.iterdir())
        for entry in entries:
            if entry.name.startswith("."):
                continue
            if _is_artifact(entry):
                add(entry, None)
            elif entry.is_dir():
                for sub in sorted(entry.iterdir()):
                    if not sub.name.startswith(".") and _is_artifact(sub):
                        add(sub, entry.name)
    except OSError as e:
        raise RepositoryError(f"{root}: cannot read the repository ({e.strerror})") from None
    return Scanned(versions, {n: why for n, why in broken.items() if n not in versions}, frozenset(unreadable))


def _is_artifact(path: Path) -> bool:
    """An artifact folder or a pack, or a link to one (followed, and confined); pointer files are
    skipped (a version is found where it lies, and a pointer names one of those)."""
    return (path / C.MANIFEST_FILE).is_file() if path.is_dir() else path.name.endswith(C.PACK_SUFFIX)


def repository_body_limit(root: str) -> int:
    """Scan ``root`` once before the server starts: RepositoryError when it holds no model at all;
    else the default body limit, the largest any local model's manifest asks for (a store's models
    are only read at load: theirs is at least 1 MiB, or give --max-body-bytes)."""
    scanned = scan(root)
    if not scanned.names:
        raise RepositoryError(
            f"{root}: no models found; a repository holds artifact folders or packs, or model folders "
            f"(<name>/<version>{C.PACK_SUFFIX}, as `precompile push` lays them out)"
        )
    limits = [MIN_BODY_BYTES]
    for versions in scanned.versions.values():
        for path in versions.values():
            if not remote.is_url(path):
                try:
                    limits.append(body_limit(read_served_manifest(path)))
                except LoaderError:
                    pass  # reported when it fails to load
    return max(limits)


# --- the repository -----------------------------------------------------------------------------


class Repository:
    """Every model under ``config.artifact``, each version a Service; see the module docstring."""

    def __init__(self, config: ServeConfig):
        self.config = config
        self.root = config.artifact
        self.policy = VersionPolicy.parse(config.versions)
        self.metrics = Metrics(self._describe_all, labels=("model",))
        self.max_body_bytes = config.max_body_bytes or MIN_BODY_BYTES
        self._models: dict[str, dict[int, Service]] = {}
        self._broken: dict[str, str] = {}  # models that cannot be served at all, and why
        self._unloaded: set[str] = set()  # by request: --watch leaves them alone
        self._warned: dict[str, str] = {}  # models served on although REPO shows them unreadable, and why
        self._lock = threading.Lock()  # the tables above, read by every request
        self._ops = threading.Lock()  # one scan, load or unload at a time
        self._started = threading.Event()  # the first scan and its loads are done
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    # --- lifecycle -------------------------------------------------------------------------------

    def start(self) -> None:
        self._thread = threading.Thread(target=self._run, name="precompile-repository", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        self._sync_logged()
        self._started.set()
        if self.config.watch:
            while not self._stop.wait(self.config.watch_interval):
                self._sync_logged()

    def _sync_logged(self) -> None:
        try:
            self.sync()
        except Exception as e:  # noqa: BLE001: the store down, the folder gone: what serves, serves on
            log.error("cannot scan the repository %s: %s", self.root, e)

    def wait_loaded(self) -> None:
        """Wait until the first scan and its loads are done (each model loaded or failed)."""
        self._started.wait()

    def stop(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join()
        with self._lock:
            services = [s for table in self._models.values() for s in table.values()]
            self._models.clear()
        for service in services:
            service.stop()

    # --- loading and unloading -------------------------------------------------------------------

    def sync(self) -> None:
        """Scan REPO and bring every model (but those unloaded by request) to its policy's versions."""
        with self._ops:
            scanned = scan(self.root)
            with self._lock:
                names = sorted(scanned.names | set(self._models) | set(self._broken))
            for name in names:
                if name not in self._unloaded:
                    self._apply(name, scanned, retry=False)

    def load(self, name: str) -> None:
        """The repository extension's load: scan REPO for ``name`` and serve its versions, retrying
        those that failed. Refused (404) for a model REPO does not hold; 400 when none loads."""
        with self._ops:
            scanned = scan(self.root)
            if name not in scanned.names:
                raise Refused(
                    Code.NOT_FOUND,
                    f"no model {name!r} in the repository {self.root} (found: {_listing(scanned.names)})",
                    "unknown_model",
                )
            with self._lock:
                self._unloaded.discard(name)
            self._apply(name, scanned, retry=True)
        reasons = [r["reason"] for r in self.index() if r["name"] == name and r["state"] != READY]
        if not any(r["state"] == READY for r in self.index() if r["name"] == name):
            raise Refused(Code.INVALID_ARGUMENT, f"failed to load {name!r}: {'; '.join(reasons) or 'no version'}")

    def unload(self, name: str) -> None:
        """The repository extension's unload: stop serving every version of ``name``."""
        with self._ops:
            with self._lock:
                if name not in self._models and name not in self._broken:
                    raise Refused(Code.NOT_FOUND, self._unknown(name), "unknown_model")
                table = self._models.pop(name, {})
                self._broken.pop(name, None)
                self._unloaded.add(name)
            for service in table.values():
                service.stop()  # requests already running on it finish first (the batcher runs its queue)
        log.info("unloaded %s", name)

    def _apply(self, name: str, scanned: Scanned, *, retry: bool) -> None:
        """Serve the versions of ``name`` the policy picks from ``scanned``, loading the new ones
        before dropping those they replace (only once one of them is ready)."""
        found = scanned.versions.get(name, {})
        wanted = {v: found[v] for v in self.policy.select(found)}
        with self._lock:
            current = dict(self._models.get(name, {}))
        unreadable = {str(s.config.artifact) for s in current.values()} & scanned.unreadable
        if current and (name in scanned.broken or unreadable):
            # Unreadable now (a damaged or unreachable index, an artifact mid-copy): what serves, serves on.
            why = scanned.broken.get(name) or f"{sorted(unreadable)[0]} cannot be read"
            if self._warned.get(name) != why:
                log.warning("model %s: %s; the versions it serves stay", name, why)
                self._warned[name] = why
            return
        self._warned.pop(name, None)
        again = {v for v, s in current.items() if retry and not s.live.ready and v in wanted}
        new = {v: self._service(name, path) for v, path in wanted.items() if v not in current or v in again}
        serving = self._started.is_set()  # past the first scan: other models serve while these load
        for service in new.values():
            service.start(background=serving)
        for service in new.values():
            service.join_load()
        with self._lock:
            table = self._models.setdefault(name, {})
            replaced = [table[v] for v in new if v in table]
            table.update(new)
            stale = [v for v in table if v not in wanted]
            if not wanted or any(table[v].live.ready for v in wanted):
                dropped = [table.pop(v) for v in stale]
            else:
                dropped = []  # none of the wanted versions loads: the older ones serve on
            if not table:
                del self._models[name]
            if name in scanned.broken and name not in self._models:
                self._broken[name] = scanned.broken[name]
            else:
                self._broken.pop(name, None)
        for service in replaced + dropped:
            if name in self._models:  # a call looked up before the swap runs on the newest version
                service.successor = lambda: self.lookup(name, None)
            service.stop()

    def _service(self, name: str, path: str) -> Service:
        def same_name(model: Any) -> None:
            if model.manifest.name != name:
                raise SwapError(f"artifact {model.manifest.name!r} stands where model {name!r} is served")

        config = replace(self.config, artifact=path, repository=False)
        return Service(config, metrics=self.metrics, labels=(name,), check=same_name)

    # --- looking up -----------------------------------------------------------------------------

    def lookup(self, name: str | None, version: str | None = None) -> Service:
        """The Service for model ``name`` (None: the only model) at ``version`` (None: the newest ready
        one). Refused: NOT_FOUND for an unknown model or version, UNAVAILABLE for one that failed."""
        with self._lock:
            if name is None:
                if len(self._models) != 1:
                    raise Refused(
                        Code.INVALID_ARGUMENT,
                        f"this server serves {len(self._models)} models ({_listing(self._models) or 'none ready'}): "
                        "name one in the path, as in POST /predict/{name}",
                        "unknown_model",
                    )
                name = next(iter(self._models))
            table = self._models.get(name)
            if table is None:
                if name in self._broken:
                    raise Refused(Code.UNAVAILABLE, f"model {name!r} is unavailable: {self._broken[name]}")
                raise Refused(Code.NOT_FOUND, self._unknown(name), "unknown_model")
            versions = sorted(table)
            if version is None:
                ready = [v for v in versions if table[v].live.ready]
                return table[(ready or versions)[-1]]  # none ready: its refusal says why
            number = parse_version(version)
            if number not in table:
                raise Refused(
                    Code.NOT_FOUND,
                    f"model {name!r} has no version {version!r} served (served: {', '.join(map(str, versions))})",
                    "unknown_model",
                )
            return table[number]

    def versions(self, name: str) -> list[str]:
        """The versions of ``name`` being served (ready or not), oldest first."""
        with self._lock:
            return [str(v) for v in sorted(self._models.get(name, {}))]

    def _unknown(self, name: str) -> str:
        return f"unknown model {name!r} (this server serves: {_listing(self._models) or 'none'})"

    def index(self, *, ready_only: bool = False) -> list[dict[str, str]]:
        """The repository index: every version served or tried, and every model that cannot be."""
        with self._lock:
            models = {name: sorted(table.items()) for name, table in self._models.items()}
            broken = dict(self._broken)
            unloaded = set(self._unloaded)
        rows = [
            {"name": name, "version": str(v), **_state(service)}
            for name, versions in models.items()
            for v, service in versions
        ]
        rows += [{"name": n, "state": UNAVAILABLE, "reason": why} for n, why in broken.items()]
        rows += [{"name": n, "state": UNAVAILABLE, "reason": "unloaded"} for n in unloaded if n not in models]
        rows.sort(key=lambda r: (r["name"], int(r.get("version", 0))))
        return [r for r in rows if r["state"] == READY] if ready_only else rows

    @property
    def ready(self) -> bool:
        """The first scan's loads are done and at least one model is ready."""
        return self._started.is_set() and any(r["state"] == READY for r in self.index())

    def readiness(self) -> tuple[dict[str, Any], int]:
        """/readyz: which models are ready, loading, failed; 200 once the first loads are done and
        one model at least is ready (a failed model never takes the others out of service)."""
        rows = self.index()
        ready = sorted({r["name"] for r in rows if r["state"] == READY})
        loading = sorted({r["name"] for r in rows if r["state"] == LOADING} - set(ready))
        failed = {r["name"]: r["reason"] for r in rows if r["state"] == UNAVAILABLE and r["name"] not in ready}
        if not self._started.is_set():
            status = "loading"
        else:
            status = "ready" if ready else "failed"
        body = {"status": status, "models": {"ready": ready, "loading": loading, "failed": failed}}
        return body, 200 if status == "ready" else 503

    def openapi_manifest(self) -> Manifest | None:
        return None  # many models: /predict's schema is the generic one

    # --- answering ------------------------------------------------------------------------------

    async def answer(self, request: Request, work: Callable[[], Awaitable[Response]]) -> Response:
        return await answer(request, work, self.refuse)

    def refuse(self, scope: dict[str, Any], refused: Refused) -> JSONResponse:
        """A refusal, counted under the model the path names."""
        name = _path_model(scope["path"])
        return refusal_response(scope, refused, lambda status, reason: self.count_refused(name, status, reason))

    def count_refused(self, name: str | None, code: int | str, reason: str | None, *, grpc: bool = False) -> None:
        """Count one prediction request answered with ``code`` (an HTTP status; gRPC: a status code's
        name) under model ``name`` (None: the only one) when it is one served; else under ``""``, so
        a client cannot grow the label set."""
        with self._lock:
            if name is None and len(self._models) == 1:
                name = next(iter(self._models))
            label = name if name is not None and name in self._models else ""
        count_refusal(self.metrics, (label,), code, reason, grpc=grpc)

    def _describe_all(self) -> list[dict]:
        with self._lock:
            services = [s for table in self._models.values() for s in table.values()]
        return [d for d in (s.describe_serving() for s in services) if d is not None]

    def control(self) -> Repository:
        """This repository, for the repository extension's routes; refused unless it is on."""
        if not self.config.allow_repository_control:
            raise Refused(
                Code.PERMISSION_DENIED, "repository control is off: start the server with --allow-repository-control"
            )
        return self


def _path_model(path: str) -> str | None:
    """The model a route's path names (/v2/models/{name}/..., /predict/{name}/...); None if none."""
    parts = path.split("/")
    if path.startswith("/v2/models/") and len(parts) > 3:
        return parts[3]
    if path.startswith("/predict/"):
        return parts[2]
    return None


def _state(service: Service) -> dict[str, str]:
    if service.live.ready:
        return {"state": READY, "reason": ""}
    attempt = service.live.last_attempt
    if attempt is not None and not attempt.ok:
        return {"state": UNAVAILABLE, "reason": attempt.error or "failed to load"}
    return {"state": LOADING, "reason": ""}


def _listing(names: Iterable[str]) -> str:
    return ", ".join(sorted(names))


# --- one artifact ----------------------------------------------------------------------------------


class OneModel:
    """The one artifact ``precompile serve ARTIFACT`` serves, behind the repository's interface: a
    name other than the one it serves is 404, as it always was; the repository extension is refused."""

    def __init__(self, service: Service):
        self.service = service
        self.metrics = service.metrics
        self.max_body_bytes = service.max_body_bytes
        self.answer = service.answer
        self.refuse = service.refuse
        self.start = service.start
        self.stop = service.stop
        self.wait_loaded = service.join_load

    def lookup(self, name: str | None, version: str | None = None) -> Service:
        if name is None:
            return self.service
        serving = self.service.live.current
        if serving is None:
            raise Refused(Code.UNAVAILABLE, "no model is loaded yet")
        if name != serving.name:
            raise Refused(
                Code.NOT_FOUND, f"unknown model {name!r} (this server serves {serving.name!r})", "unknown_model"
            )
        if version is not None and parse_version(version) != serving.version:
            raise Refused(
                Code.NOT_FOUND,
                f"model {name!r} has no version {version!r} served (served: {serving.version})",
                "unknown_model",
            )
        return self.service

    def count_refused(self, name: str | None, code: int | str, reason: str | None, *, grpc: bool = False) -> None:
        """Count one prediction request answered with ``code``, whichever model it named."""
        self.service.count_refused(code, reason, grpc=grpc)

    def versions(self, name: str) -> list[str]:
        serving = self.service.live.current
        return [str(serving.version)] if serving is not None else []

    @property
    def ready(self) -> bool:
        return self.service.live.ready

    def readiness(self) -> tuple[dict[str, Any], int]:
        serving = self.service.describe_serving()
        if serving is not None:
            return {"status": "ready", "name": serving["name"], "version": serving["version"]}, 200
        attempt = self.service.live.last_attempt
        if attempt is not None and not attempt.ok:
            return {"status": "failed", "detail": attempt.error}, 503
        return {"status": "loading"}, 503

    def openapi_manifest(self) -> Manifest | None:
        serving = self.service.live.current
        return serving.model.manifest if serving is not None else None

    def control(self) -> Repository:
        raise Refused(
            Code.PERMISSION_DENIED,
            "this server serves one artifact: serve a folder of models with --allow-repository-control to manage it",
        )


Models = Repository | OneModel
