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

import json
import os
import zipfile
from dataclasses import dataclass

from .. import constants as C
from ..errors import ArtifactError

MODEL_DIR = f"data/aotinductor/{C.AOTI_MODEL_NAME}/"
# The shim call compiled code makes for every op it hands to the proxy executor.
PROXY_CALL = b"aoti_torch_proxy_executor_call_function"
MAX_METADATA_BYTES = 1 << 20


@dataclass(frozen=True)
class PackageLibrary:
    """What the torch-free loader needs to know about one package."""

    path: str  # the package
    library: str | None  # zip member of the compiled library; None: the package has none
    metadata: dict[str, str]
    extern_kernels: str | None  # zip member listing ops run by the proxy executor, if any

    def problem(self, *, library_bytes: bytes | None = None) -> str | None:
        """Why the torch-free loader cannot run this package, or None. ``library_bytes`` (the
        library's contents, when the caller has read them) lets it look for proxy-executor calls too."""
        if self.library is None:
            return "the package holds no compiled library (only sources, which torch's loader compiles)"
        device = self.metadata.get("AOTI_DEVICE_KEY", "")
        if device != "cpu":
            return f"it was compiled for {device or 'an unknown device'}; the torch-free loader runs CPU code"
        if self.extern_kernels is not None:
            return f"it runs ops that have no C shim through torch's proxy executor ({self.extern_kernels.rsplit('/', 1)[-1]})"
        if library_bytes is not None and PROXY_CALL in library_bytes:
            return "its compiled code calls torch's proxy executor (ops that have no C shim)"
        return None


def read_package(path: str | os.PathLike) -> PackageLibrary:
    """List the package at ``path``; ArtifactError if it is not a readable AOTInductor package."""
    path = str(path)
    try:
        with zipfile.ZipFile(path) as z:
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


def library_bytes(package: PackageLibrary) -> bytes:
    """The compiled library's contents (the loader checks and writes them where it can open them)."""
    try:
        with zipfile.ZipFile(package.path) as z:
            return z.read(package.library)
    except (OSError, zipfile.BadZipFile, KeyError) as e:
        raise ArtifactError(f"{package.path}: cannot read {package.library} ({e})") from None


def native_problem(path: str | os.PathLike) -> str | None:
    """Why the torch-free loader cannot run the package at ``path``, or None (the build's check)."""
    package = read_package(path)
    return package.problem(library_bytes=library_bytes(package) if package.library is not None else None)


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
