"""Distributivity in the gradient kernels (codegen.shared_factors): networks whose last
products share an operand sum their other factors and multiply once. The gradients it
gives are checked against float64 by tests/test_triton_backward.py and
tests/test_grad_target_split.py (every grouping and part count) under the interpreter."""
import re

import pytest

import hladsl
from hladsl.codegen import triton_bwd
from hladsl.codegen.shared_factors import LastProduct, families, family_order
from hladsl.codegen.steps import Tile
from hladsl.ir.pipeline import chunk_program


def _last(a, b, out=("T", "i"), temp="t1"):
    return LastProduct(Tile(*a), Tile(*b), out, "pre", (temp, temp))


def test_networks_sharing_an_operand_in_the_same_roles_form_a_family():
    lasts = [
        _last(("t9", ("T", "n")), ("t10", ("n", "i")), temp="t11"),          # X = t9 [T, n]
        _last(("t30", ("m", "i")), ("t9", ("T", "m")), temp="t31"),          # the same X, other names
        _last(("t9", ("n", "T")), ("t40", ("n", "i")), temp="t41"),          # t9 transposed: not the same
        _last(("t9", ("T", "n")), ("t50", ("n", "i")), temp="t51"),          # X again, but its product is reused
        None,                                                               # not a plain matmul
    ]
    lines = ["t11 = _dot(t9, t10)", "dx_q += t11", "t31 = _dot(t9, t30)", "dx_q += t31",
             "t41 = _dot(tl.trans(t9), t40)", "dx_q += t41", "t51 = _dot(t9, t50)", "dx_q += t51",
             "dlam += tl.sum(t51 * in_q, axis=1)", "# t11 in a comment is no use"]
    assert families(lasts, lines) == {0: (0, 0), 1: (0, 1)}


def test_a_family_is_lowered_in_a_row_where_its_first_network_was():
    assert family_order(6, {1: (0, 0), 4: (0, 1), 2: (1, 0), 5: (1, 0)}) == [0, 1, 4, 2, 5, 3]


def _groups(name, carried, gated):
    alg = hladsl.compile_spec(name)
    if carried:
        from hladsl.runtime.op import carried_compilation, program_for
        program = program_for(carried_compilation(alg)[0], 64, (("d", 64), ("dv", 64)), gated)
    else:
        program = chunk_program(alg, 64, (("d", 64), ("dv", 64)), gated)
    return triton_bwd.backward_context(program)["grad_groups"]


@pytest.mark.parametrize("name,carried", [("hla3", True), ("hla3_masked", False)])
def test_shared_factors_save_matmuls_and_each_family_multiplies_once(name, carried, monkeypatch):
    factored = _groups(name, carried, False)
    monkeypatch.setattr(triton_bwd, "families", lambda lasts, lines: {})
    plain = _groups(name, carried, False)
    assert sum(g["matmuls"] for g in factored) < sum(g["matmuls"] for g in plain)
    for f, p in zip(factored, plain):
        assert f["matmuls"] <= p["matmuls"] and f["networks"] == p["networks"]
        code = f["code"]["pre"]
        for var in set(re.findall(r"\b(fsum\d+) = tl.zeros", code)):
            assert len(re.findall(rf"_dot\([^\n]*\b{var}\b", code)) == 1, var   # one product a family
            assert len(re.findall(rf"\b{var} [+-]= ", code)) >= 2                 # of two networks or more


def test_exact_networks_keep_their_own_products():
    """hla3 as written makes every backward product reading a state fp32-accurate (ir.precision
    rule 5): a sum of such factors would round where each product kept its side exact."""
    for g in _groups("hla3", False, False):
        code = g["code"]["pre"]
        for var in set(re.findall(r"\b(fsum\d+) = tl.zeros", code)):
            product = re.search(rf"_dot\([^\n]*\b{var}\b[^\n]*\)", code).group(0)
            assert "tl.float32" not in product, product

