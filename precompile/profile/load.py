"""Reading a profile: YAML (``yaml.safe_load``), the schema, then the checks that span fields; every
problem found is reported at once, as ``place: message`` lines of one ProfileError."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import yaml
from pydantic import ValidationError

from ..errors import ProfileError
from .checks import inductor_option_problems, precision_problems, semantic_problems, tune_problems
from .schema import LoadedProfile, Profile


def load_profile(path: str | Path, *, program: bool = False) -> LoadedProfile:
    """Read, parse and check a profile file; raise ProfileError listing every problem found.
    ``program``: the build is given an exported program, which replaces ``model.factory``."""
    path = Path(path)
    source = str(path)
    try:
        text = path.read_text(encoding="utf-8")
    except FileNotFoundError:
        raise ProfileError(source, [("", "file not found")]) from None
    except (OSError, UnicodeDecodeError) as e:
        raise ProfileError(source, [("", f"cannot read: {e}")]) from None
    try:
        raw = yaml.safe_load(text)
    except yaml.YAMLError as e:
        mark = getattr(e, "problem_mark", None)
        where = f"line {mark.line + 1}, column {mark.column + 1}" if mark else ""
        raise ProfileError(source, [(where, f"not valid YAML: {getattr(e, 'problem', None) or e}")]) from None
    return checked_profile(raw, path.resolve(), source=source, program=program)


def read_profile(
    profile: str | Path | dict[str, Any] | Profile | LoadedProfile,
    *,
    folder: str | Path | None = None,
    program: bool = False,
) -> LoadedProfile:
    """A profile as a file's path, a dict (as the YAML would parse) or a Profile, checked as
    ``load_profile`` checks a file (the same ``place: message`` problems). A dict's or a Profile's model
    imports and weights are relative to ``folder`` (default: the current directory)."""
    if isinstance(profile, LoadedProfile):
        return profile
    if isinstance(profile, (str, Path)):
        return load_profile(profile, program=program)
    where = Path(folder if folder is not None else Path.cwd()).resolve() / PROFILE_NAME
    if isinstance(profile, Profile):
        profile = profile.model_dump(exclude_unset=True)
    return checked_profile(profile, where, source=PROFILE_NAME, program=program)


# How a profile given as a dict or a Profile is named in errors (and its path's last part).
PROFILE_NAME = "<profile>"


def checked_profile(raw: Any, path: Path, *, source: str, program: bool = False) -> LoadedProfile:
    """``raw`` (a parsed document) as a checked profile at ``path`` (its folder is the model's); every
    problem at once, as ``source: place: message``."""
    if not isinstance(raw, dict):
        raise ProfileError(source, [("", "a profile is a YAML mapping (name:, model:, inputs:, dims:)")])
    try:
        profile = Profile.model_validate(raw)
    except ValidationError as e:
        raise ProfileError(source, validation_problems(e.errors())) from None
    problems = (
        semantic_problems(profile) + inductor_option_problems(profile.compile.inductor) + tune_problems(profile.compile)
    )
    problems += precision_problems(profile, path.parent) + model_problems(profile, path.parent, program=program)
    if problems:
        raise ProfileError(source, problems)
    return LoadedProfile(profile=profile, path=path)


def model_problems(profile: Profile, folder: Path, *, program: bool) -> list[tuple[str, str]]:
    """The ``model`` section against where the model comes from: a factory (and its weights file), or
    an exported program handed to the build (which is built in fp32 only: it is not the model itself)."""
    model = profile.model
    if program:
        lower = [p for t in profile.targets for p in profile.precisions(t) if p != "fp32"]
        if lower:
            return [
                (
                    "precision",
                    f"{', '.join(dict.fromkeys(lower))} need the model itself (model.factory): an exported program "
                    "is built in fp32",
                )
            ]
        return []
    if model.factory is None:
        return [
            (
                "model.factory",
                'required: "module:callable" returning the nn.Module (or give precompile.build the exported program)',
            )
        ]
    if model.weights is not None and not (folder / model.weights).is_file():
        return [("model.weights", f"file not found: {folder / model.weights}")]
    return []


def validation_problems(errors: list[dict]) -> list[tuple[str, str]]:
    """pydantic's errors as ``place: message``. A field that takes a list or a mapping (``precision``)
    reports its failure under each form; the form the user did not write is dropped, and the form's
    name (``list[...]``) is left out of the place."""
    out = []
    for err in errors:
        loc = tuple(p for p in err["loc"] if not (isinstance(p, str) and "[" in p))
        out.append((loc, err))

    def form_error(loc: tuple, err: dict) -> bool:
        return err["type"] in ("dict_type", "list_type") and len(loc) < len(err["loc"])

    shown = []
    for loc, err in out:
        if form_error(loc, err):
            if any(l2[: len(loc)] == loc and not form_error(l2, e2) for l2, e2 in out):
                continue  # the user wrote the other form, whose own errors say what is wrong
            shown.append(
                (_place(loc), "expected a list (e.g. [fp32, int8]) or a mapping per target (e.g. {cpu: [int8]})")
            )
            continue
        shown.append((_place(loc), _message(err)))
    return list(dict.fromkeys(shown))


def _place(loc: tuple) -> str:
    out = ""
    for part in loc:
        if isinstance(part, int):
            out += f"[{part}]"
        else:
            out += ("." if out else "") + str(part)
    return out


def _message(err: dict) -> str:
    if err["type"] == "extra_forbidden":
        return "unknown key"
    if err["type"] == "literal_error":
        return f"{err['input']!r} is not one of: {err['ctx']['expected']}"
    return err["msg"]
