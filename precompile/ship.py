"""Shipping an artifact from CI to serving hosts: pack it, sign it, verify it.

The formats belong to the loader (``loader.pack``, ``loader.trust``); this module is the build side's
use of them: it writes files atomically, turns user mistakes into PrecompileError, and gathers the
checks ``precompile verify`` reports.
"""

from __future__ import annotations

import datetime
import os
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterable

import torch
from pydantic import ValidationError

import loader
from loader import constants as C
from loader.artifact import manifest_digest, read_manifest_with_bytes, read_signature, verify_files
from loader.errors import IncompatibleArtifactError, LoaderError
from loader.cuda import parse_device
from loader.host import compatibility_problems, host_facts
from loader.manifest import Manifest
from loader.pack import read_head, replace_head, unpack, verify_pack, write_pack
from loader.trust import check_expiry, check_signature, key_id, make_signature, parse_signature, public_keys
from loader.weights import MappedWeights

from .compare import agreement, passes
from .errors import PrecompileError
from .runners import flatten
from .profile import AccuracyRule

REFERENCES_FILE = "references.safetensors"


# --- pack --------------------------------------------------------------------------------------


def default_pack_path(artifact: Path) -> Path:
    return artifact.with_name(artifact.name + C.PACK_SUFFIX)


def pack(artifact: str | os.PathLike, output: str | os.PathLike | None = None, *, level: int = 3, threads: int = 0) -> Path:
    """Write the artifact folder as one pack file (default: ``<folder>.tar.zst`` beside it).

    Every file is checked against the manifest as it is packed, and a signature, if present, must
    belong to this manifest: a pack is never made of a corrupt or stale artifact.
    """
    artifact = Path(artifact)
    if not artifact.is_dir():
        raise PrecompileError(f"{artifact}: not an artifact folder (pack takes the folder `precompile build` wrote)")
    _, manifest_bytes = read_manifest_with_bytes(artifact)
    _check_signature_belongs(artifact, manifest_bytes)
    target = Path(output) if output is not None else default_pack_path(artifact)
    with _atomic_output(target) as out:
        write_pack(artifact, out, level=level, threads=threads)
    return target


def _check_signature_belongs(artifact: Path, manifest_bytes: bytes) -> None:
    data = read_signature(artifact)
    if data is None:
        return
    sig = parse_signature(data, str(artifact / C.SIGNATURE_FILE))
    if sig.manifest_sha256 != manifest_digest(manifest_bytes):
        raise PrecompileError(
            f"{artifact / C.SIGNATURE_FILE}: made for another manifest (the artifact changed after signing); "
            f"sign it again with `precompile sign {artifact} --key KEY`"
        )


class _atomic_output:
    """Write a file beside ``target`` and rename it into place only when the writing succeeded."""

    def __init__(self, target: Path):
        self.target = target

    def __enter__(self):
        if self.target.is_dir():
            raise PrecompileError(f"{self.target}: is a folder; give a file name for the output")
        try:
            self.target.parent.mkdir(parents=True, exist_ok=True)
            fd, self.tmp = tempfile.mkstemp(prefix=f".{self.target.name}.", dir=self.target.parent)
        except OSError as e:
            raise PrecompileError(f"{self.target}: cannot write ({e.strerror})") from None
        self.file = os.fdopen(fd, "wb")
        return self.file

    def __exit__(self, exc_type, exc, tb):
        try:
            if exc_type is None:
                self.file.flush()
                os.fsync(self.file.fileno())
            self.file.close()
            if exc_type is None:
                os.chmod(self.tmp, 0o644)
                os.replace(self.tmp, self.target)
        finally:
            if os.path.exists(self.tmp):
                os.unlink(self.tmp)
        return False


# --- keys and signatures -----------------------------------------------------------------------


