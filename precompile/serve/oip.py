"""The Open Inference Protocol (KServe v2, spoken by Triton, KServe and MLServer) beside /predict.

    GET  /v2                          server metadata (name, version, extensions)
    GET  /v2/health/live              200 while the process is up
    GET  /v2/health/ready             200 once the artifact is loaded, 503 before
    GET  /v2/models/{name}            inputs and outputs: name, datatype (INT64, FP32, BOOL...), shape (-1: dynamic)
    GET  /v2/models/{name}/ready      200 once loaded
    POST /v2/models/{name}/infer      {"inputs": [{"name", "shape", "datatype", "data"}]} -> {"model_name", "outputs": [...]}
    .../versions/{v}/...              the same three for one version (without: the newest ready one)
    POST /v2/repository/index         [{"name", "version", "state", "reason"}] (GET too; {"ready": true}: READY only)
    POST /v2/repository/models/{name}/load | unload    the repository extension (--allow-repository-control)

The binary tensor data extension is supported both ways: a request whose JSON header is followed by
raw little-endian tensors (``Inference-Header-Content-Length``, ``binary_data_size`` per input), and
outputs in binary when asked (``binary_data`` per requested output, or ``binary_data_output`` for
all). Errors are ``{"error": "..."}``, statuses from the server's exception policy (errors.py):
400 for a bad request (any field of the wrong JSON type, ``parameters`` included), inputs the codec
or the guards refuse (NaN or infinity, binary or not, as /predict refuses them), or outputs JSON
cannot carry; 404 for an unknown model or version, 403 for the repository extension while it is off,
413 over the body limit, 503 while nothing is loaded or the batch queue is full. The routes look
models up by name in ``repository.py`` (one artifact, or a repository).

Output names: ``output`` for a single tensor; otherwise the path in forward()'s result, dict keys by
name and sequence items by index (``output.0``, ``output.1``; ``logits``, ``extra.0``).
"""

from __future__ import annotations

import time
from typing import Any

from fastapi import APIRouter, FastAPI, Request
from fastapi.responses import JSONResponse, Response
from starlette.concurrency import run_in_threadpool

from loader.constants import OIP_DATATYPES
from loader.manifest import Manifest
from loader.outputs import flatten, output_names
from loader.serving.live import Serving

from ..version import __version__
from .codec import BodyError, Codec, codec_for, dumps, json_kind, parse_json, parse_object
from .errors import Code, Refused
from .repository import Models, Repository
from .service import Service

HEADER_LENGTH = "Inference-Header-Content-Length"
DATATYPES = OIP_DATATYPES


def _invalid(message: str) -> Refused:
    """A malformed infer request (400, counted as invalid_body)."""
    return Refused(Code.INVALID_ARGUMENT, message, "invalid_body")


