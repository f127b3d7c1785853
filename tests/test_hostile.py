"""Hostile input. Every malformed, truncated, corrupted, crafted or mixed-up artifact or pack ends in
ArtifactError (or IncompatibleArtifactError) with a message naming the problem; nothing is written
outside the cache's temporary folder; the process never crashes. The corpus is generated here from
the session artifacts, and hypothesis searches manifest parsing and the pack reader beyond it."""

from __future__ import annotations

import copy
import hashlib
import io
import json
import shutil
import struct
import tempfile
from pathlib import Path

import pytest
import zstandard
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import loader
import loader.stores.pack
from loader import ArtifactError, parse_manifest
from loader import constants as C
from loader.stores.pack import tar_header, unpack
from precompile.ship.sign import sign

BLOCK = C.TAR_BLOCK
END = bytes(2 * BLOCK)


# --- crafting ------------------------------------------------------------------------------------


def header(
    name: str | bytes,
    size: int,
    *,
    kind: bytes = b"0",
    link: bytes = b"",
    magic: bytes = b"ustar\x0000",
    size_field: bytes | None = None,
) -> bytes:
    raw = name if isinstance(name, bytes) else name.encode()
    h = bytearray(tar_header("x", size))
    h[0:100] = raw[:100].ljust(100, b"\0")
    h[156:157] = kind
    h[157:257] = link.ljust(100, b"\0")
    h[257:265] = magic
    if size_field is not None:
        h[124:136] = size_field
    h[148:156] = b" " * 8
    h[148:156] = b"%06o\x00 " % sum(h)
    return bytes(h)


def member(name: str | bytes, data: bytes, **kw) -> bytes:
    return header(name, len(data), **kw) + data + bytes(-len(data) % BLOCK)


def frame(data: bytes, *, checksum: bool = True, content_size: bool = True) -> bytes:
    return zstandard.ZstdCompressor(write_checksum=checksum, write_content_size=content_size).compress(data)


def folder_files(folder: Path) -> dict[str, bytes]:
    manifest = loader.artifact.read_manifest(folder)
    return {rel: (folder / rel).read_bytes() for rel in sorted(manifest.files)}


def tree(root: Path) -> set[str]:
    return {p.relative_to(root).as_posix() for p in root.rglob("*")}


def assert_nothing_outside_the_cache_tmp(sandbox: Path) -> None:
    """Only the input and the cache's own skeleton: no entry, no leftover, nothing elsewhere."""
    allowed = {"in.tar.zst", "cache", "cache/CACHEDIR.TAG", "cache/artifacts", "cache/locks", "cache/tmp"}
    extra = {p for p in tree(sandbox) - allowed if not (p.startswith("cache/locks/") and p.endswith(".lock"))}
    assert extra == set()


def load_pack_bytes(sandbox: Path, data: bytes, **kw) -> None:
    """Load a pack from ``data``; where it is refused, nothing of it is left in the cache (where it
    is not, a harmless flip, the cache holds its entry as it should)."""
    path = sandbox / "in.tar.zst"
    path.write_bytes(data)
    try:
        loader.load(path, cache_dir=sandbox / "cache", **kw)
    except BaseException:
        assert_nothing_outside_the_cache_tmp(sandbox)
        raise


@pytest.fixture(scope="module")
def parts(classifier_artifact):
    """The classifier's manifest and files as tar members, to assemble hostile packs from."""
    manifest = (classifier_artifact / "manifest.json").read_bytes()
    files = folder_files(classifier_artifact)
    return manifest, files


def valid_body(files: dict[str, bytes]) -> bytes:
    return b"".join(member(rel, data) for rel, data in files.items()) + END


# --- crafted packs -------------------------------------------------------------------------------


