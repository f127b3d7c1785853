"""The one place that names torch's private AOTInductor package loader, and the forms its methods take
in this torch.

``torch._C._aoti.AOTIModelPackageLoader`` is what ``torch._inductor.aoti_load_package`` wraps; opening
it directly does not import ``torch._inductor`` (about 1 s on a small host). It is a pybind11 binding
whose arguments change between releases (``load_constants`` gained ``user_managed``, then
``allow_h2d_copy``), so the loader reads each method's signature from its docstring once, records it
(``signatures()``, which scripts/gpu-check reports), and calls the form that exists: a call in a form
the binding lacks would raise a TypeError from deep inside a load.
"""

from __future__ import annotations

import ctypes
import functools
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from . import constants as C
from .errors import IncompatibleArtifactError, LoaderError
from .native.libs import MIXED, TorchLibraries, expose_libtorch, shim_in_global_scope

METHODS = ("__init__", "load_constants", "run", "get_constant_fqns", "get_metadata")


@dataclass(frozen=True)
class Param:
    name: str  # pybind's name: the C++ argument's (py::arg), or arg0, arg1 ... where it has none
    default: str | None = None  # as pybind prints it; None: required


@dataclass(frozen=True)
class Signature:
    method: str
    params: tuple[Param, ...]  # without self

    def names(self) -> tuple[str, ...]:
        return tuple(p.name for p in self.params)

    def __str__(self) -> str:
        return (
            f"{self.method}({', '.join(p.name + ('' if p.default is None else '=' + p.default) for p in self.params)})"
        )


def parse_signatures(method: str, doc: str | None) -> list[Signature]:
    """Every form pybind11 documents for ``method`` (one, or several for an overloaded method).

    >>> parse_signatures("f", "f(self: X, a: int, b: bool = False) -> None")[0].names()
    ('a', 'b')
    """
    found = []
    for line in (doc or "").splitlines():
        m = re.match(rf"\s*(?:\d+\.\s*)?{re.escape(method)}\((.*)\)\s*->", line)
        if m is None:
            continue
        params = []
        for part in _split_top_level(m.group(1)):
            name, _, rest = part.partition(":")
            default = rest.partition("=")[2].strip() or None if "=" in rest else None
            name = name.strip()
            if name and name != "self":
                params.append(Param(name, default))
        found.append(Signature(method, tuple(params)))
    return found


def _split_top_level(text: str) -> list[str]:
    """Split on the commas outside brackets and quotes: 'a: dict[str, int], b: bool' -> two parts."""
    parts, depth, start, quote = [], 0, 0, ""
    for i, ch in enumerate(text):
        if quote:
            quote = "" if ch == quote else quote
        elif ch in "'\"":
            quote = ch
        elif ch in "[(":
            depth += 1
        elif ch in "])":
            depth -= 1
        elif ch == "," and depth == 0:
            parts.append(text[start:i])
            start = i + 1
    if text[start:].strip():
        parts.append(text[start:])
    return parts


@functools.cache
def signatures() -> dict[str, tuple[Signature, ...]]:
    """This torch's forms of the package loader's methods, read once from the binding's docstrings."""
    cls = torch._C._aoti.AOTIModelPackageLoader
    return {m: tuple(parse_signatures(m, getattr(getattr(cls, m, None), "__doc__", None))) for m in METHODS}


def describe() -> dict[str, list[str]]:
    """The signatures as text, for reports: {"load_constants": ["load_constants(constants_map, ...)"], ...}."""
    return {m: [str(s) for s in forms] for m, forms in signatures().items()}


@dataclass(frozen=True)
class ConstantsCall:
    """How to hand a runner its weights in this torch: the positional arguments after the map, and
    whether the runner uses the tensors in place (``user_managed``) or copies them."""

    args: tuple[bool, ...]
    in_place: bool


