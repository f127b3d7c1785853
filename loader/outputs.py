"""Outputs in flat order: the one home of how forward()'s result maps to a list of tensors and back.

The compiled code returns a flat list of tensors; the manifest's ``output`` (an ``OutputSpec``)
says the structure forward() returned them in. The flat order is depth first, sequence items by
index and dict items in their key order, as torch.export flattens them:

    flatten({"logits": a, "extra": (b, c)})       # [a, b, c]
    unflatten(spec, [a, b, c])                    # {"logits": a, "extra": (b, c)}
    output_names(spec)                            # ["logits", "extra.0", "extra.1"]

The loader rebuilds results with ``unflatten``; the batcher cuts a batch's flat outputs per call;
the build's check compares eager and compiled outputs flat; the server names each flat output.
All of them use these functions, so the order cannot differ between writer, loader and server.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

from .manifest import OutputSpec


def flatten(value: Any) -> list[Any]:
    """The tensors of ``value`` (a tensor, or tuples, lists and dicts of them: an eager result,
    a Hugging Face ``ModelOutput`` included, or what the loader returns) in flat order. Anything
    that is not a tuple, list or dict is a leaf, so numpy arrays (the torch-free loader's) flatten
    the same way, and this module needs no torch."""
    if not isinstance(value, (tuple, list, dict)):
        return [value]
    items = value.values() if isinstance(value, dict) else value
    return [t for item in items for t in flatten(item)]


def unflatten(spec: OutputSpec, flat: Iterable[Any]) -> Any:
    """The structure ``spec`` describes, holding the tensors of ``flat`` in order (the inverse of
    ``flatten`` for a result of that structure)."""
    return _build(spec, iter(flat))


def _build(spec: OutputSpec, flat) -> Any:
    if spec.kind == "tensor":
        return next(flat)
    items = [_build(item, flat) for item in spec.items]
    if spec.kind == "tuple":
        return tuple(items)
    if spec.kind == "list":
        return items
    return dict(zip(spec.keys, items))


def output_names(spec: OutputSpec) -> list[str]:
    """A name per flat output: ``output`` for a single tensor; otherwise its path in forward()'s
    result, dict keys by name and sequence items by index (``output.0``; ``logits``, ``extra.0``)."""
    if spec.kind == "tensor":
        return ["output"]
    names: list[str] = []

    def walk(s: OutputSpec, path: list[str]) -> None:
        if s.kind == "tensor":
            names.append(".".join(path))
            return
        keys = list(s.keys) if s.kind == "dict" else [str(i) for i in range(len(s.items))]
        for key, item in zip(keys, s.items):
            walk(item, path + [key])

    walk(spec, [] if spec.kind == "dict" else ["output"])
    return names
