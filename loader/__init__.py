"""precompile's runtime: load an ahead-of-time compiled artifact and call it.

    import loader
    model = loader.load("artifacts/text-classifier")
    logits = model(ids, mask)

This package imports torch, the standard library and nothing of the build side; it never compiles.
Reading a pack imports ``zstandard`` and checking a signature ``cryptography``, each only then.
"""

from .batch import Batcher, BatcherClosed, BatcherFull
from .errors import ArtifactError, GuardError, IncompatibleArtifactError, LoaderError
from .live import Live, Serving, SwapError
from .manifest import Manifest, parse_manifest
from .model import CompiledModel, load
from .traffic import TrafficFileError, TrafficRecorder
from .trust import UntrustedArtifactError

__version__ = "0.1.0"

__all__ = [
    "ArtifactError",
    "Batcher",
    "BatcherClosed",
    "BatcherFull",
    "CompiledModel",
    "GuardError",
    "IncompatibleArtifactError",
    "Live",
    "LoaderError",
    "Manifest",
    "Serving",
    "SwapError",
    "TrafficFileError",
    "TrafficRecorder",
    "UntrustedArtifactError",
    "load",
    "parse_manifest",
]
