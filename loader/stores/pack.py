"""Packs: an artifact as one zstandard-compressed file (the layout is in ``loader/constants.py``).

A pack arriving on a serving host is untrusted bytes, so reading one is defensive:

- the file must be complete zstandard frames, each declaring its content size and carrying a
  checksum; the frames are walked (block headers only, nothing decompressed) before anything is
  read, so a truncated copy is refused up front and the declared sizes are known;
- decompression is streamed a block at a time against a byte budget: before the manifest, what a
  manifest may take; after it, what its files account for. One-shot ``ZstdDecompressor().decompress(
  ..., max_output_size=...)`` is not used: it ignores the cap when the frame header states a size, so a
  16 KB frame can expand to 512 MiB;
- members are strict POSIX ustar headers (checksum, magic, octal fields) of regular files only:
  links, devices, directories, pax and GNU extensions, absolute paths and ``..`` are refused;
- ``manifest.json`` comes first and is parsed before any other member is read; every other member
  must be listed there, once, with the listed size, and its sha256 is compared as it streams, before
  the unpacked folder can be used;
- nothing but zero padding may follow the end of the archive.

``zstandard`` is imported only here and only when a pack is read or written, so ``import loader``
and loading an artifact folder stay light.
"""

from __future__ import annotations

import hashlib
import os
import struct
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, BinaryIO

from .. import constants as C
from ..artifact import manifest_digest, read_manifest, read_signature
from ..errors import ArtifactError, import_extra
from ..manifest import MAX_INT, Manifest, check_member_path, parse_manifest

CHUNK = 1 << 20
RESERVED = (C.MANIFEST_FILE, C.SIGNATURE_FILE)
MAX_FRAMES = 64
ZSTD_MAX_FRAME_HEADER = 18
# The decoder allocates the window a frame asks for: cap what a hostile frame can make us allocate.
# `precompile pack` levels (up to 19) use windows of at most 8 MiB.
MAX_WINDOW = 32 << 20

# Type flags a ustar header may carry, by what they would make on disk; only b"0" is accepted.
_REFUSED_TYPES = {
    b"1": "a hard link",
    b"2": "a symbolic link",
    b"3": "a character device",
    b"4": "a block device",
    b"5": "a directory",
    b"6": "a FIFO",
    b"7": "a contiguous file",
    b"x": "a pax extended header",
    b"g": "a pax global header",
    b"L": "a GNU long name",
    b"K": "a GNU long link name",
    b"S": "a GNU sparse file",
    b"\x00": "an old (pre-POSIX) tar entry",
}


class PackEndsEarly(ArtifactError):
    """The bytes end inside what was being read: a truncated pack, or one still arriving."""


@dataclass(frozen=True)
class PackHead:
    """What a pack's first members say: enough to find its cache entry and to check trust."""

    path: Path
    manifest: Manifest
    manifest_bytes: bytes  # manifest.json as packed
    signature: bytes | None  # raw signature.json, None when unsigned
    digest: str  # manifest_digest(manifest_bytes)


@dataclass(frozen=True)
class Frame:
    offset: int  # in the compressed file
    size: int  # compressed bytes, header to checksum
    content_size: int  # decompressed bytes, as the frame header declares


# --- writing -----------------------------------------------------------------------------------


def tar_header(name: str, size: int) -> bytes:
    """A POSIX ustar header for a regular file, with fixed mode, owner and time (reproducible packs)."""
    raw = name.encode("utf-8")
    prefix = b""
    if len(raw) > 100:
        cut = raw.rfind(b"/", 0, 156)
        if cut <= 0 or len(raw) - cut - 1 > 100:
            raise ArtifactError(f"{name!r}: path too long for a pack member (ustar allows 155 + 100 bytes)")
        prefix, raw = raw[:cut], raw[cut + 1 :]
    size_field = b"%011o\x00" % size if size < 8**11 else b"\x80" + size.to_bytes(11, "big")  # GNU base-256
    header = b"".join(
        [
            raw.ljust(100, b"\0"),
            b"0000644\x00",  # mode
            b"0000000\x00" * 2,  # uid, gid
            size_field,
            b"00000000000\x00",  # mtime
            b" " * 8,  # checksum, counted as spaces
            b"0",  # regular file
            b"\0" * 100,  # link name
            b"ustar\x0000",
            b"\0" * 64,  # user and group names
            b"0000000\x00" * 2,  # device numbers
            prefix.ljust(155, b"\0"),
            b"\0" * 12,
        ]
    )
    return header[:148] + b"%06o\x00 " % sum(header) + header[156:]


