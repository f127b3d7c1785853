"""Stage export: an fp32 variant's exported program, with one ``Dim`` per profile dim (``tracing``).

A CUDA variant is exported from a copy of the model on its device in its compute dtype, so the CPU
model stays the reference every check runs eager on. Lower precisions are exported by
``stages.quantize``. Every exported graph is then read for the tables its integer inputs index
(``analysis.value_ranges``), before anything compiles.

    hint = export_hints(vp.ranges, vp.hint)
    ep = export_variant(model, profile, vp, hint)
"""

from __future__ import annotations

import copy

import torch
from torch.export import ExportedProgram

from loader.guards import TORCH_DTYPES

from ..profile import Profile
from ..tracing import export_model
from ..units import VariantPlan


def export_variant(model: torch.nn.Module, profile: Profile, vp: VariantPlan, hint: dict[str, int]) -> ExportedProgram:
    """Export ``model`` for the fp32 variant ``vp`` at the example sizes ``hint``."""
    if vp.device != "cpu":  # a copy, so the CPU model stays the reference for the checks
        cast = TORCH_DTYPES[vp.dtype] if vp.dtype is not None else None
        model = copy.deepcopy(model).to(device=vp.device, dtype=cast)
    return export_model(model, profile, vp.ranges, hint, device=vp.device, dtype=vp.dtype)
