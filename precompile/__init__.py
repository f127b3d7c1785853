"""precompile: plan, export and compile PyTorch models ahead of time into loadable artifacts.

The build from code is one call, the one ``precompile build`` makes::

    import precompile

    result = precompile.build("profiles/tagger.yaml", "artifacts/tagger")     # a profile file
    result = precompile.build({"name": "tagger", "inputs": ..., "dims": ...},  # a dict (or a Profile)
                              "artifacts/tagger", program=torch.export.export(model, args, dynamic_shapes=...))
    result.path, result.manifest, result.check.max_abs_error

``program`` (an ``ExportedProgram`` or a ``.pt2`` file from ``torch.export.save``) replaces the
profile's model factory. ``import precompile`` itself imports nothing heavy: ``build`` (and torch with
it) is imported on first use.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from .version import __version__

__all__ = ["__version__", "build"]

if TYPE_CHECKING:
    from .pipeline import build


def __getattr__(name: str) -> Any:
    if name == "build":
        from .pipeline import build  # the build side: torch, pydantic, Inductor, only when asked for

        return build
    raise AttributeError(f"module 'precompile' has no attribute {name!r}")
