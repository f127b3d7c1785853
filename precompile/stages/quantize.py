"""Stage quantize: the lower-precision variants (bf16, int8), exported from a transformed model.

Every variant of the plan is compiled in fp32; a profile's ``precision: [fp32, bf16, int8]`` adds a
copy of it per lower precision (``stages.targets.expand_precisions``), exported here:

- bf16: the model's floating weights cast to bfloat16 inside a wrapper that casts floating inputs to
  bfloat16 and floating outputs back to their fp32 dtype, so callers see the fp32 signature.
- int8, dynamic (torchao ``Int8DynamicActivationInt8WeightConfig``): Linear weights stored in int8,
  activations quantized per call; needs no calibration. What transformers' encoders want.
- int8, static (PT2E: ``prepare_pt2e``/``convert_pt2e`` with ``X86InductorQuantizer``): activations
  quantized with scales calibrated on the calibration inputs; what convolutions need.

Both compile with Inductor's freezing (``options.LOWER_PRECISION``), which turns the quantized or bf16
weights into oneDNN's prepacked kernels. The compiled code needs neither torchao nor the quantizer at
serving time. The gate (``stages.gate``) then decides which of them the artifact keeps.
"""

from __future__ import annotations

import contextlib
import copy
import dataclasses
import io
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch.export import ExportedProgram

from loader.outputs import flatten

from ..calibration import Sample, fallback_inputs, inside
from ..compare import accuracy_entries
from ..errors import CompileError, ExportError
from ..profile import Profile
from ..profile.schema import QuantizationSpec
from ..quiet import quiet_third_party_warnings
from ..runners import run_eager
from ..tracing import export_model
from ..units import VariantPlan


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


def quantize(
    model: torch.nn.Module, profile: Profile, vp: VariantPlan, hint: dict[str, int], calibration: Sequence[Sample]
) -> ExportedProgram:
    """Export ``model`` for the lower-precision variant ``vp`` (bf16 or int8), transformed as the module
    docstring says; static int8 calibrates on the ``calibration`` samples inside ``vp``'s ranges."""
    if vp.precision == "bf16":
        return export_model(Bf16(copy.deepcopy(model).to(torch.bfloat16)).eval(), profile, vp.ranges, hint)
    if int8_method(profile, model) == "dynamic":
        with quiet_torchao():
            from torchao.quantization import Int8DynamicActivationInt8WeightConfig, quantize_

            quantized = copy.deepcopy(model)
            try:
                quantize_(quantized, Int8DynamicActivationInt8WeightConfig())
            except Exception as e:  # torchao raises many types
                raise CompileError(
                    f"int8 (dynamic, torchao) could not quantize the model: {type(e).__name__}: {e}"
                ) from None
        if not any(type(p).__name__ != "Parameter" for p in quantized.parameters()):
            raise CompileError(
                "int8 (dynamic) quantizes Linear layers and the model has none: use quantization.int8: static "
                "(calibrated, for convolutions), or drop int8 from precision"
            )
        return export_model(quantized, profile, vp.ranges, hint)
    return _export_static_int8(model, profile, vp, hint, calibration)


def _export_static_int8(
    model: torch.nn.Module, profile: Profile, vp: VariantPlan, hint: dict[str, int], calibration: Sequence[Sample]
) -> ExportedProgram:
    """PT2E: export, insert observers (X86InductorQuantizer), calibrate, convert, export again."""
    ep = export_model(model, profile, vp.ranges, hint)
    samples = [args for sizes, args in calibration if inside(sizes, vp.ranges)]
    samples = samples or [args for _, args in fallback_inputs(profile, vp.ranges)]
    converted = static_int8(ep.module(), profile.quantization, samples)
    try:
        return export_model(converted, profile, vp.ranges, hint)
    except ExportError as e:
        raise ExportError(f"re-exporting the int8 (static) model failed: {e}") from None


