"""precompile's runtime: load an ahead-of-time compiled artifact and call it.

    import loader
    model = loader.load("artifacts/text-classifier")
    logits = model(ids, mask)

This package imports torch, the standard library and nothing of the build side; it never compiles.
Reading a pack imports ``zstandard`` and checking a signature ``cryptography``, each only then.

Imported before torch, it sets ``OMP_WAIT_POLICY=PASSIVE`` unless the environment says otherwise
(see ``loader.threads``).
"""

import os as _os
import sys as _sys

from .constants import WAIT_POLICY_ENV as _WAIT_POLICY_ENV

# OpenMP reads its wait policy once, when torch loads it: before that, the policy that keeps a shared
# host fair (idle threads sleep instead of spinning beside other work; `precompile serve` sets the
# same) can still be chosen. The user's own setting wins; after torch, load() warns instead.
if "torch" not in _sys.modules:
    _os.environ.setdefault(_WAIT_POLICY_ENV, "PASSIVE")

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
