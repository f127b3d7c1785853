from __future__ import annotations

from pathlib import Path

import click

from . import main, trust_options, user_errors


@main.group()
def export() -> None:
    """Write artifacts out for another serving system."""


@export.command("triton")
@click.argument("artifacts", nargs=-1, required=True, type=click.Path(path_type=Path))
@click.option(
    "-o",
    "--output",
    "repo",
    required=True,
    type=click.Path(path_type=Path),
    help="The model repository to write (new or empty folder).",
)
@click.option("--link", is_flag=True, help="Symlink each artifact into its version folder instead of copying it.")
@click.option(
    "--instances",
    default=1,
    show_default=True,
    help="Model instances per model (KIND_CPU); each gets its share of the CPUs.",
)
@click.option(
    "--max-queue-delay-us",
    default=2000,
    show_default=True,
    help="How long Triton's dynamic batcher waits for batch-mates.",
)
@trust_options
@user_errors
def triton(
    artifacts: tuple[Path, ...],
    repo: Path,
    link: bool,
    instances: int,
    max_queue_delay_us: int,
    trusted_keys: tuple[Path, ...],
    min_version: int | None,
    refuse_rollback: bool,
    no_verify: bool,
    precision: str,
) -> None:
    """Write a Triton Inference Server model repository serving ARTIFACTS (folders or packs).

    One model per manifest name, one version folder per artifact (its manifest version), each with a
    Python-backend model.py that serves it with loader.load(). The trust options are checked here and
    written into config.pbtxt, so that model.py applies them in Triton too. Run it with
    `tritonserver --model-repository REPO` (docs/triton.md).
    """
    from ..ship.triton import LoadOptions, export_triton

    load = LoadOptions.of(
        trusted_keys=trusted_keys,
        min_version=min_version,
        refuse_rollback=refuse_rollback,
        verify=not no_verify,
        precision=precision,
    )
    models = export_triton(
        artifacts, repo, link=link, instances=instances, max_queue_delay_us=max_queue_delay_us, load=load
    )
    for model in models:
        c = model.config
        batching = f"max_batch_size {c.max_batch_size}" if c.max_batch_size else f"not batched ({c.unbatched})"
        preferred = f", preferred batch sizes {list(c.preferred_batch_sizes)}" if c.preferred_batch_sizes else ""
        click.echo(f"{model.folder}: versions {', '.join(str(v) for v in c.versions)}; {batching}{preferred}")
