"""Precision variants (bf16, int8) and the gate they pass before an artifact keeps them.

Every variant of the plan is compiled in fp32; a profile's ``precision: [fp32, bf16, int8]`` adds a
copy of it per lower precision, compiled from a transformed model:

- bf16: the model's floating weights cast to bfloat16 inside a wrapper that casts floating inputs to
  bfloat16 and floating outputs back to their fp32 dtype, so callers see the fp32 signature.
- int8, dynamic (torchao ``Int8DynamicActivationInt8WeightConfig``): Linear weights stored in int8,
  activations quantized per call; needs no calibration. What transformers' encoders want.
- int8, static (PT2E: ``prepare_pt2e``/``convert_pt2e`` with ``X86InductorQuantizer``): activations
  quantized with scales calibrated on the calibration inputs; what convolutions need.

Both compile with Inductor's freezing, which turns the quantized or bf16 weights into oneDNN's
prepacked kernels. The compiled code needs neither torchao nor the quantizer at serving time.

The gate (``gate_precisions``) then measures each such variant against fp32 eager on the calibration
inputs (the profile's ``accuracy`` rule per output) and times it against its fp32 twin on the shapes
it will serve; one that fails the rule or is not faster is dropped, with the reason printed. What
was measured goes into the manifest (``Variant.gate``), and the CPU features the code needs
(``Variant.cpu_features``), so a host without them is served the fp32 variants instead.
"""

from __future__ import annotations

import contextlib
import copy
import io
import json
import random
from dataclasses import dataclass, field, replace
from typing import Any, Callable

import torch
from torch.export import ExportedProgram

from loader.guards import TORCH_DTYPES
from loader.host import cpu_features
from loader.outputs import flatten

from .check import run_eager
from .compile import CompiledPackage
from .errors import CompileError, ExportError, ProfileError
from .export import export_model
from .plan import VariantPlan
from .profile import AccuracyRule, LoadedProfile, Profile
from .samples import check_shapes, make_inputs
from .tune import open_candidate, serving_shapes, time_calls

# CPU features (torch.cpu.get_capabilities() names) whose instructions a precision's kernels may use.
# A variant records those of the build host; a serving host lacking any of them gets fp32 instead.
PRECISION_FEATURES: dict[str, tuple[str, ...]] = {
    "bf16": ("avx512_bf16", "amx_bf16"),
    "int8": ("avx512_vnni", "avx_vnni", "amx_int8"),
}

# Inductor options every lower-precision variant compiles with (over the profile's first candidate).
PRECISION_OPTIONS: dict[str, Any] = {"freezing": True}


def needed_features(precision: str, present: frozenset[str] | None = None) -> tuple[str, ...]:
    """The features a ``precision`` variant built on this host needs where it is served."""
    present = cpu_features() if present is None else present
    return tuple(f for f in PRECISION_FEATURES.get(precision, ()) if f in present)


def expand_precisions(variants: list[VariantPlan], profile: Profile) -> list[VariantPlan]:
    """The variants, then a copy of each CPU one per lower precision the profile asks for, named
    ``<precision>-<id>``."""
    out = list(variants)
    for precision in profile.precisions("cpu")[1:]:
        out += [replace(vp, id=f"{precision}-{vp.id}", precision=precision) for vp in variants if vp.device == "cpu"]
    return out


def base_id(vp: VariantPlan) -> str:
    """The fp32 variant a lower-precision one was made from."""
    return vp.id.removeprefix(f"{vp.precision}-")


# --- the model transforms ----------------------------------------------------------------------------


class Bf16(torch.nn.Module):
    """``model`` computing in bfloat16 behind the fp32 signature it had."""

    def __init__(self, model: torch.nn.Module):
        super().__init__()
        self.model = model

    def forward(self, *args: Any) -> Any:
        args = tuple(a.to(torch.bfloat16) if isinstance(a, torch.Tensor) and a.is_floating_point() else a for a in args)
        out = self.model(*args)
        return torch.utils._pytree.tree_map(
            lambda t: t.float() if isinstance(t, torch.Tensor) and t.dtype == torch.bfloat16 else t, out
        )


def int8_method(profile: Profile, model: torch.nn.Module) -> str:
    """dynamic or static: the profile's choice, or static when the model has convolutions."""
    if profile.quantization.int8 != "auto":
        return profile.quantization.int8
    convs = (torch.nn.Conv1d, torch.nn.Conv2d, torch.nn.Conv3d)
    return "static" if any(isinstance(m, convs) for m in model.modules()) else "dynamic"


