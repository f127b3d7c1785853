"""The Open Inference Protocol's gRPC service (KServe v2 ``inference.GRPCInferenceService``) beside HTTP.

    ServerLive, ServerReady         the process is up; the model is loaded and warmed up
    ServerMetadata                  name, version, extensions
    ModelReady, ModelMetadata       as GET /v2/models/{name}/ready and GET /v2/models/{name}
    ModelInfer                      inputs as ``raw_input_contents`` (one little-endian entry per input,
                                    what tritonclient.grpc sends) or typed ``contents``; outputs always
                                    in ``raw_output_contents``

``precompile serve --grpc-port N`` runs it in the same process as HTTP, on an asyncio loop of its own
(a thread), with the same guards, batching, execution instances and exception policy (errors.py):
a refusal's ``Code`` is the gRPC status (INVALID_ARGUMENT, NOT_FOUND, RESOURCE_EXHAUSTED, UNAVAILABLE,
INTERNAL...) and its message the HTTP one. Messages over --max-body-bytes are refused by gRPC itself
(RESOURCE_EXHAUSTED). Infer answers are counted in ``precompile_grpc_requests_total{code}``, refusals
by reason in ``precompile_rejections_total`` as HTTP's are.

The messages are generated from predict_v2.proto (scripts/gen-grpc-protos); the handlers are
registered here. The service talks to the server through ``Models``, a narrow interface (find a
model by name, its metadata, run a call), so a repository of models can stand behind it.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import threading
import time
from collections.abc import Awaitable, Callable, Iterator
from concurrent.futures import Future
from typing import Any, Protocol

import grpc

from loader.manifest import Manifest
from loader.outputs import flatten, output_names
from loader.serving.live import Serving

from ..version import __version__
from . import predict_v2_pb2 as pb
from . import repository
from .codec import ITEM_BYTES, Codec
from .config import ServeConfig
from .errors import Code, Refused, internal, refusal
from .oip import DATATYPES, _metadata, _serving
from .service import Service, count_refusal

log = logging.getLogger("precompile.serve")

SERVICE = "inference.GRPCInferenceService"


Found = tuple[Service, Serving]  # the per-model service a name and version name, and what it serves now


class Models(Protocol):
    """What the gRPC service needs of the server."""

    def ready(self) -> bool:
        """Whether every served model is loaded and warmed up."""

    def find(self, name: str, version: str) -> Found:
        """The model ``name`` (``version``: "" for the newest served); Refused (NOT_FOUND, UNAVAILABLE) if none."""

    def metadata(self, found: Found) -> dict[str, Any]:
        """The Open Inference Protocol's model metadata (name, versions, platform, inputs, outputs)."""

    async def call(self, found: Found, inputs: dict[str, Any]) -> tuple[Any, str, Serving]:
        """Run one call: outputs, the variant that ran, the version that answered."""

    def count(self, found: Found, serving: Serving, variant: str, inputs: dict[str, Any], start: float) -> None:
        """Count one ModelInfer that succeeded (started at ``start``, perf_counter) in the server's metrics."""

    def count_refused(self, found: Found | None, refused: Refused, name: str) -> None:
        """Count one ModelInfer for model ``name`` answered with ``refused`` (``found``: None when no
        model or version was found)."""


class ServedModels:
    """``Models`` over what the HTTP routes look models up in (repository.py: the one artifact, or a
    repository's models and versions), so both protocols serve the same models the same way."""

    def __init__(self, models: repository.Models):
        self.models = models

    def ready(self) -> bool:
        return self.models.ready

    def find(self, name: str, version: str) -> Found:
        return _serving(self.models, name, version or None)

    def metadata(self, found: Found) -> dict[str, Any]:
        return _metadata(found[1], found[0].codec)

    async def call(self, found: Found, inputs: dict[str, Any]) -> tuple[Any, str, Serving]:
        return await found[0].call(inputs, None)

    def count(self, found: Found, serving: Serving, variant: str, inputs: dict[str, Any], start: float) -> None:
        found[0].count_served(serving, variant, inputs, start, grpc=True)

    def count_refused(self, found: Found | None, refused: Refused, name: str) -> None:
        if found is None:
            try:  # a served model's unknown version counts under the model, as over HTTP
                found = (self.models.lookup(name, None), None)
            except Refused:  # an unknown model: counted under model="" (a client cannot grow the label set)
                labels = tuple("" for _ in self.models.metrics.labels)
                count_refusal(self.models.metrics, labels, refused.code.value, refused.reason, grpc=True)
                return
        found[0].count_refused(refused.code.value, refused.reason, grpc=True)


