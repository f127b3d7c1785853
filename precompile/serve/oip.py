"""The Open Inference Protocol (KServe v2, spoken by Triton, KServe and MLServer) beside /predict.

    GET  /v2                          server metadata (name, version, extensions)
    GET  /v2/health/live              200 while the process is up
    GET  /v2/health/ready             200 once the artifact is loaded, 503 before
    GET  /v2/models/{name}            inputs and outputs: name, datatype (INT64, FP32, BOOL...), shape (-1: dynamic)
    GET  /v2/models/{name}/ready      200 once loaded
    POST /v2/models/{name}/infer      {"inputs": [{"name", "shape", "datatype", "data"}]} -> {"model_name", "outputs": [...]}

The binary tensor data extension is supported both ways: a request whose JSON header is followed by
raw little-endian tensors (``Inference-Header-Content-Length``, ``binary_data_size`` per input), and
outputs in binary when asked (``binary_data`` per requested output, or ``binary_data_output`` for
all). Errors are ``{"error": "..."}``: 400 for a bad request or inputs the guards refuse (with the
guard's message), 404 for an unknown model, 503 while nothing is loaded or the batch queue is full.

Output names: ``output`` for a single tensor; otherwise the path in forward()'s result, dict keys by
name and sequence items by index (``output.0``, ``output.1``; ``logits``, ``extra.0``).
"""

from __future__ import annotations

import logging
import math
import sys
import time
from typing import TYPE_CHECKING, Any

import torch
from fastapi import APIRouter, FastAPI, Request
from fastapi.responses import JSONResponse, Response
from starlette.concurrency import run_in_threadpool

from loader import BatcherFull, GuardError, LoaderError
from loader.guards import TORCH_DTYPES
from loader.live import Serving
from loader.manifest import Manifest, OutputSpec

from .codec import BodyError, dumps, parse_json, to_tensor
from .metrics import guard_reason

if TYPE_CHECKING:
    from .app import Service

log = logging.getLogger("precompile.serve")

HEADER_LENGTH = "Inference-Header-Content-Length"
DATATYPES = {
    "bool": "BOOL",
    "uint8": "UINT8",
    "int8": "INT8",
    "int16": "INT16",
    "int32": "INT32",
    "int64": "INT64",
    "float16": "FP16",
    "bfloat16": "BF16",
    "float32": "FP32",
    "float64": "FP64",
}
_TORCH_TO_DATATYPE = {TORCH_DTYPES[name]: code for name, code in DATATYPES.items()}


class OIPError(Exception):
    """A request the protocol answers with ``{"error": message}`` and ``status``."""

    def __init__(self, status: int, message: str):
        super().__init__(message)
        self.status = status


def mount_oip(app: FastAPI, service: Service) -> None:
    """Add the /v2 routes to ``app``, serving ``service``'s model."""
    router = APIRouter(prefix="/v2")

    @router.get("")
    def server_metadata() -> dict:
        """Server name, version and protocol extensions."""
        from precompile import __version__

        return {"name": "precompile", "version": __version__, "extensions": ["binary_tensor_data"]}

    @router.get("/health/live")
    def live() -> dict:
        """The process is up."""
        return {"live": True}

    @router.get("/health/ready")
    def ready() -> JSONResponse:
        """The artifact is loaded and warmed up."""
        ok = service.live.ready
        return JSONResponse({"ready": ok}, status_code=200 if ok else 503)

    @router.get("/models/{name}")
    def model_metadata(name: str) -> JSONResponse:
        """The model's inputs and outputs: names, datatypes, shapes (-1 for a dynamic dim)."""
        try:
            return JSONResponse(_metadata(_serving(service, name)))
        except OIPError as e:
            return _error(e)

    @router.get("/models/{name}/ready")
    def model_ready(name: str) -> JSONResponse:
        """The named model is loaded and warmed up."""
        try:
            _serving(service, name)
        except OIPError as e:
            return _error(e)
        return JSONResponse({"name": name, "ready": True})

    @router.post("/models/{name}/infer")
    async def infer(name: str, request: Request) -> Response:
        """Run the model on JSON or binary tensors (the binary tensor data extension)."""
        start = time.perf_counter()
        try:
            serving = _serving(service, name)
            body = await request.body()
            header = request.headers.get(HEADER_LENGTH)
            parsed = await run_in_threadpool(parse_infer_request, body, header, serving.model.manifest)
            outputs, variant, serving = await service.call(parsed.inputs)
            response = await run_in_threadpool(infer_response, serving, outputs, parsed)
        except OIPError as e:  # counted as /predict counts its own: a malformed request is invalid_body
            service.count_refused(e.status, "invalid_body" if e.status == 400 else None)
            return _error(e)
        except GuardError as e:
            service.count_refused(400, guard_reason(e))
            return _error(OIPError(400, str(e)))
        except BatcherFull as e:
            service.count_refused(503, "queue_full")
            return _error(OIPError(503, str(e)))
        except LoaderError as e:
            service.count_refused(503, None)
            return _error(OIPError(503, str(e)))
        except Exception as e:  # noqa: BLE001: a bug or a runtime failure; this request fails, the server serves on
            log.exception("infer failed")
            service.count_refused(500, None)
            return _error(OIPError(500, f"internal error: {type(e).__name__}: {e}"))
        service.count_served(serving, variant, parsed.inputs, start)
        return response

    app.include_router(router)