def static_int8(
    graph: torch.fx.GraphModule,
    spec: QuantizationSpec,
    samples: Sequence[tuple[torch.Tensor, ...]],
    *,
    quantizer: Any = None,
) -> torch.fx.GraphModule:
    """The exported ``graph`` quantized by PT2E as ``spec`` says (observers, keep), calibrated on
    ``samples``: quantize/dequantize nodes around each int8 op, which Inductor lowers to oneDNN's
    int8 kernels (and which runs as is in eager, for measuring an option). ``quantizer``: another
    than ``static_quantizer``'s (bench.precision's reference points)."""
    with quiet_torchao():
        from torchao.quantization.pt2e.quantize_pt2e import convert_pt2e, prepare_pt2e
    quantizer = quantizer or static_quantizer(spec, graph)
    try:
        with torch.no_grad():
            prepared = prepare_pt2e(graph, quantizer)
            for args in samples:
                prepared(*args)
            return convert_pt2e(prepared)
    except Exception as e:  # the quantizer's annotation and observers raise many types
        raise CompileError(
            f"int8 (static, PT2E X86InductorQuantizer) failed: {type(e).__name__}: {str(e)[:1000]}; "
            "try quantization.int8: dynamic, or drop int8 from precision"
        ) from None


def static_quantizer(spec: QuantizationSpec, graph: torch.fx.GraphModule) -> Any:
    """torchao's X86InductorQuantizer with its default config (int8 weights per output channel,
    uint8 activations per tensor) but ``spec.observer`` for activations, and the layers of
    ``spec.keep`` (resolved in ``graph``) left in fp32."""
    with quiet_torchao():
        import torchao.quantization.pt2e.quantizer.x86_inductor_quantizer as xiq

    config = xiq.get_default_x86_inductor_quantization_config()
    if spec.observer != "histogram":
        activation = dataclasses.replace(
            config.input_activation, observer_or_fake_quant_ctr=_OBSERVERS[spec.observer]().with_args(eps=2**-12)
        )
        config = dataclasses.replace(config, input_activation=activation, output_activation=activation)
    quantizer = xiq.X86InductorQuantizer().set_global(config)
    for name in kept_layers(graph, spec.keep):
        quantizer.set_module_name_qconfig(name, None)
    return quantizer


QUANTIZABLE = {"conv1d", "conv2d", "conv3d", "linear"}


def quantizable_layers(graph: torch.fx.GraphModule) -> list[str]:
    """The modules of the exported ``graph``'s convolutions and linear layers, in the order they run."""
    return list(dict.fromkeys(name for name in map(_layer_of, graph.graph.nodes) if name is not None))


def kept_layers(graph: torch.fx.GraphModule, keep: Sequence[str]) -> list[str]:
    """``keep``'s entries as module names: ``first`` and ``last`` are the first and the last
    convolution or linear layer that runs; any other entry names a module (its layers all stay fp32)."""
    layers = quantizable_layers(graph)
    modules = {name for name, _ in graph.named_modules()} | {
        p.removeprefix("L['self'].")
        for node in graph.graph.nodes
        for p, _ in (node.meta.get("nn_module_stack") or {}).values()
    }
    out = []
    for entry in keep:
        if entry in ("first", "last"):
            if layers:
                out.append(layers[0] if entry == "first" else layers[-1])
        elif entry in modules:
            out.append(entry)
        else:
            near = ", ".join(layers[:3] + ["..."] + layers[-2:]) if len(layers) > 5 else ", ".join(layers)
            raise CompileError(
                f"quantization.keep: the model has no module {entry!r} (its convolution and linear layers: {near})"
            )
    return list(dict.fromkeys(out))


def _percentile_observer() -> type:
    """A histogram observer whose range is the 0.01st to the 99.99th percentile of what it saw, the
    clipping TensorRT and OpenVINO's calibrators offer beside the L2 search torchao's default does."""
    with quiet_torchao():
        from torchao.quantization.pt2e.observer import HistogramObserver

    class Percentile(HistogramObserver):
        def _non_linear_param_search(self) -> tuple[torch.Tensor, torch.Tensor]:
            cdf = torch.cumsum(self.histogram, 0) / self.histogram.sum().clamp(min=1)
            width = (self.max_val - self.min_val) / self.bins
            lo = int(torch.searchsorted(cdf, torch.tensor(1e-4)))
            hi = int(torch.searchsorted(cdf, torch.tensor(1 - 1e-4)))
            return self.min_val + lo * width, self.min_val + (hi + 1) * width

    return Percentile


