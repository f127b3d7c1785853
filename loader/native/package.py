"""An AOTInductor package (a variant's ``.pt2``, a zip) read without torch: its compiled library, the
metadata AOTInductor wrote beside it, and whether the library's C interface alone can run it.

Inside the package, ``<archive>/data/aotinductor/model/`` holds ``<name>.so`` (the compiled model),
``<name>_metadata.json`` (AOTI_DEVICE_KEY, AOTI_CPU_ISA, ...) and, when the graph has ops without a
C shim, ``<name>.json``: the extern kernels torch's proxy executor runs through the dispatcher, which
the torch-free path cannot provide (torch's own runner looks for that file by the same name). The
build records the verdict in the manifest (``Variant.needs_torch``, via ``precompile.native_check``),
and the torch-free loader checks again before it opens a package.
"""

from __future__ import annotations

import hashlib
import json
import os
import struct
import zipfile
import zlib
from dataclasses import dataclass
from typing import BinaryIO

from .. import constants as C
from ..errors import ArtifactError

MODEL_DIR = f"data/aotinductor/{C.AOTI_MODEL_NAME}/"
# The shim call compiled code makes for every op it hands to the proxy executor.
PROXY_CALL = b"aoti_torch_proxy_executor_call_function"
MAX_METADATA_BYTES = 1 << 20
NOFOLLOW = getattr(os, "O_NOFOLLOW", 0)


@dataclass(frozen=True)
class PackageLibrary:
    """What the torch-free loader needs to know about one package."""

    path: str  # the package
    library: str | None  # zip member of the compiled library; None: the package has none
    metadata: dict[str, str]
    extern_kernels: str | None  # zip member listing ops run by the proxy executor, if any

    def problem(self, *, proxy_calls: bool = False) -> str | None:
        """Why the torch-free loader cannot run this package, or None. ``proxy_calls``: the library's
        contents were read (``extract_library``) and call torch's proxy executor."""
        if self.library is None:
            return "the package holds no compiled library (only sources, which torch's loader compiles)"
        device = self.metadata.get("AOTI_DEVICE_KEY", "")
        if device != "cpu":
            return f"it was compiled for {device or 'an unknown device'}; the torch-free loader runs CPU code"
        if self.extern_kernels is not None:
            return f"it runs ops that have no C shim through torch's proxy executor ({self.extern_kernels.rsplit('/', 1)[-1]})"
        if proxy_calls:
            return "its compiled code calls torch's proxy executor (ops that have no C shim)"
        return None


def read_package(path: str | os.PathLike, *, source: str | os.PathLike | None = None) -> PackageLibrary:
    """List the package at ``path`` (read from ``source`` if given); ArtifactError if it is not a
    readable AOTInductor package."""
    path = str(path)
    try:
        with zipfile.ZipFile(source if source is not None else path) as z:
            names = z.namelist()
            libraries = [n for n in names if _in_model_dir(n) and n.endswith(".so")]
            if len(libraries) > 1:
                raise ArtifactError(f"{path}: holds {len(libraries)} compiled libraries, expected one")
            if not libraries:
                return PackageLibrary(path, None, {}, None)
            stem = libraries[0][: -len(".so")]
            metadata = _metadata(z, stem + "_metadata.json", path) if stem + "_metadata.json" in names else {}
            extern = stem + ".json" if stem + ".json" in names else None
            return PackageLibrary(path, libraries[0], metadata, extern)
    except (OSError, zipfile.BadZipFile) as e:
        raise ArtifactError(f"{path}: not a readable AOTInductor package ({e})") from None


