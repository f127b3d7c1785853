from __future__ import annotations

from pathlib import Path

import click

from . import artifact_options, main, user_errors


@main.command()
@click.argument("profile", type=click.Path(dir_okay=False, path_type=Path))
@artifact_options
@click.option(
    "-j",
    "--jobs",
    type=click.IntRange(min=1),
    help="Variants compiled at once, each in its own process [default: one per core; with ray, the cluster's CPUs / --ray-cpus].",
)
@click.option(
    "--executor",
    type=click.Choice(["local", "ray"]),
    default="local",
    show_default=True,
    help="Where units compile: this host, or tasks on a Ray cluster (the ray extra).",
)
@click.option(
    "--address",
    metavar="HOST:PORT",
    help=(
        "With --executor ray: the cluster's head, as `ray start --head` printed it "
        "[default: RAY_ADDRESS, a cluster on this host, else a local Ray]."
    ),
)
@click.option(
    "--shard",
    metavar="K/N",
    help=(
        "Compile only the K-th of N shares of the units into a part (default -o: artifacts/<name>.part-K-of-N); "
        "join the N parts with `precompile assemble`."
    ),
)
@click.option(
    "--program",
    type=click.Path(dir_okay=False, path_type=Path),
    help="A .pt2 file torch.export.save wrote: the exported program replaces the profile's model factory.",
)
@click.option(
    "--ray-cpus",
    type=click.IntRange(min=1),
    default=1,
    show_default=True,
    help="With --executor ray: CPUs each unit reserves (and Inductor's compile threads).",
)
@click.option(
    "--cache",
    type=click.Path(path_type=Path),
    metavar="DIR",
    help=(
        "The build cache: a variant compiled before with the same program, options, target and toolchain "
        "is copied from DIR instead of compiled again, and a new compile is kept there [default: "
        "PRECOMPILE_BUILD_CACHE, else none]."
    ),
)
@user_errors
def build(
    profile: Path,
    output: Path | None,
    version: int,
    expires: str | None,
    jobs: int | None,
    executor: str,
    address: str | None,
    shard: str | None,
    program: Path | None,
    ray_cpus: int,
    cache: Path | None,
) -> None:
    """Build the artifact PROFILE describes: export, compile, check against eager, write.

    With --executor ray, every unit (a variant under one option set) is a task on a Ray cluster; the
    packages come back to this host, which checks and writes the artifact.

    With --shard K/N, only every N-th unit from the K-th is compiled, into a part: run the N shards on
    N machines (a CI matrix), then `precompile assemble` the parts into the artifact.

    With --program, a saved torch.export program is the model (the profile may leave model.factory
    out); it must be dynamic wherever the profile is. The same call as precompile.build(profile, ...).
    """
    from ..executors import executor_named
    from ..pipeline import build as run_build
    from ..progress import RichProgress
    from ..shard import build_part, parse_shard

    share = parse_shard(shard) if shard is not None else None
    if share is not None and program is not None:
        raise click.UsageError("--program builds in one place: shards read the profile's model factory")
    if share is not None and (version != 1 or expires is not None):
        raise click.UsageError(
            "--artifact-version and --expires belong to the artifact: give them to `precompile assemble`"
        )
    runner = executor_named(executor, address=address, cpus=ray_cpus)
    if share is not None:
        part = build_part(profile, share, output, jobs=jobs, executor=runner, progress=RichProgress(), cache=cache)
        click.echo(str(part.path))
        return
    result = run_build(
        profile,
        output,
        program=program,
        progress=RichProgress(),
        version=version,
        expires=expires,
        jobs=jobs,
        executor=runner,
        cache=cache,
    )
    click.echo(str(result.path))
