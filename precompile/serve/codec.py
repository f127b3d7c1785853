"""JSON to tensors and back, for ``POST /predict``; the request's JSON Schema and size limit.

A request is ``{"inputs": {"ids": [[...]], "mask": [[...]]}}`` with the manifest's input names; each
value is a nested list (or a number, for a 0-d input) of the input's dtype. Values are converted
strictly: an integer input takes integers only (not 1.5, not true; 3.0 is 3), a bool input takes true/false
only, a float input takes finite numbers that fit its dtype (not NaN or Infinity, not 1e39 for a
float32, which would turn into infinity). Names, shapes and ranges are left to the loader's guards,
so the service and ``model(...)`` refuse the same calls with the same words.
"""

from __future__ import annotations

import json
from typing import Any

import torch

from loader.errors import first_line
from loader.guards import TORCH_DTYPES
from loader.manifest import Manifest


class BodyError(ValueError):
    """The request body is not a well-formed request (HTTP 422 on /predict and /v1, 400 on /v2)."""


class NotJSONObject(BodyError):
    """The body is not JSON, or not a JSON object: HTTP 400 on every route."""


_INT_DTYPES = {torch.int64, torch.int32, torch.int16, torch.int8, torch.uint8}

# Bytes one value of each kind may take in a request, separator and a space included: an int64 has up
# to 20 characters, a float's shortest repr up to 24 ("-1.2345678901234567e-308").
_JSON_BYTES = {"bool": 7, "int": 22, "float": 26}
MAX_RANK = 32  # deeper nesting is refused before anything walks it recursively
_EXACT_FLOAT_INT = 2**53  # beyond, a float in the request may not be the integer the client wrote
MIN_BODY_BYTES = 1 << 20
MAX_DEFAULT_BODY_BYTES = 256 << 20


def parse_body(body: bytes) -> dict[str, Any]:
    """The ``inputs`` object of a predict request, or BodyError saying what is wrong."""
    data = parse_object(body, 'expected a JSON object {"inputs": {"<input name>": [...], ...}}')
    if set(data) != {"inputs"}:
        raise BodyError('expected a JSON object {"inputs": {"<input name>": [...], ...}}')
    inputs = data["inputs"]
    if not isinstance(inputs, dict):
        raise BodyError('"inputs" must be an object mapping input names to nested lists')
    return inputs


def parse_json(body: bytes) -> Any:
    """The JSON document in ``body``; NotJSONObject when it is not one."""
    try:
        return json.loads(body)
    except (ValueError, RecursionError) as e:
        raise NotJSONObject(f"the body is not valid JSON ({e})") from None


def parse_object(body: bytes, expected: str) -> dict[str, Any]:
    """The JSON object in ``body``; NotJSONObject saying ``expected`` when it is JSON of another kind."""
    data = parse_json(body)
    if not isinstance(data, dict):
        raise NotJSONObject(f"{expected}, got {json_kind(data)}")
    return data


def to_tensors(inputs: dict[str, Any], manifest: Manifest) -> dict[str, Any]:
    """Convert each known input to a tensor of its manifest dtype; unknown names pass through
    unchanged for the guard to name them."""
    dtypes = {spec.name: TORCH_DTYPES[spec.dtype] for spec in manifest.inputs}
    out: dict[str, Any] = {}
    for name, value in inputs.items():
        dtype = dtypes.get(name)
        out[name] = value if dtype is None else to_tensor(name, value, dtype)
    return out


def to_tensor(name: str, value: Any, dtype: torch.dtype) -> torch.Tensor:
    if isinstance(value, (str, dict)) or value is None:
        raise BodyError(f"input {name!r}: expected a nested list of numbers, got {json_kind(value)}")
    kinds = _leaf_types(name, value)
    if dtype is torch.bool:
        if not kinds <= {bool}:
            raise BodyError(f"input {name!r}: is bool, so its values must be true or false")
    elif dtype in _INT_DTYPES:
        if not kinds <= {int, float}:  # bool is not int here: json gives True, not 1
            raise BodyError(f"input {name!r}: is {_dt(dtype)}, so its values must be integers")
        if float in kinds:  # 3.0 is an integer to JSON (Schema); 3.5 is not, nor is 1e300
            value = _integral(name, value, dtype)
    elif bool in kinds:
        raise BodyError(f"input {name!r}: is {_dt(dtype)}, so its values must be numbers, not true/false")
    try:
        # Ints and bools inferred (int64, bool) to check their range below; floats through float64,
        # so a value too large for the input's dtype becomes infinity and is refused below.
        t = torch.tensor(value, dtype=torch.float64 if dtype.is_floating_point else None)
    except (TypeError, ValueError, RuntimeError, OverflowError) as e:
        raise BodyError(f"input {name!r}: not a rectangular nested list of numbers ({first_line(e)})") from None
    if t.numel() == 0:
        return t.to(dtype)
    if dtype is torch.bool:
        return t
    if dtype in _INT_DTYPES:
        info = torch.iinfo(dtype)
        if dtype is not torch.int64 and (int(t.min()) < info.min or int(t.max()) > info.max):
            raise BodyError(f"input {name!r}: values must lie in [{info.min}, {info.max}] for {_dt(dtype)}")
        return t.to(dtype)
    t = t.to(dtype)
    check_finite(name, t)
    return t


