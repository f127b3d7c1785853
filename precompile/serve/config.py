"""What one server process needs to know. Plain data, so it can travel to uvicorn workers in the
environment (``to_env``/``from_env``): a worker process imports the app by name and reads it back."""

from __future__ import annotations

import json
import os
from dataclasses import asdict, dataclass

ENV_VAR = "PRECOMPILE_SERVE_CONFIG"
LOG_LEVEL_ENV = "PRECOMPILE_SERVE_LOG_LEVEL"  # --log-level, for the workers' own loggers


@dataclass(frozen=True)
class ServeConfig:
    artifact: str  # an artifact folder or pack, or a link / pointer file that designates one; or a repository
    repository: bool = False  # ``artifact`` is a model repository: a folder of artifacts, or a store prefix
    versions: str = "latest:1"  # a repository's version policy: latest:N, or listed versions "3,5"
    allow_repository_control: bool = False  # /v2/repository/index, .../load, .../unload
    max_body_bytes: int | None = None  # larger bodies get 413 on every endpoint; None: sized from the manifest
    allow_reload: bool = False  # POST /v1/reload (an admin endpoint)
    reload_root: str | None = None  # reload may load artifacts under this folder only; None: the served path only
    allow_rollback: bool = (
        False  # let a reload or the watcher go to an older version (the server decides, never a request)
    )
    watch: bool = False  # follow ``artifact`` (a link or pointer file) as deploys replace it; a repository: rescan it
    watch_interval: float = 2.0
    record: str | None = None  # write the shape histogram here ({pid}: this process's id)
    record_interval: float = 60.0
    verify: bool = True  # check every file's sha256 at load (and at every swap)
    # loader.load's trust policy, for the first load, every reload and every version --watch sees
    trusted_keys: tuple[str, ...] = ()  # public key files; non-empty: only artifacts signed by one of them
    min_version: int | None = None
    refuse_rollback: bool = False  # loader.load(refuse_rollback=True): the host's ledger refuses older versions
    # loader.Batcher for /predict and /v2 infer: concurrent calls run as batches
    batch: bool = False
    max_batch: int | None = None  # None: the largest batch a variant serves
    max_delay_ms: float = 2.0
    max_queue: int = 1024
    precision: str = "auto"  # loader.load(precision=...): auto | fp32 | bf16 | int8
    # Execution instances (instances.py; with --batch: batches at once, loader.Batcher): None: what the CPUs can feed
    instances: int | None = None
    queue_size: int = 256  # calls waiting for an instance at most; more get 503 / UNAVAILABLE
    grpc_port: int | None = None  # the Open Inference Protocol's gRPC service (grpc_service.py); None: off
    host: str = "127.0.0.1"  # the address the gRPC service listens on (uvicorn binds HTTP's itself)
    workers: int = 1  # server processes; more than one share the ports through SO_REUSEPORT (workers.py)
    runtime: str = "torch"  # torch: loader.load; native: loader.load_native, torch never imported

    def batcher_options(self) -> dict:
        """The keyword arguments ``loader.Batcher`` gets, with ``batch`` on."""
        return {"max_batch": self.max_batch, "max_delay_ms": self.max_delay_ms, "max_queue": self.max_queue}

    def load_options(self) -> dict:
        """The keyword arguments ``loader.load`` (or ``loader.load_native``) gets for every version
        this server loads."""
        return {
            "verify": self.verify,
            "trusted_keys": list(self.trusted_keys) or None,
            "min_version": self.min_version,
            "refuse_rollback": self.refuse_rollback,
            "precision": self.precision,
        }

    def to_env(self) -> dict[str, str]:
        return {ENV_VAR: json.dumps(asdict(self))}

    @classmethod
    def from_env(cls) -> ServeConfig:
        raw = os.environ.get(ENV_VAR)
        if raw is None:
            raise RuntimeError(f"{ENV_VAR} is not set: start workers through `precompile serve`")
        data = json.loads(raw)
        data["trusted_keys"] = tuple(data.get("trusted_keys", ()))
        return cls(**data)
