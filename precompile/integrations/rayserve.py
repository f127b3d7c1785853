"""A Ray Serve deployment of an artifact: replicas, autoscaling, and requests batched by the loader.

    from precompile.integrations.rayserve import app
    serve.run(app("oci://registry.example.com/models/text-classifier:7",
                  autoscaling={"min_replicas": 2, "max_replicas": 8, "target_ongoing_requests": 8}),
              route_prefix="/text-classifier")

or, in a Serve config file (``serve deploy``; docs/ray-serve.md)::

    applications:
      - name: text-classifier
        route_prefix: /text-classifier
        import_path: precompile.integrations.rayserve:build
        args: {artifact: "oci://registry.example.com/models/text-classifier:7", min_replicas: 2, max_replicas: 8}

Each replica loads the artifact (``loader.load``, or ``load_native`` with ``runtime="native"``) with
the loader's checks, and runs concurrent requests through ``loader.Batcher``, which joins them into
batches the compiled variants serve (not ``@serve.batch``: the batcher knows the variants' batch
sizes and pads to the one that is cheapest). Requests and answers are the Open Inference Protocol's
JSON (``{"inputs": [{"name", "shape", "datatype", "data"}]}`` -> ``{"outputs": [...]}``); a call the
artifact's guards refuse, or a malformed body, is a 400 with ``{"error": reason}``.
"""

from __future__ import annotations

import json
from typing import Any

import numpy as np
from ray import serve
from starlette.requests import Request
from starlette.responses import JSONResponse

from loader import constants as C
from loader.errors import GuardError

from .served import ServedArtifact

NUMPY_DTYPES = {datatype: dtype for dtype, datatype in C.OIP_DATATYPES.items() if dtype != "bfloat16"}
# What JSON values each kind of dtype takes: an integer input takes no 1.5, a bool input only true/false.
_KINDS = {"b": "b", "u": "iub", "i": "iub", "f": "fiub"}
MAX_DIMS = 32


class BadRequest(ValueError):
    """The body is not an inference request: a 400."""


def decode(body: bytes) -> dict[str, np.ndarray]:
    """The inputs of an Open Inference Protocol JSON request, as arrays of their datatypes."""
    try:
        request = json.loads(body)
    except (ValueError, RecursionError) as e:
        raise BadRequest(f"the body is not JSON ({e})") from None
    inputs = request.get("inputs") if isinstance(request, dict) else None
    if not isinstance(inputs, list) or not inputs:
        raise BadRequest('expected {"inputs": [{"name", "shape", "datatype", "data"}, ...]}')
    arrays: dict[str, np.ndarray] = {}
    for i, tensor in enumerate(inputs):
        if not isinstance(tensor, dict) or not isinstance(tensor.get("name"), str):
            raise BadRequest(f"inputs[{i}]: expected an object with a name")
        name = tensor["name"]
        if name in arrays:
            raise BadRequest(f"input {name!r} given twice")
        datatype, shape = tensor.get("datatype"), tensor.get("shape")
        if datatype not in NUMPY_DTYPES:
            raise BadRequest(f"input {name!r}: datatype {datatype!r} is not one of {', '.join(NUMPY_DTYPES)}")
        if (
            not isinstance(shape, list)
            or len(shape) > MAX_DIMS
            or not all(isinstance(s, int) and not isinstance(s, bool) and s >= 0 for s in shape)
        ):
            raise BadRequest(f"input {name!r}: shape must be a list of sizes")
        dtype = np.dtype(NUMPY_DTYPES[datatype])
        try:
            values = np.asarray(tensor.get("data"))
        except (ValueError, TypeError) as e:
            raise BadRequest(f"input {name!r}: data is not an array of numbers ({e})") from None
        if values.size and values.dtype.kind not in _KINDS[dtype.kind]:
            raise BadRequest(f"input {name!r}: {datatype} data holds values of another kind ({values.dtype.name})")
        if values.size != int(np.prod(shape)):
            raise BadRequest(f"input {name!r}: {values.size} values for shape {shape}")
        arrays[name] = values.astype(dtype).reshape(shape)
    return arrays


