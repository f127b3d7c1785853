"""Fold recorded traffic (``loader.TrafficRecorder`` files) into a profile's ``distribution.shapes``.

    merge_traffic("profiles/text_classifier.yaml", ["traffic-101.jsonl", "traffic-102.jsonl"])

Counts of equal dims are summed, with the shapes already in the profile and across files. The YAML
is edited round-trip (ruamel.yaml): comments, key order, quoting and flow style stay as they were;
existing entries keep their place and get the new counts, new shapes are appended, most frequent
first. The result is checked as a profile before it replaces anything.
"""

from __future__ import annotations

import io
import os
import re
import tempfile
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from loader.fs import write_atomic
from loader.serving.traffic import Histogram, read_histogram

from ..errors import PrecompileError, ProfileError
from ..profile import load_profile


class MergeError(PrecompileError):
    """Recorded traffic does not fit the profile, or the profile cannot be edited."""


@dataclass(frozen=True)
class MergeResult:
    path: Path  # the profile written
    calls: int  # calls in the recordings
    shapes: int  # distinct shapes in the recordings
    added: int  # shapes new to the profile
    updated: int  # shapes whose count grew
    outside: int  # recorded calls outside the profile's dim ranges (`precompile plan` reports them)


def read_recordings(recordings: Sequence[str | os.PathLike], dims: Sequence[str]) -> Histogram:
    """Sum the recordings, each line's dim names checked against the profile's; keys in ``dims`` order.

    Sizes outside the profile's ranges are kept: the planner reports them (and a widened range may
    want them).
    """
    names = list(dims)

    def check(sizes: dict[str, int], where: str) -> None:
        if set(sizes) != set(names):
            raise MergeError(
                f"{where}: records dims {', '.join(sizes) or 'none'}; the profile's dims are {', '.join(names) or 'none'} "
                "(traffic of another model?)"
            )

    total: Histogram = {}
    for path in recordings:
        for key, count in read_histogram(path, check=check).items():
            sizes = dict(key)
            ordered = tuple((n, sizes[n]) for n in names)
            total[ordered] = total.get(ordered, 0) + count
    return total


def merge_traffic(
    profile: str | os.PathLike,
    recordings: Sequence[str | os.PathLike],
    *,
    output: str | os.PathLike | None = None,
    replace: bool = False,
) -> MergeResult:
    """Add the recorded counts to ``profile``'s ``distribution.shapes`` and write it.

    ``output`` (default: the profile itself) must be in the profile's folder, since the profile's
    paths are relative to it. ``replace`` drops the shapes already listed first, so the distribution
    is the recorded traffic alone (a ``distribution.file`` stays as it is).
    """
    from ruamel.yaml import YAML, YAMLError  # only this command needs it
    from ruamel.yaml.comments import CommentedMap, CommentedSeq

    profile = Path(profile)
    target = Path(output) if output is not None else profile
    if target.resolve().parent != profile.resolve().parent:
        raise MergeError(
            f"--output {target}: must be in the profile's folder ({profile.parent}); the profile's paths "
            "(model factory, weights, distribution file) are relative to it"
        )
    if not recordings:
        raise MergeError("no traffic files given")
    loaded = load_profile(profile)
    dims = {name: (spec.min, spec.max) for name, spec in loaded.profile.dims.items()}
    recorded = read_recordings(recordings, list(dims))
    outside = sum(
        count for key, count in recorded.items() if not all(dims[n][0] <= size <= dims[n][1] for n, size in key)
    )

    text = profile.read_text(encoding="utf-8")
    yaml = YAML()
    yaml.preserve_quotes = True
    yaml.width = 4096  # never fold a long flow mapping
    yaml.indent(**_guess_indent(text))
    try:
        data = yaml.load(text)
    except YAMLError as e:  # load_profile read it, so this is ruamel disagreeing with PyYAML
        raise MergeError(f"{profile}: cannot edit this YAML round-trip: {e}") from None

    distribution = data.get("distribution")
    if distribution is None:
        distribution = CommentedMap()
        data["distribution"] = distribution
    shapes = distribution.get("shapes")
    if shapes is None or replace:
        shapes = CommentedSeq()
        if "shapes" in distribution:
            distribution["shapes"] = shapes
        else:
            distribution.insert(0, "shapes", shapes)

    _keep_only_line_comment(shapes)
    index = {}
    for i, entry in enumerate(shapes):
        key = tuple((n, entry.get(n)) for n in dims)
        index[key] = i
    added = updated = 0
    new = []
    for key, count in recorded.items():
        if count == 0:
            continue
        if key in index:
            shapes[index[key]]["count"] = shapes[index[key]].get("count", 0) + count
            updated += 1
        else:
            new.append((key, count))
    for key, count in sorted(new, key=lambda kv: (-kv[1], kv[0])):
        entry = CommentedMap([*key, ("count", count)])
        entry.fa.set_flow_style()
        shapes.append(entry)
        added += 1

    _write_checked(target, _splice(text, data, yaml))
    return MergeResult(target, sum(recorded.values()), len(recorded), added, updated, outside)


