"""The service behind the app's routes: one loaded artifact (``loader.Live``), its metrics, the
optional batcher, and the one exception policy every route's work runs through (``answer``).

``app.create_app`` mounts the HTTP routes on it, ``oip.mount_oip`` the Open Inference Protocol's.
"""

from __future__ import annotations

import asyncio
import logging
import threading
import time
from collections.abc import Awaitable, Callable
from typing import Any

from fastapi import Request
from fastapi.responses import JSONResponse, Response
from starlette.concurrency import run_in_threadpool

import loader
from loader import Batcher, Live, LoaderError, TrafficRecorder
from loader.live import Serving, SwapAttempt, read_served_manifest

from .codec import MIN_BODY_BYTES, body_limit, codec_for, dumps, parse_body
from .config import ServeConfig
from .errors import API, OIP, ClientGone, Code, Refused, internal, refusal
from .metrics import Metrics, shape_bucket
from .reload import ReloadRefused, reload_target

log = logging.getLogger("precompile.serve")


class Service:
    """Everything one server process holds: the Live model, metrics, the recorder. The runtime
    (``config.runtime``) decides the loader every version is loaded with and the codec's arrays:
    torch tensors (``loader.load``), or numpy arrays (``loader.load_native``: torch never imported)."""

    def __init__(self, config: ServeConfig, live: Live | None = None):
        self.config = config
        self.codec = codec_for(config.runtime)
        if live is None:  # loader.load (None: imported, with torch, at the first load) or the torch-free one
            load = loader.load_native if config.runtime == "native" else None
            live = Live(allow_rollback=config.allow_rollback, load=load, **config.load_options())
        self.live = live
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
            log.log(
                level, "%s %s: %d %s: %s", scope.get("method"), path, status, refused.reason or refused.code.value, what
            )
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
        inputs = await run_in_threadpool(lambda: self.codec.inputs(parse_body(body), serving.model.manifest))
        outputs, variant, serving = await self.call(inputs, request)
        return await run_in_threadpool(self._predicted, outputs, variant, serving, inputs, start)

    def _predicted(
        self, outputs: Any, variant: str, serving: Serving, inputs: dict[str, Any], start: float
    ) -> Response:
        try:
            payload = dumps(
                {
                    "outputs": self.codec.to_json(outputs),
                    "artifact": {"name": serving.name, "version": serving.version},
                    "variant": variant,
                }
            )
        except ValueError:
            raise Refused(
                Code.INVALID_ARGUMENT, "the outputs hold NaN or infinity, which JSON cannot carry", "non_finite_output"
            ) from None
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
