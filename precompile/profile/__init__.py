"""Profiles: the YAML file that says what to build. Parsed into pydantic models (``schema``: extra keys
refused), then checked as a whole (``checks``); every problem is reported as ``place: message``
(``load``).

    name: text-classifier
    model: {factory: "models:text_classifier"}
    inputs:
      ids:  {shape: [batch, seq], dtype: int64, range: [0, 999]}
      mask: {shape: [batch, seq], dtype: bool}
    dims:
      batch: {min: 1, max: 64}
      seq:   {min: 8, max: 512}

    loaded = load_profile("profiles/text_classifier.yaml")    # LoadedProfile; ProfileError listing problems
    loaded = read_profile({"name": ..., "inputs": ...})         # a dict or a Profile, checked the same way
"""

from .checks import (
    batching_pad_values,
    batching_problems,
    inductor_option_problems,
    pad_value_problems,
    precision_problems,
    semantic_problems,
    tune_problems,
)
from .load import PROFILE_NAME, load_profile, read_profile, validation_problems
from .schema import (
    DEFAULT_TOLERANCE,
    AccuracyRule,
    AccuracySpec,
    BatchingSpec,
    CalibrationSpec,
    CheckSpec,
    CompileSpec,
    CudaSpec,
    DimSpec,
    DistributionSpec,
    Dtype,
    InputSpec,
    LoadedProfile,
    ModelSpec,
    OutputDecl,
    PlanSpec,
    PolicySpec,
    Precision,
    Profile,
    QuantizationSpec,
    SampleSpec,
    TuneSpec,
    json_schema,
)

__all__ = [
    "PROFILE_NAME",
    "DEFAULT_TOLERANCE",
    "AccuracyRule",
    "AccuracySpec",
    "BatchingSpec",
    "CalibrationSpec",
    "CheckSpec",
    "CompileSpec",
    "CudaSpec",
    "DimSpec",
    "DistributionSpec",
    "Dtype",
    "InputSpec",
    "SampleSpec",
    "LoadedProfile",
    "ModelSpec",
    "OutputDecl",
    "PlanSpec",
    "PolicySpec",
    "Precision",
    "Profile",
    "QuantizationSpec",
    "TuneSpec",
    "batching_pad_values",
    "batching_problems",
    "inductor_option_problems",
    "json_schema",
    "load_profile",
    "read_profile",
    "pad_value_problems",
    "precision_problems",
    "semantic_problems",
    "tune_problems",
    "validation_problems",
]
