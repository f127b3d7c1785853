"""The FastAPI app: ``create_app(config)``.

    POST /predict      {"inputs": {...}} -> {"outputs": ..., "artifact": {"name", "version"}, "variant": ...}
    GET  /healthz      200 while the process is up
    GET  /readyz       200 once the artifact is loaded and warmed up, 503 before (or after a failed load)
    GET  /metrics      Prometheus text format (see metrics.py)
    GET  /v1/artifact  the manifest summary of what is serving, and the last swap attempt
    POST /v1/reload    {"path": ...}: swap to another version (--allow-reload; see reload.py)
    /v2/...            the Open Inference Protocol (KServe v2; see oip.py)

Every endpoint refuses a body over ``max_body_bytes`` with 413 (limits.py), and answers whatever
its work raises through one exception policy (errors.py, ``Service.answer``). The artifact is loaded
and warmed up on a background thread at start-up, so /healthz answers at once and /readyz turns 200
when the first request would meet warm code. Requests are decoded on the server's thread pool; each
call runs there through ``Live.call_detailed``, or with ``--batch`` is queued in a ``loader.Batcher``
that runs concurrent calls as one batch (while it waits, a client that hangs up cancels it: the
batcher drops it). Either way its outputs, variant and reported version belong together, even while
a swap happens.
"""

from __future__ import annotations

import asyncio
import logging
import os
import threading
import time
from contextlib import asynccontextmanager
from typing import Any, AsyncIterator, Awaitable, Callable

from fastapi import FastAPI, Request
from fastapi.openapi.utils import get_openapi
from fastapi.responses import JSONResponse, Response
from prometheus_client import CONTENT_TYPE_LATEST
from starlette.concurrency import run_in_threadpool

from loader import Batcher, Live, LoaderError, TrafficRecorder
from loader.live import Serving, SwapAttempt, read_served_manifest

from .codec import MIN_BODY_BYTES, body_limit, dumps, parse_body, request_schema, to_json, to_tensors
from .config import LOG_LEVEL_ENV, ServeConfig
from .errors import API, OIP, ClientGone, Code, Refused, internal, refusal
from .limits import BodyLimit
from .metrics import Metrics, shape_bucket
from .oip import mount_oip
from .reload import ReloadRefused, ReloadRequest, parse_reload_request, reload_target

log = logging.getLogger("precompile.serve")


