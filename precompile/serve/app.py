"""The FastAPI app: ``create_app(config)``.

    POST /predict      {"inputs": {...}} -> {"outputs": ..., "artifact": {"name", "version"}, "variant": ...}
    POST /predict/{name}[/versions/{v}]   the same, for the model named (a repository: see repository.py)
    GET  /healthz      200 while the process is up (header X-Precompile-Worker: the answering process's id)
    GET  /readyz       200 once the artifact is loaded and warmed up, 503 before (or after a failed load);
                       a repository: which models are ready, loading, failed
    GET  /metrics      Prometheus text format (see metrics.py)
    GET  /v1/artifact  the manifest summary of what is serving, and the last swap attempt
    POST /v1/reload    {"path": ...}: swap to another version (--allow-reload; see reload.py)
    /v2/...            the Open Inference Protocol (KServe v2; see oip.py)

Every endpoint refuses a body over ``max_body_bytes`` with 413 (limits.py), and answers whatever
its work raises through one exception policy (errors.py, ``Service.answer`` in service.py). The artifact is loaded
and warmed up on a background thread at start-up, so /healthz answers at once and /readyz turns 200
when the first request would meet warm code. A worker of ``--workers N`` starts listening (HTTP and
gRPC) only once its first load has been tried: the port's other workers take the connections meanwhile
(workers.py). Requests are decoded on the server's thread pool (a /v2
infer request with binary tensors or a short JSON header on the loop: oip.py); each
call runs through ``Live.call_detailed`` on one of the model's execution instances (instances.py: a
bounded number at once, a bounded queue in front, 503 beyond it), or with ``--batch`` is queued in a ``loader.Batcher``
that runs concurrent calls as one batch (while it waits, a client that hangs up cancels it: the
batcher drops it). Either way its outputs, variant and reported version belong together, even while
a swap happens.
"""

from __future__ import annotations

import logging
import os
from collections.abc import AsyncIterator, Callable
from contextlib import AbstractAsyncContextManager, asynccontextmanager
from typing import Any

from fastapi import FastAPI, Request
from fastapi.openapi.utils import get_openapi
from fastapi.responses import JSONResponse, Response
from prometheus_client import CONTENT_TYPE_LATEST
from starlette.concurrency import run_in_threadpool

from loader import Live

from .codec import request_schema
from .config import LOG_LEVEL_ENV, ServeConfig
from .errors import Code, Refused
from .grpc_service import grpc_beside
from .limits import BodyLimit
from .oip import mount_oip
from .reload import ReloadRequest, parse_reload_request
from .repository import Models, OneModel, Repository
from .service import Service

log = logging.getLogger("precompile.serve")


def create_app(config: ServeConfig, *, live: Live | None = None) -> FastAPI:
    """The service for ``config``: one artifact, or a repository of models (``config.repository``).
    ``live``: serve this (already loaded) holder instead of loading ``config.artifact`` at start-up,
    for embedding and tests."""
    if config.repository:
        models: Models = Repository(config)
        holder: Repository | Service = models
    else:
        holder = Service(config, live)
        models = OneModel(holder)

    app = FastAPI(title="precompile serve", lifespan=_lifespan(models, config))
    app.state.service = holder
    app.state.models = models
    mount_oip(app, models)  # first: its infer fast path is middleware that must run inside the body limit
    app.add_middleware(BodyLimit, limit=models.max_body_bytes, refuse=models.refuse)

    @app.post("/predict", openapi_extra=_json_body("PredictRequest"), responses=_ERRORS)
    @app.post("/predict/{name}", openapi_extra=_json_body("PredictRequest"), responses=_ERRORS)
    @app.post("/predict/{name}/versions/{version}", openapi_extra=_json_body("PredictRequest"), responses=_ERRORS)
    async def predict(request: Request) -> Response:
        """Run the model: {"inputs": {name: nested list}} -> {"outputs": ..., "artifact": ..., "variant": ...}.
        Serving a repository, name the model in the path (optional when it holds one)."""
        return await models.answer(request, lambda: models.lookup(*_named(request)).predict(request))

    @app.get("/healthz")
    def healthz() -> JSONResponse:
        """The process is up."""
        return JSONResponse({"status": "ok"}, headers={WORKER_HEADER: str(os.getpid())})

    @app.get("/readyz")
    def readyz() -> JSONResponse:
        """The artifact is loaded and warmed up (a repository: which models are)."""
        body, status = models.readiness()
        return JSONResponse(body, status_code=status)

    @app.get("/metrics")
    def metrics() -> Response:
        """Prometheus metrics."""
        return Response(models.metrics.exposition(), media_type=CONTENT_TYPE_LATEST)

    @app.get("/v1/artifact")
    @app.get("/v1/artifact/{name}")
    async def artifact(request: Request) -> Response:
        """What is serving: the manifest summary, its digest, and the last swap attempt."""
        return await models.answer(
            request, lambda: run_in_threadpool(lambda: JSONResponse(models.lookup(*_named(request)).summary()))
        )

    @app.post("/v1/reload", openapi_extra=_json_body("ReloadRequest", required=False), responses=_ERRORS)
    async def reload(request: Request) -> JSONResponse:
        """Swap to another artifact version: {"path": "..."}; no body: the served path again."""

        async def work() -> Response:
            if isinstance(holder, Repository):
                raise Refused(
                    Code.PERMISSION_DENIED,
                    "this server serves a repository: load versions with POST /v2/repository/models/{name}/load "
                    "(--allow-repository-control) or --watch",
                )
            if not config.allow_reload:
                raise Refused(Code.PERMISSION_DENIED, "reload is off: start the server with --allow-reload")
            path = parse_reload_request(await request.body())
            return await run_in_threadpool(holder.reload, path)

        return await models.answer(request, work)

    app.openapi = lambda: _openapi(app, models)  # type: ignore[method-assign]
    return app


