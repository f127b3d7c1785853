"""Inductor's vectorisation analysis with polynomial index expressions expanded, not simplified.

Choosing how to vectorise each generated C++ loop, Inductor asks for the stride of every index
expression along each loop variable (``torch._inductor.sizevars``: ``stride_at``,
``simplify_index_in_vec_range``), each through ``sympy.simplify``: tens of milliseconds an
expression once the sizes are dynamic (products of floor divisions of the image's sizes). A
convolution routed to generated loops (``precompile.passes.conv_routes``) makes hundreds of them:
the tests' routed model spent 17.6 s of a 48 s compile in 576 such calls, MobileNetV2 with every
route most of its compile.

Those expressions are polynomials over integers, loop variables and size symbols, with floor
divisions and modulos as opaque terms; ``sympy.expand`` puts such a polynomial in its canonical
form, so a difference that is a constant comes out as that constant, as ``simplify`` gives it, in a
fraction of the time. ``faster_index_analysis`` hands Inductor's module an ``expand`` for those and
``simplify`` for anything else (relations, divisions, powers below zero), while a compile runs. The
tests' routed model compiled in 44 s against 67 s, its generated kernels byte for byte the same
(tests/test_index_analysis.py checks the rule on expressions such a compile asks about).
"""

from __future__ import annotations

import contextlib
import types
from collections.abc import Iterator
from typing import Any

import sympy


def is_polynomial(expr: Any) -> bool:
    """Whether ``expr`` is sums and products of numbers, symbols, whole powers of them and function
    terms (``FloorDiv``, ``ModularIndexing``, ...: taken as they are)."""
    if not isinstance(expr, sympy.Expr):
        return False
    if expr.is_Atom or isinstance(expr, sympy.Function):
        return True
    if isinstance(expr, (sympy.Add, sympy.Mul)):
        return all(is_polynomial(a) for a in expr.args)
    if isinstance(expr, sympy.Pow):
        return bool(expr.exp.is_Integer and expr.exp >= 0) and is_polynomial(expr.base)
    return False


def simplify(expr: Any, *args: Any, **kwargs: Any) -> Any:
    """``sympy.simplify``, by ``sympy.expand`` where ``expr`` is a polynomial (the module docstring)."""
    if not args and not kwargs and is_polynomial(expr):
        return sympy.expand(expr)
    return sympy.simplify(expr, *args, **kwargs)


class _Sympy(types.ModuleType):
    """sympy as ``torch._inductor.sizevars`` sees it during a compile: ``simplify`` above, the rest sympy's."""

    simplify = staticmethod(simplify)

    def __getattr__(self, name: str) -> Any:
        return getattr(sympy, name)


@contextlib.contextmanager
def faster_index_analysis() -> Iterator[None]:
    """Inductor's index analysis on ``simplify`` above while the block runs (a torch whose sizevars
    module reads sympy otherwise is left as it is)."""
    try:
        import torch._inductor.sizevars as sizevars
    except ImportError:  # pragma: no cover - a torch without Inductor compiles nothing here
        yield
        return
    before = getattr(sizevars, "sympy", None)
    if before is not sympy or not hasattr(sizevars, "stride_at"):
        yield
        return
    sizevars.sympy = _Sympy("sympy")
    try:
        yield
    finally:
        sizevars.sympy = before