def _case(manifest: bytes, files: dict[str, bytes], which: str) -> bytes:
    first, *rest = files
    head = member("manifest.json", manifest)
    body = valid_body(files)
    cases = {
        "symlink": lambda: frame(head + member("weights.safetensors", b"", kind=b"2", link=b"/etc/passwd") + body),
        "hardlink": lambda: frame(head + member("weights.safetensors", b"", kind=b"1", link=b"manifest.json") + body),
        "char-device": lambda: frame(head + member("dev", b"", kind=b"3") + body),
        "block-device": lambda: frame(head + member("dev", b"", kind=b"4") + body),
        "directory": lambda: frame(head + member("variants", b"", kind=b"5") + body),
        "fifo": lambda: frame(head + member("pipe", b"", kind=b"6") + body),
        "pax-header": lambda: frame(head + member("PaxHeader", b"20 path=../escape\n", kind=b"x") + body),
        "gnu-long-name": lambda: frame(head + member("././@LongLink", b"../../escape\0", kind=b"L") + body),
        "traversal": lambda: frame(head + member("../../escape", b"evil") + body),
        "deep-traversal": lambda: frame(head + member("variants/../../../escape", b"evil") + body),
        "absolute-path": lambda: frame(head + member("/tmp/escape", b"evil") + body),
        "backslash-path": lambda: frame(head + member("..\\escape", b"evil") + body),
        "not-listed": lambda: frame(head + member("extra.bin", b"surprise") + body),
        "duplicate": lambda: frame(head + member(first, files[first]) + body),
        "size-mismatch": lambda: frame(head + member(first, files[first] + b"!") + body),
        "manifest-not-first": lambda: frame(body[: -len(END)] + head + END),
        "manifest-twice": lambda: frame(head + head + body),
        "signature-out-of-place": lambda: frame(
            head + member(first, files[first]) + member("signature.json", b"{}") + END
        ),
        "empty-archive": lambda: frame(END),
        "missing-member": lambda: frame(head + b"".join(member(r, files[r]) for r in rest) + END),
        "junk-after-end": lambda: frame(head + body + b"junk" + bytes(BLOCK - 4)),
        "too-much-padding-after-end": lambda: frame(head + body + bytes(64 * BLOCK)),
        "bad-header-checksum": lambda: frame(head[:100] + b"\x01" + head[101:] + body),
        "gnu-magic": lambda: frame(member("manifest.json", manifest, magic=b"ustar  \0") + body),
        "octal-garbage-size": lambda: frame(header("manifest.json", 0, size_field=b"0000000z000\0") + body),
        "negative-base256-size": lambda: frame(header("manifest.json", 0, size_field=b"\xff" * 12) + body),
        "huge-manifest-member": lambda: frame(header("manifest.json", 1 << 30) + bytes(BLOCK)),
        "not-utf8-name": lambda: frame(head + member(b"\xff\xfe", b"x") + body),
        "zero-block-inside": lambda: frame(head + bytes(BLOCK) + member(first, files[first]) + END),
        "nonzero-padding": lambda: (
            frame(head[:-1] + b"x" + body) if len(manifest) % BLOCK else frame(head + body[:-1] + b"x")
        ),
        "not-zstd": lambda: head + body,
        "no-checksum": lambda: frame(head + body, checksum=False),
        "no-content-size": lambda: frame(head, content_size=False) + frame(body),
        "appended-bytes": lambda: frame(head) + frame(body) + b"trailing",
        "skippable-frame": lambda: struct.pack("<II", 0x184D2A50, 4) + b"skip" + frame(head + body),
        "frame-size-lies": lambda: _lying_frame(head + body),
        "empty-file": lambda: b"",
    }
    return cases[which]()


def _lying_frame(data: bytes) -> bytes:
    """A frame whose header declares one byte less than it holds (patched after compression)."""
    good = frame(data)
    params = zstandard.get_frame_parameters(good)
    fcs = params.content_size.to_bytes(4, "little")
    i = good.index(fcs, 4)
    return good[:i] + (params.content_size - 1).to_bytes(4, "little") + good[i + 4 :]


