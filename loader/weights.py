"""Safetensors reading, with a strictly validated header, from a buffer no one else can change.

Where the bytes live decides what a change to the file can do to a serving process. A mapped file that
is truncated while mapped kills the process with SIGBUS at the next call, and one rewritten in place
changes the weights under it (``MAP_PRIVATE`` only isolates pages already written to). So:

- ``read_private`` copies a file into anonymous memory, hashing it as it goes: what is served is
  what was hashed, and nothing done to the file afterwards reaches it. Used for artifact folders,
  which operators may overwrite while they are served.
- ``map_file`` maps a file, so processes share one copy in the page cache and loading reads nothing
  up front. Used only for cache entries: read-only files owned by this user, which nothing rewrites
  in place (``loader.stores.cache`` refuses a cache others can write).

The safetensors package is not used for reading because its tensors are copies; the format is simple
enough to validate here field by field (https://github.com/huggingface/safetensors#format). The
header is parsed without torch (``parse_header``: the torch-free loader hands the compiled code each
tensor's address and shape); ``MappedWeights.tensors`` makes torch views of it on first use.
"""

from __future__ import annotations

import ctypes
import hashlib
import json
import mmap
import os
import stat
import struct
import warnings
from dataclasses import dataclass
from functools import cached_property
from typing import Any

from . import constants as C
from .errors import ArtifactError

# safetensors dtype -> (the manifest's dtype name, bytes per element)
SAFETENSORS_DTYPES = {
    "F64": ("float64", 8),
    "F32": ("float32", 4),
    "F16": ("float16", 2),
    "BF16": ("bfloat16", 2),
    "I64": ("int64", 8),
    "I32": ("int32", 4),
    "I16": ("int16", 2),
    "I8": ("int8", 1),
    "U8": ("uint8", 1),
    "BOOL": ("bool", 1),
}


@dataclass(frozen=True)
class Stored:
    """Where one tensor lies in the file's buffer: ``nbytes`` bytes from ``offset``, C-contiguous."""

    dtype: str  # the manifest's name: float32, int64, ...
    shape: tuple[int, ...]
    offset: int  # from the start of the file (header included)
    nbytes: int