def _padding(size: int) -> int:
    return -size % C.TAR_BLOCK


def member_bytes(size: int) -> int:
    """How many tar bytes a member of ``size`` data bytes takes: header, data, zero padding."""
    return C.TAR_BLOCK + size + _padding(size)


# The compressed bytes a pack's head can span: the largest manifest and signature stored raw, plus a
# margin for zstandard's block headers, the decoder's read-ahead and the first block of the next frame
# (which holds the header of the member after the signature).
MAX_HEAD_BYTES = member_bytes(C.MAX_MANIFEST_BYTES) + member_bytes(C.MAX_SIGNATURE_BYTES) + (1 << 20)


def max_pack_bytes(head: PackHead) -> int:
    """The most bytes a pack with this head can take: every member stored raw, plus zstandard's
    worst-case growth (``ZSTD_compressBound``) over at most ``MAX_FRAMES`` frames. A larger object
    has bytes appended, and can be refused as soon as its head is read."""
    content = (
        member_bytes(len(head.manifest_bytes))
        + (member_bytes(len(head.signature)) if head.signature is not None else 0)
        + sum(member_bytes(e.size) for e in head.manifest.files.values())
        + 2 * C.TAR_BLOCK
        + C.MAX_TAR_TRAILER
    )
    return content + content // 255 + MAX_FRAMES * (64 + ZSTD_MAX_FRAME_HEADER + 4)


def write_pack(
    root: str | os.PathLike, out: BinaryIO, *, level: int = 3, threads: int = 0, signature: bytes | None = None
) -> Manifest:
    """Write the artifact folder ``root`` to ``out`` as a pack; return its manifest.

    Only the manifest, the signature (``signature`` if given, else ``root/signature.json`` if there)
    and the files the manifest lists are packed. Each file's size and sha256 are checked against the
    manifest as it is read, so a corrupt artifact is never packed (ArtifactError).
    """
    zstandard = import_extra("zstandard", "a pack (.tar.zst)")

    root = Path(root)
    manifest = read_manifest(root)
    manifest_bytes = (root / C.MANIFEST_FILE).read_bytes()
    if signature is None:
        signature = read_signature(root)
    for name in RESERVED:
        if name in manifest.files:
            raise ArtifactError(f"{root}: the manifest lists {name} among its files, a name reserved for packs")
    cctx = zstandard.ZstdCompressor(level=level, threads=threads, write_checksum=True, write_content_size=True)
    _write_head(cctx, out, manifest_bytes, signature)
    files = sorted(manifest.files.items())
    body_size = sum(member_bytes(e.size) for _, e in files) + 2 * C.TAR_BLOCK
    # Not a `with`: on an error its exit would try to end the frame short and raise a ZstdError
    # instead of ours; the caller discards the partial output.
    w = cctx.stream_writer(out, size=body_size, closefd=False)
    for rel, entry in files:
        path = root / rel
        w.write(tar_header(rel, entry.size))
        digest, seen = hashlib.sha256(), 0
        try:
            with open(path, "rb") as f:
                while block := f.read(CHUNK):
                    seen += len(block)
                    if seen > entry.size:
                        break
                    digest.update(block)
                    w.write(block)
        except OSError as e:
            raise ArtifactError(f"{root}: {rel}: cannot read ({e.strerror})") from None
        if seen != entry.size:
            raise ArtifactError(
                f"{root}: {rel} is not {entry.size} bytes as the manifest says (changed while packing?)"
            )
        if digest.hexdigest() != entry.sha256:
            raise ArtifactError(f"{root}: {rel} does not match its sha256 in the manifest (changed or corrupt)")
        w.write(b"\0" * _padding(entry.size))
    w.write(b"\0" * (2 * C.TAR_BLOCK))
    w.flush(zstandard.FLUSH_FRAME)
    return manifest