def mount_oip(app: FastAPI, models: Models) -> None:
    """Add the /v2 routes to ``app``, serving ``models``. Every refusal and failure is answered by
    the server's exception policy (errors.py), as ``{"error": message}``."""
    router = APIRouter(prefix="/v2")
    control = isinstance(models, Repository) and models.config.allow_repository_control

    @router.get("")
    def server_metadata() -> dict:
        """Server name, version and protocol extensions."""
        extensions = ["binary_tensor_data", *(["model_repository"] if control else [])]
        return {"name": "precompile", "version": __version__, "extensions": extensions}

    @router.get("/health/live")
    def live() -> dict:
        """The process is up."""
        return {"live": True}

    @router.get("/health/ready")
    def ready() -> JSONResponse:
        """The artifact is loaded and warmed up (a repository: one model at least, once all were tried)."""
        ok = models.ready
        return JSONResponse({"ready": ok}, status_code=200 if ok else 503)

    @router.get("/models/{name}")
    @router.get("/models/{name}/versions/{version}")
    async def model_metadata(name: str, request: Request) -> Response:
        """The model's inputs and outputs: names, datatypes, shapes (-1 for a dynamic dim)."""

        version = request.path_params.get("version")

        def metadata() -> JSONResponse:
            service, serving = _serving(models, name, version)
            described = _metadata(serving, service.codec)
            if version is None:
                described["versions"] = models.versions(name)
            return JSONResponse(described)

        return await models.answer(request, lambda: run_in_threadpool(metadata))

    @router.get("/models/{name}/ready")
    @router.get("/models/{name}/versions/{version}/ready")
    async def model_ready(name: str, request: Request) -> Response:
        """The named model is loaded and warmed up."""

        async def work() -> Response:
            _serving(models, name, request.path_params.get("version"))
            return JSONResponse({"name": name, "ready": True})

        return await models.answer(request, work)

    @router.post("/models/{name}/infer")
    @router.post("/models/{name}/versions/{version}/infer")
    async def infer(name: str, request: Request) -> Response:
        """Run the model on JSON or binary tensors (the binary tensor data extension)."""
        return await models.answer(request, lambda: _infer(models, name, request.path_params.get("version"), request))

    @router.get("/repository/index")
    @router.post("/repository/index")
    async def repository_index(request: Request) -> Response:
        """Every model and version, READY, LOADING or UNAVAILABLE (with the reason); {"ready": true}: READY only."""

        async def work() -> Response:
            repository = models.control()
            ready_only = _flag("index request", _index_request(await request.body()), "ready", False)
            return JSONResponse(repository.index(ready_only=ready_only))

        return await models.answer(request, work)

    @router.post("/repository/models/{name}/load")
    async def repository_load(name: str, request: Request) -> Response:
        """Scan the repository for the model and serve its versions (the policy's); failed ones are retried."""

        async def work() -> Response:
            repository = models.control()
            _no_parameters(await request.body())
            await run_in_threadpool(repository.load, name)
            return JSONResponse({})

        return await models.answer(request, work)

    @router.post("/repository/models/{name}/unload")
    async def repository_unload(name: str, request: Request) -> Response:
        """Stop serving every version of the model (calls running on it finish first)."""

        async def work() -> Response:
            repository = models.control()
            _no_parameters(await request.body())
            await run_in_threadpool(repository.unload, name)
            return JSONResponse({})

        return await models.answer(request, work)

    app.include_router(router)
    # Added before the app's BodyLimit (create_app), so it runs inside it: the limit holds here too.
    app.add_middleware(InferFastPath, models=models)


def _index_request(body: bytes) -> dict[str, Any]:
    if not body.strip():
        return {}
    data = parse_json(body)
    if not isinstance(data, dict) or not set(data) <= {"ready"}:
        raise BodyError('expected {"ready": true|false} or no body')
    return data


def _no_parameters(body: bytes) -> None:
    """A load or unload body: none, {} or {"parameters": {}}. A path or a config to load from is refused:
    what is loaded is what the repository holds under that name."""
    if not body.strip():
        return
    data = parse_json(body)
    if not isinstance(data, dict) or not set(data) <= {"parameters"} or data.get("parameters", {}) != {}:
        raise BodyError("load and unload take no parameters: they name a model the repository holds")


# Decoding costs what the JSON text costs (binary tensors are views of the body, or one copy): about
# 30 µs per KiB of tensors written as JSON lists (torch; numpy half that), so a JSON header of at most
# this many bytes is decoded on the loop in about the time the hops to a thread and back take; longer
# ones on the thread pool, so the loop never waits long on one. Outputs all sent in binary are one
# copy each: written on the loop too.
LOOP_JSON_BYTES = 4 << 10


