from __future__ import annotations

import dataclasses
import signal
from pathlib import Path
from typing import TYPE_CHECKING, Any

import click

from . import main, no_verify_option, options, precision_option, refuse_rollback_option, user_errors

if TYPE_CHECKING:
    from loader.manifest import Manifest

    from ..serve.config import ServeConfig


# The options, in blocks, each declared once; ``serve`` takes them as keyword arguments by these names.
# Where the server listens and how many calls it takes at once.
listen_options = options(
    click.option("--host", default="127.0.0.1", show_default=True, help="Address to listen on."),
    click.option("--port", type=click.IntRange(0, 65535), default=8000, show_default=True, help="Port to listen on."),
    click.option(
        "--workers",
        type=click.IntRange(min=1),
        default=1,
        show_default=True,
        help="Server processes, each loading the artifact.",
    ),
    click.option(
        "--grpc-port",
        type=click.IntRange(0, 65535),
        default=0,
        help="Also serve the Open Inference Protocol over gRPC (KServe v2 GRPCInferenceService) on this port; 0: off.",
    ),
    click.option(
        "--instances",
        type=click.IntRange(min=1),
        help=(
            "Calls (with --batch: batches) run at once per worker, the CPU threads split between them. "
            "Default: what the CPUs can feed (each worker's share of the CPUs over OMP_NUM_THREADS, at least 1; "
            "with --batch on the torch-free runtime, one per CPU of that share, at most its OMP_NUM_THREADS)."
        ),
    ),
    click.option(
        "--queue-size",
        type=click.IntRange(min=0),
        default=256,
        show_default=True,
        help="Without --batch: calls waiting for an instance at most; more get HTTP 503 / gRPC UNAVAILABLE at once.",
    ),
    click.option(
        "--max-body-bytes",
        type=click.IntRange(min=1),
        help=(
            "Larger request bodies get HTTP 413 on every endpoint. Default: the JSON size of the largest call "
            "within the artifact's dim ranges (1 MiB to 256 MiB)."
        ),
    ),
)

# What may replace the served version: a reload, an older version, a repository's loads.
reload_options = options(
    click.option(
        "--allow-reload",
        is_flag=True,
        help="Enable POST /v1/reload (an admin endpoint): reload ARTIFACT, or with --reload-root, artifacts under it.",
    ),
    click.option(
        "--reload-root",
        type=click.Path(exists=True, file_okay=False, path_type=Path),
        help="Let /v1/reload load artifacts under DIR only (symbolic links followed); without it, only ARTIFACT.",
    ),
    click.option(
        "--allow-rollback",
        is_flag=True,
        help="Let a reload or --watch swap to an older version (a request cannot ask for it).",
    ),
    click.option(
        "--versions",
        default="latest:1",
        show_default=True,
        help="Serving a repository: each model's versions to serve, latest:N or listed (3,5).",
    ),
    click.option(
        "--allow-repository-control",
        is_flag=True,
        help="Serving a repository: enable /v2/repository/index and .../models/{name}/load and unload (admin endpoints).",
    ),
)

# The trust policy, applied to every version the server loads (precision and --no-verify: runtime_options).
trust_options = options(
    click.option(
        "--trusted-key",
        "trusted_keys",
        multiple=True,
        type=click.Path(exists=True, dir_okay=False, path_type=Path),
        help="Serve only artifacts signed by this public key (repeatable): the first load, --watch and reloads.",
    ),
    click.option(
        "--min-version",
        type=click.IntRange(min=0),
        help="Refuse artifact versions below N, at the first load, --watch and reloads.",
    ),
    refuse_rollback_option,
)

# Following ARTIFACT as deploys replace it, and recording the traffic's shapes.
watch_options = options(
    click.option(
        "--watch",
        is_flag=True,
        help="Follow ARTIFACT (a link or pointer file, or a pointer object in a store such as s3://.../current) and swap when a deploy replaces it; "
        "a repository: scan it again for new versions and models.",
    ),
    click.option(
        "--watch-interval",
        type=click.FloatRange(min=0.05),
        default=2.0,
        show_default=True,
        help="Seconds between looks at ARTIFACT.",
    ),
    click.option(
        "--record", metavar="PATH", help="Write the observed shape histogram to PATH ({pid}: the process id)."
    ),
    click.option(
        "--record-interval",
        type=click.FloatRange(min=0.1),
        default=60.0,
        show_default=True,
        help="Seconds between writes of --record (and at shutdown).",
    ),
)

batch_options = options(
    click.option(
        "--batch",
        is_flag=True,
        help="Batch concurrent /predict and /v2 infer calls into the compiled variants (loader.Batcher).",
    ),
    click.option(
        "--max-batch",
        type=click.IntRange(min=1),
        help="With --batch: most rows one batch holds. Default: the largest batch a variant serves.",
    ),
    click.option(
        "--max-delay-ms",
        type=click.FloatRange(min=0),
        default=2.0,
        show_default=True,
        help="With --batch: longest a call waits for batch-mates.",
    ),
    click.option(
        "--max-queue",
        type=click.IntRange(min=1),
        default=1024,
        show_default=True,
        help="With --batch: calls waiting at most; more get HTTP 503.",
    ),
)

# What runs the compiled code, on which allocator, checked how, logged how.
runtime_options = options(
    precision_option,
    click.option(
        "--runtime",
        type=click.Choice(["auto", "native", "torch"]),
        default="auto",
        show_default=True,
        help=(
            "What runs the compiled code: native (loader.load_native: CPU variants through their C interface, "
            "torch's libraries but never `import torch`: a faster start, less memory), torch (loader.load), or "
            "auto (native when the manifest records every CPU variant as runnable without torch, else torch)."
        ),
    ),
    click.option(
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
    ),
    no_verify_option,
    click.option(
        "--log-level",
        type=click.Choice(["critical", "error", "warning", "info", "debug"]),
        default="info",
        show_default=True,
    ),
)