def extract_library(
    package: PackageLibrary,
    out: BinaryIO | None,
    *,
    size: int | None = None,
    sha256: str | None = None,
    source: str | os.PathLike | None = None,
) -> bool:
    """Copy the package's compiled library into ``out`` (None: only look at it), reading the package
    once, start to end; return whether the library calls torch's proxy executor.

    With ``sha256``, the whole package is hashed as it is read, and ArtifactError raised unless it
    matches: the bytes written are bytes that were hashed. The zip directory and local header that
    said where the library lies are compared with the hashed bytes too, so a package changed between
    the look at its directory and the read is refused, never run. One pass where a hash pass and a
    copy pass were, and no copy of the library in Python's memory. ``source``: where to read the
    package from, if not ``package.path`` (a ``HeldFile``'s path).
    """
    path = package.path
    try:
        # A HeldFile's path is a link to the file it holds (opened without following links itself).
        fd = os.open(source, os.O_RDONLY) if source is not None else os.open(path, os.O_RDONLY | NOFOLLOW)
    except OSError as e:
        raise ArtifactError(f"{path}: cannot read ({e.strerror})") from None
    with os.fdopen(fd, "rb", buffering=0) as f:
        total = os.fstat(fd).st_size
        if size is not None and total != size:
            raise ArtifactError(f"{path}: is {total} bytes, the manifest says {size}")
        begin, end, deflated, watched = _locate(f, package, total)
        digest = hashlib.sha256() if sha256 is not None else None
        inflate = zlib.decompressobj(-zlib.MAX_WBITS) if deflated else None
        found, tail, done = False, b"", 0
        f.seek(0)
        try:
            while done < total:
                block = f.read(min(READ_CHUNK, total - done))
                if not block:
                    raise ArtifactError(f"{path}: shrank while it was being read; load it again")
                if digest is not None:
                    digest.update(block)
                for start, expected in watched:  # what the directory said must be what is hashed
                    lo, hi = max(start, done), min(start + len(expected), done + len(block))
                    if lo < hi and block[lo - done : hi - done] != expected[lo - start : hi - start]:
                        raise ArtifactError(f"{path}: changed while it was being read; load it again")
                lo, hi = max(begin, done), min(end, done + len(block))
                if lo < hi:
                    data = block[lo - done : hi - done]
                    if inflate is not None:
                        data = inflate.decompress(data)
                    found = found or PROXY_CALL in tail + data[: len(PROXY_CALL)] or PROXY_CALL in data
                    tail = data[-(len(PROXY_CALL) - 1) :]
                    if out is not None:
                        out.write(data)
                done += len(block)
        except OSError as e:
            raise ArtifactError(f"{path}: cannot read ({e.strerror})") from None
        except zlib.error as e:
            raise ArtifactError(f"{path}: {package.library} is not valid deflate data ({e})") from None
    if digest is not None and digest.hexdigest() != sha256:
        raise ArtifactError(f"{path} does not match its sha256 in the manifest (changed or corrupt)")
    return found


# Read and hash in blocks that stay in the CPU cache between the hash and the copy.
READ_CHUNK = 1 << 20
LOCAL_HEADER = struct.Struct("<4s22xHH")  # signature, (versions, flags, sizes...), name and extra lengths
LOCAL_SIGNATURE = b"PK\x03\x04"
MAX_DIRECTORY_BYTES = 16 << 20


def _locate(f: BinaryIO, package: PackageLibrary, total: int) -> tuple[int, int, bool, list[tuple[int, bytes]]]:
    """Where the library's data lies in the package ([begin, end)), whether it is deflated, and the
    byte ranges that say so (its local header, the central directory to the end), as read now."""
    path = package.path
    try:
        with zipfile.ZipFile(f) as z:
            info = z.getinfo(package.library)
            directory = z.start_dir
        if info.compress_type not in (zipfile.ZIP_STORED, zipfile.ZIP_DEFLATED):
            raise ArtifactError(f"{path}: {package.library} is compressed with method {info.compress_type}")
        f.seek(info.header_offset)
        header = f.read(LOCAL_HEADER.size)
        if len(header) != LOCAL_HEADER.size or header[:4] != LOCAL_SIGNATURE:
            raise ArtifactError(f"{path}: {package.library} has no valid local header")
        _, name_length, extra_length = LOCAL_HEADER.unpack(header)
        begin = info.header_offset + LOCAL_HEADER.size + name_length + extra_length
        end = begin + info.compress_size
        if not end <= directory <= total or total - directory > MAX_DIRECTORY_BYTES:
            raise ArtifactError(f"{path}: {package.library} or the zip directory lies outside the package")
        f.seek(info.header_offset)
        local = f.read(begin - info.header_offset)
        f.seek(directory)
        central = f.read(total - directory)
    except (OSError, zipfile.BadZipFile, KeyError) as e:
        raise ArtifactError(f"{path}: cannot read {package.library} ({e})") from None
    return begin, end, info.compress_type == zipfile.ZIP_DEFLATED, [(info.header_offset, local), (directory, central)]


def native_problem(path: str | os.PathLike) -> str | None:
    """Why the torch-free loader cannot run the package at ``path``, or None (the build's check)."""
    package = read_package(path)
    return package.problem(proxy_calls=package.library is not None and extract_library(package, None))


def _in_model_dir(name: str) -> bool:
    # Members sit under the archive's own folder (``<id>.full/data/aotinductor/model/...``) or at the root.
    return name.startswith(MODEL_DIR) or f"/{MODEL_DIR}" in name


def _metadata(z: zipfile.ZipFile, member: str, path: str) -> dict[str, str]:
    info = z.getinfo(member)
    if info.file_size > MAX_METADATA_BYTES:
        raise ArtifactError(f"{path}: {member} is larger than {MAX_METADATA_BYTES} bytes")
    try:
        data = json.loads(z.read(member))
    except ValueError as e:
        raise ArtifactError(f"{path}: {member} is not valid JSON ({e})") from None
    if not isinstance(data, dict):
        raise ArtifactError(f"{path}: {member} is not a JSON object")
    return {str(k): str(v) for k, v in data.items()}
