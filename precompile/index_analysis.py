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

``plain_divisions`` changes what the generated C++ computes, not how it is chosen. Inductor prints
every floor division of an index as ``c10::div_floor_integer``, which branches on the operands' signs.
A loop over a dynamic convnet's later layers indexes by nested divisions of the image's sizes
(``((1 + ((1 + h)/2))/2 ...``, one per stride-2 layer): g++ hoists no branching code out of a loop,
so each of a depthwise loop's nine loads recomputed four nested divisions for every eight outputs
(about 1,400 instructions where 40 do; MobileNetV2 with every convolution routed spent two thirds of
a call there). Where the dividend is a sum or product of sizes, loop indices and non-negative numbers
and the divisor a positive one, C's ``/`` is the floor division and has no branch, so g++ hoists it.
"""

from __future__ import annotations

import contextlib
import re
import types
from collections.abc import Iterator
from typing import Any

import sympy

# Symbols a generated kernel's index may hold that are sizes or loop indices: non-negative by
# construction (Inductor's ``ks0`` kernel arguments, ``x0`` loop variables, ``s0`` size symbols,
# ``ps0`` precomputed sizes); any other symbol (a value loaded from memory) is not taken as such.
SIZE_OR_INDEX = re.compile(r"(ks|x|s|ps)\d+")


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


def nonnegative(expr: Any) -> bool:
    """Whether ``expr`` is provably ``>= 0``: numbers, sizes and loop indices, and sums, products and
    floor divisions of them (by positive ones)."""
    from torch.utils._sympy.functions import FloorDiv, ModularIndexing

    if expr.is_Integer:
        return int(expr) >= 0
    if expr.is_Symbol:
        return bool(expr.is_nonnegative) and SIZE_OR_INDEX.fullmatch(expr.name) is not None
    if isinstance(expr, (sympy.Add, sympy.Mul)):
        return all(nonnegative(a) for a in expr.args)
    if isinstance(expr, FloorDiv):
        return nonnegative(expr.args[0]) and positive(expr.args[1])
    if isinstance(expr, ModularIndexing):
        return nonnegative(expr.args[0]) and positive(expr.args[1]) and positive(expr.args[2])
    return False


def positive(expr: Any) -> bool:
    """Whether ``expr`` is provably ``> 0``: a positive number, or a product of positive ones and sizes."""
    if expr.is_Integer:
        return int(expr) > 0
    if expr.is_Symbol:
        return bool(expr.is_positive) and SIZE_OR_INDEX.fullmatch(expr.name) is not None
    if isinstance(expr, sympy.Mul):
        return all(positive(a) for a in expr.args)
    return False


def _plain_division(printer: Any, x: Any, div: Any) -> str:
    return f"(static_cast<int64_t>({printer.doprint(x)}) / static_cast<int64_t>({printer.doprint(div)}))"


@contextlib.contextmanager
def plain_divisions() -> Iterator[None]:
    """Inductor's C++ printer writes an index's floor division of a non-negative by a positive value
    as C's ``/`` while the block runs (the module docstring); others as it always does."""
    try:
        from torch._inductor.codegen.cpp_utils import CppPrinter
    except ImportError:  # pragma: no cover - a torch without Inductor compiles nothing here
        yield
        return
    names = ("_print_FloorDiv", "_print_ModularIndexing")
    own = {name: CppPrinter.__dict__.get(name) for name in names}  # Inductor's subclass, or its base's
    floor_div, modular = CppPrinter._print_FloorDiv, CppPrinter._print_ModularIndexing

    def _print_FloorDiv(self: Any, expr: Any) -> str:
        x, div = expr.args
        if expr.is_integer and nonnegative(x) and positive(div):
            return _plain_division(self, x, div)
        return floor_div(self, expr)

    def _print_ModularIndexing(self: Any, expr: Any) -> str:
        x, div, mod = expr.args
        if expr.is_integer and nonnegative(x) and positive(div) and positive(mod):
            quotient = _plain_division(self, x, div) if div != 1 else self.doprint(x)
            return f"(static_cast<int64_t>({quotient}) % static_cast<int64_t>({self.doprint(mod)}))"
        return modular(self, expr)

    CppPrinter._print_FloorDiv, CppPrinter._print_ModularIndexing = _print_FloorDiv, _print_ModularIndexing
    try:
        yield
    finally:
        for name, before in own.items():
            if before is None:
                delattr(CppPrinter, name)
            else:
                setattr(CppPrinter, name, before)


def codegen_mark() -> Any:
    """A pass that changes nothing, for Inductor's ``post_grad_custom_post_pass``: its ``uuid`` (the
    hash of this file and ``precompile.parallel_loops``) puts ``generated_code``'s changes in the keys
    of Inductor's graph cache and precompile's build cache, so that neither hands back code generated
    before them or by another version of them."""
    from torch._inductor.custom_graph_pass import CustomGraphPass, get_hash_for_files

    from . import parallel_loops

    class GeneratedCodeMark(CustomGraphPass):
        def __call__(self, graph: Any) -> None:
            return None

        def uuid(self) -> Any:
            return get_hash_for_files((__file__, parallel_loops.__file__))

    return GeneratedCodeMark()


@contextlib.contextmanager
def generated_code() -> Iterator[None]:
    """precompile's changes to Inductor's C++ code generation while a compile runs: this module's two
    and the loops' parallel split (``precompile.parallel_loops``)."""
    from .parallel_loops import parallel_for_the_least_sizes

    with faster_index_analysis(), plain_divisions(), parallel_for_the_least_sizes():
        yield
