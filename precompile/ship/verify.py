"""``precompile verify``: the checks a serving host runs on an artifact or a pack before serving it:
manifest, integrity, signature, expiry, host, and (``--run``) the stored reference outputs recomputed."""

from __future__ import annotations

import datetime
import os
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from pydantic import ValidationError

import loader
from loader import constants as C
from loader.artifact import manifest_digest, read_manifest_with_bytes, read_signature, verify_files
from loader.cuda import parse_device
from loader.errors import IncompatibleArtifactError, LoaderError
from loader.host import compatibility_problems, host_facts
from loader.manifest import Manifest, Reference
from loader.outputs import flatten
from loader.stores.pack import read_head, verify_pack
from loader.trust import check_expiry, check_signature, parse_signature, public_keys
from loader.weights import MappedWeights

from ..compare import BUILD_MARGIN, agreement, compare_tensors, reproduces
from ..errors import PrecompileError
from ..profile import AccuracyRule


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
    checks.append(
        Check(
            "manifest",
            "ok",
            f"{manifest.name} version {manifest.version}, sha256 {manifest_digest(manifest_bytes)[:16]}",
        )
    )

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
        checks.append(
            Check("expiry", "ok", f"valid until {manifest.expires}" if manifest.expires else "no expiry date")
        )
    except LoaderError as e:
        checks.append(Check("expiry", "FAIL", str(e)))

    device = device or manifest.target.device
    checks.append(_host_check(manifest, device))

    if not run:
        checks.append(Check("run", "skip", "not asked for (--run recomputes the reference outputs here)"))
    elif any(c.failed for c in checks):
        checks.append(Check("run", "skip", "not run: an earlier check failed"))
    else:
        checks.append(_run_check(path, manifest, device, cache_dir))
    return checks


def _host_check(manifest: Manifest, device: str) -> Check:
    """Whether this host can run the artifact's code on ``device``."""
    try:
        problems = compatibility_problems(manifest, device)
    except LoaderError as e:  # a device string that names no device
        problems = [str(e)]
    if problems:
        return Check("host", "FAIL", "; ".join(problems))
    host = host_facts()
    code = manifest.target.aoti_cpu_isa or manifest.target.cpu_capability if device == "cpu" else "CUDA"
    return Check("host", "ok", f"{device}: {code} code on {host.platform}/{host.machine}, torch {host.torch_version}")


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
    entries = [e for e in manifest.check.references if e.device == kind]  # this device's variants only
    if C.REFERENCES_FILE not in manifest.files or not entries:
        try:
            model.warmup()
        except Exception as e:  # compiled code failing here is what this check is for
            return Check("run", "FAIL", f"a variant failed on its hint shape: {type(e).__name__}: {e}")
        count = sum(v.device == kind for v in manifest.variants)
        return Check(
            "run",
            "ok",
            f"no reference outputs for {kind} in this artifact; ran each of {count} variant(s) on its hint shape",
        )
    checked = 0
    worst = 0.0
    try:
        for m in models:
            ids = {v.id for v in m.variants if v.precision == m.precision.order[0]}
            mine = [e for e in entries if e.variant in ids]
            worst = max(worst, compare_references(m, mine))
            checked += len(mine)
    except ReferenceMismatch as e:
        return Check("run", "FAIL", str(e))
    note = "".join(f"; {s}" for s in skipped)
    precisions = ", ".join(m.precision.order[0] for m in models)
    return Check(
        "run", "ok", f"{checked} reference output(s) recomputed ({precisions}), max abs error {worst:.1e}{note}"
    )


class ReferenceMismatch(PrecompileError):
    """The artifact's compiled code does not reproduce its stored reference outputs on this host."""


def compare_references(model: loader.CompiledModel, entries: Sequence[Reference]) -> float:
    """Run each reference entry's inputs on its variant and compare with the stored outputs, within the
    entry's per-output (atol, rtol); a bf16/int8 entry by its gate's metric at the worst row, which
    passes at the threshold or near the build host's own value (``compare.reproduces``). Returns the
    largest absolute error; ReferenceMismatch otherwise."""
    refs = MappedWeights(str(model.path / C.REFERENCES_FILE))
    worst = 0.0
    for i, entry in enumerate(entries):
        where = f"check.references[{i}]"
        variant, tolerances = entry.variant, entry.tolerance
        try:
            inputs = [refs.tensors[name].to(model.device) for name in entry.inputs]
            wanted = [refs.tensors[name] for name in entry.outputs]
            rules = (
                [
                    AccuracyRule(metric=a.metric, threshold=a.threshold) if a.metric != "equal" else None
                    for a in entry.accuracy
                ]
                if entry.accuracy is not None
                else None
            )
        except (KeyError, ValidationError) as e:
            raise ReferenceMismatch(
                f"{where}: missing tensor or unknown accuracy rule ({type(e).__name__}: {e})"
            ) from None
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
                raise ReferenceMismatch(
                    f"{where}: output {j} is {g.dtype} {tuple(g.shape)}, the reference {w.dtype} {tuple(w.shape)}"
                )
            if floating and rules is not None and j < len(rules) and rules[j] is not None:  # a bf16 or int8 variant
                value = agreement(rules[j], w, g)
                worst = max(worst, float((g.double() - w.double()).abs().max()) if g.numel() else 0.0)
                built = entry.accuracy[j].build_value
                if not reproduces(rules[j], value, built):
                    raise ReferenceMismatch(
                        f"{where}: variant {variant!r} output {j}: {_disagreement(rules[j], value, built)}"
                    )
            elif floating:
                c = compare_tensors(w, g, atol=atol, rtol=rtol)
                worst = max(worst, c.max_abs_error)
                if not c.passed:
                    raise ReferenceMismatch(
                        f"{where}: variant {variant!r} output {j} differs from the reference by up to {c.max_abs_error:.2e} "
                        f"(atol {atol}, rtol {rtol}): this host computes something else than the build host did"
                    )
            elif not torch.equal(g, w):
                raise ReferenceMismatch(f"{where}: variant {variant!r} output {j} differs from the reference")
    return worst


def _disagreement(rule: AccuracyRule, value: float, built: float | None) -> str:
    """Why a lower-precision reference fails here: this host's value, the gate's threshold, and the
    build host's own value on that input where the manifest has it."""
    sign = "≤" if rule.metric == "max_abs" else "≥"
    here = f"{rule.metric} {value:.6g} against the fp32 reference on this host"
    if built is None:
        return (
            f"{here}, the build's gate asks {sign} {rule.threshold}: this host computes something else than the "
            "build host did"
        )
    return (
        f"{here}, the build host reached {built:.6g} on this input (the gate asks {sign} {rule.threshold}; "
        f"within {BUILD_MARGIN:.0%} more error than the build host's counts as the same): this host computes "
        "something else than the build host did"
    )
