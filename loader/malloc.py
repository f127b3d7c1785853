"""Which memory allocator a serving process runs on, and the settings that start one on another.

A compiled variant allocates its buffers (and oneDNN its scratch space) on every call, and glibc's
malloc serves that traffic badly. Measured per steady call on a quiet 2-core EPYC (dynamic fp32
artifacts of ``bench.vision``, 2 threads, ``OMP_WAIT_POLICY=PASSIVE``):

- at small shapes glibc's bookkeeping (``_int_malloc``, ``malloc_consolidate``, ``_int_free``: 18% of
  ``perf``'s samples) is a third of the call: MobileNetV2 at 1×96² takes 1.43 ms on glibc and 0.97 on
  tcmalloc;
- buffers above glibc's mmap ceiling (32 MB, which no setting raises) are mapped and unmapped on every
  call, and every page of them faults again: Segformer at 4×256² pays 16,385 page faults a call and
  takes 75 ms (54 on tcmalloc, 53 faults); EfficientNet-B0 at 2×200×160, 3,252 faults and 12.1 ms (6.3).

tcmalloc keeps freed memory for the next call. jemalloc does too once told not to return it
(``MALLOC_CONF``): with its default decay it returned every large buffer at once (17,837 faults a
call on MobileNetV2 at 4×256², 2.5× slower than glibc).

The allocator is fixed when a process starts (``LD_PRELOAD``), so only a launcher can choose it:
``precompile serve`` re-executes itself with one (``--malloc``, default ``auto``: tcmalloc where it is
installed, e.g. Debian's ``libtcmalloc-minimal4``). A program that calls ``loader.load`` chooses its
own: ``LD_PRELOAD=$(python -m loader.malloc) python app.py``.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

from .errors import LoaderError

CHOICE_ENV = "PRECOMPILE_MALLOC"  # --malloc's default for `precompile serve`
CHOICES = ("auto", "tcmalloc", "jemalloc", "system")
PRELOAD_ENV = "LD_PRELOAD"

# The library names each allocator is installed under (Debian/Ubuntu, Fedora, conda), first found wins.
LIBRARIES = {
    "tcmalloc": ("libtcmalloc_minimal.so.4", "libtcmalloc.so.4"),
    "jemalloc": ("libjemalloc.so.2",),
}
# Names a preloaded allocator may have: one already in LD_PRELOAD is the user's choice, kept.
_KNOWN = ("libtcmalloc", "libjemalloc", "libmimalloc", "libhoard", "libtbbmalloc")

# Settings each allocator gets unless the user gave them:
SETTINGS = {
    # tcmalloc prints a line for every allocation above 1 GiB; a 4×256² segmentation batch makes such
    # buffers by design.
    "tcmalloc": {"TCMALLOC_LARGE_ALLOC_REPORT_THRESHOLD": str(1 << 40)},
    # jemalloc returns freed pages on a decay curve that gives back a large buffer before the next
    # call wants it again (measured above): never return them, as glibc does with its heap.
    "jemalloc": {"MALLOC_CONF": "dirty_decay_ms:-1,muzzy_decay_ms:-1"},
}


class MallocError(LoaderError):
    """The allocator asked for is not installed here, or a path that is not one."""


def search_dirs() -> list[Path]:
    """Where shared libraries are installed: the multiarch folders, the usual lib folders, this
    interpreter's prefix (conda, a venv's base), in that order."""
    machine = os.uname().machine
    dirs = [f"/usr/lib/{machine}-linux-gnu", "/usr/lib64", "/usr/lib", "/usr/local/lib", "/lib64", "/lib"]
    dirs += [os.path.join(prefix, "lib") for prefix in dict.fromkeys((sys.prefix, sys.base_prefix))]
    return [Path(d) for d in dirs]


def find(name: str, dirs: list[Path] | None = None) -> Path | None:
    """The installed library of allocator ``name`` (a key of ``LIBRARIES``), or None."""
    for folder in search_dirs() if dirs is None else dirs:
        for library in LIBRARIES[name]:
            path = folder / library
            if path.is_file():
                return path
    return None


def resolve(choice: str, dirs: list[Path] | None = None) -> Path | None:
    """The library to preload for ``choice`` (one of ``CHOICES`` or a path to a shared library):
    ``auto`` is tcmalloc where it is installed, else None (glibc's malloc); ``system`` is None. A named
    allocator that is not installed, or a path that is not a shared library, raises MallocError."""
    if choice == "system":
        return None
    if choice == "auto":
        return find("tcmalloc", dirs)
    if choice in LIBRARIES:
        path = find(choice, dirs)
        if path is None:
            package = {"tcmalloc": "libtcmalloc-minimal4", "jemalloc": "libjemalloc2"}[choice]
            raise MallocError(
                f"--malloc {choice}: no {' or '.join(LIBRARIES[choice])} in {', '.join(map(str, search_dirs()))}; "
                f"install it (Debian/Ubuntu: apt-get install {package}), give its path, or use --malloc auto"
            )
        return path
    path = Path(choice)
    if not path.is_file():
        raise MallocError(f"--malloc {choice}: no such file; give auto, {', '.join(CHOICES[1:])} or a library's path")
    try:
        with path.open("rb") as f:
            magic = f.read(4)
    except OSError as e:
        raise MallocError(f"--malloc {choice}: cannot read it ({e.strerror})") from None
    if magic != b"\x7fELF":
        raise MallocError(f"--malloc {choice}: not a shared library (no ELF header)")
    return path.resolve()


def kind(path: str | os.PathLike) -> str | None:
    """Which allocator a library is, by its file name ('tcmalloc', 'jemalloc', ...), or None."""
    name = os.path.basename(str(path))
    for known in _KNOWN:
        if name.startswith(known):
            return known[3:]
    return None


def preloaded(environ: dict[str, str] | None = None) -> list[str]:
    """The libraries ``LD_PRELOAD`` names (colon- or space-separated, as ld.so reads it)."""
    environ = os.environ if environ is None else environ
    return environ.get(PRELOAD_ENV, "").replace(":", " ").split()


def malloc_env(
    choice: str = "auto", environ: dict[str, str] | None = None, dirs: list[Path] | None = None
) -> dict[str, str]:
    """What to add to ``environ`` (default ``os.environ``) so that a process started with it runs on
    ``choice``'s allocator: ``LD_PRELOAD`` with the library first, and the allocator's ``SETTINGS`` the
    user has not set. Nothing where ``choice`` is ``system`` or ``auto`` finds none, or where
    ``LD_PRELOAD`` already names an allocator (the user chose; ``auto`` and ``system`` keep it, a
    named one that differs raises MallocError)."""
    environ = os.environ if environ is None else environ
    path = resolve(choice, dirs)
    chosen = [p for p in preloaded(environ) if kind(p)]
    if chosen:
        if path is not None and choice != "auto" and os.path.realpath(chosen[0]) != os.path.realpath(path):
            raise MallocError(f"--malloc {choice}: LD_PRELOAD already starts {chosen[0]}; unset it or drop --malloc")
        return {}
    if path is None:
        return {}
    env = {PRELOAD_ENV: " ".join([str(path), *preloaded(environ)])}
    env.update({k: v for k, v in SETTINGS.get(kind(path) or "", {}).items() if k not in environ})
    return env


def in_use(maps: str | os.PathLike = "/proc/self/maps", environ: dict[str, str] | None = None) -> str:
    """The allocator this process runs on: a preloaded one that is mapped ('tcmalloc', 'jemalloc',
    ...), else 'system' (the C library's malloc)."""
    try:
        mapped = {
            os.path.realpath(line.split(None, 5)[5].strip())
            for line in Path(maps).read_text().splitlines()
            if line.count(" ") >= 5 and "/" in line
        }
    except OSError:
        mapped = set()
    for library in preloaded(environ):
        name = kind(library)
        if name and os.path.realpath(library) in mapped:
            return name
    return "system"


def main() -> None:
    """``python -m loader.malloc [CHOICE]``: print the library ``CHOICE`` (default auto) preloads, for
    ``LD_PRELOAD=$(python -m loader.malloc)``; nothing when it is glibc's malloc."""
    choice = sys.argv[1] if len(sys.argv) > 1 else "auto"
    try:
        path = resolve(choice)
    except MallocError as e:
        print(f"error: {e}", file=sys.stderr)
        raise SystemExit(2) from None
    if path is not None:
        print(path)


if __name__ == "__main__":
    main()
