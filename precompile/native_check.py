"""Whether the torch-free loader (``loader.load_native``) can run a compiled variant, decided at build
time and recorded in the manifest (``Variant.needs_torch``), so an artifact that needs torch says so
before any serving host finds out.

A CPU package can be served from its C interface alone unless its graph has ops without a C shim
(extern kernels, run through torch's proxy executor) or it was compiled for another device; the
package is inspected by the loader's own reader (``loader.native.package``), which the torch-free
loader runs again when it opens the package.
"""

from __future__ import annotations

from pathlib import Path

from loader.native.package import native_problem


def needs_torch(package: Path, device: str) -> str | None:
    """Why only the torch loader can run the compiled ``package``, or None. CUDA variants always
    need it (the torch-free loader runs CPU code), so they are not inspected."""
    if device != "cpu":
        return None  # recorded by the device itself: the torch-free loader never opens a CUDA variant
    return native_problem(package)