def _splice(text: str, data, yaml) -> str:
    """``text`` with its ``distribution`` block replaced by the edited one, every other line as it was.

    ruamel keeps comments and order but not everything (it re-spaces ``ids:  {...}`` alignment), so
    only the edited block goes through its dumper. Blank lines and column-0 comments that end the block
    stay the original's: they introduce the next key.
    """
    from ruamel.yaml.comments import CommentedMap

    lines = text.splitlines(keepends=True)
    if lines and not lines[-1].endswith("\n"):
        lines[-1] += "\n"
    keys = list(data)
    sub = CommentedMap()
    sub["distribution"] = data["distribution"]
    if "distribution" in data.ca.items:
        sub.ca.items["distribution"] = data.ca.items["distribution"]
    out = io.StringIO()
    yaml.dump(sub, out)
    block = _trim_tail(out.getvalue().splitlines(keepends=True))
    position = data.lc.data.get("distribution") if hasattr(data.lc, "data") else None
    if position is None:  # a new key: at the end
        return "".join(_trim_tail(lines) + block + lines[len(_trim_tail(lines)) :])
    start = position[0]
    later = [data.lc.data[k][0] for k in keys[keys.index("distribution") + 1 :] if k in data.lc.data]
    end = len(_trim_tail(lines[: min(later) if later else len(lines)]))
    return "".join(lines[:start] + block + lines[end:])


def _keep_only_line_comment(shapes) -> None:
    """ruamel hangs the blank lines and comments that follow a sequence on its last item; new items go
    after it, so keep only that item's own end-of-line comment (``_splice`` keeps the rest in place)."""
    if not len(shapes):
        return
    tokens = shapes.ca.items.get(len(shapes) - 1) or []
    for token in tokens:
        if token is not None and hasattr(token, "value") and "\n" in token.value:
            first, _, _ = token.value.partition("\n")
            token.value = first + "\n"


def _trim_tail(lines: list[str]) -> list[str]:
    """Without the trailing blank lines and column-0 comments."""
    end = len(lines)
    while end and (not lines[end - 1].strip() or lines[end - 1].startswith("#")):
        end -= 1
    return lines[:end]


def _write_checked(target: Path, text: str) -> None:
    """Check ``text`` as a profile beside ``target`` (relative paths resolve the same), then write it."""
    fd, tmp = tempfile.mkstemp(prefix=f".{target.name}.merge-", suffix=".yaml", dir=target.parent)
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as f:
            f.write(text)
        load_profile(tmp)
    except ProfileError as e:
        raise MergeError(f"{target}: the merged profile would be invalid, nothing written:\n{e}") from None
    finally:
        os.unlink(tmp)
    write_atomic(target, text.encode("utf-8"))


_INDENTED = re.compile(r"^( +)(?!- |-$|#)\S")
_DASH = re.compile(r"^( *)- ")


def _guess_indent(text: str) -> dict[str, int]:
    """Indentation as the file already uses it: mapping step, and where block sequences put the dash
    (ruamel writes one style for the whole file; defaults follow docs/profiles.md)."""
    mapping = None
    offset = None
    previous_indent = 0
    for line in text.splitlines():
        if not line.strip() or line.lstrip().startswith("#"):
            continue
        indent = len(line) - len(line.lstrip(" "))
        dash = _DASH.match(line)
        if dash and offset is None and indent >= previous_indent:
            offset = indent - previous_indent
        elif mapping is None and _INDENTED.match(line):
            mapping = indent
        if not dash:
            previous_indent = indent
    mapping = mapping or 2
    offset = mapping if offset is None else offset
    return {"mapping": mapping, "sequence": offset + 2, "offset": offset}