def _lifespan(models: Models, config: ServeConfig) -> Callable[[FastAPI], AbstractAsyncContextManager[None]]:
    """The app's start and stop: load the models (a worker of several waits for its first load before
    uvicorn listens), serve them over gRPC beside HTTP with --grpc-port, stop them at shutdown."""

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        _log_allocator()
        models.start()
        try:
            if config.workers > 1:  # uvicorn listens after this: a worker takes connections once it can serve
                await run_in_threadpool(models.wait_loaded)
            with grpc_beside(models, config):  # --grpc-port: the same models over gRPC, in this process
                yield
        finally:
            models.stop()

    return lifespan


def _openapi(app: FastAPI, models: Models) -> dict[str, Any]:
    """The schema, with /predict's request body generated from the served manifest once one is
    loaded (before that, any predict request)."""
    if app.openapi_schema is not None:
        return app.openapi_schema
    schema = get_openapi(title=app.title, version=app.version, routes=app.routes)
    manifest = models.openapi_manifest()
    schemas = schema.setdefault("components", {}).setdefault("schemas", {})
    schemas["PredictRequest"] = request_schema(manifest)
    schemas["ReloadRequest"] = ReloadRequest.model_json_schema()
    if manifest is not None:  # a swap keeps the inputs, so the schema holds from now on
        app.openapi_schema = schema
    return schema


WORKER_HEADER = "X-Precompile-Worker"  # which of the --workers processes answered /healthz


def _named(request: Request) -> tuple[str | None, str | None]:
    """The model and version a route's path names ({name}, {version}; None where it has none). Read
    from the path, not as parameters: FastAPI would make a path's missing ones query parameters."""
    return request.path_params.get("name"), request.path_params.get("version")


def _log_allocator() -> None:
    """Say which memory allocator this server process runs on (``precompile serve --malloc``)."""
    from loader.malloc import in_use

    allocator = in_use()
    if allocator == "system":
        log.info("memory allocator: glibc's malloc (tcmalloc is faster per call: install it, see --malloc)")
    else:
        log.info("memory allocator: %s (preloaded)", allocator)


def log_to_stderr(level: str) -> None:
    """The service's own log lines (loads, swaps, refusals, tracebacks) on stderr beside uvicorn's,
    at ``level`` (--log-level): uvicorn configures its own loggers only."""
    logger = logging.getLogger("precompile")
    if not logger.handlers:
        handler = logging.StreamHandler()
        handler.setFormatter(logging.Formatter("%(levelname)s:     %(name)s: %(message)s"))
        logger.addHandler(handler)
    logger.setLevel(level.upper())


def app_from_env() -> FastAPI:
    """uvicorn's factory in each worker process (``precompile serve --workers N``)."""
    log_to_stderr(os.environ.get(LOG_LEVEL_ENV, "info"))
    return create_app(ServeConfig.from_env())


_ERRORS: dict[int | str, dict[str, Any]] = {
    code: {"description": text}
    for code, text in {
        403: "refused by the server's configuration",
        404: "an unknown model or version",
        413: "the body is larger than --max-body-bytes",
        422: "a malformed request, inputs the model refuses, or outputs JSON cannot carry (detail and reason say why)",
        500: "an internal failure (a bug, logged with its traceback); the server serves on",
        503: "no artifact loaded yet, or the batch queue is full (--batch)",
    }.items()
}


def _json_body(schema: str, *, required: bool = True) -> dict[str, Any]:
    """A route's request body in the OpenAPI schema; the route reads the raw body itself (strict
    conversion, and the body limit counts bytes before anything is parsed)."""
    ref = {"$ref": f"#/components/schemas/{schema}"}
    return {"requestBody": {"required": required, "content": {"application/json": {"schema": ref}}}}