def _invalid(message: str) -> Refused:
    return Refused(Code.INVALID_ARGUMENT, message, "invalid_body")


# --- ModelInfer: messages to tensors and back ------------------------------------------------

# The typed field each datatype's values travel in (FP16 and BF16 have none: raw contents only).
_CONTENTS = {
    "BOOL": "bool_contents",
    "INT8": "int_contents",
    "INT16": "int_contents",
    "INT32": "int_contents",
    "INT64": "int64_contents",
    "UINT8": "uint_contents",
    "FP32": "fp32_contents",
    "FP64": "fp64_contents",
}


def decode_inputs(request: pb.ModelInferRequest, manifest: Manifest, codec: Codec) -> dict[str, Any]:
    """The request's arrays (``codec``'s: numpy or torch) by input name; a refusal (INVALID_ARGUMENT)
    says what is wrong. Values meet the codec's rules, as over HTTP; names missing, shapes and ranges
    beyond the datatype are left to the loader's guards."""
    raw = request.raw_input_contents
    if raw and len(raw) != len(request.inputs):
        raise _invalid(
            f"raw_input_contents holds {len(raw)} entries for {len(request.inputs)} inputs: give one per input, "
            "in order, or none and each input's contents"
        )
    specs = {spec.name: spec for spec in manifest.inputs}
    inputs: dict[str, Any] = {}
    for i, item in enumerate(request.inputs):
        name = item.name
        spec = specs.get(name)
        if spec is None:
            raise _invalid(f"inputs[{i}]: unknown input {name!r} (inputs: {', '.join(specs)})")
        if name in inputs:
            raise _invalid(f"inputs[{i}]: input {name!r} given twice")
        datatype = DATATYPES[spec.dtype]
        if item.datatype != datatype:
            raise _invalid(f"input {name!r}: datatype must be {datatype}, got {item.datatype!r}")
        shape = list(item.shape)
        count = codec.shape_count(name, shape)
        if raw:
            size, itemsize = len(raw[i]), ITEM_BYTES[spec.dtype]
            if size != count * itemsize:
                raise _invalid(
                    f"input {name!r}: raw_input_contents[{i}] holds {size} bytes, not {count} × {itemsize} "
                    f"for shape {shape}"
                )
            inputs[name], _ = codec.binary(name, raw[i], 0, size, shape, count, spec.dtype)
        else:
            field = _CONTENTS.get(datatype)
            if field is None:
                raise _invalid(f"input {name!r}: {datatype} values travel in raw_input_contents only")
            values = list(getattr(item.contents, field))
            if len(values) != count:
                raise _invalid(f"input {name!r}: {len(values)} values in contents.{field} for shape {shape}")
            inputs[name] = codec.sized(name, values, shape, count, spec.dtype)
    return inputs


def encode_outputs(
    serving: Serving, outputs: Any, request: pb.ModelInferRequest, codec: Codec
) -> pb.ModelInferResponse:
    """The response: the requested outputs (all without a list) in ``raw_output_contents``."""
    named = dict(zip(output_names(serving.model.manifest.output), flatten(outputs)))
    wanted = [o.name for o in request.outputs] or list(named)
    unknown = [n for n in wanted if n not in named]
    if unknown:
        raise _invalid(f"unknown output {unknown[0]!r} (outputs: {', '.join(named)})")
    response = pb.ModelInferResponse(model_name=serving.name, model_version=str(serving.version), id=request.id)
    for name in wanted:
        t = codec.host(named[name])
        response.outputs.add(name=name, datatype=DATATYPES[codec.dtype_name(t)], shape=list(t.shape))
        response.raw_output_contents.append(codec.little_endian_bytes(t))
    return response