@main.command()
@click.argument("artifact")  # a path, or a URL (kept as typed: Path would fold its //)
@listen_options
@reload_options
@trust_options
@watch_options
@batch_options
@runtime_options
@user_errors
def serve(artifact: str, **options: Any) -> None:
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
    from ..serve.repository import is_repository
    from ..serve.server import run
    from ..serve.workers import PortTaken

    repository = is_repository(artifact)
    _check_options(artifact, repository, options)
    config = _config(artifact, repository, options)
    if config.grpc_port:
        _check_port(config.host, config.grpc_port, "--grpc-port")
    # uvicorn drains on SIGTERM, then raises it again against the handler it found: with this one, a
    # drain that a stop asked for (docker stop, a pod's termination) ends with status 0, not 143.
    signal.signal(signal.SIGTERM, _stopped)
    port = options["port"]
    try:
        run(
            config,
            host=config.host,
            port=port,
            workers=config.workers,
            log_level=options["log_level"],
            malloc=options["malloc"],
        )
    except PortTaken as e:
        raise click.ClickException(f"--port {port}: {e}") from None


def _check_options(artifact: str, repository: bool, o: dict[str, Any]) -> None:
    """Refuse options that do not apply to what ARTIFACT is, or contradict each other (a UsageError
    naming them), and an allocator that is not installed or a path that is not a library."""
    from loader.malloc import resolve

    from ..serve.repository import VersionPolicy

    if not repository and (o["allow_repository_control"] or _given("versions")):
        raise click.UsageError(
            f"--versions and --allow-repository-control apply to a repository; {artifact} is one artifact"
        )
    if o["workers"] > 1 and o["allow_repository_control"]:
        raise click.UsageError(
            "--allow-repository-control with --workers > 1: a load or unload reaches one worker only; "
            "change the repository and serve with --watch"
        )
    if repository and (o["allow_reload"] or o["record"]):
        raise click.UsageError(
            "--allow-reload and --record apply to one artifact; a repository reloads with --watch or "
            "--allow-repository-control"
        )
    VersionPolicy.parse(o["versions"])
    _check_combinations(o)
    if o["batch"] and _given("queue_size"):
        raise click.UsageError("--queue-size applies without --batch (the batcher's queue is --max-queue)")
    if o["grpc_port"] and o["grpc_port"] == o["port"]:
        raise click.UsageError(f"--grpc-port {o['grpc_port']} is --port too: give gRPC a port of its own")
    resolve(o["malloc"])


def _check_combinations(o: dict[str, Any]) -> None:
    """Refuse options that contradict each other (a UsageError naming both)."""
    workers, record = o["workers"], o["record"]
    if workers > 1 and o["allow_reload"]:
        raise click.UsageError(
            "--allow-reload with --workers > 1: a POST /v1/reload reaches one worker only; "
            "deploy by replacing ARTIFACT (a link or pointer file) and serve with --watch"
        )
    if workers > 1 and record and "{pid}" not in record:
        raise click.UsageError(
            f"--record {record} with --workers {workers}: each worker writes its own file; put {{pid}} in the "
            "path (e.g. traffic-{pid}.jsonl) and merge them with `precompile profile merge`"
        )
    if o["reload_root"] is not None and not o["allow_reload"]:
        raise click.UsageError("--reload-root without --allow-reload: reload is off")
    if o["allow_rollback"] and o["refuse_rollback"]:
        raise click.UsageError("--allow-rollback and --refuse-rollback contradict each other; pick one")
    if o["trusted_keys"] and o["no_verify"]:
        raise click.UsageError("--no-verify skips the sha256 checks a signature relies on; drop it or --trusted-key")
    if not o["batch"] and (o["max_batch"] is not None or _given("max_delay_ms") or _given("max_queue")):
        raise click.UsageError("--max-batch, --max-delay-ms and --max-queue apply with --batch only")


def _config(artifact: str, repository: bool, options: dict[str, Any]) -> ServeConfig:
    """The server's configuration: the options ServeConfig names as given, and what the artifact
    decides (the body limit, the runtime: ``auto`` resolved), after the checks that would only fail
    later in the background (_preflight)."""
    from ..serve.codec import body_limit
    from ..serve.config import ServeConfig
    from ..serve.repository import repository_body_limit

    trusted_keys, runtime = options["trusted_keys"], options["runtime"]
    if repository:  # the runtime: torch unless --runtime native (a model it cannot serve is UNAVAILABLE)
        _check_keys(trusted_keys)
        limit = options["max_body_bytes"] or repository_body_limit(artifact)
        runtime = "native" if runtime == "native" else "torch"
    else:
        manifest, runtime = _preflight(artifact, options["record"], trusted_keys, runtime)
        limit = options["max_body_bytes"] or body_limit(manifest)
    given = {f.name: options[f.name] for f in dataclasses.fields(ServeConfig) if f.name in options}
    reload_root = options["reload_root"]
    return ServeConfig(
        **{
            **given,
            "artifact": str(artifact),
            "repository": repository,
            "max_body_bytes": limit,
            "reload_root": str(reload_root) if reload_root is not None else None,
            "verify": not options["no_verify"],
            "trusted_keys": tuple(str(k) for k in trusted_keys),
            "grpc_port": options["grpc_port"] or None,
            "runtime": runtime,
        }
    )


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