class Service:
    """Everything one server process holds: the Live model, metrics, the recorder."""

    def __init__(self, config: ServeConfig, live: Live | None = None):
        self.config = config
        self.live = live if live is not None else Live(allow_rollback=config.allow_rollback, **config.load_options())
        self.max_body_bytes = config.max_body_bytes or self._default_body_limit()
        self.metrics = Metrics(self.describe_serving)
        self.live.on_attempt(self._count_attempt)
        self.recorder: TrafficRecorder | None = None
        self.batcher: Batcher | None = (
            Batcher(self.live, **config.batcher_options(), on_batch=self.metrics.count_batch) if config.batch else None
        )
        self._loader: threading.Thread | None = None

    # --- lifecycle -----------------------------------------------------------------------------

    def start(self) -> None:
        if self.config.record:
            self.recorder = TrafficRecorder(self.live, self.config.record, interval=self.config.record_interval)
        self._loader = threading.Thread(target=self._load_then_watch, name="precompile-load", daemon=True)
        self._loader.start()

    def _load_then_watch(self) -> None:
        if not self.live.ready:
            try:
                self.live.swap(self.config.artifact)
            except Exception:  # noqa: BLE001: logged by _count_attempt; /readyz reports it
                pass
        if self.config.watch:
            self.live.watch(self.config.artifact, interval=self.config.watch_interval)

    def stop(self) -> None:
        if self._loader is not None:
            self._loader.join()
        if self.batcher is not None:
            self.batcher.close()
        self.live.close()
        if self.recorder is not None:
            self.recorder.close()

    def _count_attempt(self, attempt: SwapAttempt) -> None:
        self.metrics.reloads.labels("ok" if attempt.ok else "failed").inc()
        if attempt.ok:
            log.info("serving %s version %s from %s", self.live.serving.name, attempt.version, attempt.path)
        else:
            log.error("could not load %s: %s", attempt.requested, attempt.error)

    def _default_body_limit(self) -> int:
        serving = self.live.current
        try:
            manifest = serving.model.manifest if serving is not None else read_served_manifest(self.config.artifact)
        except LoaderError:
            return MIN_BODY_BYTES  # the load will fail and say why; nothing will be served meanwhile
        return body_limit(manifest)

    def describe_serving(self) -> dict | None:
        serving = self.live.current
        return serving.describe() if serving is not None else None

    # --- answering -----------------------------------------------------------------------------

    async def answer(self, request: Request, work: Callable[[], Awaitable[Response]]) -> Response:
        """``work()``'s response, or the exception policy's answer to what it raised (errors.py): every
        handler's one way to fail, so none can turn a refusal into a 5xx."""
        try:
            return await work()
        except Exception as e:  # noqa: BLE001: the policy decides; a server fault is logged with its traceback
            refused = refusal(e)
            if refused is None:
                log.exception("%s %s failed", request.method, request.url.path)
                refused = internal(e)
            return self.refuse(request.scope, refused)

    def refuse(self, scope: dict[str, Any], refused: Refused) -> JSONResponse:
        """The response to ``refused`` in the protocol of ``scope``'s path, counted and logged in one line."""
        path = scope["path"]
        protocol = OIP if path.startswith("/v2") else API
        status = protocol.status(refused.code)
        if path == "/predict" or (path.startswith("/v2/models/") and path.endswith("/infer")):
            self.count_refused(status, refused.reason)
        if refused.code is not Code.INTERNAL:  # a server fault was logged with its traceback already
            level = logging.WARNING if refused.code is Code.UNAVAILABLE else logging.INFO
            what = " ".join(str(refused).split())[:200]  # one line, whatever the message holds
            log.log(level, "%s %s: %d %s: %s", scope.get("method"), path, status, refused.reason or refused.code.value, what)
        return JSONResponse(protocol.body(refused), status_code=status)

    # --- predict -------------------------------------------------------------------------------

    async def call(self, inputs: dict[str, Any], request: Request) -> tuple[Any, str, Serving]:
        """Run one call, through the batcher with --batch; raises what the call raises. A queued call
        whose client hangs up is cancelled (dropped from its batch) and ends in ClientGone."""
        if self.batcher is None:
            return await run_in_threadpool(self.live.call_detailed, **inputs)
        # Guards run in submit (cheap), so a refused call is never queued.
        return await unless_disconnected(asyncio.wrap_future(self.batcher.submit(**inputs)), request.receive)

    async def predict(self, request: Request) -> Response:
        start = time.perf_counter()
        serving = self.live.serving  # LoaderError (503) while nothing is loaded
        body = await request.body()
        # Decoded against the version read here; the call may run on a newer one, which the swap
        # checks has the same inputs.
        inputs = await run_in_threadpool(lambda: to_tensors(parse_body(body), serving.model.manifest))
        outputs, variant, serving = await self.call(inputs, request)
        return await run_in_threadpool(self._predicted, outputs, variant, serving, inputs, start)

    def _predicted(self, outputs: Any, variant: str, serving: Serving, inputs: dict[str, Any], start: float) -> Response:
        try:
            payload = dumps(
                {"outputs": to_json(outputs), "artifact": {"name": serving.name, "version": serving.version}, "variant": variant}
            )
        except ValueError:
            raise Refused(Code.INVALID_ARGUMENT, "the outputs hold NaN or infinity, which JSON cannot carry", "non_finite_output") from None
        self.count_served(serving, variant, inputs, start)
        return Response(payload, media_type="application/json")

    def count_served(self, serving: Serving, variant: str, inputs: dict[str, Any], start: float) -> None:
        """Count one successful prediction (/predict or /v2 infer): latency by variant, shape, 200."""
        self.metrics.latency.labels(variant, _precision(serving.model, variant)).observe(time.perf_counter() - start)
        self.metrics.shapes.labels(shape_bucket(_dims(serving.model, inputs))).inc()
        self.metrics.requests.labels("200").inc()

    def count_refused(self, code: int, reason: str | None) -> None:
        """Count one prediction request (/predict or /v2 infer) answered with ``code``, and its reason."""
        self.metrics.requests.labels(str(code)).inc()
        if reason is not None:
            self.metrics.rejections.labels(reason).inc()

    # --- artifact and reload -------------------------------------------------------------------

    def summary(self) -> dict[str, Any]:
        serving = self.live.serving
        m = serving.model.manifest
        return {
            **serving.describe(),
            "created": m.created,
            "expires": m.expires,
            "torch_version": m.torch_version,
            "precompile_version": m.precompile_version,
            "device": serving.model.device,
            "inputs": [{"name": i.name, "dtype": i.dtype, "shape": list(i.shape)} for i in m.inputs],
            "dims": {d: {"min": r.min, "max": r.max} for d, r in m.dims.items()},
            "output": m.output.to_dict(),
            "variants": [
                {"id": v.id, "kind": v.kind, "dims": {d: [r.min, r.max] for d, r in v.dims.items()}, "hint": v.hint}
                for v in m.variants
            ],
            "last_attempt": self.live.last_attempt.describe() if self.live.last_attempt else None,
        }

    def reload(self, path: str | None) -> JSONResponse:
        """Swap to ``path`` (None: the served path again) if this server may load it; rollbacks only
        with --allow-rollback, whatever the request says."""
        before = self.describe_serving()
        try:
            target = reload_target(path, served=self.config.artifact, root=self.config.reload_root)
            new: Serving = self.live.swap(target)
        except ReloadRefused as e:
            return JSONResponse({"detail": str(e), "serving": before}, status_code=403)
        except LoaderError as e:
            return JSONResponse({"detail": str(e), "serving": before}, status_code=422)
        return JSONResponse({"serving": new.describe(), "previous": before})