async def _infer(models: Models, name: str, version: str | None, request: Request) -> Response:
    start = time.perf_counter()
    service, serving = _serving(models, name, version)
    body = await request.body()
    header = request.headers.get(HEADER_LENGTH)
    manifest, codec = serving.model.manifest, service.codec
    if _json_length(body, header) <= LOOP_JSON_BYTES:
        parsed = parse_infer_request(body, header, manifest, codec)
    else:
        parsed = await run_in_threadpool(parse_infer_request, body, header, manifest, codec)
    outputs, variant, serving = await service.call(parsed.inputs, request)
    if parsed.binary_only:
        response = infer_response(serving, outputs, parsed, codec)
    else:
        response = await run_in_threadpool(infer_response, serving, outputs, parsed, codec)
    service.count_served(serving, variant, parsed.inputs, start)
    return response


def _json_length(body: bytes, header_length: str | None) -> int:
    """How many bytes of ``body`` are JSON (the header, with binary tensors after it)."""
    if header_length is not None and _ascii_digits(header_length):
        return min(int(header_length), len(body))
    return len(body)  # a malformed header: parse_infer_request refuses it


def _ascii_digits(text: str) -> bool:
    """Whether a header's value is a byte count: ASCII digits only (``int`` also takes " 12", "+12",
    "1_2" and other scripts' digits; ``str.isdigit`` takes "²", which ``int`` refuses)."""
    return 0 < len(text) <= 19 and text.isascii() and text.isdigit()


def infer_path(path: str) -> tuple[str, str | None] | None:
    """The model and version (None: the newest) of an infer route's path, as FastAPI's routes
    ``/v2/models/{name}/infer`` and ``/v2/models/{name}/versions/{version}/infer`` read it; None for
    any other path."""
    parts = path.split("/")
    if len(parts) == 5 and parts[4] == "infer" and parts[3]:
        version = None
    elif len(parts) == 7 and parts[6] == "infer" and parts[4] == "versions" and parts[3] and parts[5]:
        version = parts[5]
    else:
        return None
    if parts[0] or parts[1] != "v2" or parts[2] != "models":
        return None
    return parts[3], version


class InferFastPath:
    """``POST /v2/models/{name}[/versions/{v}]/infer`` answered straight from the ASGI scope: the same
    work (``_infer``) through the same exception policy (``models.answer``) as the FastAPI route,
    without FastAPI's route matching over every route, its request wrapping and its dependency
    machinery, which cost more than the rest of a small binary request. Mounted inside the body limit
    (limits.py), so that applies as before; every other request goes on to ``app``. The route itself
    stays: the OpenAPI schema lists it, and tests/test_oip.py checks both answer byte for byte alike."""

    def __init__(self, app: Any, *, models: Models):
        self.app = app
        self.models = models

    async def __call__(self, scope: dict[str, Any], receive: Any, send: Any) -> None:
        routed = scope["type"] == "http" and scope["method"] == "POST" and not scope.get("root_path")
        named = infer_path(scope["path"]) if routed else None
        if named is None:
            await self.app(scope, receive, send)
            return
        models = self.models
        request = Request(scope, receive)
        response = await models.answer(request, lambda: _infer(models, named[0], named[1], request))
        await response(scope, receive, send)


def _serving(models: Models, name: str, version: str | None) -> tuple[Service, Serving]:
    service = models.lookup(name, version)
    serving = service.live.current
    if serving is None:
        attempt = service.live.last_attempt
        if attempt is not None and not attempt.ok and isinstance(models, Repository):
            raise Refused(Code.UNAVAILABLE, f"model {name!r} is unavailable: {attempt.error}")
        raise Refused(Code.UNAVAILABLE, "no model is loaded yet")
    return service, serving


# --- metadata --------------------------------------------------------------------------------


def _metadata(serving: Serving, codec: Codec) -> dict[str, Any]:
    m = serving.model.manifest
    return {
        "name": serving.name,
        "versions": [str(serving.version)],
        "platform": "precompile",
        "inputs": [
            {"name": spec.name, "datatype": DATATYPES[spec.dtype], "shape": [_dim_size(m, s) for s in spec.shape]}
            for spec in m.inputs
        ],
        "outputs": _output_metadata(serving, codec),
    }


