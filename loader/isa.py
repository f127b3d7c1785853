"""Which CPU instruction set a loaded model's code was compiled for, and which of them a host runs.

A profile's ``cpu.isa`` builds every CPU variant once per ISA: ``native`` (the build host's own, as
Inductor picks it: ``-march=native``), or an x86-64 psABI level, compiled with the compiler told
exactly that level (vector width and ``-march`` alike). A level's variant records the level's CPU
features (``Variant.cpu_features``, by torch.cpu.get_capabilities() name), so a host runs it when it
has all of them; a native variant (``isa`` unset, as in every artifact built before) is checked as
before, against the vector ISA AOTInductor recorded (``loader.host``).

``choose_isa`` picks, per load, the one ISA whose variants serve: the best this host runs (native
first: it is the build host's own, then the widest level), or the one asked for (``load(cpu_isa=)``),
refusing with the ISAs the artifact has and what this host offers when none fits.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

from .errors import IncompatibleArtifactError
from .manifest import Variant

NATIVE = "native"
# The x86-64 psABI levels, by the names torch's cpuinfo gives their features. cx16, lahf_lm, movbe,
# osxsave and xsave are part of the levels too, but cpuinfo does not report them; every CPU with the
# listed features has them.
_V2 = ("popcnt", "sse3", "ssse3", "sse4_1", "sse4_2")
_V3 = (*_V2, "avx", "avx2", "bmi", "bmi2", "f16c", "fma3", "lzcnt")
LEVELS: dict[str, tuple[str, ...]] = {
    "x86-64-v3": _V3,
    "x86-64-v4": (*_V3, "avx512_f", "avx512_bw", "avx512_cd", "avx512_dq", "avx512_vl"),
}
ISAS = (NATIVE, *LEVELS)  # what a profile's cpu.isa may name
PREFERENCE = (NATIVE, "x86-64-v4", "x86-64-v3")  # auto: the first one this host runs
AUTO = "auto"


def variant_isa(v: Variant) -> str:
    return v.isa or NATIVE


def missing_features(isa: str, features: frozenset[str]) -> tuple[str, ...]:
    """The features of level ``isa`` a CPU with ``features`` lacks (all of them for an unknown level)."""
    return tuple(f for f in LEVELS.get(isa, (f"<{isa}>",)) if f not in features)


def best_level(features: frozenset[str]) -> str | None:
    """The widest x86-64 level a CPU with these features runs (None: below x86-64-v3)."""
    return next((isa for isa in reversed(LEVELS) if not missing_features(isa, features)), None)


@dataclass(frozen=True)
class IsaChoice:
    """The CPU ISA whose variants a model serves (None: the artifact's CPU variants carry no ISA
    level, or the load is for another device), and the ISAs the artifact has."""

    isa: str | None = None
    present: tuple[str, ...] = ()

    def serves(self, v: Variant) -> bool:
        return v.device != "cpu" or self.isa is None or variant_isa(v) == self.isa


def present_isas(variants: Iterable[Variant]) -> tuple[str, ...]:
    """The ISAs of these CPU variants, in ``PREFERENCE`` order (unknown names last)."""
    found = {variant_isa(v) for v in variants if v.device == "cpu"}
    return tuple(sorted(found, key=lambda i: PREFERENCE.index(i) if i in PREFERENCE else len(PREFERENCE)))


def runnable(isa: str, features: frozenset[str], native_problem: str | None) -> str | None:
    """Why this host cannot run ``isa`` code (None: it can). ``native_problem``: the host check's
    verdict on the native code (``loader.host``)."""
    if isa == NATIVE:
        return native_problem
    if isa not in LEVELS:
        return f"this loader does not know {isa}"
    missing = missing_features(isa, features)
    return f"it lacks {', '.join(missing)}" if missing else None


def isa_problem(variants: Iterable[Variant], features: frozenset[str], native_problem: str | None) -> str | None:
    """The host check's sentence when this host runs none of the CPU variants' ISAs (None: it runs one)."""
    present = present_isas(variants)
    if present == (NATIVE,):
        return native_problem  # an artifact without ISA levels: checked as it always was
    reasons = {isa: runnable(isa, features, native_problem) for isa in present}
    if any(r is None for r in reasons.values()):
        return None
    return (
        f"cpu: the artifact has code for {', '.join(present)}; this CPU runs none of them ({host_offers(features)}): "
        + "; ".join(f"{isa}: {why.removeprefix('cpu: ')}" for isa, why in reasons.items())
        + "; build with cpu: {isa: [...]} naming a level this CPU has"
    )


def host_offers(features: frozenset[str]) -> str:
    level = best_level(features)
    return f"it offers {level}" if level else "it offers no x86-64 level from x86-64-v3 up"


def choose_isa(
    variants: Iterable[Variant],
    requested: str,
    features: frozenset[str],
    native_problem: str | None,
    source: str,
) -> IsaChoice:
    """The ISA whose CPU variants serve: ``requested`` (``auto``: the first of ``PREFERENCE`` this host
    runs). IncompatibleArtifactError for an ISA the artifact lacks or this host cannot run."""
    variants = list(variants)
    present = present_isas(variants)
    if not present:
        return IsaChoice()
    if requested == AUTO:
        if present == (NATIVE,):
            return IsaChoice(None, present)
        for isa in present:
            if runnable(isa, features, native_problem) is None:
                return IsaChoice(isa, present)
        raise IncompatibleArtifactError(f"{source}: {isa_problem(variants, features, native_problem)}")
    if requested not in present:
        raise IncompatibleArtifactError(
            f"{source}: cpu_isa={requested!r}: the artifact has code for {', '.join(present)} only"
        )
    why = runnable(requested, features, native_problem)
    if why is not None:
        raise IncompatibleArtifactError(
            f"{source}: cpu_isa={requested!r}: this CPU cannot run it ({why.removeprefix('cpu: ')}; {host_offers(features)})"
        )
    return IsaChoice(requested, present)