def export_variant(
    model: torch.nn.Module, loaded: LoadedProfile, vp: VariantPlan, hint: dict[str, int]
) -> ExportedProgram:
    """Export ``model`` for ``vp`` in its precision (fp32: as it is)."""
    profile = loaded.profile
    if vp.precision == "fp32":
        return export_model(model, profile, vp.ranges, hint, device=vp.device, dtype=vp.dtype)
    if vp.precision == "bf16":
        return export_model(Bf16(copy.deepcopy(model).to(torch.bfloat16)).eval(), profile, vp.ranges, hint)
    if int8_method(profile, model) == "dynamic":
        with quiet_torchao():
            from torchao.quantization import Int8DynamicActivationInt8WeightConfig, quantize_

            quantized = copy.deepcopy(model)
            try:
                quantize_(quantized, Int8DynamicActivationInt8WeightConfig())
            except Exception as e:  # torchao raises many types
                raise CompileError(f"int8 (dynamic, torchao) could not quantize the model: {type(e).__name__}: {e}") from None
        if not any(type(p).__name__ != "Parameter" for p in quantized.parameters()):
            raise CompileError(
                "int8 (dynamic) quantizes Linear layers and the model has none: use quantization.int8: static "
                "(calibrated, for convolutions), or drop int8 from precision"
            )
        return export_model(quantized, profile, vp.ranges, hint)
    return _export_static_int8(model, loaded, vp, hint)


def _export_static_int8(model: torch.nn.Module, loaded: LoadedProfile, vp: VariantPlan, hint: dict[str, int]) -> ExportedProgram:
    """PT2E: export, insert observers (X86InductorQuantizer), calibrate, convert, export again."""
    profile = loaded.profile
    with quiet_torchao():
        import torchao.quantization.pt2e.quantizer.x86_inductor_quantizer as xiq
        from torchao.quantization.pt2e.quantize_pt2e import convert_pt2e, prepare_pt2e

    ep = export_model(model, profile, vp.ranges, hint)
    quantizer = xiq.X86InductorQuantizer()
    quantizer.set_global(xiq.get_default_x86_inductor_quantization_config())
    samples = [args for sizes, args in calibration_inputs(loaded) if _inside(sizes, vp.ranges)]
    samples = samples or [args for _, args in fallback_inputs(profile, vp)]
    try:
        with torch.no_grad():
            prepared = prepare_pt2e(ep.module(), quantizer)
            for args in samples:
                prepared(*args)
            converted = convert_pt2e(prepared)
    except Exception as e:  # the quantizer's annotation and observers raise many types
        raise CompileError(
            f"int8 (static, PT2E X86InductorQuantizer) failed: {type(e).__name__}: {str(e)[:1000]}; "
            "try quantization.int8: dynamic, or drop int8 from precision"
        ) from None
    try:
        return export_model(converted, profile, vp.ranges, hint)
    except ExportError as e:
        raise ExportError(f"re-exporting the int8 (static) model failed: {e}") from None


# Warnings printed on import by packages a model may pull in, that say nothing about the build:
# torchao (imported by transformers when installed) lists each optional CUDA extension it cannot load
# on a CPU host, and torch's pytree warns about torchao's enum registrations.
NOISY_LOGGERS = ("torchao", "torch.utils._pytree")


def quiet_third_party_warnings() -> None:
    import logging

    for name in NOISY_LOGGERS:
        logging.getLogger(name).setLevel(logging.ERROR)


@contextlib.contextmanager
def quiet_torchao():
    """torchao warns, on import, about every optional CUDA extension it cannot load (on every CPU host),
    and prints through stdout for some: none of it concerns the build."""
    quiet_third_party_warnings()
    with contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(io.StringIO()):
        yield


# --- calibration inputs --------------------------------------------------------------------------------


Sample = tuple[dict[str, int], tuple[torch.Tensor, ...]]


