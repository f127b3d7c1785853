"""The one front door every protocol reaches a model through: the Open Inference Protocol over HTTP
(oip.py) and over gRPC (grpc_service.py) find, describe, run and count a model call here, so their
lookups, refusals, outputs and counts cannot drift apart. A protocol brings only its own wire format:

    find(models, name, version)     the model version a call names, loaded (a ``Target``); Refused:
                                    NOT_FOUND (unknown), UNAVAILABLE (not loaded, failed),
                                    INVALID_ARGUMENT (a version that is no number)
    describe(models, name, version) the protocol's model metadata (name, versions, platform, inputs, outputs)
    await infer(models, name, version, decode=..., encode=...)
                                    find, decode the request against the target, run it on the model's
                                    instances or batcher (``Service.call``), encode the ``Result``, count it
    input_spec(...)                 one input of a request checked against the manifest, as every decoder does
    Result.pick(names)              the outputs asked for by name; an unknown one is refused

Output names: ``output`` for a single tensor; otherwise the path in forward()'s result, dict keys by
name and sequence items by index (``output.0``, ``output.1``; ``logits``, ``extra.0``).
"""

from __future__ import annotations

import time
from collections.abc import Awaitable, Callable, Iterable
from dataclasses import dataclass
from typing import Any, TypeVar

from fastapi import Request

from loader.constants import OIP_DATATYPES
from loader.manifest import InputSpec, Manifest
from loader.outputs import flatten, output_names
from loader.serving.live import Serving

from .codec import Codec
from .errors import Code, Refused, invalid
from .repository import Models, Repository
from .service import Service

DATATYPES = OIP_DATATYPES  # a manifest's dtype -> the protocol's datatype (FP32, INT64, BOOL...)

Answer = TypeVar("Answer")


@dataclass(frozen=True)
class Target:
    """The model version a call names, loaded: the Service that runs its calls and what it serves now."""

    service: Service
    serving: Serving

    @property
    def manifest(self) -> Manifest:
        return self.serving.model.manifest

    @property
    def codec(self) -> Codec:
        return self.service.codec


@dataclass(frozen=True)
class Result:
    """One call's answer: its outputs flattened and named, the variant that ran, the version that
    answered, and the codec that reads its arrays (numpy or torch, as the service's runtime)."""

    outputs: dict[str, Any]
    variant: str
    serving: Serving
    codec: Codec

    def pick(self, names: Iterable[str]) -> list[Any]:
        """The outputs ``names`` asks for, in its order; Refused (INVALID_ARGUMENT) for an unknown one."""
        names = list(names)
        unknown = [n for n in names if n not in self.outputs]
        if unknown:
            raise invalid(f"unknown output {unknown[0]!r} (outputs: {', '.join(self.outputs)})")
        return [self.outputs[n] for n in names]


def find(models: Models, name: str, version: str | None) -> Target:
    """The model ``name`` at ``version`` (None: the newest ready one), loaded; Refused if there is none."""
    service = models.lookup(name, version)
    serving = service.live.current
    if serving is None:
        attempt = service.live.last_attempt
        if attempt is not None and not attempt.ok and isinstance(models, Repository):
            raise Refused(Code.UNAVAILABLE, f"model {name!r} is unavailable: {attempt.error}")
        raise Refused(Code.UNAVAILABLE, "no model is loaded yet")
    return Target(service, serving)


async def infer(
    models: Models,
    name: str,
    version: str | None,
    *,
    decode: Callable[[Target], Awaitable[dict[str, Any]]],
    encode: Callable[[Result], Awaitable[Answer]],
    request: Request | None = None,
    grpc: bool = False,
) -> Answer:
    """One infer call of any protocol: find the model, ``decode`` the request into its inputs, run
    them (a queued call is dropped when ``request``'s client hangs up; gRPC's is cancelled with its
    task), ``encode`` the result, and count it as served (``grpc``: under gRPC's status codes). What
    any step raises is the caller's to answer through the exception policy (errors.py)."""
    start = time.perf_counter()
    target = find(models, name, version)
    inputs = await decode(target)
    outputs, variant, serving = await target.service.call(inputs, request)
    named = dict(zip(output_names(serving.model.manifest.output), flatten(outputs)))
    answer = await encode(Result(named, variant, serving, target.codec))
    target.service.count_served(serving, variant, inputs, start, grpc=grpc)
    return answer


def input_spec(where: str, name: str, datatype: Any, manifest: Manifest, seen: dict[str, Any]) -> InputSpec:
    """The manifest's input ``name`` that a request's ``where`` (``inputs[i]``) gives as ``datatype``;
    refused when the model has no such input, ``seen`` holds it already, or the datatype is not its."""
    spec = next((s for s in manifest.inputs if s.name == name), None)
    if spec is None:
        raise invalid(f"{where}: unknown input {name!r} (inputs: {', '.join(s.name for s in manifest.inputs)})")
    if name in seen:
        raise invalid(f"{where}: input {name!r} given twice")
    if datatype != DATATYPES[spec.dtype]:
        raise invalid(f"input {name!r}: datatype must be {DATATYPES[spec.dtype]}, got {datatype!r}")
    return spec


# --- metadata --------------------------------------------------------------------------------


def describe(models: Models, name: str, version: str | None) -> dict[str, Any]:
    """The model's metadata; without a ``version``, ``versions`` lists every one served. Runs one
    call of the model (see ``_outputs``): call it off the event loop."""
    target = find(models, name, version)
    serving, m = target.serving, target.manifest
    return {
        "name": serving.name,
        "versions": [str(serving.version)] if version is not None else models.versions(name),
        "platform": "precompile",
        "inputs": [
            {"name": spec.name, "datatype": DATATYPES[spec.dtype], "shape": [_dim_size(m, s) for s in spec.shape]}
            for spec in m.inputs
        ],
        "outputs": _outputs(serving, target.codec),
    }


def _dim_size(m: Manifest, s: str | int | None) -> int:
    if isinstance(s, int):
        return s
    r = m.dims.get(s) if s is not None else None
    return r.min if r is not None and r.min == r.max else -1


def _outputs(serving: Serving, codec: Codec) -> list[dict[str, Any]]:
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
