"""The ``precompile`` command. A thin skin: each command parses its arguments, calls one library
function, and turns the library's own exceptions into a one-block message with exit code 1."""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

import click

from loader.errors import LoaderError

from .. import __version__
from ..errors import PrecompileError


def user_errors(fn: Callable[..., Any]) -> Callable[..., Any]:
    """Turn PrecompileError and loader errors into ClickException (exit 1, no traceback)."""

    @functools.wraps(fn)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        try:
            return fn(*args, **kwargs)
        except (PrecompileError, LoaderError) as e:
            raise click.ClickException(str(e)) from None

    return wrapper


@click.group(context_settings={"help_option_names": ["-h", "--help"]})
@click.version_option(__version__, prog_name="precompile")
def main() -> None:
    """Ahead-of-time compiled PyTorch models for inputs whose shapes change.

    Build an artifact from a profile in CI, load it in serving processes with loader.load().
    """


from . import assemble as _assemble  # noqa: E402,F401
from . import build as _build  # noqa: E402,F401  (commands register themselves on main)
from . import cache as _cache  # noqa: E402,F401
from . import doctor as _doctor  # noqa: E402,F401
from . import init as _init  # noqa: E402,F401
from . import inspect as _inspect  # noqa: E402,F401
from . import keygen as _keygen  # noqa: E402,F401
from . import ls as _ls  # noqa: E402,F401
from . import pack as _pack  # noqa: E402,F401
from . import plan as _plan  # noqa: E402,F401
from . import profile_cmd as _profile_cmd  # noqa: E402,F401
from . import promote as _promote  # noqa: E402,F401
from . import pull as _pull  # noqa: E402,F401
from . import push as _push  # noqa: E402,F401
from . import schema as _schema  # noqa: E402,F401
from . import serve as _serve  # noqa: E402,F401
from . import sign as _sign  # noqa: E402,F401
from . import verify as _verify  # noqa: E402,F401