def _write_head(cctx: Any, out: BinaryIO, manifest_bytes: bytes, signature: bytes | None) -> None:
    head = tar_header(C.MANIFEST_FILE, len(manifest_bytes)) + manifest_bytes + b"\0" * _padding(len(manifest_bytes))
    if signature is not None:
        head += tar_header(C.SIGNATURE_FILE, len(signature)) + signature + b"\0" * _padding(len(signature))
    out.write(cctx.compress(head))


def replace_head(path: str | os.PathLike, out: BinaryIO, signature: bytes | None) -> bool:
    """Copy the pack at ``path`` to ``out`` with a new signature, rewriting only the head frame.

    Returns False (writing nothing) when the pack's first frame is not exactly its head, as in a
    pack another tool recompressed; the caller then unpacks and packs again.
    """
    zstandard = import_extra("zstandard", "a pack (.tar.zst)")

    path = Path(path)
    head = read_head(path)
    with open(path, "rb") as f:
        frames = walk_frames(f, path)
        expected = member_bytes(len(head.manifest_bytes))
        if head.signature is not None:
            expected += member_bytes(len(head.signature))
        if len(frames) < 2 or frames[0].content_size != expected:
            return False
        cctx = zstandard.ZstdCompressor(level=3, write_checksum=True, write_content_size=True)
        _write_head(cctx, out, head.manifest_bytes, signature)
        f.seek(frames[1].offset)
        while block := f.read(CHUNK):
            out.write(block)
    return True


# --- reading -----------------------------------------------------------------------------------


def read_head(path: str | os.PathLike) -> PackHead:
    """Parse a pack's manifest and signature, decompressing only its first members."""
    path = Path(path)
    with _open(path) as f:
        return _TarReader(path, f, frames=None).head()


def read_partial_head(path: str | os.PathLike) -> PackHead | None:
    """The head of a pack of which ``path`` holds the first bytes only (a download under way): None
    while they end inside the head, ArtifactError as soon as they show it is not a pack's head.

    The manifest and signature come first in a pack, so a download can be judged on them (trust,
    expiry, host) before the rest arrives."""
    path = Path(path)
    if path.stat().st_size < len(C.ZSTD_MAGIC):
        return None
    with _open(path) as f:
        try:
            return _TarReader(path, f, frames=None).head()
        except PackEndsEarly:
            return None


def verify_pack(path: str | os.PathLike) -> PackHead:
    """Read a whole pack and check every member against the manifest; write nothing."""
    return _read_all(Path(path), None)


def unpack(path: str | os.PathLike, dest: str | os.PathLike) -> PackHead:
    """Unpack a pack into the empty folder ``dest`` (manifest, signature and files), checking
    everything; ArtifactError if anything is wrong, and then ``dest`` holds partial files the caller
    must discard. Files are created exclusively, never through a link, only under ``dest``."""
    dest = Path(dest)

    def sink(rel: str) -> BinaryIO:
        parent = dest
        for part in rel.split("/")[:-1]:
            parent = parent / part
            if not parent.is_dir():
                os.mkdir(parent, 0o755)
        flags = os.O_WRONLY | os.O_CREAT | os.O_EXCL | getattr(os, "O_NOFOLLOW", 0) | getattr(os, "O_BINARY", 0)
        return os.fdopen(os.open(dest / rel, flags, 0o644), "wb")

    head = _read_all(Path(path), sink)
    for name, data in ((C.MANIFEST_FILE, head.manifest_bytes), (C.SIGNATURE_FILE, head.signature)):
        if data is not None:
            try:
                with sink(name) as out:
                    out.write(data)
            except OSError as e:
                raise ArtifactError(f"{dest}: cannot write {name} ({e.strerror})") from None
    return head


def _open(path: Path) -> BinaryIO:
    try:
        f = open(path, "rb")
    except FileNotFoundError:
        raise ArtifactError(f"{path}: no such pack") from None
    except OSError as e:
        raise ArtifactError(f"{path}: cannot read ({e.strerror})") from None
    if f.read(4) != C.ZSTD_MAGIC:
        f.close()
        raise ArtifactError(
            f"{path}: not a pack (it does not start with a zstandard frame); pass an artifact folder or a "
            "file written by `precompile pack`"
        )
    f.seek(0)
    return f