def calibration_inputs(loaded: LoadedProfile) -> list[Sample]:
    """The profile's calibration inputs with the size of each dim: read from ``calibration.file``, or
    ``calibration.samples`` drawn with the traffic's shapes (weighted by count) and the inputs' value
    ranges. Deterministic for the profile's seed."""
    profile = loaded.profile
    if profile.calibration.file is not None:
        return read_calibration_file(loaded)
    from .plan import read_distribution

    seed = profile.check.seed + 15485863
    dims = tuple(profile.dims)
    distribution = [(dict(zip(dims, key)), n) for key, n in read_distribution(loaded).items() if n > 0]
    rng = random.Random(seed)
    out = []
    for k in range(profile.calibration.samples):
        if distribution:
            sizes = rng.choices([s for s, _ in distribution], weights=[n for _, n in distribution])[0]
        else:
            sizes = {d: rng.randint(max(s.min, 1), s.max) for d, s in profile.dims.items()}
        out.append((sizes, make_inputs(profile, sizes, seed=seed + k)))
    return out


def fallback_inputs(profile: Profile, vp: VariantPlan, count: int = 3) -> list[Sample]:
    """Inputs at a variant's range ends and random sizes inside, when no calibration input fits it."""
    seed = profile.check.seed + 32452843
    return [(s, make_inputs(profile, s, seed=seed + i)) for i, s in enumerate(check_shapes(profile, vp.ranges, count, seed))]


def read_calibration_file(loaded: LoadedProfile) -> list[Sample]:
    profile = loaded.profile
    path = loaded.folder / profile.calibration.file
    where = "calibration.file"
    raw: list[dict[str, Any]] = []
    try:
        if path.suffix == ".safetensors":
            from safetensors.torch import load_file

            grouped: dict[str, dict[str, torch.Tensor]] = {}
            for name, t in load_file(str(path)).items():
                sample, _, input_name = name.partition("/")
                if not input_name:
                    raise ProfileError(str(loaded.path), [(where, f"{path.name}: tensor {name!r} is not named '<sample>/<input>'")])
                grouped.setdefault(sample, {})[input_name] = t
            raw = [grouped[k] for k in sorted(grouped, key=lambda k: (len(k), k))]
        else:
            for n, line in enumerate(path.read_text(encoding="utf-8").splitlines(), 1):
                if line.strip():
                    item = json.loads(line)
                    if not isinstance(item, dict):
                        raise ProfileError(str(loaded.path), [(where, f"{path.name} line {n}: expected an object of inputs")])
                    raw.append(item)
    except ProfileError:
        raise
    except Exception as e:  # unreadable, not JSON, not safetensors
        raise ProfileError(str(loaded.path), [(where, f"cannot read {path}: {type(e).__name__}: {e}")]) from None
    if not raw:
        raise ProfileError(str(loaded.path), [(where, f"{path.name} holds no samples")])
    return [_sample(profile, item, f"{path.name} sample {i}", str(loaded.path)) for i, item in enumerate(raw)]


def _sample(profile: Profile, item: dict[str, Any], label: str, source: str) -> Sample:
    problems = []
    missing = [n for n in profile.inputs if n not in item]
    extra = [n for n in item if n not in profile.inputs]
    if missing or extra:
        raise ProfileError(source, [("calibration.file", f"{label}: inputs must be exactly {list(profile.inputs)} (missing {missing}, unknown {extra})")])
    sizes: dict[str, int] = {}
    tensors = []
    for name, spec in profile.inputs.items():
        try:
            t = torch.as_tensor(item[name], dtype=TORCH_DTYPES[spec.dtype]).contiguous()
        except (TypeError, ValueError, RuntimeError) as e:
            raise ProfileError(source, [("calibration.file", f"{label}: input {name!r}: {e}")]) from None
        if t.dim() != len(spec.shape):
            problems.append(("calibration.file", f"{label}: input {name!r} has {t.dim()} axes, the profile declares {len(spec.shape)}"))
            continue
        for axis, s in enumerate(spec.shape):
            n = t.shape[axis]
            if isinstance(s, int) and s != n:
                problems.append(("calibration.file", f"{label}: {name}.shape[{axis}] is {n}, the profile fixes it to {s}"))
            elif isinstance(s, str):
                if sizes.setdefault(s, n) != n:
                    problems.append(("calibration.file", f"{label}: dim {s!r} is {sizes[s]} in one input and {n} in {name!r}"))
                elif not profile.dims[s].min <= n <= profile.dims[s].max:
                    problems.append(("calibration.file", f"{label}: {s}={n} is outside dims.{s} [{profile.dims[s].min}, {profile.dims[s].max}]"))
        if spec.range is not None and t.numel():
            lo, hi = (float(x) for x in torch.aminmax(t.double()))
            if lo < spec.range[0] or hi > spec.range[1]:
                problems.append(("calibration.file", f"{label}: input {name!r} holds values in [{lo:g}, {hi:g}], outside its range {list(spec.range)}"))
        tensors.append(t)
    if problems:
        raise ProfileError(source, problems)
    return sizes, tuple(tensors)