def create_app(config: ServeConfig, *, live: Live | None = None) -> FastAPI:
    """The service for ``config``. ``live``: serve this (already loaded) holder instead of loading
    ``config.artifact`` at start-up, for embedding and tests."""
    service = Service(config, live)

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        service.start()
        try:
            yield
        finally:
            service.stop()

    app = FastAPI(title="precompile serve", lifespan=lifespan)
    app.state.service = service
    app.add_middleware(BodyLimit, limit=service.max_body_bytes, refuse=service.refuse)
    mount_oip(app, service)

    @app.post("/predict", openapi_extra=_json_body("PredictRequest"), responses=_ERRORS)
    async def predict(request: Request) -> Response:
        """Run the model: {"inputs": {name: nested list}} -> {"outputs": ..., "artifact": ..., "variant": ...}."""
        return await service.answer(request, lambda: service.predict(request))

    @app.get("/healthz")
    def healthz() -> dict:
        """The process is up."""
        return {"status": "ok"}

    @app.get("/readyz")
    def readyz() -> JSONResponse:
        """The artifact is loaded and warmed up."""
        serving = service.describe_serving()
        if serving is not None:
            return JSONResponse({"status": "ready", "name": serving["name"], "version": serving["version"]})
        attempt = service.live.last_attempt
        if attempt is not None and not attempt.ok:
            return JSONResponse({"status": "failed", "detail": attempt.error}, status_code=503)
        return JSONResponse({"status": "loading"}, status_code=503)

    @app.get("/metrics")
    def metrics() -> Response:
        """Prometheus metrics."""
        return Response(service.metrics.exposition(), media_type=CONTENT_TYPE_LATEST)

    @app.get("/v1/artifact")
    async def artifact(request: Request) -> Response:
        """What is serving: the manifest summary, its digest, and the last swap attempt."""
        return await service.answer(request, lambda: run_in_threadpool(lambda: JSONResponse(service.summary())))

    @app.post("/v1/reload", openapi_extra=_json_body("ReloadRequest", required=False), responses=_ERRORS)
    async def reload(request: Request) -> JSONResponse:
        """Swap to another artifact version: {"path": "..."}; no body: the served path again."""

        async def work() -> Response:
            if not config.allow_reload:
                raise Refused(Code.PERMISSION_DENIED, "reload is off: start the server with --allow-reload")
            path = parse_reload_request(await request.body())
            return await run_in_threadpool(service.reload, path)

        return await service.answer(request, work)

    def openapi() -> dict[str, Any]:
        """The schema, with /predict's request body generated from the served manifest once one is
        loaded (before that, any predict request)."""
        if app.openapi_schema is not None:
            return app.openapi_schema
        schema = get_openapi(title=app.title, version=app.version, routes=app.routes)
        serving = service.live.current
        schemas = schema.setdefault("components", {}).setdefault("schemas", {})
        schemas["PredictRequest"] = request_schema(serving.model.manifest if serving is not None else None)
        schemas["ReloadRequest"] = ReloadRequest.model_json_schema()
        if serving is not None:  # a swap keeps the inputs, so the schema holds from now on
            app.openapi_schema = schema
        return schema

    app.openapi = openapi  # type: ignore[method-assign]
    return app


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


def _precision(model: Any, variant: str) -> str:
    """The precision a call ran in: its variant's ("a+b" from a pad or split: the first piece's)."""
    return model.variant_precision.get(variant.split("+", 1)[0], "fp32")


def _dims(model, inputs: dict[str, Any]) -> dict[str, int]:
    sizes: dict[str, int] = {}
    for spec in model.manifest.inputs:
        shape = inputs[spec.name].shape
        for axis, s in enumerate(spec.shape):
            if isinstance(s, str):
                sizes[s] = shape[axis]
    return {d: sizes[d] for d in model.manifest.dims if d in sizes}



async def unless_disconnected(pending: asyncio.Future, receive: Callable[[], Awaitable[dict]]) -> Any:
    """``pending``'s result, or ClientGone as soon as the client hangs up while it waits (``pending``
    is then cancelled: a call still queued in the batcher is dropped). The body has been read, so the
    next ASGI message is ``http.disconnect``, which the server sends when the connection closes."""

    async def disconnected() -> None:
        while (await receive())["type"] != "http.disconnect":
            pass

    gone = asyncio.ensure_future(disconnected())
    try:
        await asyncio.wait((pending, gone), return_when=asyncio.FIRST_COMPLETED)
    except BaseException:  # this request cancelled (the server stopping): its call goes with it
        pending.cancel()
        raise
    finally:
        gone.cancel()
        if gone.done() and not gone.cancelled():
            gone.exception()  # retrieved: a receive that failed means the connection is gone too
    if pending.done():
        return pending.result()
    pending.cancel()
    raise ClientGone()
