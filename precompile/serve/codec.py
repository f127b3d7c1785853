"""Request bodies to arrays and outputs back, for ``POST /predict`` and the Open Inference Protocol;
the request's JSON Schema and size limit.

A predict request is ``{"inputs": {"ids": [[...]], "mask": [[...]]}}`` with the manifest's input
names; each value is a nested list (or a number, for a 0-d input) of the input's dtype. Values are
converted strictly: an integer input takes integers only (not 1.5, not true; 3.0 is 3), a bool input
takes true/false only, a float input takes finite numbers that fit its dtype (not NaN or Infinity,
not 1e39 for a float32, which would turn into infinity). Binary tensors (the protocol's extension)
are little-endian bytes of the input's dtype, refused on the same rules (finite floats, bools 0 or 1).
Names, shapes and ranges are left to the loader's guards, so the service and ``model(...)`` refuse the
same calls with the same words.

The rules are written once; the arrays they make are the served model's kind: a ``Codec`` for
numpy (``NUMPY``: the torch-free loader, ``--runtime native``; binary tensors are ``np.frombuffer``
views of the body where aligned) or torch tensors (``torch_codec()``, which imports torch). This
module imports neither until one is used.
"""

from __future__ import annotations

import functools
import json
import math
import sys
from typing import Any

from loader.constants import INTEGER_DTYPES
from loader.errors import first_line
from loader.manifest import Manifest


class BodyError(ValueError):
    """The request body is not a well-formed request (HTTP 422 on /predict and /v1, 400 on /v2)."""


class NotJSONObject(BodyError):
    """The body is not JSON, or not a JSON object: HTTP 400 on every route."""


# Bytes one value of each kind may take in a request, separator and a space included: an int64 has up
# to 20 characters, a float's shortest repr up to 24 ("-1.2345678901234567e-308").
_JSON_BYTES = {"bool": 7, "int": 22, "float": 26}
MAX_RANK = 32  # deeper nesting is refused before anything walks it recursively
MAX_SIZE = 2**31 - 1  # values in one input (and per dim): far beyond any body the limit lets in
_EXACT_FLOAT_INT = 2**53  # beyond, a float in the request may not be the integer the client wrote
MIN_BODY_BYTES = 1 << 20
MAX_DEFAULT_BODY_BYTES = 256 << 20

INT_RANGES = {
    "int64": (-(2**63), 2**63 - 1),
    "int32": (-(2**31), 2**31 - 1),
    "int16": (-(2**15), 2**15 - 1),
    "int8": (-128, 127),
    "uint8": (0, 255),
}
FLOAT_MAX = {  # the largest finite value of each floating dtype (torch.finfo(...).max)
    "float16": 65504.0,
    "bfloat16": 3.3895313892515355e38,
    "float32": 3.4028234663852886e38,
    "float64": 1.7976931348623157e308,
}
ITEM_BYTES = {
    **{"bool": 1, "uint8": 1, "int8": 1, "int16": 2, "int32": 4, "int64": 8},
    **{"float16": 2, "bfloat16": 2, "float32": 4, "float64": 8},
}


def kind(dtype: str) -> str:
    """ "bool", "int" or "float": how a manifest dtype's values are written in JSON."""
    if dtype == "bool":
        return "bool"
    return "int" if dtype in INTEGER_DTYPES else "float"


# --- decoding --------------------------------------------------------------------------------------


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


