"""The precision plan (hladsl/ir/precision.py): which products reading carried states
stay fp32-accurate, and that the generated kernels and `--emit chunk` follow it."""
import re

import pytest

from hladsl.api import compile_spec
from hladsl.codegen.triton_bwd import triton_bwd_source
from hladsl.codegen.triton_gen import generate
from hladsl.emit import PASS_TEXT
from hladsl.ir.precision import precision_plan

# o = q (A - B): two states whose output terms cancel
CANCELLING_OUTPUT = """
mechanism cancel {
  dims d, dv
  input q[d], k[d], v[dv]
  state A[i, e] = k[i] v[e]
  state B[i, e] = q[i] v[e]
  output o[e] = q[i] A[i, e] - q[i] B[i, e]
}
"""


def _plan(name, **params):
    return precision_plan(compile_spec(name, **params).program)


@pytest.mark.parametrize("name,params", [("linear", {}), ("ahla", {}), ("hla3_masked", {}),
                                         ("power", {"p": 2})])
def test_specs_without_cancellation_run_every_product_in_the_input_dtype(name, params):
    plan = _plan(name, **params)
    assert not plan.exact_output and not plan.exact_derived and not plan.exact_states
    source = generate(compile_spec(name, **params).program)
    assert "tl.float32, PREC)" not in source    # no fp32-forced dot anywhere


def test_hla2_keeps_its_cancelling_carry_and_the_states_feeding_it_exact():
    plan = _plan("hla2")
    assert not plan.exact_output
    assert set(plan.exact_derived) == {"W0"}       # W = C S - G
    assert set(plan.exact_states) == {"G"}         # G's update reads C: it enters W
    source = generate(compile_spec("hla2").program)
    state_pass = source.split("def output_kernel")[0]
    output = source.split("def output_kernel")[1].split("def fused_kernel")[0]
    exact = re.findall(r"_dot\([^\n]*tl\.float32, PREC\)", output)
    derived = output.split("# ---- output:")[0]
    assert exact and all(line in derived for line in exact)   # only in the derived carry
    assert "tl.float32, PREC)" in state_pass.split("# ---- G:")[1]   # G's update
    assert "tl.float32, PREC)" not in state_pass.split("# ---- G:")[0]


def test_hla3_keeps_its_three_correction_states_exact():
    plan = _plan("hla3")
    assert set(plan.exact_derived) == {"W0"}
    assert set(plan.exact_states) == {"G1", "G2", "G3"}


def test_a_cancelling_output_is_summed_exactly_in_its_derived_carry(tmp_path):
    """Carry-only output terms are folded into a derived carry (W = A - B): the plan keeps
    that sum fp32-accurate and lets q W run in the input dtype."""
    path = tmp_path / "cancel.hla"
    path.write_text(CANCELLING_OUTPUT)
    plan = _plan(str(path))
    assert set(plan.exact_derived) == {"W0"} and not plan.exact_output
    assert not plan.exact_states    # A and B are updated from tokens alone
    assert "A@P[_0,e] - B@P[_0,e]" in "\n".join(plan.describe())


def test_backward_networks_inherit_the_plan():
    c = compile_spec("hla2")
    bwd = triton_bwd_source(c.program)
    linear_bwd = triton_bwd_source(compile_spec("linear").program)
    assert "tl.float32, PREC)" in bwd          # the VJPs of W and of G's update
    assert "tl.float32, PREC)" not in linear_bwd


def test_emit_chunk_prints_the_plan():
    text = PASS_TEXT["pack_symmetric"](compile_spec("hla2"))
    assert "precision: products reading carried states are fp32-accurate" in text
    assert "derived W0" in text and "the update of G" in text
    assert "every product runs on the tensor cores" in PASS_TEXT["pack_symmetric"](compile_spec("linear"))
