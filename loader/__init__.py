"""precompile's runtime: load an ahead-of-time compiled artifact and call it.

    import loader
    model = loader.load("artifacts/text-classifier")
    logits = model(ids, mask)

This package imports torch, the standard library and nothing of the build side; it never compiles.
"""

from .errors import ArtifactError, GuardError, IncompatibleArtifactError, LoaderError
from .manifest import Manifest, parse_manifest
from .model import CompiledModel, load

__version__ = "0.1.0"

__all__ = [
    "ArtifactError",
    "CompiledModel",
    "GuardError",
    "IncompatibleArtifactError",
    "LoaderError",
    "Manifest",
    "load",
    "parse_manifest",
]
