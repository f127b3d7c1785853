"""``POST /v1/reload``: what a request may ask for, and which paths it may load.

The server's operator decides what a reload can reach and whether it can roll back; the request only
names a path. Without ``--reload-root`` only the served path (ARTIFACT) may be loaded again (a deploy
that replaced the link or pointer, picked up at once instead of at the next ``--watch`` look). With
``--reload-root DIR``, any path that lies under DIR after following every symbolic link, and whose
pointer (if it is one) designates an artifact under DIR too; a relative path is taken from DIR.
Refusals name the path the request gave, never what the file system holds there.
"""

from __future__ import annotations

import os
from pathlib import Path

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from loader import LoaderError
from loader.serving.live import resolve_pointer

from .codec import BodyError, parse_object


class ReloadRequest(BaseModel):
    """The body of ``POST /v1/reload``; no body at all reloads the served path."""

    model_config = ConfigDict(extra="forbid", strict=True)
    path: str = Field(
        min_length=1,
        max_length=4096,
        description="artifact folder, pack, link or pointer file (relative: under --reload-root)",
    )


class ReloadRefused(LoaderError):
    """The request asks for a path this server may not load (HTTP 403)."""


def parse_reload_request(raw: bytes) -> str | None:
    """The path a reload request names (None: the served one); BodyError when malformed."""
    if not raw.strip():
        return None
    data = parse_object(raw, 'expected {"path": "<artifact folder, pack or pointer>"}')
    if "allow_rollback" in data:
        raise BodyError(
            '"allow_rollback" is not a request field: the server decides rollbacks (precompile serve --allow-rollback)'
        )
    try:
        return ReloadRequest.model_validate(data).path
    except ValidationError as e:
        problems = "; ".join(f"{'.'.join(map(str, err['loc'])) or 'body'}: {err['msg']}" for err in e.errors())
        raise BodyError(f'expected {{"path": "<artifact folder, pack or pointer>"}} ({problems})') from None


def reload_target(path: str | None, *, served: str, root: str | None, what: str = "--reload-root") -> str:
    """The path to swap to for a request naming ``path``; ReloadRefused when it may not be loaded.
    ``what`` names ``root`` in refusals (a repository's scan confines its finds the same way)."""
    if path is None or os.path.abspath(path) == os.path.abspath(served):
        return served
    if root is None:
        raise ReloadRefused(
            f"{path}: this server reloads only the path it serves ({served}); start it with --reload-root DIR "
            "to allow reloading artifacts under DIR"
        )
    base = Path(root).resolve()
    candidate = Path(path) if os.path.isabs(path) else base / path
    try:
        real = candidate.resolve()
    except (OSError, ValueError, RuntimeError):  # a link loop, a name with NUL
        raise ReloadRefused(f"{path}: not a path under {what} {base}") from None
    if not real.is_relative_to(base):
        raise ReloadRefused(f"{path}: not under {what} {base} (symbolic links followed)")
    target = resolve_pointer(real)  # a pointer file under the root may still name something outside
    if not target.is_relative_to(base):
        raise ReloadRefused(f"{path}: designates an artifact outside {what} {base}")
    return str(target)
