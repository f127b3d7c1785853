"""Stage 1, resolve: turn the profile's ``model`` section into an eval-mode nn.Module with its weights."""

from __future__ import annotations

import importlib
import sys
import traceback
from pathlib import Path

import torch

from .errors import ModelError, ProfileError
from .profile import LoadedProfile


def resolve_model(loaded: LoadedProfile) -> torch.nn.Module:
    """Import ``module:callable`` (the profile's folder first on sys.path), call it, load weights."""
    spec = loaded.profile.model
    source = str(loaded.path)
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
    return model.eval()


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