def metadata_message(described: dict[str, Any]) -> pb.ModelMetadataResponse:
    tensor = pb.ModelMetadataResponse.TensorMetadata
    return pb.ModelMetadataResponse(
        name=described["name"],
        versions=described["versions"],
        platform=described["platform"],
        inputs=[tensor(**t) for t in described["inputs"]],
        outputs=[tensor(**t) for t in described["outputs"]],
    )


# --- the service -----------------------------------------------------------------------------


class Servicer:
    """The handlers of ``inference.GRPCInferenceService``, each an ``async def (request, context)``."""

    def __init__(self, models: Models):
        self.models = models

    async def ServerLive(self, request: pb.ServerLiveRequest, context: grpc.aio.ServicerContext):
        return pb.ServerLiveResponse(live=True)

    async def ServerReady(self, request: pb.ServerReadyRequest, context: grpc.aio.ServicerContext):
        return pb.ServerReadyResponse(ready=self.models.ready())

    async def ServerMetadata(self, request: pb.ServerMetadataRequest, context: grpc.aio.ServicerContext):
        return pb.ServerMetadataResponse(name="precompile", version=__version__, extensions=[])

    async def ModelReady(self, request: pb.ModelReadyRequest, context: grpc.aio.ServicerContext):
        async def work() -> pb.ModelReadyResponse:
            try:
                self.models.find(request.name, request.version)
            except Refused as e:
                if e.code not in (Code.UNAVAILABLE, Code.NOT_FOUND):
                    raise
                return pb.ModelReadyResponse(ready=False)  # not loaded yet, or not served (as Triton answers)
            return pb.ModelReadyResponse(ready=True)

        return await self._answer("ModelReady", context, work)

    async def ModelMetadata(self, request: pb.ModelMetadataRequest, context: grpc.aio.ServicerContext):
        async def work() -> pb.ModelMetadataResponse:
            found = self.models.find(request.name, request.version)
            described = await _off_loop(self.models.metadata, found)
            return metadata_message(described)

        return await self._answer("ModelMetadata", context, work)

    async def ModelInfer(self, request: pb.ModelInferRequest, context: grpc.aio.ServicerContext):
        start = time.perf_counter()
        found: Found | None = None

        async def work() -> pb.ModelInferResponse:
            nonlocal found
            found = self.models.find(request.model_name, request.model_version)
            manifest, codec = found[1].model.manifest, found[0].codec
            # Raw contents are decoded and outputs encoded on the loop: each is a copy of bytes, cheaper
            # than the two hops to a thread and back, and calls that arrive together reach the batcher
            # together (with the hops, each ran alone). Typed contents walk Python lists: off the loop.
            if request.raw_input_contents or not request.inputs:
                inputs = decode_inputs(request, manifest, codec)
            else:
                inputs = await _off_loop(decode_inputs, request, manifest, codec)
            outputs, variant, serving = await self.models.call(found, inputs)
            response = encode_outputs(serving, outputs, request, codec)
            self.models.count(found, serving, variant, inputs, start)
            return response

        return await self._answer(
            "ModelInfer",
            context,
            work,
            counted=lambda refused: self.models.count_refused(found, refused, request.model_name),
        )

    async def _answer(
        self,
        method: str,
        context: grpc.aio.ServicerContext,
        work: Callable[[], Awaitable[Any]],
        counted: Callable[[Refused], None] | None = None,
    ) -> Any:
        """``work()``'s message, or the exception policy's answer (errors.py) as a gRPC status."""
        try:
            return await work()
        except Exception as e:  # noqa: BLE001: the policy decides; a server fault is logged with its traceback
            refused = refusal(e)
            if refused is None:
                log.exception("gRPC %s failed", method)
                refused = internal(e)
        if counted is not None:
            counted(refused)
        if refused.code is not Code.INTERNAL:
            level = logging.WARNING if refused.code is Code.UNAVAILABLE else logging.INFO
            what = " ".join(str(refused).split())[:200]
            log.log(level, "gRPC %s: %s %s", method, refused.reason or refused.code.value, what)
        await context.abort(grpc.StatusCode[refused.code.value], str(refused))

    def handler(self) -> grpc.GenericRpcHandler:
        """The service's method table for ``grpc.aio.Server.add_generic_rpc_handlers``."""
        calls = {
            "ServerLive": (pb.ServerLiveRequest, pb.ServerLiveResponse),
            "ServerReady": (pb.ServerReadyRequest, pb.ServerReadyResponse),
            "ServerMetadata": (pb.ServerMetadataRequest, pb.ServerMetadataResponse),
            "ModelReady": (pb.ModelReadyRequest, pb.ModelReadyResponse),
            "ModelMetadata": (pb.ModelMetadataRequest, pb.ModelMetadataResponse),
            "ModelInfer": (pb.ModelInferRequest, pb.ModelInferResponse),
        }
        return grpc.method_handlers_generic_handler(
            SERVICE,
            {
                name: grpc.unary_unary_rpc_method_handler(
                    getattr(self, name),
                    request_deserializer=request.FromString,
                    response_serializer=response.SerializeToString,
                )
                for name, (request, response) in calls.items()
            },
        )