CRAFTED = {
    "symlink": "a symbolic link; a pack holds regular files only",
    "hardlink": "a hard link; a pack holds regular files only",
    "char-device": "a character device; a pack holds regular files only",
    "block-device": "a block device",
    "directory": "a directory; a pack holds regular files only",
    "fifo": "a FIFO",
    "pax-header": "a pax extended header",
    "gnu-long-name": "a GNU long name",
    "traversal": "unsafe file path '../../escape'",
    "deep-traversal": "unsafe file path 'variants/../../../escape'",
    "absolute-path": "unsafe file path '/tmp/escape'",
    "backslash-path": "unsafe file path",
    "not-listed": "member 'extra.bin': not listed in the manifest",
    "duplicate": "appears twice",
    "size-mismatch": r"is \d+ bytes, the manifest says \d+",
    "manifest-not-first": "the first member is .*; a pack starts with manifest.json",
    "manifest-twice": "member 'manifest.json': out of place",
    "signature-out-of-place": "member 'signature.json': out of place",
    "empty-archive": "the pack is empty",
    "missing-member": "is listed in the manifest but missing from the pack",
    "junk-after-end": "data after the end of the archive",
    "too-much-padding-after-end": "data after the end of the archive",
    "bad-header-checksum": "header checksum does not match",
    "gnu-magic": "not a POSIX ustar header",
    "octal-garbage-size": "size field is not an octal number",
    "negative-base256-size": "negative or oversized size field",
    "huge-manifest-member": "manifest.json is 1073741824 bytes, more than the 16777216 allowed",
    "not-utf8-name": "name is not UTF-8",
    "zero-block-inside": "a zero block inside the archive",
    "nonzero-padding": "non-zero padding",
    "not-zstd": "not a pack .it does not start with a zstandard frame",
    "no-checksum": "carries no checksum",
    "no-content-size": "does not declare its decompressed size",
    "appended-bytes": "does not start a frame .bytes appended",
    "skippable-frame": "not a pack|does not start a frame",
    "frame-size-lies": "corrupt|declare|ends early",
    "empty-file": "not a pack",
}


@pytest.mark.parametrize("case", sorted(CRAFTED))
def test_a_crafted_pack_is_refused_by_name_and_writes_nothing(parts, tmp_path, case):
    manifest, files = parts
    with pytest.raises(ArtifactError, match=CRAFTED[case]):
        load_pack_bytes(tmp_path, _case(manifest, files, case))
    assert not (tmp_path / "escape").exists() and not (tmp_path / "cache" / "escape").exists()


def test_a_manifest_listing_a_traversal_path_is_refused(parts, tmp_path):
    manifest, files = parts
    m = json.loads(manifest)
    m["files"]["../escape"] = {"size": 4, "sha256": hashlib.sha256(b"evil").hexdigest()}
    data = json.dumps(m).encode()
    with pytest.raises(ArtifactError, match=r"files: unsafe file path '\.\./escape'"):
        load_pack_bytes(tmp_path, frame(member("manifest.json", data) + valid_body(files)))


def test_a_manifest_listing_reserved_names_is_refused(parts, tmp_path):
    manifest, files = parts
    m = json.loads(manifest)
    m["files"]["signature.json"] = {"size": 2, "sha256": hashlib.sha256(b"{}").hexdigest()}
    with pytest.raises(ArtifactError, match="lists signature.json among its files, a reserved name"):
        load_pack_bytes(tmp_path, frame(member("manifest.json", json.dumps(m).encode()) + valid_body(files)))


def test_a_decompression_bomb_is_refused_without_being_expanded(parts, tmp_path, monkeypatch):
    """A 16 KB frame that declares and holds 512 MiB of zeros, after a valid manifest."""
    manifest, _ = parts
    out = io.BytesIO()
    writer = zstandard.ZstdCompressor(write_checksum=True).stream_writer(out, size=512 << 20, closefd=False)
    zeros = bytes(1 << 20)
    for _ in range(512):
        writer.write(zeros)
    writer.flush(zstandard.FLUSH_FRAME)
    bomb = frame(member("manifest.json", manifest)) + out.getvalue()
    assert len(bomb) < 64 * 1024
    produced = []
    real = loader.stores.pack.open_decompressed

    class Counting:
        def __init__(self, f):
            self.inner = real(f)

        def read(self, n):
            chunk = self.inner.read(n)
            produced.append(len(chunk))
            return chunk

    monkeypatch.setattr(loader.stores.pack, "open_decompressed", Counting)
    with pytest.raises(
        ArtifactError,
        match=r"frames declare 53687\d+ bytes, more than the \d+ its manifest accounts for \(decompression bomb\?\)",
    ):
        load_pack_bytes(tmp_path, bomb)
    assert sum(produced) < 1 << 20


