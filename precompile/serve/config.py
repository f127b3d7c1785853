"""What one server process needs to know. Plain data, so it can travel to uvicorn workers in the
environment (``to_env``/``from_env``): a worker process imports the app by name and reads it back."""

from __future__ import annotations

import json
import os
from dataclasses import asdict, dataclass

ENV_VAR = "PRECOMPILE_SERVE_CONFIG"


@dataclass(frozen=True)
class ServeConfig:
    artifact: str  # an artifact folder, or a link / pointer file that designates one
    max_body_bytes: int = 8 * 1024 * 1024  # larger /predict bodies get 413
    allow_reload: bool = False  # POST /v1/reload (an admin endpoint: it loads any path on the host)
    allow_rollback: bool = False  # let a reload or the watcher go to an older version
    watch: bool = False  # follow ``artifact`` (a link or pointer file) as deploys replace it
    watch_interval: float = 2.0
    record: str | None = None  # write the shape histogram here ({pid}: this process's id)
    record_interval: float = 60.0
    verify: bool = True  # check every file's sha256 at load (and at every swap)

    def to_env(self) -> dict[str, str]:
        return {ENV_VAR: json.dumps(asdict(self))}

    @classmethod
    def from_env(cls) -> ServeConfig:
        raw = os.environ.get(ENV_VAR)
        if raw is None:
            raise RuntimeError(f"{ENV_VAR} is not set: start workers through `precompile serve`")
        return cls(**json.loads(raw))