def _read_all(path: Path, sink: Callable[[str], BinaryIO] | None) -> PackHead:
    with _open(path) as f:
        frames = walk_frames(f, path)
        f.seek(0)
        reader = _TarReader(path, f, frames)
        head = reader.head()
        files = head.manifest.files
        seen: set[str] = set()
        while (member := reader.next_member()) is not None:
            name, size = member
            where = f"{path}: member {name!r}"
            if name in RESERVED:
                raise ArtifactError(f"{where}: out of place; {C.MANIFEST_FILE} and {C.SIGNATURE_FILE} come first, once")
            entry = files.get(name)
            if entry is None:
                raise ArtifactError(f"{where}: not listed in the manifest")
            if name in seen:
                raise ArtifactError(f"{where}: appears twice")
            if size != entry.size:
                raise ArtifactError(f"{where}: is {size} bytes, the manifest says {entry.size}")
            try:
                out = sink(name) if sink is not None else None
                try:
                    digest = reader.copy_data(size, name, out.write if out is not None else None)
                finally:
                    if out is not None:
                        out.close()
            except OSError as e:
                raise ArtifactError(f"{where}: cannot write it ({e.strerror})") from None
            if digest != entry.sha256:
                raise ArtifactError(f"{where}: does not match its sha256 in the manifest (corrupt or changed)")
            seen.add(name)
        missing = sorted(files.keys() - seen)
        if missing:
            raise ArtifactError(f"{path}: {missing[0]} is listed in the manifest but missing from the pack")
        reader.finish()
        return head


def walk_frames(f: BinaryIO, path: Path) -> list[Frame]:
    """The zstandard frames of a pack, found from their block headers without decompressing.

    Refuses a file that is not whole frames back to back (truncated, or with bytes appended), a frame
    that does not declare its content size or carry a checksum, and skippable frames.
    """
    zstandard = import_extra("zstandard", "a pack (.tar.zst)")

    end = os.fstat(f.fileno()).st_size
    frames: list[Frame] = []
    offset = 0
    while offset < end:
        if len(frames) == MAX_FRAMES:
            raise ArtifactError(f"{path}: more than {MAX_FRAMES} zstandard frames; not a file `precompile pack` wrote")
        f.seek(offset)
        start = f.read(ZSTD_MAX_FRAME_HEADER)
        where = f"{path}: zstandard frame {len(frames)} (byte {offset})"
        if start[:4] != C.ZSTD_MAGIC:
            raise ArtifactError(f"{where}: does not start a frame (bytes appended to the pack, or corrupt)")
        try:
            header_size = zstandard.frame_header_size(start)
            params = zstandard.get_frame_parameters(start)
        except zstandard.ZstdError as e:
            raise ArtifactError(f"{where}: bad frame header ({e})") from None
        if (
            params.content_size in (zstandard.CONTENTSIZE_UNKNOWN, zstandard.CONTENTSIZE_ERROR)
            or params.content_size > MAX_INT
        ):
            raise ArtifactError(f"{where}: does not declare its decompressed size; write packs with `precompile pack`")
        if not params.has_checksum:
            raise ArtifactError(f"{where}: carries no checksum; write packs with `precompile pack`")
        pos = offset + header_size
        while True:
            f.seek(pos)
            block = f.read(3)
            if len(block) < 3:
                raise ArtifactError(
                    f"{path}: truncated (the file ends inside zstandard frame {len(frames)}); copy it again"
                )
            (value,) = struct.unpack("<I", block + b"\0")
            last, kind, size = value & 1, (value >> 1) & 3, value >> 3
            if kind == 3:
                raise ArtifactError(f"{where}: reserved block type at byte {pos} (corrupt pack)")
            if size > zstandard.BLOCKSIZE_MAX:
                raise ArtifactError(
                    f"{where}: block of {size} bytes at byte {pos}, more than zstandard allows (corrupt pack)"
                )
            pos += 3 + (1 if kind == 1 else size)
            if last:
                break
        pos += 4  # the checksum
        if pos > end:
            raise ArtifactError(
                f"{path}: truncated (the file ends inside zstandard frame {len(frames)}); copy it again"
            )
        frames.append(Frame(offset, pos - offset, params.content_size))
        offset = pos
    if not frames:
        raise ArtifactError(f"{path}: empty file")
    return frames