def _error(e: OIPError) -> JSONResponse:
    return JSONResponse({"error": str(e)}, status_code=e.status)


def _serving(service: Service, name: str) -> Serving:
    serving = service.live.current
    if serving is None:
        raise OIPError(503, "no model is loaded yet")
    if name != serving.name:
        raise OIPError(404, f"unknown model {name!r} (this server serves {serving.name!r})")
    return serving


# --- metadata --------------------------------------------------------------------------------


def _metadata(serving: Serving) -> dict[str, Any]:
    m = serving.model.manifest
    return {
        "name": serving.name,
        "versions": [str(serving.version)],
        "platform": "precompile",
        "inputs": [
            {"name": spec.name, "datatype": DATATYPES[spec.dtype], "shape": [_dim_size(m, s) for s in spec.shape]}
            for spec in m.inputs
        ],
        "outputs": _output_metadata(serving),
    }


def _dim_size(m: Manifest, s: str | int | None) -> int:
    if isinstance(s, int):
        return s
    r = m.dims.get(s) if s is not None else None
    return r.min if r is not None and r.min == r.max else -1


def _output_metadata(serving: Serving) -> list[dict[str, Any]]:
    """Names, datatypes and shapes of the outputs. The manifest does not record output dtypes, so
    one variant is run once on valid inputs at its hint shape (not counted in stats)."""
    model = serving.model
    m = model.manifest
    variant = model.variants[0]
    sample = flatten_outputs(m.output, model.run_variant(variant.id, *model.example_inputs(variant)))
    described = []
    for i, (name, t) in enumerate(zip(output_names(m.output), sample)):
        axes = m.output_dims[i] if m.output_dims is not None else (None,) * t.dim()
        shape = [n if d is None else _dim_size(m, d) for d, n in zip(axes, t.shape)]
        if m.output_dims is None and shape and "batch" in m.dims:
            shape[0] = -1  # unknown without the profile's outputs; axis 0 commonly follows the batch
        described.append({"name": name, "datatype": _TORCH_TO_DATATYPE[t.dtype], "shape": shape})
    return described


def output_names(spec: OutputSpec) -> list[str]:
    """Flat output names, in the order of the flattened outputs (see the module docstring)."""
    return spec.names()


def flatten_outputs(spec: OutputSpec, value: Any) -> list[torch.Tensor]:
    """The output tensors in the manifest's flat order (dict items in the order of its keys)."""
    if spec.kind == "tensor":
        return [value]
    items = [value[k] for k in spec.keys] if spec.kind == "dict" else list(value)
    return [t for s, v in zip(spec.items, items) for t in flatten_outputs(s, v)]


# --- infer -----------------------------------------------------------------------------------


class InferRequest:
    """A decoded infer request: tensors by input name and how each output should be sent back."""

    def __init__(self, inputs: dict[str, torch.Tensor], request_id: str | None, wanted: dict[str, bool] | None, binary_all: bool):
        self.inputs = inputs
        self.id = request_id
        self.wanted = wanted  # output name -> binary; None: every output
        self.binary_all = binary_all


def parse_infer_request(body: bytes, header_length: str | None, manifest: Manifest) -> InferRequest:
    """Decode an infer request (JSON, or a JSON header then binary tensors); OIPError(400) says what
    is wrong. Names, shapes and ranges beyond the datatype are left to the loader's guards."""
    binary = b""
    if header_length is not None:
        try:
            n = int(header_length)
        except ValueError:
            raise OIPError(400, f"{HEADER_LENGTH}: {header_length!r} is not a number") from None
        if not 0 <= n <= len(body):
            raise OIPError(400, f"{HEADER_LENGTH}: {n} is not within the body's {len(body)} bytes")
        body, binary = body[:n], body[n:]
    try:
        request = parse_json(body)
    except BodyError as e:
        raise OIPError(400, str(e)) from None
    if not isinstance(request, dict) or not isinstance(request.get("inputs"), list):
        raise OIPError(400, 'expected a JSON object {"inputs": [{"name", "shape", "datatype", "data"}, ...]}')
    specs = {spec.name: spec for spec in manifest.inputs}
    inputs: dict[str, torch.Tensor] = {}
    offset = 0
    for i, item in enumerate(request["inputs"]):
        where = f"inputs[{i}]"
        if not isinstance(item, dict) or not isinstance(item.get("name"), str):
            raise OIPError(400, f"{where}: expected an object with a name, shape, datatype and data")
        name = item["name"]
        spec = specs.get(name)
        if spec is None:
            raise OIPError(400, f"{where}: unknown input {name!r} (inputs: {', '.join(specs)})")
        if name in inputs:
            raise OIPError(400, f"{where}: input {name!r} given twice")
        if item.get("datatype") != DATATYPES[spec.dtype]:
            raise OIPError(400, f"input {name!r}: datatype must be {DATATYPES[spec.dtype]}, got {item.get('datatype')!r}")
        shape = item.get("shape")
        if not isinstance(shape, list) or not all(type(s) is int and s >= 0 for s in shape):
            raise OIPError(400, f"input {name!r}: shape must be a list of sizes ≥ 0")
        count = math.prod(shape)
        dtype = TORCH_DTYPES[spec.dtype]
        size = (item.get("parameters") or {}).get("binary_data_size")
        if size is not None:
            tensor, offset = _binary_tensor(name, binary, offset, size, shape, count, dtype)
        else:
            tensor = _json_tensor(name, item.get("data"), shape, count, dtype)
        inputs[name] = tensor
    if offset != len(binary):
        raise OIPError(400, f"{len(binary) - offset} bytes of binary data follow the inputs that no input claims")
    return InferRequest(inputs, request.get("id"), *_wanted_outputs(request))