def _dim_size(m: Manifest, s: str | int | None) -> int:
    if isinstance(s, int):
        return s
    r = m.dims.get(s) if s is not None else None
    return r.min if r is not None and r.min == r.max else -1


def _output_metadata(serving: Serving, codec: Codec) -> list[dict[str, Any]]:
    """Names, datatypes and shapes of the outputs. The manifest does not record output dtypes, so
    one variant is run once on valid inputs at its hint shape (not counted in stats)."""
    model = serving.model
    m = model.manifest
    variant = model.variants[0]
    sample = flatten(model.run_variant(variant.id, *model.example_inputs(variant)))
    described = []
    for i, (name, t) in enumerate(zip(output_names(m.output), sample)):
        axes = m.output_dims[i] if m.output_dims is not None else (None,) * t.ndim
        shape = [n if d is None else _dim_size(m, d) for d, n in zip(axes, t.shape)]
        if m.output_dims is None and shape and "batch" in m.dims:
            shape[0] = -1  # unknown without the profile's outputs; axis 0 commonly follows the batch
        described.append({"name": name, "datatype": DATATYPES[codec.dtype_name(t)], "shape": shape})
    return described


# --- infer -----------------------------------------------------------------------------------


class InferRequest:
    """A decoded infer request: arrays by input name and how each output should be sent back."""

    def __init__(
        self, inputs: dict[str, Any], request_id: str | None, wanted: dict[str, bool] | None, binary_all: bool
    ):
        self.inputs = inputs
        self.id = request_id
        self.wanted = wanted  # output name -> binary; None: every output
        self.binary_all = binary_all

    @property
    def binary_only(self) -> bool:
        """Whether every output asked for is sent in binary (none as JSON lists)."""
        return self.binary_all if self.wanted is None else all(self.wanted.values())


def parse_infer_request(
    body: bytes, header_length: str | None, manifest: Manifest, codec: Codec | None = None
) -> InferRequest:
    """Decode an infer request (JSON, or a JSON header then binary tensors) into ``codec``'s arrays
    (default: torch tensors); a refusal (400) says what is wrong. Names, shapes and ranges beyond the
    datatype are left to the loader's guards."""
    codec = codec if codec is not None else codec_for("torch")
    binary = b""
    if header_length is not None:
        if not _ascii_digits(header_length):
            raise _invalid(f"{HEADER_LENGTH}: {header_length[:40]!r} is not a byte count (ASCII digits)")
        n = int(header_length)
        if n > len(body):
            raise _invalid(f"{HEADER_LENGTH}: {n} is not within the body's {len(body)} bytes")
        body, binary = body[:n], body[n:]
    expected = 'expected a JSON object {"inputs": [{"name", "shape", "datatype", "data"}, ...]}'
    request = parse_object(body, expected)
    if not isinstance(request.get("inputs"), list):
        raise _invalid(expected)
    request_id = request.get("id")
    if request_id is not None and not isinstance(request_id, str):
        raise _invalid(f"id: expected a string, got {json_kind(request_id)}")
    binary_all = _flag("parameters", _parameters("parameters", request), "binary_data_output", False)
    specs = {spec.name: spec for spec in manifest.inputs}
    inputs: dict[str, Any] = {}
    offset = 0
    for i, item in enumerate(request["inputs"]):
        where = f"inputs[{i}]"
        if not isinstance(item, dict) or not isinstance(item.get("name"), str):
            raise _invalid(f"{where}: expected an object with a name, shape, datatype and data")
        name = item["name"]
        spec = specs.get(name)
        if spec is None:
            raise _invalid(f"{where}: unknown input {name!r} (inputs: {', '.join(specs)})")
        if name in inputs:
            raise _invalid(f"{where}: input {name!r} given twice")
        if item.get("datatype") != DATATYPES[spec.dtype]:
            raise _invalid(f"input {name!r}: datatype must be {DATATYPES[spec.dtype]}, got {item.get('datatype')!r}")
        shape = item.get("shape")
        count = codec.shape_count(name, shape)
        size = _parameters(f"{where}.parameters", item).get("binary_data_size")
        if size is not None:  # BodyError, as the codec refuses a value: 400, counted as invalid_body
            inputs[name], offset = codec.binary(name, binary, offset, size, shape, count, spec.dtype)
        else:
            inputs[name] = codec.sized(name, item.get("data"), shape, count, spec.dtype)
    if offset != len(binary):
        raise _invalid(f"{len(binary) - offset} bytes of binary data follow the inputs that no input claims")
    return InferRequest(inputs, request_id, _wanted_outputs(request, binary_all), binary_all)


