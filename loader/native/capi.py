"""The C interfaces the torch-free loader calls through ctypes, and nothing else of torch.

- libtorch_cpu's stable C shim (``torch/csrc/inductor/aoti_torch/c/shim.h``): tensors made around
  memory we own (``aoti_torch_create_tensor_from_blob_v2``), read back (``aoti_torch_get_*``) and
  freed (``aoti_torch_delete_tensor_object``); dtype and device codes are asked of the library, never
  hard-coded (they are not part of the ABI).
- a compiled model's container (``torch/csrc/inductor/aoti_runtime/interface.h``): create it for
  "cpu", list its inputs, outputs and constants, hand it the weights in place
  (``...UpdateUserManagedConstantBufferPairs``: the tensors keep pointing into our memory map), run it.

A frozen variant's constants are copied out of its library when its container is created; the
library's pages they came from are given back as it happens (``ConstantsRelease``), so the variant
costs its constants once.

Both are what torch's own runner (``AOTIModelContainerRunner``) calls; the C++ package loader adds
only unzipping and the proxy executor, which this path refuses to need (``loader.native.package``).
Every call returns an error code; a failure raises ``CallFailed`` with the runtime's last message.
Every one of them is a ctypes call of a CDLL function, which lets go of the GIL while it runs: a
call, the container's creation (a frozen variant's constants copied) and the library's dlopen (its
relocations) leave the interpreter to the process's other threads.

Closing a container deletes it and then closes its library (``dlclose``): its code and data pages
are unmapped, unless glibc must keep them: a library is kept while a thread that called into it
lives (every entry point sets AOTInductor's last error, a ``thread_local`` string, whose destructor
glibc runs at that thread's exit; the library goes at the next ``dlclose`` after; so the deletion
runs on a thread of its own), and the first
library to define one of the C++ runtime's unique symbols stays for the process (``STB_GNU_UNIQUE``:
glibc marks it not unloadable). So a process that loads and unloads a model from threads that end
with it (a server's, ``precompile serve``) maps one such library at most, whatever the cycles.
"""

from __future__ import annotations

import contextlib
import ctypes
import os
import threading
import time
import weakref
from collections.abc import Sequence
from ctypes import POINTER, byref, c_bool, c_char_p, c_int32, c_int64, c_size_t, c_void_p
from pathlib import Path

import numpy as np

from ..constants import DTYPES
from ..pages import ConstantsRelease

# numpy has no bfloat16: an artifact whose inputs or outputs are bfloat16 needs the torch loader.
NUMPY_DTYPES = {name: np.dtype(name) for name in DTYPES if name != "bfloat16"}
RTLD_NOW = getattr(os, "RTLD_NOW", 2)


class CallFailed(RuntimeError):
    """A call into compiled code or libtorch's shim returned an error."""


class ConstantMapEntry(ctypes.Structure):
    _fields_ = [("name", c_char_p), ("handle", c_void_p)]


_SHIM = {
    # name: (argument types, result type); AOTITorchError is int32, 0 is success
    "aoti_torch_create_tensor_from_blob_v2": (
        [
            c_void_p,
            c_int64,
            POINTER(c_int64),
            POINTER(c_int64),
            c_int64,
            c_int32,
            c_int32,
            c_int32,
            POINTER(c_void_p),
            c_int32,
            c_void_p,
            c_int64,
        ],
        c_int32,
    ),
    "aoti_torch_delete_tensor_object": ([c_void_p], c_int32),
    "aoti_torch_get_data_ptr": ([c_void_p, POINTER(c_void_p)], c_int32),
    "aoti_torch_get_dim": ([c_void_p, POINTER(c_int64)], c_int32),
    "aoti_torch_get_sizes": ([c_void_p, POINTER(POINTER(c_int64))], c_int32),
    "aoti_torch_get_strides": ([c_void_p, POINTER(POINTER(c_int64))], c_int32),
    "aoti_torch_get_dtype": ([c_void_p, POINTER(c_int32)], c_int32),
    "aoti_torch_device_type_cpu": ([], c_int32),
    "aoti_torch_layout_strided": ([], c_int32),
    **{f"aoti_torch_dtype_{name}": ([], c_int32) for name in DTYPES},
}

