"""Stage resolve: the profile's ``model`` section as an eval-mode nn.Module with its weights, run once
in eager at the plan's largest sample sizes to learn what its outputs look like.

    resolved = resolve(loaded, sizes)       # Resolved: the model, its output structure and output dims

A failure of that eager run is explained in the profile's words where it can be (a declared range
past a table the model indexes: ``explain_eager_failure``).
"""

from __future__ import annotations

import importlib
import inspect
import sys
import traceback
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch.export import ExportedProgram

from loader.constants import INTEGER_DTYPES
from loader.manifest import OutputSpec
from loader.outputs import flatten

from ...analysis.value_ranges import check_declared_ranges, index_tables
from ...context import OutputDims
from ...errors import DimBoundError, ExportError, ModelError, ProfileError
from ...profile import LoadedProfile
from ...runners import run_eager
from ...samples import make_inputs
from ...tracing import export_model
from .program import check_program, program_module, read_program, save_program


@dataclass(frozen=True, eq=False)
class Resolved:
    model: torch.nn.Module
    output: OutputSpec  # the structure of forward()'s result
    output_dims: OutputDims | None  # the profile's ``outputs`` as dim names per axis, checked
    loaded: LoadedProfile  # as compile workers read it: with the exported program's file, if any


def resolve(
    loaded: LoadedProfile,
    sizes: dict[str, int],
    program: ExportedProgram | str | Path | None = None,
    *,
    scratch: Path | None = None,
) -> Resolved:
    """The model (``program``'s module when given, else the profile's factory's), run once in eager on
    sample inputs of ``sizes``. A program given in memory is saved under ``scratch`` for the compile
    workers, which read it from there."""
    if program is not None and not isinstance(program, ExportedProgram):
        loaded = loaded.model_copy(update={"program": Path(program).resolve()})
        program = None
    model = resolve_model(loaded, program)
    args = make_inputs(loaded.profile, sizes, seed=loaded.profile.check.seed)
    try:
        eager_out = run_eager(model, args, profile=loaded.profile, sizes=sizes)
    except ModelError as e:
        explain_eager_failure(loaded, model, sizes, e)  # a range past a table, if that is why
        raise
    dims = output_dims(loaded, flatten(eager_out), sizes)
    if program is not None:
        if scratch is None:
            raise ValueError("resolve: an ExportedProgram in memory needs a scratch folder to save it in")
        loaded = loaded.model_copy(update={"program": save_program(program, scratch)})
    return Resolved(model, output_spec(eager_out), dims, loaded)


def output_spec(value: Any, where: str = "output") -> OutputSpec:
    """The structure of an eager output, in the order torch.export flattens it."""
    if isinstance(value, torch.Tensor):
        return OutputSpec("tensor")
    if isinstance(value, dict):  # also HF ModelOutput, which flattens its non-None fields in order
        keys = tuple(value.keys())
        if not all(isinstance(k, str) for k in keys):
            raise ModelError(f"{where}: dict outputs need string keys, got {keys!r}")
        return OutputSpec("dict", tuple(output_spec(value[k], f"{where}[{k!r}]") for k in keys), keys)
    if isinstance(value, (tuple, list)):
        kind = "list" if isinstance(value, list) else "tuple"
        return OutputSpec(kind, tuple(output_spec(v, f"{where}[{i}]") for i, v in enumerate(value)))
    raise ModelError(
        f"{where} is {type(value).__name__}; forward() may return tensors and tuples, lists or dicts of tensors "
        "(name the outputs to keep in the profile: `model: {factory: ..., outputs: [logits]}`)"
    )


def output_dims(loaded: LoadedProfile, outputs: list[torch.Tensor], sizes: dict[str, int]) -> OutputDims | None:
    """The profile's ``outputs`` as per-axis dim names, checked against a real eager output."""
    profile = loaded.profile
    if profile.outputs is None:
        return None
    problems = []
    if len(profile.outputs) != len(outputs):
        problems.append(
            ("outputs", f"declares {len(profile.outputs)} outputs, forward() returns {len(outputs)} tensors")
        )
    rows = []
    for i, (decl, t) in enumerate(zip(profile.outputs, outputs)):
        if len(decl.shape) != t.dim():
            problems.append(
                (f"outputs[{i}].shape", f"has {len(decl.shape)} axes, the output has shape {tuple(t.shape)}")
            )
            continue
        row = []
        for axis, (s, n) in enumerate(zip(decl.shape, t.shape)):
            if isinstance(s, str) and s in profile.dims:
                if sizes[s] != n:
                    problems.append(
                        (
                            f"outputs[{i}].shape[{axis}]",
                            f"says it follows {s!r} ({s}={sizes[s]}) but the output's size is {n}",
                        )
                    )
                row.append(s)
            else:
                row.append(None)
        rows.append(tuple(row))
    if problems:
        raise ProfileError(str(loaded.path), problems)
    return tuple(rows)