class Codec:
    """The rules above, making one kind of array. Subclasses give the few array operations."""

    name = ""

    # --- what a subclass gives ---

    def _nested(self, value: Any, dtype: str) -> Any:
        """An array of checked nested values: int64 for "int", bool for "bool", float64 for "float"
        (so a value too large for the input's dtype becomes infinity, refused after the cast)."""
        raise NotImplementedError

    def _cast(self, a: Any, dtype: str) -> Any:
        raise NotImplementedError

    def _finite(self, a: Any) -> bool:
        raise NotImplementedError

    def _from_bytes(self, binary: bytes, offset: int, count: int, dtype: str) -> Any:
        """``count`` little-endian values of ``dtype`` at ``offset``, as a 1-d array the call may use."""
        raise NotImplementedError

    def _bool_bytes_ok(self, a: Any) -> bool:
        raise NotImplementedError

    def _count(self, a: Any) -> int:
        """How many values ``a`` holds."""
        raise NotImplementedError

    def _reshape(self, a: Any, shape: list[int]) -> Any:
        return a.reshape(shape)

    def is_array(self, value: Any) -> bool:
        raise NotImplementedError

    def host(self, a: Any) -> Any:
        """An output as a contiguous array in CPU memory."""
        raise NotImplementedError

    def dtype_name(self, a: Any) -> str:
        """An array's dtype under the manifest's name (``float32``, ``int64``, ``bool``)."""
        raise NotImplementedError

    def tolist(self, a: Any) -> Any:
        return a.tolist()

    def little_endian_bytes(self, a: Any) -> bytes:
        raise NotImplementedError

    # --- the rules ---

    def inputs(self, inputs: dict[str, Any], manifest: Manifest) -> dict[str, Any]:
        """Convert each known input to an array of its manifest dtype; unknown names pass through
        unchanged for the guard to name them."""
        dtypes = {spec.name: spec.dtype for spec in manifest.inputs}
        out: dict[str, Any] = {}
        for name, value in inputs.items():
            dtype = dtypes.get(name)
            out[name] = value if dtype is None else self.array(name, value, dtype)
        return out

    def array(self, name: str, value: Any, dtype: str) -> Any:
        """A nested list (or a number) of JSON values as an array of ``dtype``; BodyError unless every
        value is one of that dtype (see the module docstring)."""
        if isinstance(value, (str, dict)) or value is None:
            raise BodyError(f"input {name!r}: expected a nested list of numbers, got {json_kind(value)}")
        kinds = _leaf_types(name, value)
        want = kind(dtype)
        if want == "bool":
            if not kinds <= {bool}:
                raise BodyError(f"input {name!r}: is bool, so its values must be true or false")
        elif want == "int":
            if not kinds <= {int, float}:  # bool is not int here: json gives True, not 1
                raise BodyError(f"input {name!r}: is {dtype}, so its values must be integers")
            if float in kinds:  # 3.0 is an integer to JSON (Schema); 3.5 is not, nor is 1e300
                value = _integral(name, value, dtype)
        elif bool in kinds:
            raise BodyError(f"input {name!r}: is {dtype}, so its values must be numbers, not true/false")
        try:
            a = self._nested(value, want)
        except (TypeError, ValueError, RuntimeError, OverflowError) as e:
            overflow = isinstance(e, OverflowError) or str(e).startswith("Overflow")
            detail = "Overflow: a value is beyond the int64 and float64 ranges" if overflow else first_line(e)
            raise BodyError(f"input {name!r}: not a rectangular nested list of numbers ({detail})") from None
        if want == "bool" or self._count(a) == 0:
            return self._cast(a, dtype)
        if want == "int":
            low, high = INT_RANGES[dtype]
            if dtype != "int64" and (int(a.min()) < low or int(a.max()) > high):
                raise BodyError(f"input {name!r}: values must lie in [{low}, {high}] for {dtype}")
            return self._cast(a, dtype)
        a = self._cast(a, dtype)
        self.check_finite(name, a, dtype)
        return a

    def check_finite(self, name: str, a: Any, dtype: str) -> None:
        """BodyError unless every value of a floating-point input is finite: the one rule for values sent
        as JSON (where a number too large for the dtype has become infinity) and as binary tensors."""
        if kind(dtype) == "float" and not self._finite(a):
            raise BodyError(
                f"input {name!r}: values must be finite numbers within {dtype}'s range "
                f"(±{FLOAT_MAX[dtype]:.4g}); NaN, Infinity and larger numbers are refused"
            )

    def shape_count(self, name: str, shape: Any) -> int:
        """How many values an input of the request's ``shape`` holds; BodyError unless ``shape`` is a
        list of at most MAX_RANK whole sizes whose non-zero ones multiply to at most MAX_SIZE. Checked
        before any array is made, so that an empty input of a huge shape (``[0, 2**31-1, 2**31-1]``,
        which numpy cannot make and torch can) is refused alike by both runtimes' codecs, the
        loader's guards naming the dim and its range for anything smaller."""
        if not isinstance(shape, list) or len(shape) > MAX_RANK or not all(type(s) is int and s >= 0 for s in shape):
            raise BodyError(f"input {name!r}: shape must be a list of at most {MAX_RANK} sizes, each 0 or more")
        extent = 1
        for s in shape:
            extent *= max(s, 1)
            if extent > MAX_SIZE:
                raise BodyError(
                    f"input {name!r}: shape {shape[:MAX_RANK]} is too large: its sizes multiply past {MAX_SIZE} "
                    "values (zero sizes left out)"
                )
        return math.prod(shape)

    def sized(self, name: str, data: Any, shape: list[int], count: int, dtype: str) -> Any:
        """An OIP input's JSON ``data`` (nested or flat, row-major) as an array of ``shape``."""
        if not isinstance(data, list):
            raise BodyError(f"input {name!r}: data must be a list (or use binary_data_size)")
        a = self.array(name, data, dtype)
        if self._count(a) != count:
            raise BodyError(f"input {name!r}: {self._count(a)} values for shape {shape}")
        return self._reshape(a, shape)

    def binary(
        self, name: str, binary: bytes, offset: int, size: Any, shape: list[int], count: int, dtype: str
    ) -> tuple[Any, int]:
        """An OIP input sent in binary: ``size`` bytes of ``binary`` from ``offset``, as an array of
        ``shape``; and the offset of the next input's bytes."""
        itemsize = ITEM_BYTES[dtype]
        if type(size) is not int or size != count * itemsize:
            raise BodyError(
                f"input {name!r}: binary_data_size {size!r} is not {count} × {itemsize} bytes for shape {shape}"
            )
        if offset + size > len(binary):
            raise BodyError(f"input {name!r}: binary_data_size {size} runs past the end of the body")
        a = self._from_bytes(binary, offset, count, dtype)
        if dtype == "bool" and not self._bool_bytes_ok(a):
            raise BodyError(f"input {name!r}: BOOL bytes must be 0 or 1")
        self.check_finite(name, a, dtype)  # the rule JSON values meet, so both routes refuse the same
        return self._reshape(a, shape), offset + size

    # --- encoding ---

    def to_json(self, outputs: Any) -> Any:
        """The model's outputs as nested lists, keeping the structure (tuples become lists)."""
        if self.is_array(outputs):
            return self.tolist(outputs)
        if isinstance(outputs, dict):
            return {k: self.to_json(v) for k, v in outputs.items()}
        if isinstance(outputs, (tuple, list)):
            return [self.to_json(v) for v in outputs]
        raise TypeError(f"unexpected output of type {type(outputs).__name__}")


