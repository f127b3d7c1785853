"""JSON to tensors and back, for ``POST /predict``.

A request is ``{"inputs": {"ids": [[...]], "mask": [[...]]}}`` with the manifest's input names; each
value is a nested list (or a number, for a 0-d input) of the input's dtype. Values are converted
strictly: an integer input takes integers only (1.5 is not silently truncated), a bool input takes
true/false only, a float input takes numbers. Names, shapes and ranges are left to the loader's
guards, so the service and ``model(...)`` refuse the same calls with the same words.
"""

from __future__ import annotations

import json
from typing import Any

import torch

from loader.guards import TORCH_DTYPES
from loader.manifest import Manifest


class BodyError(ValueError):
    """The request body is not a well-formed predict request (HTTP 422)."""


_INT_DTYPES = {torch.int64, torch.int32, torch.int16, torch.int8, torch.uint8}


def parse_body(body: bytes) -> dict[str, Any]:
    """The ``inputs`` object of a predict request, or BodyError saying what is wrong."""
    try:
        data = json.loads(body)
    except (ValueError, RecursionError) as e:
        raise BodyError(f"the body is not valid JSON ({e})") from None
    if not isinstance(data, dict) or set(data) != {"inputs"}:
        raise BodyError('expected a JSON object {"inputs": {"<input name>": [...], ...}}')
    inputs = data["inputs"]
    if not isinstance(inputs, dict):
        raise BodyError('"inputs" must be an object mapping input names to nested lists')
    return inputs


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
        raise BodyError(f"input {name!r}: expected a nested list of numbers, got {_json_kind(value)}")
    try:
        # Inferred first (ints stay int64, floats float32, bools bool) to refuse lossy conversions.
        t = torch.tensor(value)
    except (TypeError, ValueError, RuntimeError, OverflowError) as e:
        raise BodyError(f"input {name!r}: not a rectangular nested list of numbers ({_first_line(e)})") from None
    if t.numel() == 0:
        return t.to(dtype)
    if dtype is torch.bool:
        if t.dtype is not torch.bool:
            raise BodyError(f"input {name!r}: is bool, so its values must be true or false")
        return t
    if dtype in _INT_DTYPES:
        if t.dtype is not torch.int64:
            raise BodyError(f"input {name!r}: is {_dt(dtype)}, so its values must be integers")
        info = torch.iinfo(dtype)
        if dtype is not torch.int64 and (int(t.min()) < info.min or int(t.max()) > info.max):
            raise BodyError(f"input {name!r}: values must lie in [{info.min}, {info.max}] for {_dt(dtype)}")
        return t.to(dtype)
    if t.dtype is torch.bool:
        raise BodyError(f"input {name!r}: is {_dt(dtype)}, so its values must be numbers, not true/false")
    if dtype is torch.float64:
        return torch.tensor(value, dtype=torch.float64)  # again, without the float32 detour
    return t.to(dtype)


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


def _json_kind(value: Any) -> str:
    return {str: "a string", dict: "an object", type(None): "null"}.get(type(value), type(value).__name__)


def _dt(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def _first_line(e: BaseException) -> str:
    text = str(e).strip()
    return text.splitlines()[0] if text else type(e).__name__
