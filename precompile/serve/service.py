"""The service behind the app's routes: one served model (``Service``: its ``loader.Live``, its
metrics, the optional batcher), and the one exception policy every route's work runs through
(``answer``).

The routes look a Service up by name through repository.py (the one artifact, or a repository's
model versions); ``app.create_app`` mounts the HTTP routes, ``oip.mount_oip`` the Open Inference
Protocol's. ``Service.call`` is the one entry point that runs a decoded request on a model.
"""

from __future__ import annotations

import asyncio
import functools
import logging
import threading
import time
from collections.abc import Awaitable, Callable
from typing import Any

from fastapi import Request
from fastapi.responses import JSONResponse, Response
from starlette.concurrency import run_in_threadpool

import loader
from loader import Batcher, BatcherClosed, Live, LoaderError, TrafficRecorder
from loader.manifest import Manifest
from loader.serving.live import Serving, SwapAttempt, read_served_manifest
from loader.threads import default_threads, lower_priority

from .codec import MIN_BODY_BYTES, body_limit, codec_for, dumps, parse_body
from .config import ServeConfig
from .errors import API, OIP, ClientGone, Code, Refused, internal, refusal
from .handoff import loop_results
from .instances import Instances, InstancesClosed, default_batch_count, default_count, set_team_size
from .metrics import Metrics, shape_bucket
from .reload import ReloadRefused, reload_target

log = logging.getLogger("precompile.serve")


