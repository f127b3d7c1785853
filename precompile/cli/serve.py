from __future__ import annotations

import signal
from pathlib import Path
from typing import TYPE_CHECKING, Any

import click

from . import main, user_errors

if TYPE_CHECKING:
    from loader.manifest import Manifest


@main.command()
@click.argument("artifact")  # a path, or a URL (kept as typed: Path would fold its //)
@click.option("--host", default="127.0.0.1", show_default=True, help="Address to listen on.")
@click.option("--port", type=click.IntRange(0, 65535), default=8000, show_default=True, help="Port to listen on.")
@click.option(
    "--workers",
    type=click.IntRange(min=1),
    default=1,
    show_default=True,
    help="Server processes, each loading the artifact.",
)
@click.option(
    "--grpc-port",
    type=click.IntRange(0, 65535),
    default=0,
    help="Also serve the Open Inference Protocol over gRPC (KServe v2 GRPCInferenceService) on this port; 0: off.",
)
@click.option(
    "--instances",
    type=click.IntRange(min=1),
    help=(
        "Calls (with --batch: batches) run at once per worker, the CPU threads split between them. "
        "Default: what the CPUs can feed (each worker's share of the CPUs over OMP_NUM_THREADS, at least 1; "
        "with --batch on the torch-free runtime, one per CPU of that share, at most its OMP_NUM_THREADS)."
    ),
)
@click.option(
    "--queue-size",
    type=click.IntRange(min=0),
    default=256,
    show_default=True,
    help="Without --batch: calls waiting for an instance at most; more get HTTP 503 / gRPC UNAVAILABLE at once.",
)
@click.option(
    "--max-body-bytes",
    type=click.IntRange(min=1),
    help=(
        "Larger request bodies get HTTP 413 on every endpoint. Default: the JSON size of the largest call within "
        "the artifact's dim ranges (1 MiB to 256 MiB)."
    ),
)
@click.option(
    "--allow-reload",
    is_flag=True,
    help="Enable POST /v1/reload (an admin endpoint): reload ARTIFACT, or with --reload-root, artifacts under it.",
)
@click.option(
    "--reload-root",
    type=click.Path(exists=True, file_okay=False, path_type=Path),
    help="Let /v1/reload load artifacts under DIR only (symbolic links followed); without it, only ARTIFACT.",
)
@click.option(
    "--allow-rollback",
    is_flag=True,
    help="Let a reload or --watch swap to an older version (a request cannot ask for it).",
)
@click.option(
    "--versions",
    default="latest:1",
    show_default=True,
    help="Serving a repository: each model's versions to serve, latest:N or listed (3,5).",
)
@click.option(
    "--allow-repository-control",
    is_flag=True,
    help="Serving a repository: enable /v2/repository/index and .../models/{name}/load and unload (admin endpoints).",
)
@click.option(
    "--trusted-key",
    "trusted_keys",
    multiple=True,
    type=click.Path(exists=True, dir_okay=False, path_type=Path),
    help="Serve only artifacts signed by this public key (repeatable): the first load, --watch and reloads.",
)
@click.option(
    "--min-version",
    type=click.IntRange(min=0),
    help="Refuse artifact versions below N, at the first load, --watch and reloads.",
)
@click.option(
    "--refuse-rollback",
    is_flag=True,
    help="Refuse a version older than one this host loaded with --refuse-rollback ($PRECOMPILE_STATE ledger).",
)
@click.option(
    "--watch",
    is_flag=True,
    help="Follow ARTIFACT (a link or pointer file, or a pointer object in a store such as s3://.../current) and swap when a deploy replaces it; "
    "a repository: scan it again for new versions and models.",
)
@click.option(
    "--watch-interval",
    type=click.FloatRange(min=0.05),
    default=2.0,
    show_default=True,
    help="Seconds between looks at ARTIFACT.",
)
@click.option("--record", metavar="PATH", help="Write the observed shape histogram to PATH ({pid}: the process id).")
@click.option(
    "--record-interval",
    type=click.FloatRange(min=0.1),
    default=60.0,
    show_default=True,
    help="Seconds between writes of --record (and at shutdown).",
)
@click.option(
    "--batch",
    is_flag=True,
    help="Batch concurrent /predict and /v2 infer calls into the compiled variants (loader.Batcher).",
)
@click.option(
    "--max-batch",
    type=click.IntRange(min=1),
    help="With --batch: most rows one batch holds. Default: the largest batch a variant serves.",
)
@click.option(
    "--max-delay-ms",
    type=click.FloatRange(min=0),
    default=2.0,
    show_default=True,
    help="With --batch: longest a call waits for batch-mates.",
)
@click.option(
    "--max-queue",
    type=click.IntRange(min=1),
    default=1024,
    show_default=True,
    help="With --batch: calls waiting at most; more get HTTP 503.",
)
@click.option(
    "--precision",
    type=click.Choice(["auto", "fp32", "bf16", "int8"]),
    default="auto",
    show_default=True,
    help="Variants to serve: auto (the bf16/int8 ones the build kept, where this CPU runs them, fp32 elsewhere), or one precision first.",
)
@click.option(
    "--runtime",
    type=click.Choice(["auto", "native", "torch"]),
    default="auto",
    show_default=True,
    help=(
        "What runs the compiled code: native (loader.load_native: CPU variants through their C interface, torch's "
        "libraries but never `import torch`: a faster start, less memory), torch (loader.load), or auto (native "
        "when the manifest records every CPU variant as runnable without torch, else torch)."
    ),
)
@click.option(
    "--malloc",
    default="auto",
    show_default=True,
    envvar="PRECOMPILE_MALLOC",
    metavar="auto|tcmalloc|jemalloc|system|PATH",
    help=(
        "The memory allocator the server runs on (preloaded: the server re-executes itself with it): auto "
        "(tcmalloc where installed, e.g. apt-get install libtcmalloc-minimal4; else glibc's), a named one, "
        "system (glibc's), or a library's path. An allocator already in LD_PRELOAD is kept."
    ),
)
@click.option("--no-verify", is_flag=True, help="Skip the sha256 check of the artifact's files at load.")
@click.option(
    "--log-level",
    type=click.Choice(["critical", "error", "warning", "info", "debug"]),
    default="info",
    show_default=True,
)
@user_errors
def serve(
    artifact: str,
    host: str,
    port: int,
    workers: int,
    grpc_port: int,
    instances: int | None,
    queue_size: int,
    max_body_bytes: int | None,
    allow_reload: bool,
    reload_root: Path | None,
    allow_rollback: bool,
    versions: str,
    allow_repository_control: bool,
    trusted_keys: tuple[Path, ...],
    min_version: int | None,
    refuse_rollback: bool,
    watch: bool,
    watch_interval: float,
    record: str | None,
    record_interval: float,
    batch: bool,
    max_batch: int | None,
    max_delay_ms: float,
    max_queue: int,
    precision: str,
    runtime: str,
    malloc: str,
    no_verify: bool,
    log_level: str,
) -> None:
    """Serve ARTIFACT over HTTP: POST /predict, /healthz, /readyz, /metrics, /v1/artifact, and the
    Open Inference Protocol (KServe v2) under /v2.

    ARTIFACT is an artifact folder or pack, or a link or pointer file naming one, or a URL: a pack in
    an object store or a pointer object naming one (`precompile promote`; see --watch). The
    model is loaded and warmed up in the background; /readyz answers 200 once it is. The trust options
    apply to every version served. Needs the serve extra: pip install 'precompile[serve]'.

    ARTIFACT may be a repository instead: a folder of artifacts, packs or model folders
    (<name>/<version>.tar.zst, as `precompile push` lays them out), or a store prefix ending in /
    (s3://bucket/models/). Every model is served at /v2/models/{name} and /predict/{name}, in the
    versions --versions picks.
    """
    from ..serve.repository import VersionPolicy, is_repository, repository_body_limit

    repository = is_repository(artifact)
    if not repository and (allow_repository_control or _given("versions")):
        raise click.UsageError(
            f"--versions and --allow-repository-control apply to a repository; {artifact} is one artifact"
        )
    if workers > 1 and allow_repository_control:
        raise click.UsageError(
            "--allow-repository-control with --workers > 1: a load or unload reaches one worker only; "
            "change the repository and serve with --watch"
        )
    if repository and (allow_reload or record):
        raise click.UsageError(
            "--allow-reload and --record apply to one artifact; a repository reloads with --watch or "
            "--allow-repository-control"
        )
    VersionPolicy.parse(versions)
    _check_combinations(
        workers=workers,
        allow_reload=allow_reload,
        reload_root=reload_root,
        record=record,
        allow_rollback=allow_rollback,
        refuse_rollback=refuse_rollback,
        trusted_keys=trusted_keys,
        no_verify=no_verify,
        batch=batch,
        max_batch=max_batch,
    )
    if batch and _given("queue_size"):
        raise click.UsageError("--queue-size applies without --batch (the batcher's queue is --max-queue)")
    if grpc_port and grpc_port == port:
        raise click.UsageError(f"--grpc-port {grpc_port} is --port too: give gRPC a port of its own")

    from loader.malloc import resolve

    resolve(malloc)  # an allocator that is not installed, or a path that is not a library: refused now

    from ..serve.codec import body_limit
    from ..serve.config import ServeConfig
    from ..serve.server import run
    from ..serve.workers import PortTaken

    if repository:  # the runtime: torch unless --runtime native (a model it cannot serve is UNAVAILABLE)
        _check_keys(trusted_keys)
        limit = max_body_bytes or repository_body_limit(artifact)
        runtime = "native" if runtime == "native" else "torch"
    else:
        manifest, runtime = _preflight(artifact, record, trusted_keys, runtime)
        limit = max_body_bytes or body_limit(manifest)
    config = ServeConfig(
        artifact=str(artifact),
        repository=repository,
        versions=versions,
        allow_repository_control=allow_repository_control,
        max_body_bytes=limit,
        allow_reload=allow_reload,
        reload_root=str(reload_root) if reload_root is not None else None,
        allow_rollback=allow_rollback,
        watch=watch,
        watch_interval=watch_interval,
        record=record,
        record_interval=record_interval,
        verify=not no_verify,
        trusted_keys=tuple(str(k) for k in trusted_keys),
        min_version=min_version,
        refuse_rollback=refuse_rollback,
        batch=batch,
        max_batch=max_batch,
        max_delay_ms=max_delay_ms,
        max_queue=max_queue,
        precision=precision,
        instances=instances,
        queue_size=queue_size,
        grpc_port=grpc_port or None,
        runtime=runtime,
    )
    if grpc_port:
        _check_port(host, grpc_port, "--grpc-port")
    # uvicorn drains on SIGTERM, then raises it again against the handler it found: with this one, a
    # drain that a stop asked for (docker stop, a pod's termination) ends with status 0, not 143.
    signal.signal(signal.SIGTERM, _stopped)
    try:
        run(config, host=host, port=port, workers=workers, log_level=log_level, malloc=malloc)
    except PortTaken as e:
        raise click.ClickException(f"--port {port}: {e}") from None