class _TarReader:
    """Strict ustar members from a pack's decompressed stream, read against a byte budget."""

    def __init__(self, path: Path, f: BinaryIO, frames: list[Frame] | None):
        zstandard = import_extra("zstandard", "a pack (.tar.zst)")

        self.path = path
        self._zstd_error = zstandard.ZstdError
        self._stream = open_decompressed(f)
        self._frames = frames
        self.offset = 0  # decompressed bytes consumed
        # Until the manifest is read: one header, the largest manifest, one more header to peek at.
        self.budget = member_bytes(C.MAX_MANIFEST_BYTES) + C.TAR_BLOCK
        self._pending: tuple[str, int] | None = None
        self._ended = False
        self.count = 0

    # -- raw stream

    def _read(self, n: int, what: str) -> bytes:
        if self.offset + n > self.budget:
            raise ArtifactError(
                f"{self.path}: {what} goes past the {self.budget} bytes the manifest accounts for (decompression bomb?)"
            )
        parts, got = [], 0
        while got < n:
            try:
                chunk = self._stream.read(n - got)
            except self._zstd_error as e:
                raise ArtifactError(f"{self.path}: corrupt compressed data in {what} ({e})") from None
            if not chunk:
                raise PackEndsEarly(f"{self.path}: the pack ends early, in {what} (truncated copy?)")
            parts.append(chunk)
            got += len(chunk)
        self.offset += n
        return b"".join(parts)

    # -- members

    def next_member(self) -> tuple[str, int] | None:
        """The next member's (path, size), or None at the end of the archive."""
        if self._pending is not None:
            member, self._pending = self._pending, None
            return member
        if self._ended:
            return None
        block = self._read(C.TAR_BLOCK, f"the header of member {self.count}")
        if block == bytes(C.TAR_BLOCK):
            if self._read(C.TAR_BLOCK, "the end-of-archive marker") != bytes(C.TAR_BLOCK):
                raise ArtifactError(
                    f"{self.path}: a zero block inside the archive, before member {self.count} (corrupt pack)"
                )
            self._ended = True
            return None
        member = self._parse_header(block)
        self.count += 1
        return member

    def _parse_header(self, block: bytes) -> tuple[str, int]:
        where = f"{self.path}: member {self.count}"
        stored = _octal(block[148:156])
        if stored is None or stored != sum(block[:148]) + 8 * 32 + sum(block[156:]):
            raise ArtifactError(f"{where}: header checksum does not match (corrupt pack, or not a tar stream)")
        if block[257:265] != b"ustar\x0000":
            raise ArtifactError(f"{where}: not a POSIX ustar header; write packs with `precompile pack`")
        name = _field(block[345:500], where, "prefix")
        base = _field(block[0:100], where, "name")
        name = f"{name}/{base}" if name else base
        kind = block[156:157]
        if kind != b"0":
            what = _REFUSED_TYPES.get(kind, f"an entry of unknown type {kind!r}")
            raise ArtifactError(f"{where} {name!r}: {what}; a pack holds regular files only")
        check_member_path(name, where)
        if block[124] & 0x80:  # GNU base-256, written for members of 8 GiB and more
            if block[124] != 0x80:
                raise ArtifactError(f"{where} {name!r}: negative or oversized size field")
            size = int.from_bytes(block[125:136], "big")
        else:
            size = _octal(block[124:136])
            if size is None:
                raise ArtifactError(f"{where} {name!r}: size field is not an octal number")
        if size > MAX_INT:
            raise ArtifactError(f"{where} {name!r}: size {size} is not a real file size")
        return name, size

    def read_data(self, size: int, name: str) -> bytes:
        data = self._read(size, f"member {name!r}")
        self._skip_padding(size, name)
        return data

    def copy_data(self, size: int, name: str, write: Callable[[bytes], Any] | None) -> str:
        """Stream a member's data to ``write``; return its sha256."""
        digest = hashlib.sha256()
        left = size
        while left:
            chunk = self._read(min(left, CHUNK), f"member {name!r}")
            digest.update(chunk)
            if write is not None:
                write(chunk)
            left -= len(chunk)
        self._skip_padding(size, name)
        return digest.hexdigest()

    def _skip_padding(self, size: int, name: str) -> None:
        if any(self._read(_padding(size), f"the padding after member {name!r}")):
            raise ArtifactError(f"{self.path}: non-zero padding after member {name!r} (corrupt pack)")

    # -- structure

    def head(self) -> PackHead:
        member = self.next_member()
        if member is None:
            raise ArtifactError(f"{self.path}: the pack is empty (it ends before {C.MANIFEST_FILE})")
        name, size = member
        if name != C.MANIFEST_FILE:
            raise ArtifactError(
                f"{self.path}: the first member is {name!r}; a pack starts with {C.MANIFEST_FILE} (write packs with "
                "`precompile pack`)"
            )
        if size > C.MAX_MANIFEST_BYTES:
            raise ArtifactError(
                f"{self.path}: {C.MANIFEST_FILE} is {size} bytes, more than the {C.MAX_MANIFEST_BYTES} allowed"
            )
        manifest_bytes = self.read_data(size, name)
        manifest = parse_manifest(manifest_bytes, source=f"{self.path}: {C.MANIFEST_FILE}")
        for reserved in RESERVED:
            if reserved in manifest.files:
                raise ArtifactError(f"{self.path}: the manifest lists {reserved} among its files, a reserved name")
        self.budget = (
            self.offset
            + member_bytes(C.MAX_SIGNATURE_BYTES)
            + sum(member_bytes(e.size) for e in manifest.files.values())
            + 2 * C.TAR_BLOCK
            + C.MAX_TAR_TRAILER
        )
        if self._frames is not None:
            declared = sum(fr.content_size for fr in self._frames)
            if declared > self.budget:
                raise ArtifactError(
                    f"{self.path}: the pack's frames declare {declared} bytes, more than the {self.budget} its manifest "
                    "accounts for (decompression bomb?)"
                )
        signature = None
        member = self.next_member()
        if member is not None and member[0] == C.SIGNATURE_FILE:
            if member[1] > C.MAX_SIGNATURE_BYTES:
                raise ArtifactError(
                    f"{self.path}: {C.SIGNATURE_FILE} is {member[1]} bytes, more than the {C.MAX_SIGNATURE_BYTES} allowed"
                )
            signature = self.read_data(member[1], member[0])
        else:
            self._pending = member
        return PackHead(self.path, manifest, manifest_bytes, signature, manifest_digest(manifest_bytes))

    def finish(self) -> None:
        """After the end-of-archive marker: zero padding at most, then the end of every frame."""
        trailer = 0
        while True:
            try:
                chunk = self._stream.read(C.TAR_BLOCK)
            except self._zstd_error as e:
                raise ArtifactError(f"{self.path}: corrupt compressed data at the end of the pack ({e})") from None
            if not chunk:
                break
            trailer += len(chunk)
            if trailer > C.MAX_TAR_TRAILER or any(chunk):
                raise ArtifactError(
                    f"{self.path}: data after the end of the archive (corrupt pack, or not one `precompile pack` wrote)"
                )
        if self._frames is not None and self.offset + trailer != sum(fr.content_size for fr in self._frames):
            raise ArtifactError(f"{self.path}: the frames' declared sizes do not match their content (corrupt pack)")


def open_decompressed(f: BinaryIO) -> Any:
    """The decompressed stream of every frame in ``f``, read on demand: ``read(n)`` never makes more
    than ``n`` bytes, whatever the frame headers claim. (One function, so tests can watch it.)"""
    zstandard = import_extra("zstandard", "a pack (.tar.zst)")

    dctx = zstandard.ZstdDecompressor(max_window_size=MAX_WINDOW)
    return dctx.stream_reader(f, read_size=1 << 17, read_across_frames=True, closefd=False)


def _octal(field: bytes) -> int | None:
    text = field.rstrip(b"\0 ").lstrip(b" ")
    if not text or any(c not in b"01234567" for c in text):
        return None
    return int(text, 8)


def _field(raw: bytes, where: str, what: str) -> str:
    value, _, rest = raw.partition(b"\0")
    if any(rest):
        raise ArtifactError(f"{where}: bytes after the end of its {what} field (corrupt pack)")
    try:
        return value.decode("utf-8")
    except UnicodeDecodeError:
        raise ArtifactError(f"{where}: {what} is not UTF-8") from None