class Service:
    """One served model: its Live holder, its batcher, the metrics it counts into, the recorder.

    ``precompile serve ARTIFACT`` holds one; a repository (repository.py) one per model version,
    sharing one ``metrics`` registry whose ``labels`` (the model's name) each counts under.
    ``check(model)`` runs on every version the Live loads (a repository's: the model's name).
    The runtime (``config.runtime``) decides the loader every version is loaded with and the codec's
    arrays: torch tensors (``loader.load``), or numpy arrays (``loader.load_native``: torch never imported).
    """

    def __init__(
        self,
        config: ServeConfig,
        live: Live | None = None,
        *,
        metrics: Metrics | None = None,
        labels: tuple[str, ...] = (),
        check: Callable[[Any], None] | None = None,
    ):
        self.config = config
        self.codec = codec_for(config.runtime)
        self._owns_live = live is None  # a holder it made is unloaded when it stops; a caller's is left
        if live is None:  # loader.load (None: imported, with torch, at the first load) or the torch-free one
            load = loader.load_native if config.runtime == "native" else None
            live = Live(allow_rollback=config.allow_rollback, load=load, check=check, **config.load_options())
        self.live = live
        manifest = self._manifest()
        self.max_body_bytes = config.max_body_bytes or (body_limit(manifest) if manifest else MIN_BODY_BYTES)
        # Compiled calls that let go of the GIL run side by side: every torch-free one, and a CPU
        # artifact's on the torch runtime (loader.cpu_runner); a CUDA one's holds it.
        self.gil_free = config.runtime == "native" or (manifest is not None and manifest.target.device == "cpu")
        self.labels = labels
        self.metrics = metrics if metrics is not None else Metrics(lambda: listed(self.describe_serving()))
        self.live.on_attempt(self._count_attempt)
        self.recorder: TrafficRecorder | None = None
        self.batcher: Batcher | None = None
        if config.batch:  # batches run on execution instances too, as many at once as the CPUs can feed
            count = config.instances or default_batch_count(workers=config.workers, gil_free=self.gil_free)
            self.batcher = Batcher(
                self.live,
                **config.batcher_options(),
                on_batch=self._count_batch,
                instances=count,
                threads=default_threads(),
                team=set_team_size,
            )
        self.instances: Instances | None = None  # without --batch: started with the service
        # Set by a repository when it replaces this version: where calls still on their way here go.
        self.successor: Callable[[], Service] | None = None
        self._loader: threading.Thread | None = None
        # The first load happens before anything of this process serves (a lone artifact, a
        # repository's first scan): its execution instances warm every shape the load warmed, each
        # in its own thread. Any later load (a repository's model loaded while others serve, a new
        # version swapped in) warms them at the hints only (see _count_attempt).
        self._quiet_start = False
        self._children: dict[tuple[int, tuple[str, ...]], Any] = {}  # see _labelled

    # --- lifecycle -----------------------------------------------------------------------------

    def start(self, *, background: bool = False) -> None:
        """Start serving: the execution instances, and the first load on a thread of its own; with
        ``background`` (a repository's model loaded while others serve), at a lower CPU priority, it
        and the OpenMP team its warm-up starts, so the models serving keep their latency. Not
        ``SCHED_IDLE``: the load holds the GIL between its steps, and a thread that runs only on idle
        CPUs held it for up to a second on a busy host (every call of the others waiting)."""
        if self.batcher is None:  # calls run on a bounded number of execution instances, a queue in front
            self.instances = Instances(
                count=self.config.instances or default_count(workers=self.config.workers, gil_free=self.gil_free),
                queue_size=self.config.queue_size,
            )
        if self.config.record:
            self.recorder = TrafficRecorder(self.live, self.config.record, interval=self.config.record_interval)
        self._loader = threading.Thread(
            target=self._load_then_watch, args=(background,), name="precompile-load", daemon=True
        )
        self._quiet_start = not background
        self._loader.start()

    def _load_then_watch(self, background: bool) -> None:
        if background:
            lower_priority()
        if not self.live.ready:
            try:
                self.live.swap(self.config.artifact)
            except Exception:  # noqa: BLE001: logged by _count_attempt; /readyz reports it
                pass
        self._quiet_start = False  # whatever loads from now on (a retry, --watch) loads beside calls
        if self.config.watch:
            self.live.watch(self.config.artifact, interval=self.config.watch_interval)

    def join_load(self) -> None:
        """Wait until the first load (started by ``start``) has succeeded or failed."""
        if self._loader is not None:
            self._loader.join()

    def stop(self) -> None:
        self.join_load()
        if self.batcher is not None:
            self.batcher.close()
        if self.instances is not None:
            self.instances.close()
        if self.recorder is not None:
            self.recorder.close()
        if self._owns_live:  # no call reaches its model now: closed (its libraries too), not left to the collector
            self.live.unload()
        else:
            self.live.close()

    def _count_attempt(self, attempt: SwapAttempt) -> None:
        self.metrics.reloads.labels(*self.labels, "ok" if attempt.ok else "failed").inc()
        if attempt.ok:
            log.info("serving %s version %s from %s", self.live.serving.name, attempt.version, attempt.path)
            # Each instance or batch worker thread warms the new version before its next call. Where
            # other models or an older version serve, an instance warms its own state at the hints
            # alone: the load warmed the other shapes' oneDNN kernels for the whole process, and the
            # rest (every instance at the largest shape, at normal priority) took the CPUs of the
            # calls being served (bench/results/load-stall.md).
            quiet, self._quiet_start = self._quiet_start, False
            model = self.live.model
            if self.instances is not None:
                self.instances.on_each(
                    model.warm_thread if quiet else functools.partial(model.warm_thread, hint_only=True)
                )
            if self.batcher is not None:
                self.batcher.on_each(model.warmup if quiet else functools.partial(model.warmup, hint_only=True))
        else:
            log.error("could not load %s: %s", attempt.requested, attempt.error)

    def _count_batch(self, size: int, waits: list[float]) -> None:
        self.metrics.count_batch(size, waits, self.labels)

    def _manifest(self) -> Manifest | None:
        """The manifest of what this service serves or will load; None where it cannot be read (the
        load will fail and say why; nothing will be served meanwhile)."""
        serving = self.live.current
        try:
            return serving.model.manifest if serving is not None else read_served_manifest(self.config.artifact)
        except LoaderError:
            return None

    def describe_serving(self) -> dict | None:
        serving = self.live.current
        return serving.describe() if serving is not None else None

    # --- answering -----------------------------------------------------------------------------

    async def answer(self, request: Request, work: Callable[[], Awaitable[Response]]) -> Response:
        """``work()``'s response, or the exception policy's answer to what it raised (errors.py)."""
        return await answer(request, work, self.refuse)

    def refuse(self, scope: dict[str, Any], refused: Refused) -> JSONResponse:
        """The response to ``refused`` in the protocol of ``scope``'s path, counted and logged in one line."""
        return refusal_response(scope, refused, self.count_refused)

    # --- predict -------------------------------------------------------------------------------

    async def call(self, inputs: dict[str, Any], request: Request | None = None) -> tuple[Any, str, Serving]:
        """Run one decoded call on this model: on an execution instance, or through the batcher with
        --batch; raises what the call raises. The one entry point every protocol's infer uses. A queued
        call whose client hangs up (``request``'s connection; None, as for gRPC: cancelling the awaiting
        task does it) is cancelled, dropped from its queue or batch, and ends in ClientGone. A call that
        reaches a version a repository has just replaced (looked up before, stopped since) runs on
        what replaced it (``successor``)."""
        try:
            if self.batcher is None:
                pending = loop_results().wrap(self.instances.submit(self.live.call_detailed, **inputs))
            else:  # guards run in submit (cheap), so a refused call is never queued
                pending = loop_results().wrap(self.batcher.submit(**inputs))
        except (InstancesClosed, BatcherClosed):
            if self.successor is None:
                raise
            return await self.successor().call(inputs, request)
        return await (pending if request is None else unless_disconnected(pending, request.receive))

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

    def count_served(
        self, serving: Serving, variant: str, inputs: dict[str, Any], start: float, *, grpc: bool = False
    ) -> None:
        """Count one successful prediction (/predict, /v2 infer or gRPC ModelInfer): latency by
        variant, shape, and 200 (gRPC: OK)."""
        metrics, elapsed = self.metrics, time.perf_counter() - start
        self._labelled(metrics.latency, variant, _precision(serving.model, variant)).observe(elapsed)
        self._labelled(metrics.shapes, shape_bucket(_dims(serving.model, inputs))).inc()
        (self._labelled(metrics.grpc_requests, "OK") if grpc else self._labelled(metrics.requests, "200")).inc()

    def _labelled(self, metric: Any, *values: str) -> Any:
        """``metric.labels(*self.labels, *values)``, looked up once: ``labels`` validates and takes a
        lock on every call, a cost each request paid three times. The children are those the
        registry holds anyway (variants, precisions, shape buckets, codes: a bounded set)."""
        key = (id(metric), values)
        child = self._children.get(key)
        if child is None:
            child = self._children[key] = metric.labels(*self.labels, *values)
        return child

    def count_refused(self, code: int | str, reason: str | None, *, grpc: bool = False) -> None:
        """Count one prediction request answered with ``code`` (an HTTP status; gRPC: a status code's
        name), and its reason."""
        count_refusal(self.metrics, self.labels, code, reason, grpc=grpc)

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
                {
                    "id": v.id,
                    "kind": v.kind,
                    "dims": {d: [r.min, r.max] for d, r in v.dims.items()},
                    "hint": v.hint,
                    **({"first_calls_of": v.first_calls_of} if v.first_calls_of else {}),
                }
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


