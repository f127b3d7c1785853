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
import io
from collections.abc import Sequence
from typing import Any

import torch
from torch.export import ExportedProgram

from ..calibration import Sample, fallback_inputs, inside
from ..errors import CompileError, ExportError
from ..profile import Profile
from ..quiet import quiet_third_party_warnings
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
    with quiet_torchao():
        import torchao.quantization.pt2e.quantizer.x86_inductor_quantizer as xiq
        from torchao.quantization.pt2e.quantize_pt2e import convert_pt2e, prepare_pt2e

    ep = export_model(model, profile, vp.ranges, hint)
    quantizer = xiq.X86InductorQuantizer()
    quantizer.set_global(xiq.get_default_x86_inductor_quantization_config())
    samples = [args for sizes, args in calibration if inside(sizes, vp.ranges)]
    samples = samples or [args for _, args in fallback_inputs(profile, vp.ranges)]
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
@contextlib.contextmanager
def quiet_torchao():
    """torchao warns, on import, about every optional CUDA extension it cannot load (on every CPU host),
    and prints through stdout for some: none of it concerns the build."""
    quiet_third_party_warnings()
    with contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(io.StringIO()):
        yield
