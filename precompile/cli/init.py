from __future__ import annotations

import shlex
from pathlib import Path

import click
import yaml

from . import main, user_errors


@main.command()
@click.argument("factory", metavar="MODULE:FACTORY")
@click.option(
    "--example",
    "examples",
    multiple=True,
    metavar="NAME=SHAPE[:DTYPE]",
    help="An input of a representative call, e.g. input_ids=2x16:int64; repeat per input. A name already in the call, or ';', starts the next call.",
)
@click.option(
    "--traffic",
    type=click.Path(dir_okay=False, exists=True, path_type=Path),
    help='Observed calls instead of examples: JSON lines {"inputs": {"input_ids": "2x16:int64"}, "count": N}.',
)
@click.option(
    "--kwarg",
    "kwargs",
    multiple=True,
    metavar="KEY=YAML",
    help="A keyword argument for the factory, e.g. --kwarg vocab=1000 (repeatable).",
)
@click.option("--name", help="The artifact's name [default: from the factory].")
@click.option(
    "-o",
    "--output",
    type=click.Path(dir_okay=False, path_type=Path),
    default=Path("profile.yaml"),
    show_default=True,
    help="Profile to write; the factory is imported with its folder first on sys.path, as build does.",
)
@click.option("--force", is_flag=True, help="Overwrite OUTPUT if it exists.")
@user_errors
def init(
    factory: str,
    examples: tuple[str, ...],
    traffic: Path | None,
    kwargs: tuple[str, ...],
    name: str | None,
    output: Path,
    force: bool,
) -> None:
    """Write a profile for MODULE:FACTORY from a few representative calls.

    Axes whose sizes differ between calls become dims; torch.export says which the model keeps
    dynamic, fixes or bounds (a position table, a size from its config), and each range is written
    with its reason. Two calls of a text model:

      precompile init models:bert --example input_ids=2x16:int64 --example attention_mask=2x16:int64
      --example input_ids=4x40 --example attention_mask=4x40
    """
    from ..authoring.init import init_profile, parse_examples, read_traffic
    from ..progress import RichProgress

    if bool(examples) == bool(traffic):
        raise click.UsageError("give --example calls or --traffic FILE (one of them)")
    if output.exists() and not force:
        raise click.ClickException(f"{output} exists; pass --force to overwrite it")
    parsed: dict = {}
    for item in kwargs:
        key, sep, value = item.partition("=")
        if not sep or not key.isidentifier():
            raise click.UsageError(f"--kwarg {item!r}: expected KEY=VALUE")
        try:
            parsed[key] = yaml.safe_load(value)
        except yaml.YAMLError as e:
            raise click.UsageError(f"--kwarg {item!r}: {e}") from None
    calls = read_traffic(traffic) if traffic else parse_examples(list(examples))
    words = [factory, *(f"--example {e}" for e in examples), *(f"--kwarg {k}" for k in kwargs)]
    command = "precompile init " + " ".join(shlex.quote(w) if " " in w and not w.startswith("--") else w for w in words)
    command += f" --traffic {traffic}" if traffic else ""
    result = init_profile(
        factory, calls, output=output, kwargs=parsed, name=name, command=command, progress=RichProgress()
    )
    output.parent.mkdir(parents=True, exist_ok=True)
    output.write_text(result.text, encoding="utf-8")
    for note in result.notes:
        click.echo(f"note: {note}", err=True)
    click.echo(result.text, nl=False, err=True)
    click.echo(str(output))
