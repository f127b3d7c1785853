"""The loader's exceptions. Every failure a caller can cause or a file can contain is one of these."""

from __future__ import annotations

import importlib
from types import ModuleType


class LoaderError(Exception):
    """Base of every error the loader raises on purpose."""


class ArtifactError(LoaderError):
    """The artifact is missing, unreadable, of an unknown format, or does not match its manifest."""


class IncompatibleArtifactError(ArtifactError):
    """The artifact is valid but was built for another host (torch version, device, CPU)."""


class GuardError(LoaderError, ValueError):
    """A call's inputs do not fit what the compiled code was built for.

    ``reason`` names the kind of problem in one word, for metrics and callers that branch on it:
    missing_input, too_many_inputs, unknown_input, duplicate_input, not_a_tensor, tensor_subclass,
    nested, layout, meta, quantized, neg_view, conj_view, dtype, device, rank, static_size, out_of_range,
    dim_mismatch, not_contiguous, no_storage, value_range, no_variant, policy; and for numpy arrays
    (``loader.load_native``) not_aligned.
    """

    def __init__(self, message: str, reason: str = "other"):
        super().__init__(message)
        self.reason = reason

    def __reduce__(self):
        return (GuardError, (str(self), self.reason))


class InsecurePathError(LoaderError):
    """A cache or state folder, or a file in one, that another user owns or that group or others can
    write: what it holds could have been planted, so it is refused (the message says how to fix it)."""


def first_line(e: BaseException, *, limit: int | None = None) -> str:
    """The first line of ``e``'s message (its type's name when it has none), cut at ``limit``
    characters: what a one-line error says about a cause whose own text may be a whole page
    (a compiler's log, a worker's traceback). Loader and build side share this one."""
    text = str(e).strip()
    line = text.splitlines()[0] if text else type(e).__name__
    return line if limit is None else line[:limit]


def import_extra(module: str, needed_for: str) -> ModuleType:
    """Import ``module`` of the ``packs`` extra (zstandard, cryptography), which the runtime alone
    leaves out, or raise a LoaderError saying how to install it."""
    try:
        return importlib.import_module(module)
    except ImportError:
        raise LoaderError(
            f"{needed_for} needs {module}, which is not installed: pip install 'precompile[packs]'"
        ) from None
