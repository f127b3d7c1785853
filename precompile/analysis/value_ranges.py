"""Value ranges of integer inputs: which values the compiled code can take, found in the exported graph.

An index past a table (an embedding's rows, the axis an ``index_select`` or ``gather`` reads) makes
compiled code call std::terminate, so the loader checks every integer input against a range stored in
the manifest. The range is the profile's ``inputs.<name>.range`` when given, else ``[0, rows - 1]`` of
the smallest table the input indexes. ``index_tables`` finds those tables by following each integer
input forward through ops that keep its values (views, reshapes, copies) to the ops that index with it.

    tables = index_tables(exported, profile)      # {"ids": IndexTable(rows=1000, op="embedding")}
    loaded, notes = with_value_ranges(loaded, tables)
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch.export import ExportedProgram

from loader.constants import INTEGER_DTYPES
from loader.manifest import DimRange, InputSpec

from ..errors import ProfileError
from ..profile import LoadedProfile, Profile, pad_value_problems
from .shapes import KEEP_VALUES

aten = torch.ops.aten


@dataclass(frozen=True)
class IndexTable:
    """The smallest table an input indexes: its size along the indexed axis and the op that reads it."""

    rows: int
    op: str  # "embedding", "index_select", "gather", "index", ...

    def describe(self) -> str:
        what = "embedding table" if self.op in ("embedding", "embedding_bag") else f"axis the {self.op} indexes"
        return f"the {what} of {self.rows} rows (valid 0..{self.rows - 1})"


def _indexed_size(node: torch.fx.Node, arg: torch.fx.Node) -> int | None:
    """The size of the axis ``node`` indexes with ``arg``, or None if ``arg`` is not an index there
    (or the size varies with the call's shapes)."""
    packet, args = node.target.overloadpacket, node.args

    def size(source, axis) -> int | None:
        val = source.meta.get("val") if isinstance(source, torch.fx.Node) else None
        if not isinstance(val, torch.Tensor) or not isinstance(axis, int) or val.dim() == 0:
            return None
        n = val.shape[axis % val.dim()]
        return n if isinstance(n, int) else None

    if packet in (aten.embedding, aten.embedding_bag, aten._embedding_bag) and len(args) > 1 and args[1] is arg:
        return size(args[0], 0)
    if packet in (aten.index_select, aten.gather, aten.scatter, aten.scatter_add, aten.index_add, aten.index_copy):
        if len(args) > 2 and args[2] is arg:
            return size(args[0], args[1])
        return None
    if packet in (aten.index, aten.index_put, aten._unsafe_index) and len(args) > 1:
        for axis, index in enumerate(args[1] or ()):
            if index is arg:
                return size(args[0], axis)
    return None


def index_tables(ep: ExportedProgram, profile: Profile) -> dict[str, IndexTable]:
    """Per integer input that indexes a table of fixed size, the smallest such table."""
    placeholders = {n.name: n for n in ep.graph.nodes if n.op == "placeholder"}
    user_inputs = [placeholders[name] for name in ep.graph_signature.user_inputs]
    out: dict[str, IndexTable] = {}
    for (name, spec), node in zip(profile.inputs.items(), user_inputs):
        if spec.dtype not in INTEGER_DTYPES:
            continue
        found: IndexTable | None = None
        todo, seen = [node], {node}
        while todo:
            current = todo.pop()
            for user in current.users:
                if user.op != "call_function" or not isinstance(user.target, torch._ops.OpOverload):
                    continue
                if user.target.overloadpacket in KEEP_VALUES and user.args and user.args[0] is current:
                    if user not in seen:
                        seen.add(user)
                        todo.append(user)
                    continue
                rows = _indexed_size(user, current)
                if rows is not None and (found is None or rows < found.rows):
                    found = IndexTable(rows, user.target.overloadpacket.__name__.lstrip("_"))
        if found is not None:
            out[name] = found
    return out


def range_problems(profile: Profile, tables: dict[str, IndexTable]) -> list[tuple[str, str]]:
    """A declared range that goes past the table its input indexes, in the profile's words."""
    problems = []
    for name, table in tables.items():
        declared = profile.inputs[name].range
        if declared is not None and (declared[0] < 0 or declared[1] > table.rows - 1):
            problems.append(
                (f"inputs.{name}.range", f"[{declared[0]:g}, {declared[1]:g}] goes past {table.describe()}: narrow it")
            )
    return problems


def check_declared_ranges(loaded: LoadedProfile, tables: dict[str, IndexTable]) -> None:
    """Raise ProfileError when a declared range goes past a table (before anything is compiled)."""
    problems = range_problems(loaded.profile, tables)
    if problems:
        raise ProfileError(str(loaded.path), problems)


def with_value_ranges(
    loaded: LoadedProfile, tables: dict[str, IndexTable]
) -> tuple[LoadedProfile, list[tuple[str, str]]]:
    """The profile with each undeclared range of a table-indexing input set to ``[0, rows - 1]`` (so the
    checks draw samples from it too), and ("info" | "warning", text) notes: a warning per integer input
    left without a range. Raises ProfileError if a pad value falls outside a range found this way."""
    profile = loaded.profile
    inputs: dict = dict(profile.inputs)
    notes: list[tuple[str, str]] = []
    for name, spec in profile.inputs.items():
        if spec.dtype not in INTEGER_DTYPES or spec.range is not None:
            continue
        table = tables.get(name)
        if table is None:
            notes.append(
                (
                    "warning",
                    f"inputs.{name}: an {spec.dtype} input with no range, and it indexes no table the build could "
                    f"find: its values are not checked at the call (declare inputs.{name}.range to guard them)",
                )
            )
            continue
        inputs[name] = spec.model_copy(update={"range": (0, table.rows - 1)})
        notes.append(("info", f"inputs.{name}: values guarded to [0, {table.rows - 1}], {table.describe()}"))
    if inputs == dict(profile.inputs):
        return loaded, notes
    profile = profile.model_copy(update={"inputs": inputs})
    problems = pad_value_problems(profile)
    if problems:
        raise ProfileError(str(loaded.path), problems)
    return loaded.model_copy(update={"profile": profile}), notes


def manifest_inputs(profile: Profile) -> tuple[InputSpec, ...]:
    """The manifest's inputs: integer ones carry their range (the profile's, filled by with_value_ranges)."""
    return tuple(
        InputSpec(
            name,
            spec.dtype,
            tuple(spec.shape),
            DimRange(int(spec.range[0]), int(spec.range[1]))
            if spec.range is not None and spec.dtype in INTEGER_DTYPES
            else None,
        )
        for name, spec in profile.inputs.items()
    )