class NumpyCodec(Codec):
    """numpy arrays, for the torch-free loader."""

    name = "numpy"

    def __init__(self) -> None:
        import numpy as np

        self.np = np
        self.little = sys.byteorder == "little"

    def _nested(self, value: Any, want: str) -> Any:
        np = self.np
        return np.array(value, dtype={"bool": np.bool_, "int": np.int64, "float": np.float64}[want])

    def _cast(self, a: Any, dtype: str) -> Any:
        np = self.np
        with np.errstate(over="ignore"):  # too large for the dtype: infinity, refused by check_finite
            return a.astype(dtype, copy=False)

    def _finite(self, a: Any) -> bool:
        return bool(self.np.isfinite(a).all())

    def _count(self, a: Any) -> int:
        return int(a.size)

    def _from_bytes(self, binary: bytes, offset: int, count: int, dtype: str) -> Any:
        np = self.np
        a = np.frombuffer(binary, dtype=np.dtype(dtype).newbyteorder("<"), count=count, offset=offset)
        if not self.little:
            return a.astype(np.dtype(dtype))  # the protocol's bytes are little-endian: a native copy
        if not a.flags.aligned:
            return a.copy()  # the guards take aligned arrays only; a view where the body allows
        return a  # a read-only view of the body: the compiled code reads its inputs only

    def _bool_bytes_ok(self, a: Any) -> bool:
        return bool((a.view(self.np.uint8) <= 1).all())

    def is_array(self, value: Any) -> bool:
        return isinstance(value, self.np.ndarray)

    def host(self, a: Any) -> Any:
        return self.np.ascontiguousarray(a)

    def dtype_name(self, a: Any) -> str:
        return a.dtype.name

    def little_endian_bytes(self, a: Any) -> bytes:
        a = self.np.ascontiguousarray(a)
        return (a if self.little else a.astype(a.dtype.newbyteorder("<"))).tobytes()


