"""The loader's exceptions. Every failure a caller can cause or a file can contain is one of these."""


class LoaderError(Exception):
    """Base of every error the loader raises on purpose."""


class ArtifactError(LoaderError):
    """The artifact is missing, unreadable, of an unknown format, or does not match its manifest."""


class IncompatibleArtifactError(ArtifactError):
    """The artifact is valid but was built for another host (torch version, device, CPU)."""


class GuardError(LoaderError, ValueError):
    """A call's inputs do not fit what the compiled code was built for."""