def explain_eager_failure(
    loaded: LoadedProfile, model: torch.nn.Module, sizes: dict[str, int], error: BaseException | None = None
) -> None:
    """Eager forward() just failed on sample inputs: if a declared range goes past a table (samples drawn
    from it index past the end), raise that ProfileError instead, in the profile's words. Exports once
    at ``sizes`` (static), only on this failure path; returns if that is not the cause. When the failure
    is an IndexError (``error``, the ModelError run_eager raised), first looks for a dim whose range goes
    past a table the model indexes by position (exporting once with the profile's ranges)."""
    cause = getattr(error, "cause", None)
    if isinstance(cause, IndexError):
        ranges = {d: (spec.min, spec.max) for d, spec in loaded.profile.dims.items()}
        try:
            export_model(model, loaded.profile, ranges, sizes)
        except DimBoundError as e:
            at = ", ".join(f"{d}={n}" for d, n in sizes.items())
            raise ProfileError(
                str(loaded.path),
                [
                    (place, f"{message}; the eager sample at {at} failed with IndexError: {cause}")
                    for place, message in e.problems
                ],
            ) from None
        except ExportError:
            pass
    if not any(spec.range is not None and spec.dtype in INTEGER_DTYPES for spec in loaded.profile.inputs.values()):
        return
    try:
        ep = export_model(model, loaded.profile, {d: (n, n) for d, n in sizes.items()}, sizes)
    except ExportError:
        return
    check_declared_ranges(loaded, index_tables(ep, loaded.profile))


def resolve_model(loaded: LoadedProfile, program: ExportedProgram | None = None) -> torch.nn.Module:
    """Import ``module:callable`` (the profile's folder first on sys.path), call it, load weights; or,
    given an exported program (``program``, or the file ``loaded.program``), its module, once its
    inputs are checked against the profile's (``stages.program``)."""
    if program is not None or loaded.program is not None:
        ep = program if program is not None else read_program(loaded.program)
        check_program(ep, loaded)
        return adapt(program_module(ep), list(loaded.profile.inputs), loaded.profile.model.outputs)
    spec = loaded.profile.model
    source = str(loaded.path)
    if spec.factory is None:  # load_profile refuses it unless a program was to be given
        raise ProfileError(source, [("model.factory", "required when no exported program is given")])
    module_name, _, attr = spec.factory.partition(":")
    folder = str(loaded.folder)
    _forget_foreign_module(module_name.split(".")[0], Path(folder))
    sys.path.insert(0, folder)
    try:
        module = importlib.import_module(module_name)
    except Exception as e:  # the user's code can raise anything while importing
        raise ProfileError(source, [("model.factory", f"cannot import {module_name!r}: {_short(e)}")]) from None
    finally:
        try:
            sys.path.remove(folder)
        except ValueError:
            pass
    factory = module
    for part in attr.split("."):
        factory = getattr(factory, part, None)
        if factory is None:
            raise ProfileError(source, [("model.factory", f"{module_name!r} has no attribute {attr!r}")])
    if not callable(factory):
        raise ProfileError(source, [("model.factory", f"{spec.factory} is not callable")])
    try:
        model = factory(**spec.kwargs)
    except Exception as e:
        raise ModelError(f"{spec.factory}(**{spec.kwargs}) raised {_short(e)}\n{_user_frames(e)}") from None
    if not isinstance(model, torch.nn.Module):
        raise ProfileError(
            source, [("model.factory", f"{spec.factory} returned {type(model).__name__}, not a torch.nn.Module")]
        )
    if spec.weights is not None:
        _load_weights(model, loaded.folder / spec.weights, source)
    return adapt(_inference_mode(model), list(loaded.profile.inputs), spec.outputs)


def _inference_mode(model: torch.nn.Module) -> torch.nn.Module:
    """``model.eval()``; a module that refuses it (``torch.export.load(...).module()`` raises
    NotImplementedError: an exported graph's mode was fixed when it was exported) as it is."""
    try:
        return model.eval()
    except NotImplementedError:
        return model


