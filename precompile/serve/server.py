"""Start uvicorn on the app: one process, or several workers that each load the artifact.

Workers are separate processes (a CUDA variant's compiled code holds the GIL while it runs, so its
threads in one process take turns; CPU variants run off the GIL: docs/serving.md), each listening on the port with a socket of its own
(workers.py: the kernel spreads connections over them). Each maps the same weights file, so the page
cache holds one copy. Workers cannot share a POST /v1/reload (it reaches one of them), so with several
workers hot swap goes through --watch, which every worker follows.
"""

from __future__ import annotations

import logging
import os
import shutil
import sys
import tempfile
from dataclasses import replace

from .config import LOG_LEVEL_ENV, ServeConfig
from .workers import run_workers

REEXEC_MARK = "PRECOMPILE_SERVE_ENV_SET"  # set in the re-executed server, so it never loops


def serving_env(workers: int, environ: dict[str, str] | None = None, *, malloc: str = "auto") -> dict[str, str]:
    """What the serving processes' environment must add, the user's own settings left alone:

    - how idle OpenMP threads wait (``loader.threads.wait_env``): they sleep instead of spinning, so a
      server on a shared host keeps about its fair share beside neighbours (measured on 2 cores beside
      a torch process and a busy loop: p50 6.6× its quiet p50 spinning, 2.7× sleeping), after a spin
      of about 0.1 ms that keeps one call's threads awake (``OMP_WAIT_POLICY=ACTIVE
      GOMP_SPINCOUNT=10000``: libgomp keeps a short spin under that policy where the server's threads
      each run a team, where PASSIVE's is none and doubled a call, ``loader.constants.WAIT_POLICY``);
    - ``OMP_NUM_THREADS``: each worker's share of the CPUs this process really gets (affinity and
      cgroup quota, not the host's core count);
    - ``LD_PRELOAD``: the memory allocator ``malloc`` names (``loader.malloc``; ``auto``: tcmalloc where
      installed), which keeps each call's buffers for the next instead of glibc's bookkeeping and page
      faults (MobileNetV2 at 1×96²: 1.43 → 0.97 ms a call; Segformer at 4×256²: 75 → 54 ms).
    """
    from loader.malloc import malloc_env
    from loader.threads import cpu_allowance, wait_env

    environ = os.environ if environ is None else environ
    env = wait_env(environ)
    env.update(malloc_env(malloc, environ))
    if "OMP_NUM_THREADS" not in environ:
        env["OMP_NUM_THREADS"] = str(max(1, cpu_allowance().cpus // workers))
    return env


def passive_policy_warning(environ: dict[str, str] | None = None) -> str | None:
    """What to say where the user set ``OMP_WAIT_POLICY=PASSIVE``, which precompile keeps: with
    several threads running calls (execution instances, batch workers), libgomp then stops spinning
    at a call's barriers (``loader.constants.WAIT_POLICY``); None otherwise."""
    environ = os.environ if environ is None else environ
    if environ.get("OMP_WAIT_POLICY", "").strip().lower() != "passive":
        return None
    return (
        "OMP_WAIT_POLICY=PASSIVE is set: with more than one execution instance or batch worker, libgomp then "
        "sleeps at every barrier of a call and calls run up to 2x slower (MiniLM 1x16 on 2 CPUs: 11.6 against "
        "5.4 ms); unset it (precompile then sets OMP_WAIT_POLICY=ACTIVE GOMP_SPINCOUNT=10000: a spin of 0.1 ms, "
        "then sleep), or serve with --instances 1"
    )


def _warn_passive() -> None:
    said = passive_policy_warning()
    if said:
        logging.getLogger("precompile.serve").warning(said)


def reexec_with(env: dict[str, str]) -> None:
    """Replace this process by the same ``precompile serve`` command with ``env`` added: the OpenMP
    runtime reads its settings once, when torch is imported, which has happened here already.
    Returns (doing nothing) when there is nothing to add, when this is the re-executed server, or when
    this process is not the precompile command itself (an embedding program, a test runner). Where no
    OpenMP runtime is loaded yet (``--runtime native``: torch never imported) and no allocator is to be
    preloaded, ``env`` is simply put in the environment, read when the torch-free loader opens it."""
    from loader.malloc import PRELOAD_ENV
    from loader.native.libs import openmp_library

    entry = os.path.basename(sys.argv[0]) if sys.argv else ""
    is_command = entry == "precompile" or sys.argv[0].endswith(os.path.join("precompile", "__main__.py"))
    if not env or os.environ.get(REEXEC_MARK) or not is_command:
        return
    if openmp_library() is None and PRELOAD_ENV not in env:
        os.environ.update(env)
        return
    sys.stdout.flush()
    sys.stderr.flush()
    os.execve(sys.executable, list(sys.orig_argv), {**os.environ, **env, REEXEC_MARK: "1"})


# uvicorn's HTTP protocol with TCP_NODELAY on each connection (see precompile.serve.nodelay).
HTTP_PROTOCOL = "precompile.serve.nodelay:NoDelayHTTPProtocol"


def run(
    config: ServeConfig,
    *,
    host: str = "127.0.0.1",
    port: int = 8000,
    workers: int = 1,
    log_level: str = "info",
    malloc: str = "auto",
) -> None:
    import uvicorn

    config = replace(config, host=host, workers=workers)  # the gRPC service listens beside HTTP
    env = serving_env(workers, malloc=malloc)
    if workers == 1:
        reexec_with(env)  # no return when it re-executes: the server then starts with the settings in effect
        from .app import create_app, log_to_stderr

        log_to_stderr(log_level)
        _warn_passive()
        uvicorn.run(create_app(config), host=host, port=port, log_level=log_level, http=HTTP_PROTOCOL)
        return
    # Counters from every worker are summed through files in this folder (prometheus_client's
    # multiprocess mode, which reads the variable when a worker imports it).
    metrics_dir = tempfile.mkdtemp(prefix="precompile-metrics-")
    os.environ["PROMETHEUS_MULTIPROC_DIR"] = metrics_dir
    os.environ.update(config.to_env())
    os.environ[LOG_LEVEL_ENV] = log_level
    # Workers are fresh interpreters: the OpenMP settings take effect there (one thread pool per
    # worker, sized to its share of the CPUs: more threads than cores slow every call down).
    os.environ.update(env)
    from .app import log_to_stderr

    log_to_stderr(log_level)  # the supervisor's own lines: a worker replaced, or one that failed to start
    _warn_passive()
    try:
        run_workers(workers, host=host, port=port, log_level=log_level, http=HTTP_PROTOCOL)
    finally:
        shutil.rmtree(metrics_dir, ignore_errors=True)