_CONTAINER = {
    "AOTInductorModelContainerCreateWithDevice": ([POINTER(c_void_p), c_size_t, c_char_p, c_char_p], c_int32),
    "AOTInductorModelContainerDelete": ([c_void_p], c_int32),
    "AOTInductorModelContainerRun": (
        [c_void_p, POINTER(c_void_p), c_size_t, POINTER(c_void_p), c_size_t, c_void_p, c_void_p],
        c_int32,
    ),
    "AOTInductorModelContainerGetNumInputs": ([c_void_p, POINTER(c_size_t)], c_int32),
    "AOTInductorModelContainerGetNumOutputs": ([c_void_p, POINTER(c_size_t)], c_int32),
    "AOTInductorModelContainerGetNumConstants": ([c_void_p, POINTER(c_size_t)], c_int32),
    "AOTInductorModelContainerGetConstantName": ([c_void_p, c_size_t, POINTER(c_char_p)], c_int32),
    "AOTInductorModelContainerGetConstantOriginalFQN": ([c_void_p, c_size_t, POINTER(c_char_p)], c_int32),
    "AOTInductorModelContainerGetConstantFromFolded": ([c_void_p, c_size_t, POINTER(c_bool)], c_int32),
    "AOTInductorModelContainerUpdateUserManagedConstantBufferPairs": (
        [c_void_p, POINTER(ConstantMapEntry), c_size_t, c_bool, c_bool],
        c_int32,
    ),
}
_OPTIONAL = {"AOTInductorGetLastError": ([POINTER(c_char_p)], c_int32)}


_libdl = ctypes.CDLL(None)
_dlopen = _libdl.dlopen
_dlopen.argtypes, _dlopen.restype = [c_char_p, ctypes.c_int], c_void_p
_dlclose = _libdl.dlclose
_dlclose.argtypes, _dlclose.restype = [c_void_p], ctypes.c_int
_dlerror = _libdl.dlerror
_dlerror.argtypes, _dlerror.restype = [], c_char_p


def open_library(path: str | Path, mode: int) -> ctypes.CDLL:
    """``ctypes.CDLL(path, mode)``, its ``dlopen`` called as a foreign function: ctypes' own holds the
    GIL through the dynamic linker's relocations, a stall for every other thread of a server while a
    model loads. OSError with the linker's message if it cannot be opened."""
    handle = _dlopen(str(path).encode(), mode)
    if not handle:
        error = _dlerror()
        raise OSError(error.decode(errors="replace") if error else f"{path}: cannot open")
    return ctypes.CDLL(str(path), mode=mode, handle=handle)


def close_library(handle: int) -> None:
    """``dlclose`` a handle ``open_library`` returned (nothing of it may be called after)."""
    _dlclose(handle)


def _bind(lib: ctypes.CDLL, table: dict, where: str, optional: bool = False) -> dict:
    out = {}
    for name, (args, result) in table.items():
        try:
            fn = getattr(lib, name)
        except AttributeError:
            if optional:
                continue
            raise CallFailed(
                f"{where} has no {name}: built by a torch whose C interface this loader does not know"
            ) from None
        fn.argtypes, fn.restype = args, result
        out[name] = fn
    return out


class Shim:
    """libtorch_cpu's C shim (or precompile's standalone one, which has the same functions), with the
    codes it gives dtypes, the CPU and strided layout."""

    def __init__(self, libtorch: ctypes.CDLL, *, where: str = "libtorch_cpu"):
        self.lib = libtorch  # kept loaded as long as this object lives
        f = _bind(libtorch, _SHIM, where)
        self._from_blob = f["aoti_torch_create_tensor_from_blob_v2"]
        self._delete = f["aoti_torch_delete_tensor_object"]
        self._data_ptr = f["aoti_torch_get_data_ptr"]
        self._dim = f["aoti_torch_get_dim"]
        self._sizes = f["aoti_torch_get_sizes"]
        self._strides = f["aoti_torch_get_strides"]
        self._dtype = f["aoti_torch_get_dtype"]
        self.cpu = f["aoti_torch_device_type_cpu"]()
        self.strided = f["aoti_torch_layout_strided"]()
        self.codes = {name: f[f"aoti_torch_dtype_{name}"]() for name in DTYPES}
        self.names = {code: name for name, code in self.codes.items()}

    def tensor(self, address: int, shape: Sequence[int], dtype: str) -> int:
        """A new tensor handle viewing ``address`` as a C-contiguous ``dtype`` array of ``shape``; the
        memory must outlive it (and every tensor compiled code makes from it)."""
        ndim = len(shape)
        sizes = (c_int64 * ndim)(*shape)
        strides = (c_int64 * ndim)(*_contiguous_strides(shape))
        handle = c_void_p()
        _check(
            self._from_blob(
                address, ndim, sizes, strides, 0, self.codes[dtype], self.cpu, 0, byref(handle), self.strided, None, 0
            ),
            "aoti_torch_create_tensor_from_blob_v2",
        )
        return handle.value

    def delete(self, handle: int) -> None:
        _check(self._delete(handle), "aoti_torch_delete_tensor_object")

    def to_array(self, handle: int) -> np.ndarray:
        """A numpy copy of the tensor ``handle`` (any strides), then the handle is freed."""
        try:
            ndim, ptr, dtype = c_int64(), c_void_p(), c_int32()
            sizes, strides = POINTER(c_int64)(), POINTER(c_int64)()
            _check(self._dim(handle, byref(ndim)), "aoti_torch_get_dim")
            _check(self._sizes(handle, byref(sizes)), "aoti_torch_get_sizes")
            _check(self._strides(handle, byref(strides)), "aoti_torch_get_strides")
            _check(self._dtype(handle, byref(dtype)), "aoti_torch_get_dtype")
            _check(self._data_ptr(handle, byref(ptr)), "aoti_torch_get_data_ptr")
            shape = tuple(sizes[i] for i in range(ndim.value))
            steps = tuple(strides[i] for i in range(ndim.value))
            name = self.names.get(dtype.value)
            if name not in NUMPY_DTYPES:
                raise CallFailed(
                    f"an output is {name or f'dtype code {dtype.value}'}, which numpy cannot hold: load this artifact with loader.load()"
                )
            out = np.empty(shape, NUMPY_DTYPES[name])
            if out.size == 0:
                return out
            if steps == _contiguous_strides(shape):
                ctypes.memmove(out.ctypes.data, ptr.value, out.nbytes)
                return out
            itemsize = out.itemsize
            extent = (1 + sum((n - 1) * s for n, s in zip(shape, steps))) * itemsize
            flat = np.frombuffer((ctypes.c_char * extent).from_address(ptr.value), dtype=out.dtype)
            out[...] = np.lib.stride_tricks.as_strided(flat, shape, [s * itemsize for s in steps])
            return out
        finally:
            self.delete(handle)