def _check_combinations(
    *,
    workers: int,
    allow_reload: bool,
    reload_root: Path | None,
    record: str | None,
    allow_rollback: bool,
    refuse_rollback: bool,
    trusted_keys: tuple[Path, ...],
    no_verify: bool,
    batch: bool,
    max_batch: int | None,
) -> None:
    """Refuse options that contradict each other (a UsageError naming both)."""
    if workers > 1 and allow_reload:
        raise click.UsageError(
            "--allow-reload with --workers > 1: a POST /v1/reload reaches one worker only; "
            "deploy by replacing ARTIFACT (a link or pointer file) and serve with --watch"
        )
    if workers > 1 and record and "{pid}" not in record:
        raise click.UsageError(
            f"--record {record} with --workers {workers}: each worker writes its own file; put {{pid}} in the "
            "path (e.g. traffic-{pid}.jsonl) and merge them with `precompile profile merge`"
        )
    if reload_root is not None and not allow_reload:
        raise click.UsageError("--reload-root without --allow-reload: reload is off")
    if allow_rollback and refuse_rollback:
        raise click.UsageError("--allow-rollback and --refuse-rollback contradict each other; pick one")
    if trusted_keys and no_verify:
        raise click.UsageError("--no-verify skips the sha256 checks a signature relies on; drop it or --trusted-key")
    if not batch and (max_batch is not None or _given("max_delay_ms") or _given("max_queue")):
        raise click.UsageError("--max-batch, --max-delay-ms and --max-queue apply with --batch only")