async def answer(
    request: Request, work: Callable[[], Awaitable[Response]], refuse: Callable[[dict[str, Any], Refused], Response]
) -> Response:
    """``work()``'s response, or ``refuse``'s answer to what it raised as the exception policy
    (errors.py) reads it: every handler's one way to fail, so none can turn a refusal into a 5xx."""
    try:
        return await work()
    except Exception as e:  # noqa: BLE001: the policy decides; a server fault is logged with its traceback
        refused = refusal(e)
        if refused is None:
            log.exception("%s %s failed", request.method, request.url.path)
            refused = internal(e)
        return refuse(request.scope, refused)


def is_prediction(path: str) -> bool:
    """Whether ``path`` runs a model (/predict, /predict/{name}, /v2 infer): those refusals are counted."""
    return (
        path == "/predict"
        or path.startswith("/predict/")
        or (path.startswith("/v2/models/") and path.endswith("/infer"))
    )


def refusal_response(scope: dict[str, Any], refused: Refused, count: Callable[[int, str | None], None]) -> JSONResponse:
    """The response to ``refused`` in the protocol of ``scope``'s path, counted with ``count(status,
    reason)`` when the path runs a model, and logged in one line."""
    path = scope["path"]
    protocol = OIP if path.startswith("/v2") else API
    status = protocol.status(refused.code, malformed=refused.malformed)
    if is_prediction(path):
        count(status, refused.reason)
    if refused.code is not Code.INTERNAL:  # a server fault was logged with its traceback already
        level = logging.WARNING if refused.code is Code.UNAVAILABLE else logging.INFO
        what = " ".join(str(refused).split())[:200]  # one line, whatever the message holds
        log.log(
            level, "%s %s: %d %s: %s", scope.get("method"), path, status, refused.reason or refused.code.value, what
        )
    return JSONResponse(protocol.body(refused), status_code=status)


def count_refusal(
    metrics: Metrics, labels: tuple[str, ...], code: int | str, reason: str | None, *, grpc: bool = False
) -> None:
    """Count one prediction request answered with ``code`` (gRPC: a status code's name), and its
    reason, under ``labels``."""
    (metrics.grpc_requests if grpc else metrics.requests).labels(*labels, str(code)).inc()
    if reason is not None:
        metrics.rejections.labels(*labels, reason).inc()


def listed(serving: dict | None) -> list[dict]:
    return [serving] if serving is not None else []


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