def keygen(prefix: str | os.PathLike, *, force: bool = False) -> tuple[Path, Path, str]:
    """Make an Ed25519 key pair: ``PREFIX.key`` (private, mode 0600) and ``PREFIX.pub`` (PEM).

    Returns both paths and the key id (sha256 of the raw public key) that signatures name.
    """
    from cryptography.hazmat.primitives import serialization
    from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey

    prefix = Path(prefix)
    private_path, public_path = prefix.with_name(prefix.name + ".key"), prefix.with_name(prefix.name + ".pub")
    for path in (private_path, public_path):
        if path.exists() and not force:
            raise PrecompileError(f"{path}: exists; refusing to overwrite a key (choose another -o, or --force)")
    key = Ed25519PrivateKey.generate()
    private_pem = key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption())
    public_pem = key.public_key().public_bytes(serialization.Encoding.PEM, serialization.PublicFormat.SubjectPublicKeyInfo)
    try:
        prefix.parent.mkdir(parents=True, exist_ok=True)
        fd = os.open(private_path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        with os.fdopen(fd, "wb") as f:
            f.write(private_pem)
        os.chmod(private_path, 0o600)
        public_path.write_bytes(public_pem)
    except OSError as e:
        raise PrecompileError(f"{prefix}: cannot write the key pair ({e.strerror})") from None
    return private_path, public_path, key_id(key.public_key().public_bytes_raw())


def load_private_key(path: str | os.PathLike) -> Any:
    """An Ed25519 private key from a PEM (PKCS#8) or OpenSSH file; PrecompileError otherwise."""
    from cryptography.hazmat.primitives import serialization
    from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey

    path = Path(path)
    try:
        data = path.read_bytes()
    except OSError as e:
        raise PrecompileError(f"--key {path}: cannot read ({e.strerror})") from None
    try:
        if b"OPENSSH PRIVATE KEY" in data:
            key = serialization.load_ssh_private_key(data, password=None)
        else:
            key = serialization.load_pem_private_key(data, password=None)
    except TypeError:
        raise PrecompileError(f"--key {path}: the key is encrypted; give an unencrypted key (keep it in your CI's secret store)") from None
    except ValueError as e:
        if b"PUBLIC KEY" in data or data.lstrip().startswith(b"ssh-ed25519"):
            raise PrecompileError(f"--key {path}: a public key; signing needs the private one (the .key file)") from None
        raise PrecompileError(f"--key {path}: not a PEM or OpenSSH private key ({e})") from None
    if not isinstance(key, Ed25519PrivateKey):
        raise PrecompileError(f"--key {path}: a {type(key).__name__}; signatures use Ed25519 keys (`precompile keygen`)")
    return key


def sign(artifact: str | os.PathLike, key_path: str | os.PathLike) -> str:
    """Sign an artifact folder or a pack with the private key at ``key_path``; return the key id.

    The artifact is verified in full first (never sign what you have not checked). A folder gets a
    ``signature.json``; a pack is rewritten with it, replacing any earlier signature.
    """
    artifact = Path(artifact)
    key = load_private_key(key_path)
    if artifact.is_dir():
        manifest, manifest_bytes = read_manifest_with_bytes(artifact)
        verify_files(artifact, manifest, hashes=True)
        _write_file(artifact / C.SIGNATURE_FILE, make_signature(manifest_bytes, key))
    elif artifact.is_file():
        head = verify_pack(artifact)
        signature = make_signature(head.manifest_bytes, key)
        with _atomic_output(artifact) as out:
            if not replace_head(artifact, out, signature):
                _repack(artifact, out, signature)
    else:
        raise PrecompileError(f"{artifact}: no such artifact folder or pack")
    return key_id(key.public_key().public_bytes_raw())


def _repack(pack_path: Path, out: Any, signature: bytes) -> None:
    with tempfile.TemporaryDirectory(prefix=".repack-", dir=pack_path.parent) as tmp:
        unpack(pack_path, tmp)
        write_pack(tmp, out, signature=signature)


def _write_file(path: Path, data: bytes) -> None:
    with _atomic_output(path) as out:
        out.write(data)


# --- verify ------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Check:
    name: str
    status: str  # "ok" | "FAIL" | "skip"
    detail: str

    @property
    def failed(self) -> bool:
        return self.status == "FAIL"


def verify(
    path: str | os.PathLike,
    *,
    keys: Iterable[Any] = (),
    run: bool = False,
    device: str | None = None,
    cache_dir: str | os.PathLike | None = None,
    now: datetime.datetime | None = None,
) -> list[Check]:
    """Every check ``precompile verify`` reports, in order; nothing raised for a failing artifact.

    manifest, integrity (every file's size and sha256; a pack is read in full, nothing written),
    signature (against ``keys``; reported, not required, without them), expiry, host (can ``device``,
    default the artifact's target device, of this host run it) and, with ``run``, the reference outputs
    recomputed there (a pack is then unpacked into the cache, as ``loader.load`` would).
    """
    path = Path(path)
    keys = list(keys)
    checks: list[Check] = []

    def skipped(*names: str, why: str) -> list[Check]:
        return checks + [Check(n, "skip", why) for n in names]

    later = ("integrity", "signature", "expiry", "host", "run")
    try:
        if path.is_file():
            head = read_head(path)
            manifest, manifest_bytes, signature = head.manifest, head.manifest_bytes, head.signature
        else:
            manifest, manifest_bytes = read_manifest_with_bytes(path)
            signature = read_signature(path)
    except LoaderError as e:
        checks.append(Check("manifest", "FAIL", str(e)))
        return skipped(*later, why="needs a readable manifest")
    checks.append(Check("manifest", "ok", f"{manifest.name} version {manifest.version}, sha256 {manifest_digest(manifest_bytes)[:16]}"))

    try:
        if path.is_file():
            verify_pack(path)
        else:
            verify_files(path, manifest, hashes=True)
        total = sum(e.size for e in manifest.files.values())
        checks.append(Check("integrity", "ok", f"{len(manifest.files)} files, {total:,} bytes: sizes and sha256 match"))
    except LoaderError as e:
        checks.append(Check("integrity", "FAIL", str(e)))

    checks.append(_signature_check(manifest_bytes, signature, keys, str(path)))

    try:
        check_expiry(manifest, str(path), now)
        checks.append(Check("expiry", "ok", f"valid until {manifest.expires}" if manifest.expires else "no expiry date"))
    except LoaderError as e:
        checks.append(Check("expiry", "FAIL", str(e)))

    device = device or manifest.target.device
    try:
        problems = compatibility_problems(manifest, device)
    except LoaderError as e:  # a device string that names no device
        problems = [str(e)]
    if problems:
        checks.append(Check("host", "FAIL", "; ".join(problems)))
    else:
        host = host_facts()
        code = manifest.target.aoti_cpu_isa or manifest.target.cpu_capability if device == "cpu" else "CUDA"
        checks.append(Check("host", "ok", f"{device}: {code} code on {host.platform}/{host.machine}, torch {host.torch_version}"))

    if not run:
        checks.append(Check("run", "skip", "not asked for (--run recomputes the reference outputs here)"))
    elif any(c.failed for c in checks):
        checks.append(Check("run", "skip", "not run: an earlier check failed"))
    else:
        checks.append(_run_check(path, manifest, device, cache_dir))
    return checks


def _signature_check(manifest_bytes: bytes, signature: bytes | None, keys: list[Any], source: str) -> Check:
    try:
        if keys:
            key = check_signature(manifest_bytes, signature, public_keys(keys), source)
            return Check("signature", "ok", f"signed by trusted key {key.short_id}")
        if signature is None:
            return Check("signature", "skip", "unsigned (--key PUB requires a signature by that key)")
        sig = parse_signature(signature, f"{source}: {C.SIGNATURE_FILE}")
        if sig.manifest_sha256 != manifest_digest(manifest_bytes):
            return Check("signature", "FAIL", f"{source}: {C.SIGNATURE_FILE} was made for another manifest")
        return Check("signature", "skip", f"signed by key {sig.key_id[:16]}, not checked (give --key PUB to check it)")
    except LoaderError as e:
        return Check("signature", "FAIL", str(e))


def _run_check(path: Path, manifest: Manifest, device: str, cache_dir: str | os.PathLike | None) -> Check:
    try:
        model = loader.load(path, device=device, cache_dir=cache_dir, precision="fp32")
    except LoaderError as e:
        return Check("run", "FAIL", f"cannot load: {e}")
    kind = parse_device(model.device)[0]
    # Every precision this host can run is checked: the fp32 model, then one load per lower precision.
    lower = sorted({v.precision for v in manifest.variants if v.device == kind} - {"fp32"})
    models = [model]
    skipped = []
    for precision in lower:
        try:
            # The first load hashed every file: the others only open their precision's variants.
            models.append(loader.load(path, device=device, cache_dir=cache_dir, precision=precision, verify=False))
        except IncompatibleArtifactError as e:
            skipped.append(f"{precision} not run on this host ({e})")
        except LoaderError as e:
            return Check("run", "FAIL", f"cannot load the {precision} variants: {e}")
    entries = manifest.check.get("references") if isinstance(manifest.check, dict) else None
    if isinstance(entries, list):  # references for this device's variants only
        entries = [e for e in entries if not isinstance(e, dict) or e.get("device", "cpu") == kind]
    if REFERENCES_FILE not in manifest.files or not entries:
        try:
            model.warmup()
        except Exception as e:  # compiled code failing here is what this check is for
            return Check("run", "FAIL", f"a variant failed on its hint shape: {type(e).__name__}: {e}")
        count = sum(v.device == kind for v in manifest.variants)
        return Check("run", "ok", f"no reference outputs for {kind} in this artifact; ran each of {count} variant(s) on its hint shape")
    checked = 0
    worst = 0.0
    try:
        for m in models:
            ids = {v.id for v in m.variants if v.precision == m.precision.order[0]}
            mine = [e for e in entries if not isinstance(e, dict) or e.get("variant") in ids]
            worst = max(worst, compare_references(m, mine))
            checked += len(mine)
    except ReferenceMismatch as e:
        return Check("run", "FAIL", str(e))
    note = "".join(f"; {s}" for s in skipped)
    precisions = ", ".join(m.precision.order[0] for m in models)
    return Check("run", "ok", f"{checked} reference output(s) recomputed ({precisions}), max abs error {worst:.1e}{note}")


class ReferenceMismatch(PrecompileError):
    """The artifact's compiled code does not reproduce its stored reference outputs on this host."""


def compare_references(model: loader.CompiledModel, entries: Any) -> float:
    """Run each reference entry's inputs on its variant and compare with the stored outputs, within the
    entry's per-output (atol, rtol). Returns the largest absolute error; ReferenceMismatch otherwise."""
    refs = MappedWeights(str(model.path / REFERENCES_FILE))
    if not isinstance(entries, list):
        raise ReferenceMismatch(f"check.references: expected a list, got {type(entries).__name__}")
    worst = 0.0
    for i, entry in enumerate(entries):
        where = f"check.references[{i}]"
        try:
            variant, ins, outs, tolerance = entry["variant"], entry["inputs"], entry["outputs"], entry["tolerance"]
            inputs = [refs.tensors[name].to(model.device) for name in ins]
            wanted = [refs.tensors[name] for name in outs]
            tolerances = [(float(a), float(r)) for a, r in tolerance]
            rules = [AccuracyRule(**rule) if rule["metric"] != "equal" else None for rule in entry["accuracy"]] if "accuracy" in entry else None
        except (KeyError, TypeError, ValueError, ValidationError) as e:
            raise ReferenceMismatch(f"{where}: malformed entry or missing tensor ({type(e).__name__}: {e})") from None
        try:
            got = flatten(model.run_variant(variant, *inputs))
        except Exception as e:  # a guard refusing the stored inputs, or the compiled code failing
            raise ReferenceMismatch(f"{where}: variant {variant!r} failed: {type(e).__name__}: {e}") from None
        if len(got) != len(wanted) or len(tolerances) != len(wanted):
            raise ReferenceMismatch(f"{where}: {len(got)} outputs, the references hold {len(wanted)}")
        for j, (g, w, (atol, rtol)) in enumerate(zip(got, wanted, tolerances)):
            g = g.cpu()
            floating = g.is_floating_point() and w.is_floating_point()  # a lower compute dtype is fine
            if g.shape != w.shape or (not floating and g.dtype != w.dtype):
                raise ReferenceMismatch(f"{where}: output {j} is {g.dtype} {tuple(g.shape)}, the reference {w.dtype} {tuple(w.shape)}")
            if floating and rules is not None and j < len(rules) and rules[j] is not None:  # a bf16 or int8 variant
                value = agreement(rules[j], w, g)
                worst = max(worst, float((g.double() - w.double()).abs().max()) if g.numel() else 0.0)
                if not passes(rules[j], value):
                    raise ReferenceMismatch(
                        f"{where}: variant {variant!r} output {j}: {rules[j].metric} {value:.4g} against the fp32 reference, "
                        f"the build's gate asks {'≤' if rules[j].metric == 'max_abs' else '≥'} {rules[j].threshold}: this host "
                        "computes something else than the build host did"
                    )
            elif floating:
                err = (g.double() - w.double()).abs()
                worst = max(worst, float(err.max()) if err.numel() else 0.0)
                if not torch.allclose(g.double(), w.double(), atol=atol, rtol=rtol, equal_nan=True):
                    raise ReferenceMismatch(
                        f"{where}: variant {variant!r} output {j} differs from the reference by up to {float(err.max()):.2e} "
                        f"(atol {atol}, rtol {rtol}): this host computes something else than the build host did"
                    )
            elif not torch.equal(g, w):
                raise ReferenceMismatch(f"{where}: variant {variant!r} output {j} differs from the reference")
    return worst