class Container:
    """One compiled model (a variant's library) and its container of ``runners`` model instances,
    for "cpu" (they share the constants; each holds its own activations).

    ``run`` takes C-contiguous numpy arrays in forward() order (the guards checked them) and returns
    numpy copies of the outputs. Up to ``runners`` calls run at once; the container makes a further
    one wait for a free instance. With one instance, execution and batch instances of the server ran
    one call at a time, whatever their number.
    """

    def __init__(self, shim: Shim, library: Path, *, own_constants: bool = False, runners: int = 1):
        self.shim = shim
        try:
            # RTLD_NOW: one built against another torch fails here, not at a call; RTLD_LOCAL: each
            # variant's library keeps its own symbols.
            self.lib = open_library(library, RTLD_NOW)
        except OSError as e:
            raise CallFailed(f"cannot open the compiled library: {e}") from None
        try:
            f = _bind(self.lib, _CONTAINER, "the compiled library")
        except CallFailed:
            close_library(self.lib._handle)
            raise
        self._last_error = _bind(self.lib, _OPTIONAL, "", optional=True).get("AOTInductorGetLastError")
        self._run = f["AOTInductorModelContainerRun"]
        self._f = f
        handle = c_void_p()
        self._in_flight = _InFlight()  # close() (and the deletion at exit) waits for the runs in flight
        try:
            # A frozen variant (``own_constants``) copies its constants out of the library as it is created.
            with ConstantsRelease(library) if own_constants else contextlib.nullcontext():
                self._call("AOTInductorModelContainerCreateWithDevice", byref(handle), max(1, runners), b"cpu", None)
        except CallFailed:
            close_library(self.lib._handle)
            raise
        self.handle = handle.value
        # Deleted with this object (or by close()), and then its library closed.
        self._finalizer = weakref.finalize(
            self, _delete, self._in_flight, f["AOTInductorModelContainerDelete"], self.handle, self.lib._handle
        )
        self.num_inputs = self._size("AOTInductorModelContainerGetNumInputs")
        self.num_outputs = self._size("AOTInductorModelContainerGetNumOutputs")

    def constant_names(self) -> dict[str, str]:
        """Original FQN (what the manifest lists) -> the container's own name, for every constant it
        expects to be given (folded ones it computes itself)."""
        names = {}
        for i in range(self._size("AOTInductorModelContainerGetNumConstants")):
            folded = c_bool()
            self._call("AOTInductorModelContainerGetConstantFromFolded", self.handle, i, byref(folded))
            if folded.value:
                continue
            name, fqn = c_char_p(), c_char_p()
            self._call("AOTInductorModelContainerGetConstantName", self.handle, i, byref(name))
            self._call("AOTInductorModelContainerGetConstantOriginalFQN", self.handle, i, byref(fqn))
            names[fqn.value.decode()] = name.value.decode()
        return names

    def use_constants(self, tensors: dict[str, int]) -> None:
        """Hand the container every constant (its own name -> a tensor handle) to use in place; the
        handles stay ours (the container keeps its own references to the same memory)."""
        entries = (ConstantMapEntry * len(tensors))(*[ConstantMapEntry(n.encode(), h) for n, h in tensors.items()])
        # use_inactive=False; validate_full_update=True: a constant left out would be read as null.
        self._call(
            "AOTInductorModelContainerUpdateUserManagedConstantBufferPairs",
            self.handle,
            entries,
            len(tensors),
            False,
            True,
        )

    def run(self, arrays: Sequence[np.ndarray]) -> list[np.ndarray]:
        shim = self.shim
        outputs = self.run_handles([shim.tensor(a.ctypes.data, a.shape, a.dtype.name) for a in arrays])
        results, failed = [], None
        for h in outputs:  # every handle is freed, even after one output cannot be read
            try:
                results.append(shim.to_array(h))
            except CallFailed as e:
                failed = failed or e
        if failed is not None:
            raise failed
        return results

    def run_handles(self, inputs: Sequence[int]) -> list[int]:
        """Run on tensor handles in forward() order, which the container takes (it frees them, even
        when the run fails or the container is closed); return the output handles, which are the
        caller's to free."""
        handles = (c_void_p * self.num_inputs)(*inputs)
        outputs = (c_void_p * self.num_outputs)()
        if not self._in_flight.enter():
            for h in inputs:
                self.shim.delete(h)
            raise CallFailed("the model was closed")
        try:
            self._check(self._run(self.handle, handles, self.num_inputs, outputs, self.num_outputs, None, None), "run")
        finally:
            self._in_flight.leave()
        return [h or 0 for h in outputs]

    def close(self) -> None:
        """Delete the container now and close its library (later runs raise CallFailed)."""
        self._in_flight.close()
        self._finalizer()

    def _size(self, name: str) -> int:
        out = c_size_t()
        self._call(name, self.handle, byref(out))
        return out.value

    def _call(self, name: str, *args) -> None:
        if self._in_flight.closed:
            raise CallFailed("the model was closed")  # its library is closed: nothing of it may run
        self._check(self._f[name](*args), name.removeprefix("AOTInductorModelContainer"))

    def _check(self, code: int, what: str) -> None:
        if code != 0:
            message = ""
            if self._last_error is not None:
                text = c_char_p()
                if self._last_error(byref(text)) == 0 and text.value:
                    message = ": " + text.value.decode(errors="replace").strip()
            raise CallFailed(f"compiled code: {what} failed{message}")