class MappedWeights:
    """The tensors of one safetensors file in ``buffer`` (default: ``read_private(path)``), which lives
    as long as this object: ``stored`` says where each lies, ``tensors`` gives torch views of them."""

    def __init__(self, path: str, *, buffer: mmap.mmap | None = None):
        self.path = path
        self._mmap = buffer if buffer is not None else read_private(path)
        self.stored = parse_header(self._mmap, len(self._mmap), path)

    @cached_property
    def address(self) -> int:
        """Where the buffer starts in memory (for the torch-free loader, which hands compiled code
        ``address + Stored.offset``); the buffer cannot be closed while this object lives."""
        self._pin = ctypes.c_char.from_buffer(self._mmap)
        return ctypes.addressof(self._pin)

    @cached_property
    def tensors(self) -> dict[str, Any]:
        """name -> torch tensor viewing the buffer (torch is imported here, by the torch loader only)."""
        import torch

        from .guards import TORCH_DTYPES

        tensors = {}
        for name, s in self.stored.items():
            dtype = TORCH_DTYPES[s.dtype]
            if s.nbytes == 0:
                tensors[name] = torch.empty(s.shape, dtype=dtype)
                continue
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")  # frombuffer warns about non-resizable buffers; harmless here
                flat = torch.frombuffer(self._mmap, dtype=dtype, count=s.nbytes // dtype.itemsize, offset=s.offset)
            tensors[name] = flat.view(s.shape)
        return tensors

    def __len__(self) -> int:
        return len(self.stored)

    def check(self, constants: dict[str, Any]) -> None:
        """Refuse a file that lacks a constant the manifest declares (``{name: ConstantSpec}``) or
        holds it in another dtype or shape."""
        for name, spec in constants.items():
            s = self.stored.get(name)
            if s is None:
                raise ArtifactError(f"{self.path}: constant {name!r} is missing")
            if s.dtype != spec.dtype or s.shape != tuple(spec.shape):
                raise ArtifactError(
                    f"{self.path}: constant {name!r} is {s.dtype} {s.shape}, the compiled code expects {spec.dtype} {spec.shape}"
                )


def map_file(path: str) -> mmap.mmap:
    """A copy-on-write map of ``path``: only for files nothing rewrites in place (see the module doc)."""
    try:
        with open(path, "rb") as f:
            size = _check_size(path, os.fstat(f.fileno()))
            return mmap.mmap(f.fileno(), size, access=mmap.ACCESS_COPY)
    except OSError as e:
        raise ArtifactError(f"{path}: cannot map weights ({e.strerror})") from None


def read_private(path: str, *, size: int | None = None, sha256: str | None = None) -> mmap.mmap:
    """``path``'s bytes in anonymous memory, checked against ``size`` and ``sha256`` when given.

    The hash is of the bytes copied, so a file changed during or after the read cannot be served
    unhashed. One pass over the file: about what hashing it alone costs (``verify_files``).
    """
    try:
        fd = os.open(path, os.O_RDONLY | getattr(os, "O_NOFOLLOW", 0) | getattr(os, "O_BINARY", 0))
    except OSError as e:
        raise ArtifactError(f"{path}: cannot read weights ({e.strerror})") from None
    with os.fdopen(fd, "rb", buffering=0) as f:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            raise ArtifactError(f"{path}: not a regular file")
        if size is not None and st.st_size != size:
            raise ArtifactError(f"{path}: is {st.st_size} bytes, the manifest says {size}")
        total = _check_size(path, st)
        buf = mmap.mmap(-1, total)
        view = memoryview(buf)
        digest = hashlib.sha256() if sha256 is not None else None
        done = 0
        try:
            while done < total:
                n = f.readinto(view[done : done + READ_CHUNK])
                if not n:
                    raise ArtifactError(f"{path}: shrank while it was being read; load it again")
                if digest is not None:
                    digest.update(view[done : done + n])
                done += n
        except OSError as e:
            raise ArtifactError(f"{path}: cannot read weights ({e.strerror})") from None
        finally:
            view.release()
    if digest is not None and digest.hexdigest() != sha256:
        raise ArtifactError(f"{path} does not match its sha256 in the manifest (changed or corrupt)")
    return buf


# Read and hash in blocks that stay in the CPU cache between the copy and the hash.
READ_CHUNK = 1 << 20


def _check_size(path: str, st: os.stat_result) -> int:
    if st.st_size < 8:
        raise ArtifactError(f"{path}: {st.st_size} bytes is too short for a safetensors file")
    return st.st_size


def parse_header(buf: mmap.mmap, size: int, path: str) -> dict[str, Stored]:
    """Validate the header of the safetensors file in ``buf`` and say where each tensor lies."""
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
    stored: dict[str, Stored] = {}
    for name, info in header.items():
        if name == "__metadata__":
            continue
        where = f"{path}: tensor {name!r}"
        if not isinstance(info, dict) or set(info) != {"dtype", "shape", "data_offsets"}:
            raise ArtifactError(f"{where}: entry must have exactly dtype, shape and data_offsets")
        known = SAFETENSORS_DTYPES.get(info["dtype"]) if isinstance(info["dtype"], str) else None
        if known is None:
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
        dtype, itemsize = known
        nbytes = numel * itemsize
        if not 0 <= begin <= end <= data_len:
            raise ArtifactError(f"{where}: data_offsets [{begin}, {end}] lie outside the {data_len} data bytes")
        if end - begin != nbytes:
            raise ArtifactError(f"{where}: data_offsets span {end - begin} bytes but shape {shape} needs {nbytes}")
        if begin % itemsize:
            raise ArtifactError(f"{where}: offset {begin} is not aligned to {itemsize} bytes")
        spans.append((begin, end, name))
        stored[name] = Stored(dtype, tuple(shape), data_start + begin, nbytes)
    spans.sort()
    for (_, e0, n0), (b1, _, n1) in zip(spans, spans[1:]):
        if b1 < e0:
            raise ArtifactError(f"{path}: tensors {n0!r} and {n1!r} overlap")
    return stored