async def _off_loop(fn: Callable[..., Any], *args: Any) -> Any:
    """``fn(*args)`` on the loop's thread pool, for work that would hold the loop up."""
    return await asyncio.get_running_loop().run_in_executor(None, fn, *args)


# --- the server ------------------------------------------------------------------------------


class GrpcBindError(Exception):
    """The gRPC port cannot be listened on."""


class GrpcServer:
    """A ``grpc.aio`` server on an asyncio loop of its own thread, so it runs beside any HTTP server.

    ``reuse_port``: join the other workers' listening sockets on the port (SO_REUSEPORT: the kernel
    spreads connections over them); off, a port in use is an error."""

    def __init__(self, models: Models, *, host: str, port: int, max_message_bytes: int, reuse_port: bool):
        self.servicer = Servicer(models)
        self.address = f"[{host}]:{port}" if ":" in host else f"{host}:{port}"
        self.options = [
            ("grpc.max_receive_message_length", max_message_bytes),
            ("grpc.so_reuseport", 1 if reuse_port else 0),
        ]
        self.port: int | None = None
        self._thread: threading.Thread | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._stopping: asyncio.Event | None = None

    def start(self) -> int:
        """Listen and serve; returns the bound port (GrpcBindError when it cannot listen)."""
        started: Future = Future()
        self._thread = threading.Thread(target=asyncio.run, args=(self._serve(started),), name="precompile-grpc")
        self._thread.daemon = True
        self._thread.start()
        self.port = started.result()
        return self.port

    async def _serve(self, started: Future) -> None:
        self._loop = asyncio.get_running_loop()
        self._stopping = asyncio.Event()
        try:
            server = grpc.aio.server(options=self.options)
            server.add_generic_rpc_handlers((self.servicer.handler(),))
            port = server.add_insecure_port(self.address)
            if port == 0:
                raise RuntimeError("the port is taken or the address is not this host's")
            await server.start()
        except Exception as e:  # noqa: BLE001: grpc raises RuntimeError for a port it cannot bind
            started.set_exception(GrpcBindError(f"gRPC cannot listen on {self.address}: {e}"))
            return
        started.set_result(port)
        await self._stopping.wait()
        await server.stop(grace=5.0)  # calls in flight finish; new ones are refused

    def stop(self) -> None:
        if self._thread is None:
            return
        if self._loop is not None and self._stopping is not None:
            self._loop.call_soon_threadsafe(self._stopping.set)
        self._thread.join()
        self._thread = None


@contextlib.contextmanager
def grpc_beside(models: repository.Models, config: ServeConfig) -> Iterator[GrpcServer | None]:
    """The gRPC service for ``models`` on ``config.grpc_port`` while the block runs (nothing when it is off)."""
    if not config.grpc_port:
        yield None
        return
    server = GrpcServer(
        ServedModels(models),
        host=config.host,
        port=config.grpc_port,
        max_message_bytes=models.max_body_bytes,
        reuse_port=config.workers > 1,
    )
    server.start()
    log.info("gRPC (KServe v2 GRPCInferenceService) on %s", server.address)
    try:
        yield server
    finally:
        server.stop()