def _minmax_observer() -> type:
    with quiet_torchao():
        from torchao.quantization.pt2e.observer import MinMaxObserver
    return MinMaxObserver


_OBSERVERS = {"minmax": _minmax_observer, "percentile": _percentile_observer}


# Warnings printed on import by packages a model may pull in, that say nothing about the build:
@contextlib.contextmanager
def quiet_torchao():
    """torchao warns, on import, about every optional CUDA extension it cannot load (on every CPU host),
    and prints through stdout for some: none of it concerns the build."""
    quiet_third_party_warnings()
    with contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(io.StringIO()):
        yield


# --- the accuracy-driven fallback ---------------------------------------------------------------


@dataclass(frozen=True)
class Sensitivity:
    """The layers of a static int8 variant ranked by how much of its error each one makes, measured
    in eager on the quantize/dequantize graph: ``error`` is the int8 graph's noise-to-signal ratio
    (sum of squared differences from fp32 over sum of squares, on the search inputs; ``sensitivity``
    says of what), ``layers`` each layer with what that ratio drops by when it alone runs in fp32, the
    largest drop first, and ``prefixes`` the ratio and whether the accuracy rule passes (on the
    search inputs) with the first k of them in fp32, k = 1, 2, ..."""

    error: float
    layers: tuple[tuple[str, float], ...]
    prefixes: tuple[tuple[float, bool], ...] = ()

    @property
    def order(self) -> list[str]:
        return [name for name, _ in self.layers]

    def first_passing(self) -> int | None:
        """The fewest layers of the order in fp32 that pass the rule in eager, if any prefix does."""
        return next((k for k, (_, passed) in enumerate(self.prefixes, 1) if passed), None)


def sensitivity(
    model: torch.nn.Module,
    profile: Profile,
    vp: VariantPlan,
    hint: dict[str, int],
    calibration: Sequence[Sample],
    *,
    search: int = 32,
    prefixes: int = 0,
) -> Sensitivity:
    """Rank the int8 layers of ``vp`` (those ``quantization.keep`` does not already keep) by how much
    the int8 graph's error drops when each one alone stays fp32, on the first ``search`` calibration
    inputs inside ``vp``'s ranges (never the gate's held-out ones); then the error and whether the
    accuracy rule passes with the first 1 … ``prefixes`` of that order in fp32. A layer is made fp32 by
    bypassing its input's quantize/dequantize (``_in_fp32``): one calibration for the whole search
    (PT2E's observers see fp32 values, whichever layers are kept, so the scales are the same), where
    keeping the layer for real (``quantization.keep``) calibrates again.

    The error is the mean of two noise-to-signal ratios: the floating outputs', and that of the
    features the last layer reads (a classifier's input): a head of a few logits alone says too little
    to rank fifty layers by."""
    ep = export_model(model, profile, vp.ranges, hint)
    samples = [args for sizes, args in calibration if inside(sizes, vp.ranges)]
    samples = samples or [args for _, args in fallback_inputs(profile, vp.ranges)]
    converted = static_int8(ep.module(), profile.quantization, samples)
    inputs = samples[:search]
    layers = quantizable_layers(converted)
    last = [n for n in converted.graph.nodes if layers and _layer_of(n) == layers[-1]]
    with torch.no_grad():
        want = [_features(model, layers[-1] if last else None, args) for args in inputs]

    def error(bypassed: Sequence[str]) -> tuple[float, bool]:
        with _in_fp32(converted, bypassed), torch.no_grad():
            got = [_Recorder(converted, last[-1] if last else None).outputs(args) for args in inputs]
        ratios = [_noise_to_signal([w[0] for w in want], [g[0] for g in got])]
        if all(w[1] is not None and g[1] is not None and w[1].shape == g[1].shape for w, g in zip(want, got)):
            ratios.append(_noise_to_signal([[w[1]] for w in want], [[g[1]] for g in got]))
        entries = accuracy_entries(profile, [(w[0], g[0]) for w, g in zip(want, got)])
        return sum(ratios) / len(ratios), all(a["passed"] for a in entries)

    kept = set(kept_layers(ep.module(), profile.quantization.keep))
    base, _ = error(())
    drops = [(name, base - error((name,))[0]) for name in layers if name not in kept]
    ranked = tuple(sorted(drops, key=lambda x: -x[1]))
    order = [n for n, _ in ranked]
    return Sensitivity(base, ranked, tuple(error(order[:k]) for k in range(1, min(prefixes, len(order)) + 1)))