def _check_port(host: str, port: int, option: str) -> None:
    """Refuse a port this host cannot listen on now, before the server starts (it would fail later,
    in each worker)."""
    from ..serve.workers import PortTaken, bound_socket

    try:
        bound_socket(host, port, reuse_port=False).close()
    except PortTaken as e:
        raise click.ClickException(f"{option} {port}: {e}") from None


def _stopped(signum: int, frame: Any) -> None:
    raise SystemExit(0)


def _given(name: str) -> bool:
    """Whether the user gave option ``name`` (not its default)."""
    source = click.get_current_context().get_parameter_source(name)
    return source is not None and source is not click.core.ParameterSource.DEFAULT


def _preflight(artifact: str, record: str | None, trusted_keys: tuple[Path, ...], runtime: str) -> tuple[Manifest, str]:
    """Refuse at once what would only fail later in the background: no artifact, one for another host
    or that the runtime asked for cannot run, a key that is not one, an unreadable traffic file.
    Returns the artifact's manifest and the runtime to serve it with (``auto`` decided)."""
    from loader.host import check_compatible
    from loader.serving.live import read_served_manifest
    from loader.serving.traffic import expand_path, read_histogram

    manifest = read_served_manifest(artifact)
    host = None  # the torch loader's facts (torch imported)
    if runtime != "torch":
        from loader.native import manifest_problem
        from loader.native.libs import find_torch, host_facts

        problem = manifest_problem(manifest)
        if problem is not None and runtime == "native":
            raise click.ClickException(f"--runtime native: {artifact}: {problem}; serve it with --runtime torch")
        if problem is None:
            runtime, host = "native", host_facts(find_torch())  # gathered without importing torch
        else:
            runtime = "torch"
    check_compatible(manifest, manifest.target.device, host)
    _check_keys(trusted_keys)
    if record:
        path = expand_path(record)
        if not path.parent.is_dir():
            raise click.ClickException(f"--record {record}: folder {path.parent} does not exist")
        if path.exists():
            read_histogram(path)  # it will be added to: it must be a traffic file
    return manifest, runtime


def _check_keys(trusted_keys: tuple[Path, ...]) -> None:
    """Refuse a --trusted-key that is not a public key, before anything starts."""
    from loader.trust import public_keys

    if trusted_keys:
        public_keys(trusted_keys)