class _InFlight:
    """The runs of one container in flight, and its closing, which refuses new runs and waits for
    those in flight (runs go on at once: the container has a model instance for each)."""

    def __init__(self):
        self._changed = threading.Condition()
        self._count = 0
        self._closed = False

    @property
    def closed(self) -> bool:
        return self._closed

    def enter(self) -> bool:
        with self._changed:
            if self._closed:
                return False
            self._count += 1
            return True

    def leave(self) -> None:
        with self._changed:
            self._count -= 1
            if self._count == 0:
                self._changed.notify_all()

    def close(self) -> None:
        with self._changed:
            self._closed = True
            while self._count:
                self._changed.wait()


def _delete(in_flight: _InFlight, delete, handle: int, library: int) -> None:
    """Delete a container, then close its library. The deletion runs on a thread of its own that
    ends before the library is closed: every entry point sets AOTInductor's ``thread_local`` last
    error, and glibc keeps a library mapped while a thread that set one lives."""
    in_flight.close()  # never while a run is in flight
    deleting = threading.Thread(target=delete, args=(handle,), name="delete-container")
    try:
        deleting.start()
    except RuntimeError:  # no new thread (the interpreter exiting): delete here; the process unmaps it
        delete(handle)
        return
    deleting.join()
    _wait_gone(deleting.native_id)
    close_library(library)


def _wait_gone(tid: int | None, timeout: float = 1.0) -> None:
    """Wait until the thread ``tid`` has left the kernel: glibc runs its ``thread_local``
    destructors after Python's ``join`` returns. Past ``timeout``, the library is closed anyway,
    and goes at a later ``dlclose``."""
    deadline = time.monotonic() + timeout
    while tid is not None and os.path.exists(f"/proc/self/task/{tid}") and time.monotonic() < deadline:
        time.sleep(0.0002)


def _check(code: int, what: str) -> None:
    if code != 0:
        raise CallFailed(f"libtorch: {what} failed")


def _contiguous_strides(shape: Sequence[int]) -> tuple[int, ...]:
    strides, step = [], 1
    for size in reversed(shape):
        strides.append(step)
        step *= max(size, 1)
    return tuple(reversed(strides))