def encode(served: ServedArtifact, outputs: list) -> dict[str, Any]:
    return {
        "model_name": served.name,
        "model_version": str(served.version),
        "outputs": [
            {"name": o.name, "datatype": o.datatype, "shape": list(o.array.shape), "data": o.array.ravel().tolist()}
            for o in outputs
        ],
    }


@serve.deployment(ray_actor_options={"num_cpus": 1}, max_ongoing_requests=16)
class PrecompileDeployment:
    """One replica: the artifact loaded once, each request a call through the loader's batcher."""

    def __init__(
        self,
        artifact: str,
        runtime: str = "torch",
        trusted_keys: list[str] | None = None,
        max_delay_ms: float = 2.0,
        threads: int | None = None,
    ):
        self.served = ServedArtifact(
            artifact, runtime=runtime, trusted_keys=trusted_keys, max_delay_ms=max_delay_ms, threads=threads
        )

    async def __call__(self, request: Request) -> JSONResponse:
        if request.method == "GET":  # metadata, as GET /v2/models/NAME answers it
            meta = {"name": self.served.name, "versions": [str(self.served.version)], "platform": "precompile"}
            return JSONResponse({**meta, "inputs": self.served.input_metadata()})
        try:
            arrays = decode(await request.body())
            outputs = await self.served.infer(arrays)
        except (BadRequest, GuardError) as e:
            return JSONResponse({"error": str(e)}, status_code=400)
        return JSONResponse(encode(self.served, outputs))


def app(
    artifact: str,
    *,
    name: str = "precompile",
    num_replicas: int | None = None,
    autoscaling: dict[str, Any] | None = None,
    num_cpus: float = 1,
    max_ongoing_requests: int = 16,
    runtime: str = "torch",
    trusted_keys: list[str] | None = None,
    max_delay_ms: float = 2.0,
    threads: int | None = None,
) -> serve.Application:
    """The deployment of ``artifact`` (a path every node sees, a URL or an ``oci://`` reference), for
    ``serve.run``: ``num_replicas`` fixed, or ``autoscaling`` (Ray Serve's ``autoscaling_config``:
    ``min_replicas``, ``max_replicas``, ``target_ongoing_requests``, ...). ``threads``: OpenMP threads
    per replica (default: its CPUs)."""
    if num_replicas is not None and autoscaling is not None:
        raise ValueError("give num_replicas or autoscaling, not both")
    options: dict[str, Any] = {
        "name": name,
        "ray_actor_options": {"num_cpus": num_cpus},
        "max_ongoing_requests": max_ongoing_requests,
    }
    if autoscaling is not None:
        options["autoscaling_config"] = autoscaling
    else:
        options["num_replicas"] = num_replicas or 1
    threads = threads if threads is not None else max(1, int(num_cpus))
    return PrecompileDeployment.options(**options).bind(artifact, runtime, trusted_keys, max_delay_ms, threads)


def build(args: dict[str, Any]) -> serve.Application:
    """The application builder for Serve config files (``import_path: precompile.integrations.rayserve:build``):
    ``args`` holds ``artifact`` and, optionally, ``min_replicas``/``max_replicas``/``target_ongoing_requests``
    (autoscaling) or ``num_replicas``, ``num_cpus``, ``runtime``, ``trusted_keys``, ``max_delay_ms``."""
    args = dict(args)
    artifact = args.pop("artifact", None)
    if not isinstance(artifact, str):
        raise ValueError("args.artifact: the artifact's path, URL or oci:// reference")
    scaling = {k: args.pop(k) for k in ("min_replicas", "max_replicas", "target_ongoing_requests") if k in args}
    return app(artifact, autoscaling=scaling or None, **args)
