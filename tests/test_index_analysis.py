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


def _printed(expr) -> str:
    from torch._inductor.codegen.cpp_utils import cexpr_index

    return cexpr_index(expr)


ks1, ks2 = sympy.symbols("ks1 ks2", integer=True, positive=True)  # a kernel's size arguments
tmp3 = sympy.Symbol("tmp3", integer=True, nonnegative=True)  # a value loaded from memory


def test_a_division_of_sizes_and_indices_is_printed_as_c_division():
    nested = FloorDiv(1 + FloorDiv(1 + FloorDiv(1 + ks1, 2), 2), 2)  # three stride-2 layers' height
    index = x3 + 96 * x0 * nested + ModularIndexing(x0 + 8 * ks2, 4, 16)
    assert "div_floor_integer" in _printed(index)  # Inductor's own: a branch on the signs
    with index_analysis.plain_divisions():
        fast = _printed(index)
    assert "div_floor_integer" not in fast
    assert fast.count(" / static_cast<int64_t>(2L))") == 3 and " / static_cast<int64_t>(4L))" in fast
    assert "div_floor_integer" in _printed(index)  # put back after the block


def test_a_division_that_may_see_a_negative_value_keeps_the_floor():
    with index_analysis.plain_divisions():
        for expr in (FloorDiv(ks1 - 1, 2), FloorDiv(x0 - 3, 4), FloorDiv(tmp3, 8), FloorDiv(x0, ks1 - 2)):
            assert "div_floor_integer" in _printed(expr), expr
        assert "div_floor_integer" in _printed(ModularIndexing(x0 - 1, 2, 8))


def test_the_printed_division_computes_the_floor_division(tmp_path):
    """C's division truncates: on a non-negative dividend and a positive divisor that is the floor.
    The printed index, compiled by g++, against sympy's value of it."""
    import subprocess

    nested = FloorDiv(1 + FloorDiv(x0 + 3 * ks1, 2), 3) + 5 * ModularIndexing(x0 + ks1, 2, 7)
    with index_analysis.plain_divisions():
        printed = _printed(nested)
    assert "div_floor_integer" not in printed
    points = [(0, 1), (5, 7), (6, 96), (255, 129), (1001, 3)]
    source = tmp_path / "index.cpp"
    source.write_text(
        "#include <cstdint>\n#include <cstdio>\nint main() {\n"
        + "".join(
            f'  {{ int64_t x0 = {x}, ks1 = {k}; std::printf("%ld\\n", (long)({printed})); }}\n' for x, k in points
        )
        + "}\n"
    )
    subprocess.run(["g++", "-O2", "-o", str(tmp_path / "index"), str(source)], check=True)
    got = subprocess.run([str(tmp_path / "index")], capture_output=True, text=True, check=True).stdout.split()
    assert [int(v) for v in got] == [int(nested.subs({x0: x, ks1: k})) for x, k in points]
    assert index_analysis.nonnegative(1 + FloorDiv(x0 + 3 * ks1, 2)) and not index_analysis.nonnegative(-x0)