def _binary_tensor(name: str, binary: bytes, offset: int, size: Any, shape: list[int], count: int, dtype: torch.dtype):
    itemsize = torch.empty((), dtype=dtype).element_size()
    if type(size) is not int or size != count * itemsize:
        raise OIPError(400, f"input {name!r}: binary_data_size {size!r} is not {count} × {itemsize} bytes for shape {shape}")
    if offset + size > len(binary):
        raise OIPError(400, f"input {name!r}: binary_data_size {size} runs past the end of the body")
    raw = bytearray(binary[offset : offset + size])  # a copy: the tensor must own writable memory
    tensor = torch.frombuffer(raw, dtype=dtype) if size else torch.empty(0, dtype=dtype)
    if sys.byteorder != "little":  # the protocol's bytes are little-endian
        tensor = tensor.view(torch.uint8).view(-1, itemsize).flip(1).contiguous().view(dtype).view(-1)
    if dtype is torch.bool and not bool(((tensor.view(torch.uint8) == 0) | (tensor.view(torch.uint8) == 1)).all()):
        raise OIPError(400, f"input {name!r}: BOOL bytes must be 0 or 1")
    return tensor.reshape(shape), offset + size


def _json_tensor(name: str, data: Any, shape: list[int], count: int, dtype: torch.dtype) -> torch.Tensor:
    if not isinstance(data, list):
        raise OIPError(400, f"input {name!r}: data must be a list (or use binary_data_size)")
    try:
        tensor = to_tensor(name, data, dtype)
    except BodyError as e:
        raise OIPError(400, str(e)) from None
    if tensor.numel() != count:
        raise OIPError(400, f"input {name!r}: {tensor.numel()} values for shape {shape}")
    return tensor.reshape(shape)


def _wanted_outputs(request: dict[str, Any]) -> tuple[dict[str, bool] | None, bool]:
    binary_all = bool((request.get("parameters") or {}).get("binary_data_output", False))
    outputs = request.get("outputs")
    if outputs is None:
        return None, binary_all
    if not isinstance(outputs, list) or not all(isinstance(o, dict) and isinstance(o.get("name"), str) for o in outputs):
        raise OIPError(400, 'outputs must be a list of {"name": ..., "parameters": {...}}')
    return {o["name"]: bool((o.get("parameters") or {}).get("binary_data", binary_all)) for o in outputs}, binary_all


def infer_response(serving: Serving, outputs: Any, request: InferRequest) -> Response:
    """The infer response: JSON, or a JSON header followed by the binary outputs."""
    spec = serving.model.manifest.output
    named = dict(zip(output_names(spec), flatten_outputs(spec, outputs)))
    wanted = request.wanted if request.wanted is not None else {n: request.binary_all for n in named}
    unknown = [n for n in wanted if n not in named]
    if unknown:
        raise OIPError(400, f"unknown output {unknown[0]!r} (outputs: {', '.join(named)})")
    described, chunks = [], []
    for name, binary in wanted.items():
        t = named[name].detach().cpu().contiguous()
        entry: dict[str, Any] = {"name": name, "datatype": _TORCH_TO_DATATYPE[t.dtype], "shape": list(t.shape)}
        if binary:
            raw = _little_endian_bytes(t)
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
        raise OIPError(500, "the outputs hold NaN or infinity, which JSON cannot carry; ask for them in binary") from None
    if not chunks:
        return Response(header, media_type="application/json")
    return Response(header + b"".join(chunks), media_type="application/octet-stream", headers={HEADER_LENGTH: str(len(header))})


def _little_endian_bytes(t: torch.Tensor) -> bytes:
    raw = t.reshape(-1).view(torch.uint8) if t.numel() else torch.empty(0, dtype=torch.uint8)
    if sys.byteorder != "little" and t.element_size() > 1:
        raw = raw.view(-1, t.element_size()).flip(1).reshape(-1)
    return raw.numpy().tobytes()
