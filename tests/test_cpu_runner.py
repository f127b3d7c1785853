"""``loader.load``'s CPU variants run through their container's C entry points (``loader.cpu_runner``,
off the GIL), torch tensors in and out: bit for bit what torch's package loader gives, behind the
same guards."""

from __future__ import annotations

import pytest
import torch

import loader
from loader import GuardError
from loader.aoti import load_constants, open_package
from loader.cpu_runner import ContainerRunner


def binding_outputs(model, variant, args: list[torch.Tensor]) -> list[torch.Tensor]:
    """What torch's package loader (the path CPU variants took before) gives for ``args``."""
    runner = open_package(str(model.path / variant.file))
    weights = model._weights.tensors
    load_constants(runner, {n: weights[variant.constant_prefix + n] for n in variant.constants})
    return runner.run(args)


def test_cpu_variants_run_through_the_container_not_the_binding(classifier_artifact):
    model = loader.load(classifier_artifact, open="eager")
    assert all(isinstance(model._runners[v.id], ContainerRunner) for v in model.variants)


@pytest.mark.parametrize("batch,seq", [(1, 2), (3, 17), (8, 48)])
def test_answers_are_bit_identical_to_the_package_loaders(classifier_artifact, batch, seq):
    model = loader.load(classifier_artifact)
    gen = torch.Generator().manual_seed(batch * 100 + seq)
    ids = torch.randint(0, 50, (batch, seq), generator=gen)
    mask = torch.rand(batch, seq, generator=gen) > 0.3
    out, variant_id = model.call_detailed(ids, mask)
    variant = next(v for v in model.variants if v.id == variant_id)
    (expected,) = binding_outputs(model, variant, [ids, mask])
    assert out.dtype == expected.dtype and torch.equal(out, expected)


def test_structured_outputs_come_back_as_torch_tensors(structured_artifact):
    model = loader.load(structured_artifact)
    x = torch.randn(5, 8, generator=torch.Generator().manual_seed(3))
    out, variant_id = model.call_detailed(x)
    variant = next(v for v in model.variants if v.id == variant_id)
    hidden, soft, total = binding_outputs(model, variant, [x])
    assert torch.equal(out["hidden"], hidden) and torch.equal(out["pair"][0], soft)
    assert torch.equal(out["pair"][1], total)


def test_the_guards_run_before_the_container(classifier_artifact):
    model = loader.load(classifier_artifact)
    with pytest.raises(GuardError, match="ids"):
        model(torch.zeros(2, 5, dtype=torch.int32), torch.ones(2, 5, dtype=torch.bool))
    with pytest.raises(GuardError):
        model(torch.full((2, 5), 50, dtype=torch.int64), torch.ones(2, 5, dtype=torch.bool))  # outside [0, 49]
    ids = torch.zeros(5, 2, dtype=torch.int64).t()
    with pytest.raises(GuardError, match="contiguous"):
        model(ids, torch.ones(2, 5, dtype=torch.bool))