class TorchCodec(Codec):
    """torch tensors, for ``loader.load``."""

    name = "torch"

    def __init__(self) -> None:
        import numpy as np
        import torch

        from loader.guards import TORCH_DTYPES

        self.torch = torch
        self.np = np  # binary tensors are read and checked through numpy: a few µs where torch ops take tens
        self.dtypes = TORCH_DTYPES
        self.names = {v: k for k, v in TORCH_DTYPES.items()}

    def _nested(self, value: Any, want: str) -> Any:
        # Ints and bools inferred (int64, bool) to check their range; floats through float64.
        return self.torch.tensor(value, dtype=self.torch.float64 if want == "float" else None)

    def _cast(self, a: Any, dtype: str) -> Any:
        return a.to(self.dtypes[dtype])

    def _finite(self, a: Any) -> bool:
        if a.dtype is self.torch.bfloat16:  # numpy has no bfloat16
            return bool(self.torch.isfinite(a).all())
        return bool(self.np.isfinite(a.numpy()).all())

    def _count(self, a: Any) -> int:
        return a.numel()

    def _from_bytes(self, binary: bytes, offset: int, count: int, dtype: str) -> Any:
        torch, torch_dtype = self.torch, self.dtypes[dtype]
        if not count:
            return torch.empty(0, dtype=torch_dtype)
        if dtype != "bfloat16":  # a native-order copy the tensor owns, writable (the body is read-only)
            np = self.np
            a = np.frombuffer(binary, dtype=np.dtype(dtype).newbyteorder("<"), count=count, offset=offset)
            return torch.from_numpy(a.astype(np.dtype(dtype)))
        itemsize = ITEM_BYTES[dtype]
        raw = bytearray(binary[offset : offset + count * itemsize])  # a copy: the tensor must own writable memory
        t = torch.frombuffer(raw, dtype=torch_dtype)
        if sys.byteorder != "little":  # the protocol's bytes are little-endian
            t = t.view(torch.uint8).view(-1, itemsize).flip(1).contiguous().view(torch_dtype).view(-1)
        return t

    def _bool_bytes_ok(self, a: Any) -> bool:
        return bool((a.numpy().view(self.np.uint8) <= 1).all())

    def is_array(self, value: Any) -> bool:
        return isinstance(value, self.torch.Tensor)

    def host(self, a: Any) -> Any:
        return a.detach().cpu().contiguous()

    def dtype_name(self, a: Any) -> str:
        return self.names[a.dtype]

    def little_endian_bytes(self, a: Any) -> bytes:
        torch = self.torch
        raw = a.reshape(-1).view(torch.uint8) if a.numel() else torch.empty(0, dtype=torch.uint8)
        if sys.byteorder != "little" and a.element_size() > 1:
            raw = raw.view(-1, a.element_size()).flip(1).reshape(-1)
        return raw.numpy().tobytes()


RUNTIMES = ("native", "torch")


@functools.cache
def codec_for(runtime: str) -> Codec:
    """The codec of a runtime's arrays: numpy for ``native`` (torch never imported), else torch."""
    return NumpyCodec() if runtime == "native" else TorchCodec()


def _integral(name: str, value: Any, dtype: str) -> Any:
    """``value`` with its floats as ints, if each is a whole number a float holds exactly."""
    if type(value) is list:
        return [_integral(name, v, dtype) for v in value]
    if type(value) is float:
        if not (value.is_integer() and abs(value) <= _EXACT_FLOAT_INT):
            raise BodyError(f"input {name!r}: is {dtype}, so its values must be integers")
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
        total += count * _JSON_BYTES[kind(spec.dtype)]
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
    values = kind(spec.dtype)
    if values == "bool":
        schema: dict[str, Any] = {"type": "boolean"}
    elif values == "int":
        low, high = INT_RANGES[spec.dtype]
        schema = {"type": "integer", "minimum": low, "maximum": high}
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


def json_kind(value: Any) -> str:
    """How a JSON value is named in a refusal: "a string", "an object", "null", "list", "int"..."""
    return {str: "a string", dict: "an object", type(None): "null"}.get(type(value), type(value).__name__)
