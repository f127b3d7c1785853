"""The ``precompile`` command. A thin skin: each command parses its arguments, calls one library
function, and turns the library's own exceptions into a one-block message with exit code 1."""

from __future__ import annotations

import functools
import importlib
import importlib.util
from collections.abc import Callable
from pathlib import Path
from typing import Any

try:
    import click
except ImportError:  # the runtime alone: `import loader` works, the command line needs an extra
    raise SystemExit(
        "precompile: the command line needs the serve or the build extra: "
        "pip install 'precompile[serve]' (to serve) or 'precompile[build]' (to build)"
    ) from None

from loader.errors import LoaderError

from ..errors import PrecompileError
from ..quiet import quiet_third_party_warnings
from ..version import __version__


def user_errors(fn: Callable[..., Any]) -> Callable[..., Any]:
    """Turn PrecompileError and loader errors into ClickException (exit 1, no traceback)."""

    @functools.wraps(fn)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        try:
            return fn(*args, **kwargs)
        except (PrecompileError, LoaderError) as e:
            raise click.ClickException(str(e)) from None

    return wrapper


def options(*block: Callable[[Any], Any]) -> Callable[[Any], Any]:
    """A block of ``click.option`` decorators as one decorator, declared once and reused: the options
    appear in ``--help`` in the order listed. A ``click.option(...)`` makes a new option each time it
    decorates a command, so one declaration serves several commands."""

    def decorate(fn: Any) -> Any:
        for option in reversed(block):
            fn = option(fn)
        return fn

    return decorate


# The artifact's destination, release number and expiry: the commands that write one (`build`, `assemble`).
artifact_options = options(
    click.option(
        "-o",
        "--output",
        type=click.Path(file_okay=False, path_type=Path),
        help="Artifact folder [default: artifacts/<name>].",
    ),
    click.option(
        "--artifact-version",
        "version",
        type=click.IntRange(min=1),
        default=1,
        show_default=True,
        help="Release number of this artifact name; loaders can refuse older ones.",
    ),
    click.option(
        "--expires", metavar="ISO-DATETIME", help="Refuse to load after this moment, e.g. 2027-01-01T00:00:00+00:00."
    ),
)

# The options of every command that hands an artifact to ``loader.load()`` (`serve`, `export triton`).
refuse_rollback_option = click.option(
    "--refuse-rollback",
    is_flag=True,
    help="Refuse a version older than one this host loaded with --refuse-rollback ($PRECOMPILE_STATE ledger).",
)
precision_option = click.option(
    "--precision",
    type=click.Choice(["auto", "fp32", "bf16", "int8"]),
    default="auto",
    show_default=True,
    help="Variants to serve: auto (the bf16/int8 ones the build kept, where this CPU runs them, fp32 elsewhere), or one precision first.",
)
no_verify_option = click.option(
    "--no-verify", is_flag=True, help="Skip the sha256 check of the artifact's files at load."
)

# The trust policy (signatures, minimum version, the rollback ledger, hash checks) and the precision
# served, of a command that loads every artifact once (`export triton`; `serve` says when it loads).
# Parameters: trusted_keys, min_version, refuse_rollback, precision, no_verify.
trust_options = options(
    click.option(
        "--trusted-key",
        "trusted_keys",
        multiple=True,
        type=click.Path(exists=True, dir_okay=False, path_type=Path),
        help="Load only artifacts signed by this public key (repeatable), at every load.",
    ),
    click.option("--min-version", type=click.IntRange(min=0), help="Refuse artifact versions below N, at every load."),
    refuse_rollback_option,
    precision_option,
    no_verify_option,
)


# What each extra adds that commands import, by import name (pyproject.toml names the distributions;
# tests/test_install.py keeps the two in step).
EXTRA_MODULES = {
    "serve": ("fastapi", "uvicorn", "prometheus_client", "grpc", "google.protobuf"),
    "build": ("pydantic", "yaml", "rich", "ruamel.yaml", "safetensors"),
}

# Each command: the module under precompile.cli that defines it, and the extra it needs. A command's
# module is imported only when that command runs (or --help lists it), so `precompile serve` never
# imports the build side, and a command whose extra is missing says so in one line.
COMMANDS = {
    "serve": ("serve", "serve"),
    "inspect": ("inspect", None),
    "cache": ("cache", None),
    "export": ("export", None),
    **{
        name: (module, "build")
        for name, module in {
            "build": "build",
            "assemble": "assemble",
            "plan": "plan",
            "schema": "schema",
            "profile": "profile_cmd",
            "init": "init",
            "doctor": "doctor",
            "keygen": "keygen",
            "pack": "pack",
            "sign": "sign",
            "verify": "verify",
            "push": "push",
            "pull": "pull",
            "ls": "ls",
            "promote": "promote",
        }.items()
    },
}


def missing_modules(extra: str | None) -> list[str]:
    """The modules of ``extra`` that cannot be imported here (none for the runtime's commands)."""
    return [m for m in EXTRA_MODULES.get(extra or "", ()) if not _importable(m)]


def _importable(module: str) -> bool:
    # The top-level name only: finding ruamel.yaml would import ruamel, and --help imports nothing.
    try:
        return importlib.util.find_spec(module.split(".")[0]) is not None
    except (ImportError, ValueError):
        return False


class Commands(click.Group):
    """The command group, importing each command's module on first use."""

    def list_commands(self, ctx: click.Context) -> list[str]:
        return sorted(COMMANDS)

    def get_command(self, ctx: click.Context, name: str) -> click.Command | None:
        if name not in COMMANDS:
            return None
        module, extra = COMMANDS[name]
        missing = missing_modules(extra)
        if missing:
            return _needs_extra(name, extra, missing)
        if name not in self.commands:
            importlib.import_module(f"{__name__}.{module}")  # registers the command on main
        return self.commands[name]


def _needs_extra(name: str, extra: str, missing: list[str]) -> click.Command:
    """A stand-in for a command whose extra is not installed: any use of it is that one-line error."""
    message = f"precompile {name} needs the {extra} extra ({', '.join(missing)} not installed): pip install 'precompile[{extra}]'"

    def refuse(args: tuple[str, ...]) -> None:
        raise click.ClickException(message)

    return click.Command(
        name,
        callback=refuse,
        params=[click.Argument(["args"], nargs=-1, type=click.UNPROCESSED)],
        help=f"(needs pip install 'precompile[{extra}]')",
        context_settings={"ignore_unknown_options": True, "help_option_names": []},
    )


@click.group(cls=Commands, context_settings={"help_option_names": ["-h", "--help"]})
@click.version_option(__version__, prog_name="precompile")
def main() -> None:
    """Ahead-of-time compiled PyTorch models for inputs whose shapes change.

    Build an artifact from a profile in CI, load it in serving processes with loader.load().
    """
    quiet_third_party_warnings()  # before any command imports a model (and transformers, torchao with it)
