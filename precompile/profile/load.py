"""Reading a profile: YAML (``yaml.safe_load``), the schema, then the checks that span fields; every
problem found is reported at once, as ``place: message`` lines of one ProfileError."""

from __future__ import annotations

from pathlib import Path

import yaml
from pydantic import ValidationError

from ..errors import ProfileError
from .checks import inductor_option_problems, precision_problems, semantic_problems, tune_problems
from .schema import LoadedProfile, Profile


def load_profile(path: str | Path) -> LoadedProfile:
    """Read, parse and check a profile file; raise ProfileError listing every problem found."""
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
    if not isinstance(raw, dict):
        raise ProfileError(source, [("", "a profile is a YAML mapping (name:, model:, inputs:, dims:)")])
    try:
        profile = Profile.model_validate(raw)
    except ValidationError as e:
        raise ProfileError(source, validation_problems(e.errors())) from None
    problems = (
        semantic_problems(profile) + inductor_option_problems(profile.compile.inductor) + tune_problems(profile.compile)
    )
    problems += precision_problems(profile, path.parent)
    if profile.model.weights is not None and not (path.parent / profile.model.weights).is_file():
        problems.append(("model.weights", f"file not found: {path.parent / profile.model.weights}"))
    if problems:
        raise ProfileError(source, problems)
    return LoadedProfile(profile=profile, path=path.resolve())


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
