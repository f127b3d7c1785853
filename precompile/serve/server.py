"""Start uvicorn on the app: one process, or several workers that each load the artifact.

Workers are separate processes (the compiled code holds the GIL while it runs, so threads in one
process take turns; see bench/concurrency.py). Each maps the same weights file, so the page cache
holds one copy. Workers cannot share a POST /v1/reload (it reaches one of them), so with several
workers hot swap goes through --watch, which every worker follows.
"""

from __future__ import annotations

import os
import shutil
import tempfile

from .config import ServeConfig


def run(config: ServeConfig, *, host: str = "127.0.0.1", port: int = 8000, workers: int = 1, log_level: str = "info") -> None:
    import uvicorn

    if workers == 1:
        from .app import create_app

        uvicorn.run(create_app(config), host=host, port=port, log_level=log_level)
        return
    # Counters from every worker are summed through files in this folder (prometheus_client's
    # multiprocess mode, which reads the variable when a worker imports it).
    metrics_dir = tempfile.mkdtemp(prefix="precompile-metrics-")
    os.environ["PROMETHEUS_MULTIPROC_DIR"] = metrics_dir
    os.environ.update(config.to_env())
    # One OpenMP thread pool per worker sized to its share of the cores: more threads than cores slow
    # every call down (bench/concurrency.py).
    os.environ.setdefault("OMP_NUM_THREADS", str(max(1, (os.cpu_count() or 1) // workers)))
    try:
        uvicorn.run(
            "precompile.serve.app:app_from_env", factory=True, host=host, port=port, workers=workers, log_level=log_level
        )
    finally:
        shutil.rmtree(metrics_dir, ignore_errors=True)
