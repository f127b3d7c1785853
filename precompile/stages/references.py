"""Stage references: a small input/output pair per variant (at its smallest shape), stored in the
artifact, so a serving host can later check the artifact against what was built
(``precompile verify --run``). Lower-precision variants carry the accuracy rule they are judged by.

    entries = write_references(loaded, model, staging, variants)    # the manifest's check.references
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import save_file

from loader import constants as C
from loader.outputs import flatten

from ..profile import LoadedProfile
from ..runners import run_eager
from ..samples import make_inputs
from ..units import VariantPlan


def write_references(
    loaded: LoadedProfile, model: torch.nn.Module, folder: Path, plan: Sequence[VariantPlan]
) -> list[dict[str, Any]]:
    """A small input/output pair per variant (at its smallest shape), so a serving host can later
    check the artifact against what was built (``precompile verify --run``)."""
    profile = loaded.profile
    tensors: dict[str, torch.Tensor] = {}
    entries = []
    for vp in plan:
        sizes = {d: lo for d, (lo, _) in vp.ranges.items()}
        args = make_inputs(profile, sizes, seed=profile.check.seed + 7919)
        outs = flatten(run_eager(model, args))
        ins = [f"{vp.id}/in/{name}" for name in profile.inputs]
        outn = [f"{vp.id}/out/{i}" for i in range(len(outs))]
        tensors.update({k: t.contiguous() for k, t in zip(ins, args)})
        tensors.update({k: t.detach().contiguous() for k, t in zip(outn, outs)})
        entry = {
            "variant": vp.id,
            "dims": sizes,
            "inputs": ins,
            "outputs": outn,
            "device": vp.device,
            "tolerance": [
                list(
                    profile.tolerance(
                        vp.dtype if vp.dtype and t.is_floating_point() else str(t.dtype).removeprefix("torch.")
                    )
                )
                for t in outs
            ],
        }
        if vp.precision != "fp32":  # compared by the accuracy gate's rule, not by a tolerance
            entry["accuracy"] = [
                {"metric": profile.accuracy.rule(i).metric, "threshold": profile.accuracy.rule(i).threshold}
                if t.is_floating_point()
                else {"metric": "equal", "threshold": 1.0}
                for i, t in enumerate(outs)
            ]
        entries.append(entry)
    save_file(tensors, str(folder / C.REFERENCES_FILE))
    return entries
