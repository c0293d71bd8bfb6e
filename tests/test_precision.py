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


# A state read by both the output and the normaliser (S), beside states read by one (U, z)
SHARED_BY_QUOTIENT = """
mechanism shared {
  dims d, dv
  input q[d], k[d], v[dv]
  param normalize = true, eps = 1e-6
  state S[i, j] = k[i] k[j]
  state U[j, e] = k[j] v[e]
  state z[i] = k[i]
  output o[e] = q[i] S[i, j] U[j, e]
  normalizer = q[i] S[i, j] z[j]
}
"""


def _quotient(source_or_name, **params):
    from hladsl.ir.precision import quotient_cancelling
    return quotient_cancelling(compile_spec(source_or_name, **params).backward)


def test_quotient_rule_marks_d_states_reached_from_num_and_den(tmp_path):
    """dS sums the numerator's and the normaliser's cotangent paths (they nearly cancel);
    dU (numerator only) and dz (normaliser only) do not."""
    path = tmp_path / "shared.hla"
    path.write_text(SHARED_BY_QUOTIENT)
    marked, reasons = _quotient(str(path))
    assert ("carry", "S") in marked
    assert not {("carry", "U"), ("carry", "z")} & marked
    assert len(reasons) == 1 and reasons[0].startswith("dS ")


@pytest.mark.parametrize("name,normalize,expect", [
    ("linear", True, set()),          # S in num only, z in den only
    ("ahla", True, set()),
    ("hla2", False, set()),           # no quotient
    ("hla2", True, {("carry", "S")}),
    ("hla3_masked", True, {("carry", "S")}),
])
def test_quotient_rule_on_the_shipped_specs(name, normalize, expect):
    marked, _ = _quotient(name, normalize=normalize)
    assert {k for k in marked if k[0] == "carry"} == expect


def _dots_reading_output_cotangents(kernel_source: str) -> list[str]:
    """The dtype argument of every ``_dot`` whose operands read d num / d den, directly or
    through temps computed from them (a small dataflow over the generated lines)."""
    tracked = re.compile(r"\b(ct_num|ct_den|rawct_num|dnum_ptr|dden_ptr)\b")
    derived, dtypes = set(), []
    for line in kernel_source.splitlines():
        code = line.split("#")[0]
        m = re.match(r"\s*(t\d+) = (.*)", code)
        if not m:
            continue
        var, expr = m.groups()
        reads = bool(tracked.search(expr)) or bool(set(re.findall(r"\bt\d+\b", expr)) & derived)
        if reads:
            derived.add(var)
            dot = re.search(r"_dot\(.*, (\w+(?:\.\w+)?), PREC\)", expr)
            if dot:
                dtypes.append(dot.group(1))
    return dtypes


def test_every_product_on_a_marked_d_states_cotangent_path_is_fp32():
    """hla2 normalised, reverse kernel: every dot reading d num / d den (or a value made
    from them) runs in fp32 (its marked networks: dS and the derived carries feeding it)."""
    source = triton_bwd_source(compile_spec("hla2", normalize=True).program)
    reverse = source.split("def reverse_kernel(")[1].split("@triton.jit")[0]
    dtypes = _dots_reading_output_cotangents(reverse)
    assert dtypes and set(dtypes) == {"tl.float32"}, dtypes


def test_marked_networks_read_the_output_cotangents_in_fp32():
    """hla2 normalised: the reverse pass's products reading d num run as fp32 dots
    (tl.float32), and only there; linear normalised keeps every one in the input dtype."""
    hla2 = triton_bwd_source(compile_spec("hla2", normalize=True).program)
    linear = triton_bwd_source(compile_spec("linear", normalize=True).program)
    assert re.search(r"_dot\(rawct_num, \w+, tl\.float32, PREC(, DOT)?\)", hla2)   # (, DOT: against a token tile)
    assert not re.search(r"_dot\(rawct_num, [^)]*tl\.float32", linear)
    unnormalised = triton_bwd_source(compile_spec("hla2").program)
    assert not re.search(r"_dot\(rawct_num, [^)]*tl\.float32", unnormalised)