def _inside(sizes: dict[str, int], ranges: dict[str, tuple[int, int]]) -> bool:
    return all(lo <= sizes[d] <= hi for d, (lo, hi) in ranges.items())


# --- accuracy metrics ----------------------------------------------------------------------------------


def agreement(rule: AccuracyRule, want: torch.Tensor, got: torch.Tensor) -> float:
    """``rule``'s metric between fp32 eager's ``want`` and a variant's ``got``."""
    w, g = want.detach().double().cpu(), got.detach().double().cpu()
    if rule.metric == "max_abs":
        return float((w - g).abs().max()) if w.numel() else 0.0
    rows_w = w.reshape(-1, w.shape[-1]) if w.dim() >= 2 else w.reshape(1, -1)
    rows_g = g.reshape(rows_w.shape)
    if rows_w.numel() == 0:
        return 1.0
    if rule.metric == "top1":
        return float((rows_w.argmax(-1) == rows_g.argmax(-1)).double().mean())
    return float(torch.nn.functional.cosine_similarity(rows_w, rows_g, dim=-1, eps=1e-12).min())


def passes(rule: AccuracyRule, value: float) -> bool:
    return value <= rule.threshold if rule.metric == "max_abs" else value >= rule.threshold


def worst(rule: AccuracyRule, values: list[float]) -> float:
    return max(values) if rule.metric == "max_abs" else min(values)


# --- the gate ------------------------------------------------------------------------------------------


@dataclass
class GateResult:
    """One lower-precision variant measured against fp32: its accuracy per output and its speed."""

    variant: str
    precision: str
    against: str  # the fp32 variant it was timed against
    accuracy: list[dict[str, Any]] = field(default_factory=list)  # per output: metric, threshold, value
    samples: int = 0
    ms: float | None = None  # traffic-weighted mean of median ms per serving shape
    fp32_ms: float | None = None
    kept: bool = False
    reason: str = ""

    @property
    def speedup(self) -> float | None:
        return self.fp32_ms / self.ms if self.ms and self.fp32_ms else None

    def to_dict(self) -> dict[str, Any]:
        out = {
            "precision": self.precision,
            "against": self.against,
            "accuracy": self.accuracy,
            "samples": self.samples,
            "ms": self.ms,
            "fp32_ms": self.fp32_ms,
            "speedup": self.speedup,
            "kept": self.kept,
        }
        if self.reason:
            out["reason"] = self.reason
        return {k: v for k, v in out.items() if v is not None}

    def describe(self) -> str:
        acc = ", ".join(f"out{a['output']} {a['metric']} {a['value']:.4g}" for a in self.accuracy)
        speed = f"{self.ms:.3f} ms vs fp32 {self.fp32_ms:.3f} ms ({self.speedup:.2f}×)" if self.speedup else "not timed"
        verdict = "kept" if self.kept else f"dropped: {self.reason}"
        return f"{self.variant}: {acc}; {speed} → {verdict}"


