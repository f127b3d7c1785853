"""Stage references: a small input/output pair per variant (at its smallest shape), stored in the
artifact, so a serving host can later check the artifact against what was built
(``precompile verify --run``). Lower-precision variants carry the accuracy rule they are judged by
and the value they reached on the reference input here, run through the real loader (``build_value``:
a serving host computing what this one did reaches about the same, whatever the threshold).

    entries = write_references(loaded, model, staging, variants, opened)    # the manifest's check.references
    # opened(vp): the staged artifact, loaded with the model serving vp (check.Staged.every)
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import save_file

import loader
from loader import constants as C
from loader.outputs import flatten

from ..compare import agreement
from ..profile import LoadedProfile
from ..runners import run_eager
from ..samples import make_inputs, to_device
from ..units import VariantPlan


def write_references(
    loaded: LoadedProfile,
    model: torch.nn.Module,
    folder: Path,
    plan: Sequence[VariantPlan],
    opened: Callable[[VariantPlan], loader.CompiledModel],
) -> list[dict[str, Any]]:
    """A small input/output pair per variant (at its smallest shape), so a serving host can later
    check the artifact against what was built (``precompile verify --run``); a lower-precision
    variant's entry with its rule per output and the value it reaches on that input, run on ``opened(vp)``."""
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
            entry["accuracy"] = _accuracy(loaded, outs, _run_built(opened(vp), vp, args))
        entries.append(entry)
    save_file(tensors, str(folder / C.REFERENCES_FILE))
    return entries


def _run_built(
    compiled: loader.CompiledModel, vp: VariantPlan, args: Sequence[torch.Tensor]
) -> list[torch.Tensor] | None:
    """Variant ``vp``'s outputs on ``args``, run through the loader as ``verify --run`` will; None when
    the staged artifact does not serve it on this host (its entry then has no build value)."""
    if vp.id not in {v.id for v in compiled.variants}:
        return None
    return [t.cpu() for t in flatten(compiled.run_variant(vp.id, *to_device(args, vp.device, None)))]


def _accuracy(
    loaded: LoadedProfile, outs: Sequence[torch.Tensor], got: Sequence[torch.Tensor] | None
) -> list[dict[str, Any]]:
    """Per output: the gate's rule, and the value ``got`` reaches against fp32 eager's ``outs`` (at the
    worst row, as ``verify --run`` measures it); integer outputs are compared for equality."""
    accuracy = []
    for i, t in enumerate(outs):
        if not t.is_floating_point():
            accuracy.append({"metric": "equal", "threshold": 1.0})
            continue
        rule = loaded.profile.accuracy.rule(i)
        record: dict[str, Any] = {"metric": rule.metric, "threshold": rule.threshold}
        if got is not None:
            record["build_value"] = agreement(rule, t, got[i])
        accuracy.append(record)
    return accuracy
