"""The build side's exceptions. A PrecompileError is the user's to fix: the CLI prints its message
and exits 1 without a traceback. Anything else escaping is a bug and keeps its traceback."""

from __future__ import annotations


class PrecompileError(Exception):
    """A problem the user can fix (profile, model, options); the message says where and what to do."""


class ProfileError(PrecompileError):
    """The profile is invalid. ``problems`` holds (place, message) pairs, one per problem."""

    def __init__(self, source: str, problems: list[tuple[str, str]]):
        self.source = source
        self.problems = problems
        lines = [f"{source}: {len(problems)} problem(s)" if len(problems) > 1 else f"{source}: invalid profile"]
        lines += [f"  {place}: {message}" if place else f"  {message}" for place, message in problems]
        super().__init__("\n".join(lines))

    def __reduce__(self):  # raised in build worker processes and pickled back to the parent
        return (ProfileError, (self.source, self.problems))


class ModelError(PrecompileError):
    """The model could not be built, loaded with its weights, or run eagerly on sample inputs."""


class ExportError(PrecompileError):
    """torch.export failed; the message names the dims involved and what to change."""


class DimBoundError(ExportError):
    """A dim's declared range goes past a table the model indexes by position. ``problems`` holds
    (place, message) pairs in the profile's terms, as a ProfileError's do."""

    def __init__(self, problems: list[tuple[str, str]] | str):
        if isinstance(problems, str):  # re-raised with a prefix (the variant it happened in)
            problems = [("", problems)]
        self.problems = problems
        super().__init__("\n".join(f"{place}: {message}" if place else message for place, message in problems))

    def __reduce__(self):  # raised in build worker processes and pickled back to the parent
        return (DimBoundError, (self.problems,))


class CompileError(PrecompileError):
    """AOTInductor failed to compile an exported program."""


class CheckError(PrecompileError):
    """The compiled code disagrees with eager beyond tolerance."""
