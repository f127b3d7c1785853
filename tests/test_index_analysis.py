"""precompile.index_analysis: Inductor's stride questions answered by expand where that is exact.

The expressions are those a routed convolution's compile asks about (tests/test_conv_routes.py's
model: loop variables d0..d3 and x0..x3, the image's sizes s0 and s53, floor divisions of them)."""

from __future__ import annotations

import sympy
import torch._inductor.sizevars as sizevars
from torch.utils._sympy.functions import FloorDiv, ModularIndexing

from precompile import index_analysis

d0, d1, d2, d3, x0, x3 = sympy.symbols("d0 d1 d2 d3 x0 x3", integer=True, nonnegative=True)
s0, s53 = sympy.symbols("s0 s53", integer=True, positive=True)
A, B = FloorDiv(s0 - 1, 2), FloorDiv(s53 - 1, 2)
INDEX = 32 * d0 * A * B + 32 * d0 * A + 32 * d0 * B + 32 * d0 + 32 * d1 * A + 32 * d1 + 32 * d2 + d3 - 32 * A - 64


def test_a_stride_along_each_loop_variable_is_what_simplify_gives():
    for var in (d0, d1, d2, d3):
        step = INDEX.xreplace({var: var + 1}) - INDEX
        fast, slow = index_analysis.simplify(step), sympy.simplify(step)
        assert fast == slow  # the same expression, not only an equal one
    assert index_analysis.simplify(INDEX.xreplace({d3: d3 + 1}) - INDEX) == 1  # contiguous along d3
    assert index_analysis.simplify(INDEX.xreplace({d2: d2 + 1}) - INDEX) == 32


def test_floor_divisions_and_modulos_are_terms_of_the_polynomial():
    expr = 16 * ModularIndexing(x3, 1, 8) + FloorDiv(x0, 16) * (s0 + 1) - FloorDiv(x0, 16) * s0
    assert index_analysis.is_polynomial(expr)
    assert sympy.expand(index_analysis.simplify(expr) - sympy.simplify(expr)) == 0
    assert index_analysis.simplify(expr) == 16 * ModularIndexing(x3, 1, 8) + FloorDiv(x0, 16)


def test_anything_but_a_polynomial_goes_to_simplify():
    for expr in (x0 / s0 + x0 / s0, (s0 + 1) ** -1, sympy.Eq(x0, 1), sympy.sqrt(s0)):
        assert not index_analysis.is_polynomial(expr)
    ratio = (s0**2 - 1) / (s0 - 1)
    assert index_analysis.simplify(ratio) == s0 + 1  # simplify's cancel, which expand would not do


def test_inductor_sees_it_during_the_block_only():
    assert sizevars.sympy is sympy
    with index_analysis.faster_index_analysis():
        assert sizevars.sympy.simplify is index_analysis.simplify
        assert sizevars.sympy.Symbol is sympy.Symbol  # the rest is sympy's
        with index_analysis.faster_index_analysis():  # nested (a second compile in the process): left as it is
            assert sizevars.sympy.simplify is index_analysis.simplify
        assert sizevars.stride_at_vec_range(INDEX, d3, 8) == 1
    assert sizevars.sympy is sympy