def _noise_to_signal(want: Sequence[Sequence[torch.Tensor]], got: Sequence[Sequence[Any]]) -> float:
    """Sum of squared differences over sum of squares, over every floating tensor of ``want``."""
    pairs = [(w.double(), g.double()) for ws, gs in zip(want, got) for w, g in zip(ws, gs) if w.is_floating_point()]
    signal = sum(float(w.pow(2).sum()) for w, _ in pairs)
    return sum(float((w - g).pow(2).sum()) for w, g in pairs) / max(signal, 1e-30)


def _features(model: torch.nn.Module, layer: str | None, args: tuple) -> tuple[list[torch.Tensor], Any]:
    """fp32 eager's flat outputs for ``args``, and the input of module ``layer`` (None: not asked, or
    no such module)."""
    seen: list[torch.Tensor] = []
    try:
        module = model.get_submodule(layer) if layer else None
    except AttributeError:
        module = None
    hook = module.register_forward_pre_hook(lambda _, a: seen.append(a[0].detach())) if module is not None else None
    try:
        out = flatten(run_eager(model, args))
    finally:
        if hook is not None:
            hook.remove()
    return out, (seen[-1] if seen else None)


class _Recorder(torch.fx.Interpreter):
    """Runs a graph, keeping the value the node ``watch`` takes as its first input."""

    def __init__(self, graph: torch.fx.GraphModule, watch: torch.fx.Node | None):
        super().__init__(graph)
        self.watch, self.seen = watch, None

    def run_node(self, n: torch.fx.Node) -> Any:
        if n is self.watch and isinstance(n.args[0], torch.fx.Node):
            self.seen = self.env[n.args[0]]
        return super().run_node(n)

    def outputs(self, args: tuple) -> tuple[list[torch.Tensor], Any]:
        return flatten(self.run(*args)), self.seen


def _layer_of(node: torch.fx.Node) -> str | None:
    """The module name of a convolution or linear node (as ``quantizable_layers`` names it), else None."""
    if node.op != "call_function" or getattr(node.target, "__name__", "").split(".")[0] not in QUANTIZABLE:
        return None
    stack = node.meta.get("nn_module_stack") or {}
    return list(stack.values())[-1][0].removeprefix("L['self'].") if stack else None


@contextlib.contextmanager
def _in_fp32(converted: torch.fx.GraphModule, layers: Sequence[str]):
    """``converted`` (PT2E's quantize/dequantize graph) with the convolution and linear nodes of
    ``layers`` taking their input before its quantize/dequantize pair while inside: fp32 activations,
    the weight still rounded to int8 per channel (where little of the error is: batch norms are
    folded into the weights, so no fp32 weight of the graph's own is at hand)."""
    changed = []
    for node in converted.graph.nodes:
        if _layer_of(node) not in layers:
            continue
        x = node.args[0]
        if isinstance(x, torch.fx.Node) and "dequantize_per" in str(x.target):
            q = x.args[0]
            if isinstance(q, torch.fx.Node) and str(q.target).startswith("quantized_decomposed.quantize_per"):
                changed.append((node, node.args))
                node.args = (q.args[0], *node.args[1:])
    converted.recompile()
    try:
        yield
    finally:
        for node, args in changed:
            node.args = args
        converted.recompile()