class Adapted(torch.nn.Module):
    """A model called the way a profile declares it: inputs by name when forward() takes them in
    another order (or among others), and only the outputs ``model.outputs`` names. The build sees
    ``forward(*inputs)`` in the profile's order returning tensors, so no hand-written wrapper is needed
    for a transformers model returning a ``ModelOutput`` with a cache in it."""

    def __init__(self, model: torch.nn.Module, names: list[str] | None, outputs: list[str | int] | None):
        super().__init__()
        self.model = model  # precompile.analysis.shapes.WRAPPED names this attribute
        self.names = names
        self.outputs = outputs

    def forward(self, *args: torch.Tensor):
        out = self.model(**dict(zip(self.names, args))) if self.names is not None else self.model(*args)
        if self.outputs is None:
            return out
        return pick_outputs(out, self.outputs)


def pick_outputs(out, keep: list[str | int]):
    """``keep``'s items of a dict/ModelOutput (as a dict) or of a tuple/list (as a tuple)."""
    if isinstance(out, dict) or hasattr(out, "keys"):
        missing = [k for k in keep if not isinstance(k, str) or k not in out.keys() or out[k] is None]
        if missing:
            have = ", ".join(k for k in out.keys() if out[k] is not None)
            raise ModelError(
                f"model.outputs: forward() returned no {', '.join(map(repr, missing))} (it returned: {have})"
            )
        return {k: out[k] for k in keep}
    if isinstance(out, (tuple, list)):
        bad = [k for k in keep if not isinstance(k, int) or not -len(out) <= k < len(out)]
        if bad:
            raise ModelError(f"model.outputs: forward() returned {len(out)} items; {bad} are not indices of them")
        return tuple(out[k] for k in keep)
    raise ModelError(f"model.outputs: forward() returned a {type(out).__name__}, which has no items to pick")


def adapt(model: torch.nn.Module, names: list[str], outputs: list[str | int] | None) -> torch.nn.Module:
    """``model`` as is when forward() takes ``names`` first and in order and every output is kept;
    else wrapped in ``Adapted`` (keyword call when every name is one of forward()'s parameters)."""
    params = _parameters(model)
    positional = params is None or params[: len(names)] == names or not set(names) <= set(params)
    if positional and outputs is None:
        return model
    adapted = Adapted(model, None if positional else names, outputs)
    adapted.training = False  # the model's own mode is its caller's (an exported program's cannot change)
    return adapted


def _parameters(model: torch.nn.Module) -> list[str] | None:
    try:
        params = inspect.signature(model.forward).parameters.values()
    except (TypeError, ValueError):
        return None
    if any(p.kind is inspect.Parameter.VAR_POSITIONAL for p in params):
        return None
    return [
        p.name for p in params if p.kind in (inspect.Parameter.POSITIONAL_OR_KEYWORD, inspect.Parameter.KEYWORD_ONLY)
    ]


def _load_weights(model: torch.nn.Module, path: Path, source: str) -> None:
    from safetensors import SafetensorError
    from safetensors.torch import load_file

    try:
        state = load_file(str(path))
    except (OSError, SafetensorError) as e:
        raise ProfileError(source, [("model.weights", f"cannot read {path}: {e}")]) from None
    try:
        result = model.load_state_dict(state, strict=False)
    except RuntimeError as e:  # size mismatches are raised even with strict=False
        raise ProfileError(source, [("model.weights", f"{path.name} does not fit the model: {e}")]) from None
    problems = []
    if result.missing_keys:
        problems.append(f"missing from the file: {', '.join(result.missing_keys[:8])}")
    if result.unexpected_keys:
        problems.append(f"not in the model: {', '.join(result.unexpected_keys[:8])}")
    if problems:
        raise ProfileError(source, [("model.weights", f"{path.name} does not fit the model ({'; '.join(problems)})")])


def _forget_foreign_module(top: str, folder: Path) -> None:
    """Drop a cached module of the same name imported from elsewhere (another profile's models.py)."""
    cached = sys.modules.get(top)
    file = getattr(cached, "__file__", None)
    if cached is None or file is None or Path(file).resolve().is_relative_to(folder.resolve()):
        return
    if "site-packages" in file or "dist-packages" in file:
        return  # an installed package: the factory means that one
    for name in [n for n in sys.modules if n == top or n.startswith(top + ".")]:
        del sys.modules[name]


def _short(e: BaseException) -> str:
    return f"{type(e).__name__}: {e}".strip()


def _user_frames(e: BaseException, limit: int = 4) -> str:
    """The last frames of a traceback from the user's code, to say where their factory failed."""
    frames = traceback.extract_tb(e.__traceback__)[-limit:]
    return "".join(traceback.format_list(frames)).rstrip()
