"""The build context: what every stage after ``prepare`` works from, read once and frozen.

``pipeline.prepare`` makes it (the checked profile, its traffic and plan, the variants per target and
precision, the model and what its eager outputs look like); the stages take what they need from it
and return their own typed results, never a changed context. The one stage that learns something
about the profile (value ranges found in the exported graphs) returns a new context
(``with_profile``).

    ctx = prepare("profiles/tagger.yaml", progress)
    ctx.traffic                  # {(4, 32): 120, ...}: the distribution, parsed once
    ctx.calibration              # calibration samples, read or drawn on first use, then kept
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from functools import cached_property
from typing import Any

import torch

from loader.manifest import Batching, CudaInfo, OutputSpec

from .calibration import Sample, calibration_inputs
from .profile import LoadedProfile, Profile
from .traffic import Shape
from .units import Plan, VariantPlan

# Per declared output, per axis: the dim it follows, or None (the profile's ``outputs``).
OutputDims = tuple[tuple[str | None, ...], ...]


@dataclass(frozen=True, eq=False)
class BuildContext:
    loaded: LoadedProfile
    model: torch.nn.Module  # on the CPU: the reference every check runs eager on
    traffic: dict[Shape, int]
    plan: Plan
    devices: tuple[str, ...]  # the targets this host builds for
    cuda: CudaInfo | None
    variants: tuple[VariantPlan, ...]  # per target and precision
    candidates: tuple[dict[str, Any], ...]  # Inductor option sets each fp32 variant compiles under
    output: OutputSpec  # the structure of forward()'s result
    output_dims: OutputDims | None = None
    batching: Batching | None = None  # the manifest's batching section, once its claim held in eager

    @property
    def profile(self) -> Profile:
        return self.loaded.profile

    @property
    def tuning(self) -> bool:
        return len(self.candidates) > 1

    @cached_property
    def calibration(self) -> list[Sample]:
        """The calibration samples (``precompile.calibration``), made once per context."""
        return calibration_inputs(self.loaded, self.traffic)

    def with_profile(self, loaded: LoadedProfile) -> BuildContext:
        """This context for ``loaded`` (the same profile with more known about it: its calibration
        samples are drawn again, from the value ranges now known)."""
        return dataclasses.replace(self, loaded=loaded)

    def with_batching(self, batching: Batching | None) -> BuildContext:
        """This context with its batching section; the calibration samples, if made, are kept."""
        return self._keeping_calibration(batching=batching)

    def with_cuda(self, cuda: CudaInfo | None) -> BuildContext:
        """This context with what is known of its CUDA build; the calibration samples, if made, are kept."""
        return self._keeping_calibration(cuda=cuda)

    def _keeping_calibration(self, **changes: Any) -> BuildContext:
        new = dataclasses.replace(self, **changes)
        if "calibration" in self.__dict__:  # where functools.cached_property keeps its value
            new.__dict__["calibration"] = self.__dict__["calibration"]
        return new
