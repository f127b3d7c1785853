"""The flat output order (``loader.outputs``): the loader rebuilds results with it, the batcher cuts
batches with it, the build's check compares with it and the server names outputs with it."""

from __future__ import annotations

from collections import OrderedDict

import torch

from loader.manifest import OutputSpec
from loader.outputs import flatten, output_names, unflatten

T = OutputSpec("tensor")
NESTED = OutputSpec("dict", (T, OutputSpec("tuple", (T, OutputSpec("list", (T,))))), ("logits", "extra"))


def test_unflatten_builds_the_structure_and_flatten_undoes_it():
    a, b, c = torch.zeros(1), torch.ones(2), torch.full((3,), 2.0)
    value = unflatten(NESTED, [a, b, c])
    assert list(value) == ["logits", "extra"]
    assert value["logits"] is a and isinstance(value["extra"], tuple) and value["extra"][1] == [c]
    assert [t is u for t, u in zip(flatten(value), [a, b, c])] == [True, True, True]


def test_a_single_tensor_is_itself():
    t = torch.arange(3)
    assert unflatten(T, [t]) is t and flatten(t) == [t]
    assert output_names(T) == ["output"]


def test_flatten_takes_dicts_in_their_key_order_as_eager_results_give_them():
    class ModelOutput(OrderedDict):  # what Hugging Face models return: a dict of their non-None fields
        pass

    a, b = torch.zeros(1), torch.ones(1)
    assert [t is u for t, u in zip(flatten(ModelOutput(last=b, first=a)), [b, a])] == [True, True]


def test_output_names_are_paths_in_the_result():
    assert output_names(NESTED) == ["logits", "extra.0", "extra.1.0"]
    assert output_names(OutputSpec("tuple", (T, T))) == ["output.0", "output.1"]