def gate_precisions(
    loaded: LoadedProfile,
    model: torch.nn.Module,
    packages: list[tuple[VariantPlan, CompiledPackage]],
    distribution: dict[tuple[int, ...], int],
) -> tuple[list[tuple[VariantPlan, CompiledPackage]], list[GateResult]]:
    """Measure every lower-precision package; return the packages kept (fp32 ones all are) and the
    results. Each is checked for accuracy on its own; those that pass are timed with their fp32 twin
    and the twin's other precisions in the same interleaved rounds, so that their times compare (the
    loader ranks them by it). A dropped package's file is deleted."""
    profile = loaded.profile
    dims = tuple(profile.dims)
    calibration = calibration_inputs(loaded)
    by_id = {vp.id: (vp, pkg) for vp, pkg in packages}
    groups: dict[str, list[tuple[VariantPlan, CompiledPackage]]] = {}
    for vp, pkg in packages:
        if vp.precision != "fp32":
            groups.setdefault(base_id(vp), []).append((vp, pkg))
    results: dict[str, GateResult] = {}
    for base, group in groups.items():
        twin_vp, twin_pkg = by_id[base]
        timed = []  # (result, run) of those that passed the accuracy rule
        for vp, pkg in group:
            result = results[vp.id] = GateResult(vp.id, vp.precision, twin_vp.id)
            samples = [s for s in calibration if _inside(s[0], vp.ranges)] or fallback_inputs(profile, vp)
            result.samples = len(samples)
            try:
                run = open_candidate(pkg, vp.device)
                _measure_accuracy(profile, model, run, samples, result)
            except RuntimeError as e:  # the compiled code failing on a calibration input
                result.reason = f"failed to run: {_first_line(e)}"
                continue
            failing = [a for a in result.accuracy if not a["passed"]]
            if failing:
                result.reason = "; ".join(
                    f"output {a['output']}: {a['metric']} {a['value']:.4g} {'>' if a['metric'] == 'max_abs' else '<'} {a['threshold']}"
                    for a in failing
                ) + " (accuracy gate)"
            else:
                timed.append((result, run))
        if timed:
            twin = open_candidate(twin_pkg, twin_vp.device)
            try:
                fp32_ms, *ms = _time_together(profile, [twin] + [run for _, run in timed], serving_shapes(twin_vp, distribution, dims))
            except RuntimeError as e:
                for result, _ in timed:
                    result.reason = f"failed to run: {_first_line(e)}"
            else:
                for (result, _), mine in zip(timed, ms):
                    result.ms, result.fp32_ms = mine, fp32_ms
                    if not _fast_enough(result.speedup, profile.accuracy.min_speedup):
                        wanted = "faster than fp32" if profile.accuracy.min_speedup == 1.0 else f"{profile.accuracy.min_speedup}× fp32's speed"
                        result.reason = f"not {wanted} ({result.ms:.3f} vs {result.fp32_ms:.3f} ms, accuracy.min_speedup)"
        for vp, pkg in group:
            results[vp.id].kept = not results[vp.id].reason
            if not results[vp.id].kept:
                pkg.path.unlink(missing_ok=True)
    kept = [(vp, pkg) for vp, pkg in packages if vp.precision == "fp32" or results[vp.id].kept]
    return kept, [results[vp.id] for vp, _ in packages if vp.id in results]


def _first_line(e: BaseException) -> str:
    text = str(e).strip()
    return text.splitlines()[0][:300] if text else type(e).__name__


def _fast_enough(speedup: float, wanted: float) -> bool:
    """1.0 (the default) means strictly faster; another value, at least that."""
    return speedup > 1.0 if wanted == 1.0 else speedup >= wanted


def _measure_accuracy(profile: Profile, model: torch.nn.Module, run: Callable, samples: list[Sample], result: GateResult) -> None:
    """Each output's metric over all samples (its worst value); integer outputs must be equal."""
    values: dict[int, list[float]] = {}
    floating: dict[int, bool] = {}
    for _, args in samples:
        want = flatten(run_eager(model, args))
        got = run(*args)
        for i, (w, g) in enumerate(zip(want, got)):
            floating[i] = w.is_floating_point()
            if floating[i]:
                values.setdefault(i, []).append(agreement(profile.accuracy.rule(i), w, g))
            else:
                values.setdefault(i, []).append(float(torch.equal(w, g.cpu())))
    for i, vals in sorted(values.items()):
        rule = profile.accuracy.rule(i)
        if not floating[i]:
            entry = {"metric": "equal", "threshold": 1.0, "value": min(vals), "passed": min(vals) == 1.0}
        else:
            value = worst(rule, vals)
            entry = {"metric": rule.metric, "threshold": rule.threshold, "value": value, "passed": passes(rule, value)}
        result.accuracy.append({"output": i, **entry})


def _time_together(profile: Profile, runs: list[Callable], shapes: list[tuple[dict[str, int], float]]) -> list[float]:
    """Traffic-weighted mean of the median ms per shape of each of ``runs``, timed in alternating
    rounds so that a change in the machine's load hits all of them alike."""
    totals = [0.0] * len(runs)
    for i, (sizes, weight) in enumerate(shapes):
        args = make_inputs(profile, sizes, seed=profile.check.seed + 49979687 + i)
        for k, ms in enumerate(time_calls(*[lambda run=run: run(*args) for run in runs])):
            totals[k] += weight * ms
    return totals