def test_emit_chunk_bwd_says_which_d_states_keep_fp32_cotangent_products():
    from hladsl.emit import emit
    text = emit("hla2", "chunk_bwd", {"normalize": True}, None)
    assert "cotangent products stay fp32-accurate" in text and "dS (" in text



def _kernel(source: str, kernel: str) -> str:
    return source.split(f"def {kernel}(")[1].split("\n@triton.jit")[0]


def test_states_of_a_cubic_cancellation_keep_their_token_products_fp32():
    """Rule 3: HLA3's W = SK SQ P - G1 - G2 - G3 multiplies three states, so every state it
    reads (and what their updates read) sums even its token products fp32-accurately, in
    the state pass and the fused kernel: in fp32, or in the input dtype where both sides
    are token tiles as loaded (exact on the tensor cores); the output kernel still runs
    tokens in bf16."""
    plan = _plan("hla3")
    assert set(plan.exact_tokens) == {"SK", "SQ", "P", "G1", "G2", "G3"}
    source = generate(compile_spec("hla3").program)
    for kernel in ("state_pass_kernel", "fused_kernel"):
        updates = re.findall(r"# ---- (\w+): state at the end of this chunk\n(.*?)(?=# ----|\Z)",
                             _kernel(source, kernel), re.S)
        assert {name for name, _ in updates} == set(plan.exact_tokens), kernel
        body = _kernel(source, kernel)
        tokens = {"raw_k", "raw_q", "raw_v"} | set(re.findall(
            r"loaded transposed in the input dtype\n\s+(t\d+) = ", body))
        for name, code in updates:
            assert "_dot(" in code and ", SDOT, PREC)" not in code, name
            for a, b in re.findall(r"_dot\(([^,]+), ([^,]+), DOT, PREC\)", code):
                assert {a, b} <= tokens, (name, a, b)
    assert ", DOT, PREC)" in _kernel(source, "output_kernel")
    assert "token products of G1, G2, G3, P, SK, SQ" in "\n".join(plan.describe())


@pytest.mark.parametrize("name,params", [("hla2", {}), ("linear", {}), ("ahla", {}),
                                         ("hla3_masked", {}), ("power", {"p": 2})])
def test_quadratic_or_no_cancellation_keeps_token_products_in_the_input_dtype(name, params):
    """HLA2's W = C S - G multiplies two states: its token products stay bf16."""
    assert not _plan(name, **params).exact_tokens
    body = _kernel(generate(compile_spec(name, **params).program), "state_pass_kernel")
    assert ", DOT, PREC)" in body


@pytest.mark.parametrize("name,params,exact", [("hla3", {}, True), ("hla2", {}, False),
                                               ("hla3_masked", {}, False), ("linear", {}, False)])
def test_a_cubic_cancellation_makes_the_backwards_state_products_fp32(name, params, exact):
    """Rule 5: HLA3's backward reads every state and d-state fp32-accurately (SDOT = fp32
    for bf16 inputs, as fp16 inputs always do); a quadratic or no cancellation keeps them
    in bf16. ``--emit chunk_bwd`` says so."""
    import torch
    import triton.language as tl

    from hladsl.codegen.triton_bwd import backward_kernels
    from hladsl.emit import emit
    from hladsl.runtime import launch
    program = compile_spec(name, **params).program
    assert precision_plan(program).exact_backward is exact
    _, ctx = backward_kernels(program)
    assert ctx["exact_state_reads"] is exact
    cuda = torch.device("cuda")   # dtype rules only: nothing runs on it
    want = tl.float32 if exact else tl.bfloat16
    assert launch.state_dot_dtype(torch.bfloat16, cuda, ctx["exact_state_reads"]) == want
    assert launch.state_dot_dtype(torch.float16, cuda, ctx["exact_state_reads"]) == tl.float32
    assert ("every product reading a state or d-state" in emit(name, "chunk_bwd", params, None)) is exact