def constants_call(forms: tuple[Signature, ...]) -> ConstantsCall:
    """The ``load_constants`` call for these forms: ``(map, use_inactive=False, check_full_update=True,
    user_managed=True)`` where the binding takes ``user_managed``, else the three-argument form (the
    runner then copies the weights). IncompatibleArtifactError for a form this loader does not know."""
    for sig in forms:
        names = sig.names()
        if len(names) >= 4 and names[3] == "user_managed":
            return ConstantsCall((False, True, True), in_place=True)
    for sig in forms:
        required = [p for p in sig.params if p.default is None]
        if len(required) == 3 and len(sig.params) in (3, 4) and "user_managed" not in sig.names():
            # (map, use_inactive, check_full_update) named or as arg0..arg2; a fourth with a default
            # that is not user_managed is left at its default.
            return ConstantsCall((False, True), in_place=False)
    shown = "; ".join(str(s) for s in forms) or "no documented signature"
    raise IncompatibleArtifactError(
        f"torch {torch.__version__}: AOTIModelPackageLoader.load_constants has a form this loader does not "
        f"know ({shown}); install a torch release it was tested with (2.8 to 2.14)"
    )


def open_package(
    path: str,
    *,
    single_threaded: bool = False,
    device_index: int | None = None,
    runners: int = 1,
    standalone: bool = False,
) -> Any:
    """Open one AOTInductor package without importing torch._inductor.

    Arguments to the binding: package path, model name inside the package, run single-threaded (needed
    for CUDA graph capture), number of runners (model instances that run calls at once; they share
    the constants), device index (-1: the default one). ``standalone``: the package is known to be a
    standalone variant (``precompile.standalone``), so libtorch's symbols are made global before the
    first attempt: a failed attempt leaves the folder torch extracted the package into behind (one
    ``aotinductor_*`` folder in the temporary directory per process that opened one so).
    """
    index = -1 if device_index is None else device_index
    if shim_in_global_scope():  # its calls would bind to precompile's shim, not to libtorch_cpu's
        raise IncompatibleArtifactError(f"{path}: {MIXED}")
    if standalone:
        _expose_libtorch()
    try:
        return torch._C._aoti.AOTIModelPackageLoader(path, C.AOTI_MODEL_NAME, single_threaded, max(1, runners), index)
    except RuntimeError as e:
        if "undefined symbol: aoti_torch_" not in str(e) or not _expose_libtorch():
            raise
    return torch._C._aoti.AOTIModelPackageLoader(path, C.AOTI_MODEL_NAME, single_threaded, max(1, runners), index)


@functools.cache
def _expose_libtorch() -> bool:
    """Make libtorch_cpu's symbols global in this process (``import torch`` opens it RTLD_LOCAL), for
    a standalone variant (``precompile.standalone``): its library is linked without libtorch, so the
    C shim it calls must be found in the global scope. Once, and only when such a variant is opened.
    Whether it was done."""
    try:
        expose_libtorch(TorchLibraries(Path(torch.__file__).parent, torch.__version__, torch.version.cuda))
    except LoaderError:
        return False
    return True


def load_constants(runner: Any, constants: dict[str, torch.Tensor]) -> bool:
    """Hand ``runner`` its weights in the form this torch's binding takes; True when it uses them in
    place. Every constant must be given (check_full_update): a missing one would be read as null by
    the compiled code. The runner's own refusal is a RuntimeError, left to the caller."""
    call = constants_call(signatures()["load_constants"])
    runner.load_constants(constants, *call.args)
    return call.in_place


# torch's own way to pass tensors across the C ABI as AtenTensorHandles (``at::Tensor*``), what
# Inductor's cpp_wrapper code uses: handles come and go as PyCapsules, read and made here.
_capsule_pointer = ctypes.pythonapi.PyCapsule_GetPointer
_capsule_pointer.argtypes, _capsule_pointer.restype = [ctypes.py_object, ctypes.c_char_p], ctypes.c_void_p
_capsule_new = ctypes.pythonapi.PyCapsule_New
_capsule_new.argtypes, _capsule_new.restype = [ctypes.c_void_p, ctypes.c_char_p, ctypes.c_void_p], ctypes.py_object


def tensor_handles(tensors: list[torch.Tensor]) -> list[int]:
    """A new tensor handle for each tensor, sharing its storage (zero-copy; it keeps the storage
    alive): for a container's run, which takes them and frees them."""
    return [_capsule_pointer(c, None) for c in torch._C._aoti.unsafe_alloc_void_ptrs_from_tensors(tensors)]


def tensors_from_handles(handles: list[int]) -> list[torch.Tensor]:
    """torch tensors taking over the tensor handles a container's run returned (zero-copy; the
    handles are freed)."""
    return torch._C._aoti.alloc_tensors_by_stealing_from_void_ptrs([_capsule_new(h, None, None) for h in handles])