def check_finite(name: str, t: torch.Tensor) -> None:
    """BodyError unless every value of a floating-point input is finite: the one rule for values sent
    as JSON (where a number too large for the dtype has become infinity) and as binary tensors."""
    if t.dtype.is_floating_point and not bool(torch.isfinite(t).all()):
        raise BodyError(
            f"input {name!r}: values must be finite numbers within {_dt(t.dtype)}'s range "
            f"(±{torch.finfo(t.dtype).max:.4g}); NaN, Infinity and larger numbers are refused"
        )


def _integral(name: str, value: Any, dtype: torch.dtype) -> Any:
    """``value`` with its floats as ints, if each is a whole number a float holds exactly."""
    if type(value) is list:
        return [_integral(name, v, dtype) for v in value]
    if type(value) is float:
        if not (value.is_integer() and abs(value) <= _EXACT_FLOAT_INT):
            raise BodyError(f"input {name!r}: is {_dt(dtype)}, so its values must be integers")
        return int(value)
    return value


def _leaf_types(name: str, value: Any) -> set[type]:
    """The Python types of the non-list values in a nested list, level by level (no recursion)."""
    kinds: set[type] = set()
    level = [value]
    for _depth in range(MAX_RANK + 2):
        if not level:
            return kinds
        deeper = []
        for v in level:
            if type(v) is list:
                deeper.extend(v)
            else:
                kinds.add(type(v))
        level = deeper
    raise BodyError(f"input {name!r}: nested more than {MAX_RANK} lists deep")


def to_json(outputs: Any) -> Any:
    """The model's outputs as nested lists, keeping the structure (tuples become lists)."""
    if isinstance(outputs, torch.Tensor):
        return outputs.tolist()
    if isinstance(outputs, dict):
        return {k: to_json(v) for k, v in outputs.items()}
    if isinstance(outputs, (tuple, list)):
        return [to_json(v) for v in outputs]
    raise TypeError(f"unexpected output of type {type(outputs).__name__}")


def dumps(data: Any) -> bytes:
    """Strict JSON; ValueError for NaN or infinity, which JSON cannot carry."""
    return json.dumps(data, separators=(",", ":"), allow_nan=False).encode()


def body_limit(manifest: Manifest) -> int:
    """The default body limit: the JSON size of the largest call within the manifest's dim ranges
    (every value at its longest), at least ``MIN_BODY_BYTES``, at most ``MAX_DEFAULT_BODY_BYTES``.
    Calls a ``split`` policy serves above the range need ``--max-body-bytes``."""
    total = 0
    for spec in manifest.inputs:
        count = 1
        for s in spec.shape:
            count *= manifest.dims[s].max if isinstance(s, str) else s
        total += count * _JSON_BYTES[_kind(TORCH_DTYPES[spec.dtype])]
    return min(max(total + 4096, MIN_BODY_BYTES), MAX_DEFAULT_BODY_BYTES)


def request_schema(manifest: Manifest | None) -> dict[str, Any]:
    """The JSON Schema of a predict request for ``manifest`` (input names, nesting, sizes within the
    dim ranges, value types), or of any predict request when no artifact is loaded yet."""
    if manifest is None:
        inputs: dict[str, Any] = {"type": "object"}
    else:
        props = {spec.name: _input_schema(spec, manifest) for spec in manifest.inputs}
        inputs = {"type": "object", "properties": props, "required": list(props), "additionalProperties": False}
    return {"type": "object", "properties": {"inputs": inputs}, "required": ["inputs"], "additionalProperties": False}


def _input_schema(spec, manifest: Manifest) -> dict[str, Any]:
    dtype = TORCH_DTYPES[spec.dtype]
    kind = _kind(dtype)
    if kind == "bool":
        schema: dict[str, Any] = {"type": "boolean"}
    elif kind == "int":
        info = torch.iinfo(dtype)
        schema = {"type": "integer", "minimum": info.min, "maximum": info.max}
    else:
        schema = {"type": "number"}
    for s in reversed(spec.shape):
        if isinstance(s, str):
            r, policy = manifest.dims[s], manifest.policy.get(s, "error")
            sizes = {"minItems": 1 if policy == "pad" else r.min}
            if policy != "split":
                sizes["maxItems"] = r.max
        else:
            sizes = {"minItems": s, "maxItems": s}
        schema = {"type": "array", "items": schema, **sizes}
    return schema


def _kind(dtype: torch.dtype) -> str:
    if dtype is torch.bool:
        return "bool"
    return "float" if dtype.is_floating_point else "int"


def json_kind(value: Any) -> str:
    """How a JSON value is named in a refusal: "a string", "an object", "null", "list", "int"..."""
    return {str: "a string", dict: "an object", type(None): "null"}.get(type(value), type(value).__name__)


def _dt(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")
