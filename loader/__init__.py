"""precompile's runtime: load an ahead-of-time compiled artifact and call it.

    import loader
    model = loader.load("artifacts/text-classifier")
    logits = model(ids, mask)

    model = loader.load_native("artifacts/text-classifier")   # numpy in and out, torch never imported
    logits = model(ids_array, mask_array)

This package imports torch, the standard library and nothing of the build side; it never compiles.
``import loader`` itself imports neither torch nor numpy: ``load`` and ``CompiledModel`` import torch
when first used, ``load_native`` only numpy; batching and hot swap (``Batcher``, ``Live``) serve either
loader's models and import torch only to load with ``load`` (``Live(path, load=loader.load_native)``
never does).
Reading a pack imports ``zstandard`` and checking a signature ``cryptography``, each only then.

Imported before torch, it sets how idle OpenMP threads wait (a spin of 0.1 ms, then sleep:
``OMP_WAIT_POLICY=ACTIVE GOMP_SPINCOUNT=10000``) unless the environment says otherwise
(see ``loader.threads``); before oneDNN's first use, the sizes of its kernel caches.
"""

from __future__ import annotations

import importlib
import os as _os
import sys as _sys
from typing import Any

from .threads import onednn_cache_env as _onednn_cache_env
from .threads import wait_env as _wait_env

# OpenMP reads its wait policy once, when torch loads it: before that, the policy that keeps a shared
# host fair (idle threads sleep, after a short spin, instead of spinning beside other work; `precompile
# serve` sets the same) can still be chosen. The user's own setting wins; after torch, load() warns instead.
if "torch" not in _sys.modules:
    _os.environ.update(_wait_env())
# oneDNN sizes its kernel caches at their first use; a dynamic variant needs more entries than its
# default keeps (loader.threads.onednn_cache_env).
_os.environ.update(_onednn_cache_env())

from .errors import ArtifactError, GuardError, IncompatibleArtifactError, LoaderError
from .manifest import Manifest, parse_manifest
from .trust import UntrustedArtifactError

__version__ = "0.1.0"

# name -> the module that defines it, imported on first use (PEP 562). The serving names come from
# loader.serving, which the core never imports (pyproject's import contract): a core vendored without
# it imports and loads as before.
_LAZY = {
    "Batcher": "serving.batch",
    "BatcherClosed": "serving.batch",
    "BatcherFull": "serving.batch",
    "CompiledModel": "model",
    "load": "model",
    "Live": "serving.live",
    "Serving": "serving.live",
    "SwapError": "serving.live",
    "TrafficFileError": "serving.traffic",
    "TrafficRecorder": "serving.traffic",
    "NativeModel": "native",
    "load_native": "native",
}


def __getattr__(name: str) -> Any:
    module = _LAZY.get(name)
    if module is None:  # a submodule not imported yet (`loader.model.open_package`), as before
        try:
            return importlib.import_module(f".{name}", __name__)
        except ModuleNotFoundError as e:
            if e.name != f"{__name__}.{name}":
                raise
            raise AttributeError(f"module 'loader' has no attribute {name!r}") from None
    value = getattr(importlib.import_module(f".{module}", __name__), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(_LAZY))


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
    "NativeModel",
    "Serving",
    "SwapError",
    "TrafficFileError",
    "TrafficRecorder",
    "UntrustedArtifactError",
    "load",
    "load_native",
    "parse_manifest",
]
