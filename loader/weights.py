"""Memory-mapped safetensors reading, with a strictly validated header.

The file is mapped copy-on-write (``MAP_PRIVATE``): tensors are views of the page cache, so several
serving processes share one copy of the weights and loading costs no reads up front. The safetensors
package is not used for reading because its tensors are copies; the format is simple enough to
validate here field by field (https://github.com/huggingface/safetensors#format).
"""

from __future__ import annotations

import json
import mmap
import os
import struct
import warnings

import torch

from . import constants as C
from .errors import ArtifactError

SAFETENSORS_DTYPES = {
    "F64": torch.float64,
    "F32": torch.float32,
    "F16": torch.float16,
    "BF16": torch.bfloat16,
    "I64": torch.int64,
    "I32": torch.int32,
    "I16": torch.int16,
    "I8": torch.int8,
    "U8": torch.uint8,
    "BOOL": torch.bool,
}


class MappedWeights:
    """The tensors of one safetensors file, as views of a private memory map."""

    def __init__(self, path: str):
        self.path = path
        try:
            with open(path, "rb") as f:
                size = os.fstat(f.fileno()).st_size
                if size < 8:
                    raise ArtifactError(f"{path}: {size} bytes is too short for a safetensors file")
                self._mmap = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_COPY)
        except OSError as e:
            raise ArtifactError(f"{path}: cannot map weights ({e.strerror})") from None
        self.tensors = _parse(self._mmap, size, path)

    def __len__(self) -> int:
        return len(self.tensors)


def _parse(buf: mmap.mmap, size: int, path: str) -> dict[str, torch.Tensor]:
    (header_len,) = struct.unpack("<Q", buf[:8])
    if header_len > C.MAX_SAFETENSORS_HEADER_BYTES:
        raise ArtifactError(f"{path}: header of {header_len} bytes is larger than allowed")
    if 8 + header_len > size:
        raise ArtifactError(f"{path}: header of {header_len} bytes runs past the end of the file ({size} bytes)")
    try:
        header = json.loads(bytes(buf[8 : 8 + header_len]))
    except (ValueError, RecursionError) as e:
        raise ArtifactError(f"{path}: header is not valid JSON ({e})") from None
    if not isinstance(header, dict):
        raise ArtifactError(f"{path}: header is not a JSON object")
    data_start = 8 + header_len
    data_len = size - data_start
    spans = []
    tensors: dict[str, torch.Tensor] = {}
    for name, info in header.items():
        if name == "__metadata__":
            continue
        where = f"{path}: tensor {name!r}"
        if not isinstance(info, dict) or set(info) != {"dtype", "shape", "data_offsets"}:
            raise ArtifactError(f"{where}: entry must have exactly dtype, shape and data_offsets")
        dtype = SAFETENSORS_DTYPES.get(info["dtype"]) if isinstance(info["dtype"], str) else None
        if dtype is None:
            raise ArtifactError(f"{where}: unsupported dtype {info['dtype']!r}")
        shape, offsets = info["shape"], info["data_offsets"]
        if not isinstance(shape, list) or not all(type(s) is int and 0 <= s < 2**40 for s in shape):
            raise ArtifactError(f"{where}: shape {shape!r} is not a list of sizes")
        if not isinstance(offsets, list) or len(offsets) != 2 or not all(type(o) is int for o in offsets):
            raise ArtifactError(f"{where}: data_offsets {offsets!r} is not [begin, end]")
        begin, end = offsets
        numel = 1
        for s in shape:
            numel *= s
        nbytes = numel * dtype.itemsize
        if not 0 <= begin <= end <= data_len:
            raise ArtifactError(f"{where}: data_offsets [{begin}, {end}] lie outside the {data_len} data bytes")
        if end - begin != nbytes:
            raise ArtifactError(f"{where}: data_offsets span {end - begin} bytes but shape {shape} needs {nbytes}")
        if begin % dtype.itemsize:
            raise ArtifactError(f"{where}: offset {begin} is not aligned to {dtype.itemsize} bytes")
        spans.append((begin, end, name))
        if numel == 0:
            tensors[name] = torch.empty(shape, dtype=dtype)
            continue
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # frombuffer warns about non-resizable buffers; harmless here
            flat = torch.frombuffer(buf, dtype=dtype, count=numel, offset=data_start + begin)
        tensors[name] = flat.view(shape)
    spans.sort()
    for (b0, e0, n0), (b1, e1, n1) in zip(spans, spans[1:]):
        if b1 < e0:
            raise ArtifactError(f"{path}: tensors {n0!r} and {n1!r} overlap")
    return tensors
