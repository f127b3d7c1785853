"""A frozen variant's constants, kept in memory once.

A frozen AOTInductor package links its constants into its library (a ``.lrodata`` section); when
its container is created, AOTInductor's ``load_constants`` copies them into memory it owns. The
library's pages they were copied from would stay resident too, doubling what each frozen variant
costs (88 MB more per MiniLM variant). ``ConstantsRelease`` gives those pages back
(``madvise(MADV_DONTNEED)``): while the container is being created (the torch-free loader), so they
never pile up, or once after (the torch loader, whose package loader creates it). On a private
mapping of a file nothing writes, that only unmaps the pages: read again, they come back from the
file (deleted, it stays while mapped), so what runs cannot change. Best effort: nothing is done
where the section or the mapping cannot be found. No torch, no numpy: both loaders use it.
"""

from __future__ import annotations

import ctypes
import mmap
import os
import struct
import threading
from ctypes import c_size_t, c_void_p
from pathlib import Path

ELF_HEADER = struct.Struct("<4sB11x2xHI3QI6H")  # e_ident (magic, class), e_machine, ..., e_shoff, ..., e_shstrndx
SECTION_HEADER = struct.Struct("<2IQ3Q2I2Q")  # name, type, flags, addr, offset, size, link, info, align, entsize
CONSTANTS_SECTION = b".lrodata"  # where AOTInductor links a package's constants (its _binary_constants_bin)
MADV_DONTNEED = 4
RELEASE_EVERY_S = 0.002


def constants_section(library: Path) -> tuple[int, int] | None:
    """(virtual address, size) of the section holding the compiled model's own constants in a 64-bit
    little-endian ELF library, or None (not such a library, or no such section)."""
    try:
        with open(library, "rb") as f:
            head = f.read(ELF_HEADER.size)
            if len(head) != ELF_HEADER.size or head[:5] != b"\x7fELF\x02" or head[5] != 1:
                return None
            fields = ELF_HEADER.unpack(head)
            shoff, shentsize, shnum, shstrndx = fields[6], fields[11], fields[12], fields[13]
            if shentsize != SECTION_HEADER.size or not 0 < shnum <= 1024 or shstrndx >= shnum:
                return None
            f.seek(shoff)
            table = f.read(shentsize * shnum)
            if len(table) != shentsize * shnum:
                return None
            sections = [SECTION_HEADER.unpack_from(table, i * shentsize) for i in range(shnum)]
            names = sections[shstrndx]
            f.seek(names[4])
            strings = f.read(min(names[5], 1 << 20))
    except OSError:
        return None
    for name, _, _, addr, _, size, *_ in sections:
        if strings[name : name + len(CONSTANTS_SECTION) + 1] == CONSTANTS_SECTION + b"\0" and addr and size:
            return addr, size
    return None


class ConstantsRelease:
    """The pages of ``library``'s constants section, as this process maps them: ``release()`` gives
    them back now; ``with ConstantsRelease(library):`` also every couple of milliseconds until the
    block ends (around the creation of a container, which copies the constants out)."""

    def __init__(self, library: Path, maps: str | os.PathLike = "/proc/self/maps"):
        self.range: tuple[int, int] | None = None
        section = constants_section(library)
        base = _mapped_base(library, maps) if section is not None else None
        if section is not None and base is not None:
            page = mmap.PAGESIZE
            start = -(-(base + section[0]) // page) * page  # only whole pages inside the section
            end = (base + section[0] + section[1]) // page * page
            if end > start:
                self.range = (start, end - start)
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def release(self) -> int:
        """Unmap the section's pages now; the bytes of address space that covers (0: nothing to do)."""
        if self.range is None or _madvise(self.range[0], self.range[1], MADV_DONTNEED) != 0:
            return 0
        return self.range[1]

    def __enter__(self) -> ConstantsRelease:
        if self.range is not None:
            self._thread = threading.Thread(target=self._loop, name="release-constants", daemon=True)
            self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join()
        self.release()

    def _loop(self) -> None:
        while not self._stop.wait(RELEASE_EVERY_S):
            self.release()


def _mapped_base(library: Path, maps: str | os.PathLike) -> int | None:
    """Where ``library`` (opened by the dynamic linker) starts in this process, from its first mapping."""
    name = os.path.realpath(library)  # as the kernel lists it
    try:
        lines = Path(maps).read_text(encoding="utf-8", errors="replace").splitlines()
    except OSError:
        return None
    for line in lines:
        parts = line.split(maxsplit=5)
        if len(parts) == 6 and parts[5] == name and int(parts[2], 16) == 0:
            return int(parts[0].split("-")[0], 16)
    return None


_libc = ctypes.CDLL(None, use_errno=True)
_madvise = _libc.madvise
_madvise.argtypes, _madvise.restype = [c_void_p, c_size_t, ctypes.c_int], ctypes.c_int


def mapped_libraries(maps: str | os.PathLike = "/proc/self/maps") -> set[str]:
    """The shared libraries this process has mapped (their paths), to tell which one a call opened."""
    try:
        lines = Path(maps).read_text(encoding="utf-8", errors="replace").splitlines()
    except OSError:
        return set()
    return {
        parts[5] for parts in (line.split(maxsplit=5) for line in lines) if len(parts) == 6 and parts[5].endswith(".so")
    }