def _parameters(where: str, holder: dict[str, Any]) -> dict[str, Any]:
    """``holder``'s ``parameters`` object (the protocol's request, input and output level); {} without one."""
    parameters = holder.get("parameters")
    if parameters is None:
        return {}
    if not isinstance(parameters, dict):
        raise _invalid(f"{where}: expected an object, got {json_kind(parameters)}")
    return parameters


def _flag(where: str, parameters: dict[str, Any], key: str, default: bool) -> bool:
    value = parameters.get(key, default)
    if not isinstance(value, bool):
        raise _invalid(f"{where}.{key}: expected true or false, got {json_kind(value)}")
    return value


def _wanted_outputs(request: dict[str, Any], binary_all: bool) -> dict[str, bool] | None:
    """Output name -> whether it is sent in binary; None: every output, as ``binary_all`` says."""
    outputs = request.get("outputs")
    if outputs is None:
        return None
    if not isinstance(outputs, list) or not all(
        isinstance(o, dict) and isinstance(o.get("name"), str) for o in outputs
    ):
        raise _invalid('outputs must be a list of {"name": ..., "parameters": {...}}')
    return {
        o["name"]: _flag(
            f"outputs[{i}].parameters", _parameters(f"outputs[{i}].parameters", o), "binary_data", binary_all
        )
        for i, o in enumerate(outputs)
    }


def infer_response(serving: Serving, outputs: Any, request: InferRequest, codec: Codec | None = None) -> Response:
    """The infer response: JSON, or a JSON header followed by the binary outputs."""
    codec = codec if codec is not None else codec_for("torch")
    spec = serving.model.manifest.output
    named = dict(zip(output_names(spec), flatten(outputs)))
    wanted = request.wanted if request.wanted is not None else {n: request.binary_all for n in named}
    unknown = [n for n in wanted if n not in named]
    if unknown:
        raise _invalid(f"unknown output {unknown[0]!r} (outputs: {', '.join(named)})")
    described, chunks = [], []
    for name, binary in wanted.items():
        t = codec.host(named[name])
        entry: dict[str, Any] = {"name": name, "datatype": DATATYPES[codec.dtype_name(t)], "shape": list(t.shape)}
        if binary:
            raw = codec.little_endian_bytes(t)
            entry["parameters"] = {"binary_data_size": len(raw)}
            chunks.append(raw)
        else:
            entry["data"] = t.reshape(-1).tolist()
        described.append(entry)
    result: dict[str, Any] = {"model_name": serving.name, "model_version": str(serving.version), "outputs": described}
    if request.id is not None:
        result["id"] = request.id
    try:
        header = dumps(result)
    except ValueError:
        raise Refused(
            Code.INVALID_ARGUMENT,
            "the outputs hold NaN or infinity, which JSON cannot carry; ask for them in binary",
            "non_finite_output",
        ) from None
    if not chunks:
        return Response(header, media_type="application/json")
    return Response(
        header + b"".join(chunks), media_type="application/octet-stream", headers={HEADER_LENGTH: str(len(header))}
    )