def test_a_bomb_without_a_manifest_is_refused_at_once(tmp_path):
    out = io.BytesIO()
    writer = zstandard.ZstdCompressor(write_checksum=True).stream_writer(out, size=64 << 20, closefd=False)
    for _ in range(64):
        writer.write(bytes(1 << 20))
    writer.flush(zstandard.FLUSH_FRAME)
    with pytest.raises(ArtifactError, match="the pack is empty"):
        load_pack_bytes(tmp_path, out.getvalue())


# --- truncations and bit flips -------------------------------------------------------------------


def test_a_pack_truncated_anywhere_is_refused(classifier_pack, tmp_path):
    data = classifier_pack.read_bytes()
    cuts = sorted(set(range(0, len(data), len(data) // 40)) | set(range(len(data) - 9, len(data))) | {4, 5, 17, 1000})
    for cut in cuts:
        with pytest.raises(ArtifactError, match="truncated|ends early|not a pack|empty|frame"):
            load_pack_bytes(tmp_path, data[:cut])


def test_a_bit_flipped_anywhere_in_a_pack_is_refused_or_harmless(classifier_pack, tmp_path):
    """A flip that still decodes to the very same bytes (a zstd match moved within a run of zeros)
    is harmless: every member is checked by sha256. Any other flip is refused."""
    data = classifier_pack.read_bytes()
    original = _decompressed(data)
    positions = sorted(
        set(range(0, 64, 3)) | set(range(0, len(data), len(data) // 40)) | set(range(len(data) - 8, len(data)))
    )
    refused = 0
    for i, pos in enumerate(positions):
        flipped = bytearray(data)
        flipped[pos] ^= 1 << (i % 8)
        sandbox = tmp_path / str(pos)
        sandbox.mkdir()
        try:
            load_pack_bytes(sandbox, bytes(flipped))
        except ArtifactError:
            refused += 1
            continue
        assert _decompressed(bytes(flipped)) == original, pos
    assert refused >= len(positions) - 3


def _decompressed(data: bytes) -> bytes:
    return zstandard.ZstdDecompressor().stream_reader(io.BytesIO(data), read_across_frames=True).read()


@pytest.fixture(scope="module")
def signed_copy(classifier_artifact, signing_keys, tmp_path_factory) -> Path:
    folder = tmp_path_factory.mktemp("hostile") / "signed"
    shutil.copytree(classifier_artifact, folder)
    sign(folder, signing_keys[0])
    return folder


@pytest.mark.parametrize("rel", ["manifest.json", "signature.json", "weights.safetensors", "variants/dynamic.pt2"])
def test_a_bit_flipped_in_any_file_of_a_signed_artifact_is_refused(signed_copy, signing_keys, tmp_path, rel):
    original = (signed_copy / rel).read_bytes()
    step = max(1, len(original) // 25)
    for i, pos in enumerate(range(0, len(original), step)):
        folder = tmp_path / str(pos)
        shutil.copytree(signed_copy, folder)
        flipped = bytearray(original)
        flipped[pos] ^= 1 << (i % 8)
        (folder / rel).write_bytes(bytes(flipped))
        with pytest.raises(ArtifactError, match="JSON|manifest|signature|sha256|expected|does not match|not"):
            loader.load(folder, trusted_keys=[signing_keys[1]])
        shutil.rmtree(folder)


@pytest.mark.parametrize("rel", ["manifest.json", "weights.safetensors", "variants/dynamic.pt2"])
def test_a_file_truncated_anywhere_is_refused(classifier_artifact, tmp_path, rel):
    folder = tmp_path / "a"
    shutil.copytree(classifier_artifact, folder)
    original = (folder / rel).read_bytes()
    end = len(original.rstrip()) if rel == "manifest.json" else len(original)  # a trailing newline is no loss
    for cut in sorted(set(range(0, end, max(1, end // 20))) | {end - 1}):
        (folder / rel).write_bytes(original[:cut])
        with pytest.raises(ArtifactError, match="not valid JSON|bytes, the manifest says"):
            loader.load(folder)


def test_a_symlink_in_an_artifact_folder_is_refused(classifier_artifact, tmp_path):
    folder = tmp_path / "a"
    shutil.copytree(classifier_artifact, folder)
    (tmp_path / "elsewhere").write_bytes((folder / "weights.safetensors").read_bytes())
    (folder / "weights.safetensors").unlink()
    (folder / "weights.safetensors").symlink_to(tmp_path / "elsewhere")
    with pytest.raises(ArtifactError, match="weights.safetensors is not a regular file"):
        loader.load(folder)


# --- hostile manifests ---------------------------------------------------------------------------


def _nested(depth: int) -> bytes:
    return b"[" * depth + b"]" * depth


MANIFESTS = {
    "missing-key": (lambda m: m.pop("variants"), r"missing key\(s\) \['variants'\]"),
    "missing-nested-key": (lambda m: m["target"].pop("device"), r"target: missing key\(s\) \['device'\]"),
    "unknown-key": (lambda m: m.update(surprise=1), r"unknown key\(s\) \['surprise'\]"),
    "name-not-a-string": (lambda m: m.update(name=5), "name: expected a string, got int"),
    "files-a-list": (lambda m: m.update(files=[]), "files: expected an object, got a list"),
    "target-null": (lambda m: m.update(target=None), "target: expected an object, got null"),
    "size-2**64": (
        lambda m: m["files"]["weights.safetensors"].update(size=2**64),
        r"weights.safetensors.size: 18446744073709551616 is outside",
    ),
    "size-negative": (lambda m: m["files"]["weights.safetensors"].update(size=-1), r"size: -1 is outside"),
    "size-a-float": (lambda m: m["files"]["weights.safetensors"].update(size=1.5), "expected an integer, got float"),
    "size-a-bool": (
        lambda m: m["files"]["weights.safetensors"].update(size=True),
        "expected an integer, got a boolean",
    ),
    "dim-10**30": (
        lambda m: m["dims"]["seq"].update(max=10**30),
        r"dims.seq\[1\]: 1000000000000000000000000000000 is outside",
    ),
    "version-huge": (lambda m: m.update(version=10**20), "version: 100000000000000000000 is outside"),
    "version-zero": (lambda m: m.update(version=0), r"version: 0 is outside \[1, "),
    "version-nan": (lambda m: m.update(version=float("nan")), "version: expected an integer, got float"),
    "dim-infinite": (
        lambda m: m["dims"]["seq"].update(max=float("inf")),
        r"dims.seq\[1\]: expected an integer, got float",
    ),
    "sha-not-hex": (
        lambda m: m["files"]["weights.safetensors"].update(sha256="Z" * 64),
        "sha256: 'ZZZZ.* does not match",
    ),
    "traversal-file": (
        lambda m: m["files"].update({"../x": {"size": 1, "sha256": "0" * 64}}),
        r"unsafe file path '\.\./x'",
    ),
    "absolute-file": (
        lambda m: m["files"].update({"/etc/passwd": {"size": 1, "sha256": "0" * 64}}),
        "unsafe file path '/etc/passwd'",
    ),
    "variant-file-unlisted": (
        lambda m: m["variants"][0].update(file="variants/other.pt2"),
        "'variants/other.pt2' is not listed in files",
    ),
    "huge-string": (lambda m: m.update(created="x" * 5000), "created: string is longer than 4096"),
    "many-inputs": (lambda m: m.update(inputs=[{}] * 2000), "inputs: list has 2000 items, more than 1024"),
    "expires-not-a-date": (lambda m: m.update(expires="tomorrow"), "expires: 'tomorrow' is not an ISO 8601 date-time"),
    "expires-naive": (lambda m: m.update(expires="2030-01-01T00:00:00"), "needs a time zone"),
    "format-other": (lambda m: m.update(format="zip"), "format: not 'precompile-artifact'"),
    "first-calls-of-unknown": (
        lambda m: m["variants"][0].update(first_calls_of="nope"),
        r"variants\[0\].first_calls_of: 'nope' is not another variant that serves calls itself",
    ),
    "first-calls-of-itself": (
        lambda m: m["variants"][0].update(first_calls_of=m["variants"][0]["id"]),
        "is not another variant that serves calls itself",
    ),
    "first-calls-of-other-ranges": (
        lambda m: _twin(m, dims={d: [lo, hi - 1] for d, (lo, hi) in m["variants"][0]["dims"].items()}),
        r"first_calls_of: must be dynamic with '.*'s ranges, device, dtype and precision",
    ),
    "first-calls-of-a-twin": (
        lambda m: (_twin(m), _twin(m, "twin2", of="twin")),
        "'twin' is not another variant that serves calls itself",
    ),
    "first-calls-twice": (
        lambda m: (_twin(m), _twin(m, "twin2")),
        "has its first calls served by two variants",
    ),
}


def _twin(m: dict, vid: str = "twin", of: str | None = None, **changes) -> None:
    """A copy of the first variant (its file too) that serves the first calls of ``of`` (the first's id)."""
    first = m["variants"][0]
    m["variants"].append({**first, "id": vid, "first_calls_of": of or first["id"], **changes})


@pytest.mark.parametrize("case", sorted(MANIFESTS))
def test_a_hostile_manifest_is_refused_naming_the_key(classifier_artifact, tmp_path, case):
    edit, message = MANIFESTS[case]
    m = json.loads((classifier_artifact / "manifest.json").read_text())
    edit(m)
    folder = tmp_path / "a"
    shutil.copytree(classifier_artifact, folder)
    (folder / "manifest.json").write_text(json.dumps(m))
    with pytest.raises(ArtifactError, match=message):
        loader.load(folder)


@pytest.mark.parametrize(
    "text, message",
    [
        (b"", "not valid JSON"),
        (b"\x89PNG\r\n\x1a\n\0\0\0", "not valid JSON"),
        (b"[]", "manifest: expected an object, got a list"),
        (_nested(100_000), "not valid JSON"),
        (b'{"format": "precompile-artifact", "format_version": 1' + b"0" * 5000 + b"}", "not valid JSON"),
        (
            b'{"format": "precompile-artifact", "format_version": 1}',
            r"manifest: missing key\(s\) \['constants', 'created'",
        ),
        (b" " * (C.MAX_MANIFEST_BYTES + 1), "more than the 16777216 allowed"),
    ],
    ids=["empty", "binary", "a-list", "nested-100000", "5000-digit-number", "nearly-empty", "too-large"],
)
def test_a_manifest_that_is_not_one_is_refused(classifier_artifact, tmp_path, text, message):
    folder = tmp_path / "a"
    shutil.copytree(classifier_artifact, folder)
    (folder / "manifest.json").write_bytes(text)
    with pytest.raises(ArtifactError, match=message):
        loader.load(folder)


# --- hostile weights and mixed-up artifacts ------------------------------------------------------


def _rehash(folder: Path, rel: str) -> None:
    """What an attacker who can also rewrite the (unsigned) manifest does after swapping a file."""
    m = json.loads((folder / "manifest.json").read_text())
    data = (folder / rel).read_bytes()
    m["files"][rel] = {"size": len(data), "sha256": hashlib.sha256(data).hexdigest()}
    (folder / "manifest.json").write_text(json.dumps(m))


def _safetensors(header: dict | bytes, data: bytes, header_len: int | None = None) -> bytes:
    raw = header if isinstance(header, bytes) else json.dumps(header).encode()
    return struct.pack("<Q", len(raw) if header_len is None else header_len) + raw + data


def _weights_case(real: bytes, case: str) -> bytes:
    (n,) = struct.unpack("<Q", real[:8])
    header, data = json.loads(real[8 : 8 + n]), real[8 + n :]
    first = next(k for k in header if k != "__metadata__")

    def edit(**changes):
        h = copy.deepcopy(header)
        h[first].update(changes)
        return _safetensors(h, data)

    return {
        "too-short": lambda: b"\x01\x02",
        "header-len-huge": lambda: _safetensors(b"{}", data, header_len=2**63),
        "header-past-end": lambda: _safetensors(b"{}", b"", header_len=4096),
        "header-not-json": lambda: _safetensors(b"{not json", data),
        "header-a-list": lambda: _safetensors(b"[1, 2]", data),
        "unknown-dtype": lambda: edit(dtype="F8_E4M3"),
        "negative-shape": lambda: edit(shape=[-1, 16]),
        "huge-shape": lambda: edit(shape=[2**50, 2**50]),
        "offsets-outside": lambda: edit(data_offsets=[0, 10**12]),
        "offsets-vs-shape": lambda: edit(data_offsets=[0, 8]),
        "misaligned": lambda: edit(shape=[1], data_offsets=[2, 6]),
        "overlap": lambda: _safetensors({**header, "twin": header[first]}, data),
        "extra-field": lambda: edit(extra=1),
        "constant-missing": lambda: _safetensors({k: v for k, v in header.items() if k != first}, data),
        "constant-wrong-dtype": lambda: edit(dtype="I32"),
    }[case]()


WEIGHTS = {
    "too-short": "too short for a safetensors file",
    "header-len-huge": "header of 9223372036854775808 bytes is larger than allowed",
    "header-past-end": "runs past the end of the file",
    "header-not-json": "header is not valid JSON",
    "header-a-list": "header is not a JSON object",
    "unknown-dtype": "unsupported dtype 'F8_E4M3'",
    "negative-shape": r"shape \[-1, 16\] is not a list of sizes",
    "huge-shape": "is not a list of sizes|lie outside|span",
    "offsets-outside": "lie outside the",
    "offsets-vs-shape": "data_offsets span 8 bytes but shape",
    "misaligned": "offset 2 is not aligned to 4 bytes",
    "overlap": "overlap",
    "extra-field": "entry must have exactly dtype, shape and data_offsets",
    "constant-missing": "constant .* is missing",
    "constant-wrong-dtype": "the compiled code expects float32",
}


@pytest.mark.parametrize("case", sorted(WEIGHTS))
def test_a_hostile_weights_header_is_refused_by_name(classifier_artifact, tmp_path, case):
    folder = tmp_path / "a"
    shutil.copytree(classifier_artifact, folder)
    (folder / "weights.safetensors").write_bytes(_weights_case((folder / "weights.safetensors").read_bytes(), case))
    _rehash(folder, "weights.safetensors")
    with pytest.raises(ArtifactError, match=WEIGHTS[case]):
        loader.load(folder)


@pytest.mark.parametrize("rel", ["weights.safetensors", "variants/dynamic.pt2", "manifest.json"])
@pytest.mark.parametrize("rehash", [False, True], ids=["as-is", "manifest-rehashed"])
def test_files_swapped_between_two_valid_artifacts_are_refused(
    classifier_artifact, structured_artifact, tmp_path, rel, rehash
):
    folder = tmp_path / "a"
    shutil.copytree(classifier_artifact, folder)
    shutil.copy(structured_artifact / rel, folder / rel)
    if rehash and rel != "manifest.json":
        _rehash(folder, rel)
    with pytest.raises(
        ArtifactError,
        match="sha256|bytes, the manifest says|constant|compiled code needs|compiled code takes|is missing",
    ):
        loader.load(folder)


# --- property-based: manifest parsing and the pack reader ------------------------------------------

JSON_VALUES = st.recursive(
    st.none() | st.booleans() | st.integers(min_value=-(2**70), max_value=2**70) | st.floats() | st.text(max_size=12),
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=8), inner, max_size=4),
    max_leaves=6,
)
FAST = settings(
    max_examples=2000,
    derandomize=True,
    database=None,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture, HealthCheck.data_too_large],
)


def _pick(data, value) -> list:
    """A random path into a JSON value, found by walking down (cheaper than listing every node)."""
    path = []
    while isinstance(value, (dict, list)) and value and data.draw(st.integers(0, 3)):
        key = data.draw(st.sampled_from(list(value) if isinstance(value, dict) else range(len(value))))
        path.append(key)
        value = value[key]
    return path


@pytest.fixture(scope="module")
def manifest_text(classifier_artifact) -> str:
    return (classifier_artifact / "manifest.json").read_text()


@pytest.fixture(scope="module")
def manifest_dict(manifest_text) -> dict:
    return json.loads(manifest_text)


@FAST
@given(data=st.data())
def test_property_manifest_parsing_accepts_or_names_the_problem(manifest_text, data):
    m = json.loads(manifest_text)
    for _ in range(data.draw(st.integers(1, 3))):
        path = _pick(data, m)
        op = data.draw(st.sampled_from(["replace", "delete", "insert"]))
        if not path:
            if op == "replace":
                m = data.draw(JSON_VALUES)
            continue
        parent = m
        for key in path[:-1]:
            parent = parent[key]
        if op == "replace":
            parent[path[-1]] = data.draw(JSON_VALUES)
        elif op == "delete":
            del parent[path[-1]]
        elif isinstance(parent, dict):
            parent[data.draw(st.text(max_size=8))] = data.draw(JSON_VALUES)
        else:
            parent.insert(path[-1], data.draw(JSON_VALUES))
    text = json.dumps(m).encode()
    if data.draw(st.booleans()):
        raw = bytearray(text)
        for _ in range(data.draw(st.integers(1, 4))):
            raw[data.draw(st.integers(0, len(raw) - 1))] = data.draw(st.integers(0, 255))
        text = bytes(raw)
    try:
        manifest = parse_manifest(text)
    except ArtifactError as e:
        assert str(e).startswith("manifest.json: ")
        return
    # What parses has a canonical form (what signatures and cache keys cover) that is stable and
    # means the same manifest; and what the build writes (to_json) reads back the same.
    canonical = loader.artifact.canonical_manifest
    assert canonical(canonical(text)) == canonical(text)
    assert canonical(parse_manifest(canonical(text))) == canonical(manifest)
    assert canonical(parse_manifest(manifest.to_json())) == canonical(manifest)


class SmallPack:
    """A pack with the classifier's manifest but files of a few hundred bytes, for fast examples."""

    def __init__(self, manifest: dict, folder: Path):
        m = copy.deepcopy(manifest)
        self.files = {
            rel: bytes((i * 7 + n) % 251 for n in range(100 + 300 * i)) for i, rel in enumerate(sorted(m["files"]))
        }
        for rel, data in self.files.items():
            (folder / rel).parent.mkdir(parents=True, exist_ok=True)
            (folder / rel).write_bytes(data)
            m["files"][rel] = {"size": len(data), "sha256": hashlib.sha256(data).hexdigest()}
        (folder / "manifest.json").write_text(json.dumps(m))
        self.manifest = parse_manifest((folder / "manifest.json").read_bytes())
        buf = io.BytesIO()
        loader.stores.pack.write_pack(folder, buf)
        self.packed = buf.getvalue()
        self.tar = _decompressed(self.packed)

    def __repr__(self) -> str:  # hypothesis prints the arguments of a failing example
        return "<SmallPack>"


@pytest.fixture(scope="module")
def small_pack(manifest_dict, tmp_path_factory) -> SmallPack:
    return SmallPack(manifest_dict, tmp_path_factory.mktemp("small"))


@FAST
@given(data=st.data())
def test_property_the_pack_reader_unpacks_consistently_or_refuses(small_pack, data):
    """Whatever the bytes, unpack() either refuses with ArtifactError having written nothing outside
    its folder, or leaves exactly a manifest and the files it lists, each as it lists them. (Without a
    signature a changed manifest can still be a valid one; authenticity is the signature's job.)"""
    layer = data.draw(st.sampled_from(["tar", "zstd"]))
    raw = bytearray(small_pack.tar if layer == "tar" else small_pack.packed)
    op = data.draw(st.sampled_from(["flip", "truncate", "insert", "overwrite-block"]))
    at = data.draw(st.integers(0, len(raw) - 1))
    if op == "flip":
        for _ in range(data.draw(st.integers(1, 3))):
            raw[data.draw(st.integers(0, len(raw) - 1))] ^= 1 << data.draw(st.integers(0, 7))
    elif op == "truncate":
        del raw[at:]
    elif op == "insert":
        raw[at:at] = data.draw(st.binary(min_size=1, max_size=600))
    else:
        start = at - at % BLOCK
        raw[start : start + BLOCK] = data.draw(st.binary(min_size=BLOCK, max_size=BLOCK))
    blob = frame(bytes(raw)) if layer == "tar" else bytes(raw)
    with tempfile.TemporaryDirectory() as sandbox:
        path, dest = Path(sandbox) / "in.tar.zst", Path(sandbox) / "dest"
        path.write_bytes(blob)
        dest.mkdir()
        try:
            unpack(path, dest)
        except ArtifactError as e:
            assert str(e).startswith(str(path)) or str(e).startswith(str(dest))
            assert {p for p in tree(Path(sandbox)) if not p.startswith("dest")} == {"in.tar.zst"}
            return
        manifest = parse_manifest((dest / "manifest.json").read_bytes())
        loader.artifact.verify_files(dest, manifest)
        written = {p for p in tree(dest) if (dest / p).is_file()}
        assert written == set(manifest.files) | {"manifest.json"}
        if manifest == small_pack.manifest:
            assert {rel: (dest / rel).read_bytes() for rel in small_pack.files} == small_pack.files
