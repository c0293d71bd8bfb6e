"""ir.carried: an algebra's derived carries with a recursion written as summaries of their own,
proved to give the same outputs; the op runs that form for calls with no state in or out where
launch.CARRY_DERIVED (the generated kernels under the interpreter, against the float64 oracle)."""
import contextlib
import io
from fractions import Fraction

import pytest
import torch

import hladsl
from hladsl.ir.carried import CarriedSummary, _check_same_output, carried_form
from hladsl.ir.expr import Factor, Monomial, Poly
from hladsl.runtime import launch
from hladsl.runtime import op as op_module
from oracles import oracle


def test_hla2_carries_w0_and_the_normalisers_w1_instead_of_g_and_h():
    carried, forms = carried_form(hladsl.compile_spec("hla2", normalize=True))
    assert [(c.name, c.dropped) for c in forms] == [("W0", "G"), ("W1", "h")]
    assert [s.name for s in carried.summaries] == ["S", "C", "m", "W0", "W1"]
    assert [s.name for s in carried.streaming] == ["S", "W0", "W1"]    # C, m: combine-only
    w0 = carried.summary("W0")
    assert w0.weight == 2 and w0.delta.text() == "k_t[_0] k_t[w0] q_t[_0] v_t[w1]"
    assert [m.text() for m in w0.crosses] == ["S@A[_0,w0] C@B[_0,w1]"]
    assert carried.output.text() == "q_t[_0] W0[_0,e]" and carried.normalizer.text() == "q_t[_0] W1[_0]"


@pytest.mark.parametrize("name, params", [("linear", {}), ("ahla", {}), ("power", {}),
                                          ("hla3_masked", {}), ("hla2", {"ridge": 0.5})])
def test_no_carried_form_without_a_recursion_that_drops_a_state(name, params):
    """AHLA's and HLA3-masked's outputs read a state directly (E, H); HLA2's ridge term q C sits
    beside S C - G at another decay weight, so that sum has no recursion."""
    assert carried_form(hladsl.compile_spec(name, **params)) is None


@pytest.mark.parametrize("gated", [False, True])
def test_hla3_carries_w0_through_product_summaries(gated):
    """HLA3's W0 = SK SQ P - G1 - G2 - G3: its increment reads two summaries of segment B in
    some terms (ρ_B SK(A) SQ(B) P(B)), which read combine-only products instead (Z0..Z2, each a
    summary of its own); only SK, SQ, P, W0 carried. The float64 torch path gives the oracle's
    output; its kernels generate (W0's update contracts SQ's symmetric group against a product of
    segment B's tokens, so SK and SQ stay unpacked, as HLA3 holds them as written: ir.symmetric),
    and it adds product summaries (launch.CARRY_PRODUCTS)."""
    from hladsl.ir.pipeline import algebra_compilation, program_for
    from hladsl.runtime.op import Op, carried_compilation, carried_kernels_error
    alg = hladsl.compile_spec("hla3")
    carried, forms = carried_form(alg)
    assert [(c.name, c.dropped) for c in forms] == [("W0", "G1")]
    assert [s.name for s in carried.streaming] == ["SK", "SQ", "P", "W0"]
    assert {"Z0", "Z1", "Z2"} <= {s.name for s in carried.summaries} and "G2" not in {s.name for s in carried.summaries}
    torch.manual_seed(5)
    T, d = 30, 4
    q, k, v = (torch.randn(T, d, dtype=torch.float64) for _ in range(3))
    g = -0.2 * torch.rand(T, dtype=torch.float64) if gated else None
    o, _ = Op(algebra_compilation(carried), "torch")(q[None, :, None], k[None, :, None], v[None, :, None],
                                                     g=None if g is None else g[None, :, None], scale=1.0)
    want = oracle("hla3", q, k, v, g)
    assert ((o[0, :, 0] - want).norm() / want.norm()).item() < 1e-12
    compilation, products = carried_compilation(alg)
    assert carried_kernels_error(compilation) is None and products == ("Z0", "Z1", "Z2")
    # ir.symmetric: SQ's group is consumed in W0's update, so neither it nor SK is held packed
    assert program_for(compilation, 64, (("d", 64), ("dv", 64)), True).packed == ()
    assert carried_compilation(hladsl.compile_spec("hla2"))[1] == ()


# A derived carry whose combine reads a state at both segments: W0 = S C - 2 G with G's cross
# S@B C@A gives W0(A⊕B) ∋ + ρ_B S@A C@B - ρ_B C@A S@B, so C, read at A, must be carried.
C_READ_AT_BOTH = """mechanism c_read_at_both {
  dims d, dv
  input q[d], k[d], v[dv]
  state S[i, j] = k[i] k[j]  symmetric(i, j)
  state C[i, e] = q[i] v[e]
  state G[i, e] = 0  cross S@B[i, j] C@A[j, e]
  output o[e] = q[i] (S[i, j] C[j, e] - 2 G[i, e])
}
"""


@pytest.mark.parametrize("gated", [False, True])
def test_a_state_read_at_both_segments_is_carried(carrying, gated, tmp_path):
    """Algebra.graph keeps every segment a summary is read at (it once kept the last, so C read
    at A and at B counted as B only: combine-only, and the kernels' generation raised KeyError).
    The carried form carries C; a stateless call of its kernels (backend="triton", float32)
    matches the spec as written on the float64 torch path to 1e-4, output and gradients."""
    path = tmp_path / "c_read_at_both.hla"
    path.write_text(C_READ_AT_BOTH)
    alg = hladsl.compile_spec(str(path))
    assert alg.graph().succ["G"]["C"]["sides"] == {"A"}
    carried, forms = carried_form(alg)
    assert carried.graph().succ["W0"]["C"]["sides"] == {"A", "B"}
    assert [s.name for s in carried.streaming] == ["S", "C", "W0"]
    torch.manual_seed(2)
    T, d = 80, 8
    base = [torch.randn(1, T, 1, d, dtype=torch.float64) for _ in range(3)] + [
        -0.2 * torch.rand(1, T, 1, dtype=torch.float64)]
    xs = [x.float().requires_grad_() for x in base]
    o, _ = hladsl.load(str(path), backend="triton")(*xs[:3], g=xs[3] if gated else None, scale=1.0)
    assert carrying == ["c_read_at_both_carried"]
    refs = [x.clone().requires_grad_() for x in base]
    ref, _ = hladsl.load(str(path), backend="torch")(*refs[:3], g=refs[3] if gated else None, scale=1.0)
    assert carrying[-1] == "c_read_at_both"
    cot = torch.randn_like(ref)
    o.backward(cot.float())
    ref.backward(cot)
    pairs = [("o", o.detach(), ref.detach())] + [
        (n, x.grad, r.grad) for n, x, r in zip(("dq", "dk", "dv", "dg"), xs, refs) if gated or n != "dg"]
    for what, got, want in pairs:
        err = ((got.double() - want).norm() / want.norm()).item()
        assert err < 1e-4, f"{what}: {err:.2e}"


def test_a_wrong_rewrite_is_caught():
    before = hladsl.compile_spec("hla2").output
    w = Poly(("a", "e"), (Monomial(Fraction(1), (Factor("state", "C", "", ("a", "e")),)),))   # not S C - G
    after = Poly(before.free, (Monomial(Fraction(1), (Factor("input", "q", "t", ("a",)),
                                                      Factor("state", "W0", "", ("a", "e")))),))
    with pytest.raises(AssertionError, match="changes the output"):
        _check_same_output(before, after, (CarriedSummary("W0", w, "G"),))


def test_emit_carried():
    from hladsl.cli import main
    out = io.StringIO()
    with contextlib.redirect_stdout(out), launch.switched(CARRY_DERIVED=True):
        main(["compile", "hla2", "--emit", "carried"])
    text = out.getvalue()
    assert "W0[w0,w1] = C[_1,w1] S[w0,_1] - G[w0,w1]   (replaces G)" in text
    assert "W0(A⊕B) = ρ_B^2 W0@A[w0,w1] + W0@B[w0,w1] + ρ_B S@A[_0,w0] C@B[_0,w1]" in text
    assert text.endswith("kernels: generated (launch.CARRY_DERIVED=on): calls with no state in or out run them\n")
    for derived, products in ((True, True), (True, False), (False, True)):
        runs = "calls with no state in or out run them" if derived and products else "calls run the spec as written"
        out = io.StringIO()
        with contextlib.redirect_stdout(out), launch.switched(CARRY_DERIVED=derived, CARRY_PRODUCTS=products):
            main(["compile", "hla3", "--emit", "carried"])
        on = {True: "on", False: "off"}
        assert out.getvalue().endswith(f"kernels: generated; with product summaries (Z0, Z1, Z2) (launch.CARRY_DERIVED="
                                       f"{on[derived]}, launch.CARRY_PRODUCTS={on[products]}): {runs}\n")


@pytest.fixture
def carrying(monkeypatch):
    """CARRY_DERIVED on, and the algebra each Op._forward ran recorded."""
    ran = []
    forward = op_module.Op._forward

    def recorded(self, *args, **kwargs):
        ran.append(self.algebra.name)
        return forward(self, *args, **kwargs)
    monkeypatch.setattr(op_module.Op, "_forward", recorded)
    with launch.switched(CARRY_DERIVED=True):
        yield ran


@pytest.mark.parametrize("normalize", [False, True])
@pytest.mark.parametrize("gated", [False, True])
def test_stateless_calls_run_the_carried_form(carrying, gated, normalize):
    """hla2 with backend="triton" (the interpreter): a call with no state in or out runs the
    carried form's kernels, forward and backward: the oracle's output and gradients (q, k, v,
    log gates) to 1e-4 (float32 against float64)."""
    check_stateless_call("hla2", gated, normalize, carrying, "hla2_carried")


@pytest.mark.parametrize("gated", [False, True])
def test_hla3_runs_its_carried_form_where_products_are_on(carrying, gated):
    """The same for hla3, whose carried form adds product summaries: with launch.CARRY_PRODUCTS
    (on) its carried kernels (SK, SQ, P, W0 carried; Z0..Z2 combine-only); off, as written."""
    check_stateless_call("hla3", gated, False, carrying, "hla3_carried")
    carrying.clear()
    with launch.switched(CARRY_PRODUCTS=False):
        check_stateless_call("hla3", gated, False, carrying, "hla3")


def check_stateless_call(name: str, gated: bool, normalize: bool, carrying: list, runs: str):
    """A call of spec ``name`` with no state in or out, backend="triton", runs the algebra
    ``runs``; its output and gradients match the oracle to 1e-4 (float32 against float64)."""
    torch.manual_seed(3)
    T, d = 80, 8     # two chunks of 64 (the interpreter's): the carried W0 is read
    base = [torch.randn(T, d, dtype=torch.float64) for _ in range(3)]
    base = [x.abs() if normalize else x for x in base] + [-0.2 * torch.rand(T, dtype=torch.float64)]   # den off 0
    op = hladsl.load(name, backend="triton", normalize=normalize)
    xs = [x.float().requires_grad_() for x in base]
    o, final = op(*(x[None, :, None] for x in xs[:3]), g=xs[3][None, :, None] if gated else None, scale=1.0)
    assert final is None and carrying == [runs]
    cot = torch.randn(T, d, dtype=torch.float64)
    o[0, :, 0].backward(cot.float())
    refs = [x.clone().requires_grad_() for x in base]
    ref = oracle(name, *refs[:3], refs[3] if gated else None, normalize=normalize)
    ref.backward(cot)
    pairs = [("o", o[0, :, 0].detach(), ref.detach())] + [
        (n, x.grad, r.grad) for n, x, r in zip(("dq", "dk", "dv", "dg"), xs, refs) if gated or n != "dg"]
    for what, got, want in pairs:
        err = ((got.double() - want).norm() / want.norm()).item()
        assert err < 1e-4, f"{name} {what}: {err:.2e}"


def test_calls_with_a_state_run_as_written(carrying):
    """An initial state or a final state asked for: the spec's own summaries (S, C, m, G, h),
    so the algebra as written runs; without either, the carried form (bound once, replayed)."""
    op = hladsl.load("hla2", backend="triton", normalize=True)
    q, k, v = (torch.randn(1, 40, 2, 8) for _ in range(3))
    with torch.no_grad():
        _, final = op(q, k, v, output_final_state=True)
        assert set(final) == {"S", "C", "m", "G", "h"} and carrying == ["hla2"]
        op(q, k, v, initial_state=final)
        assert carrying == ["hla2", "hla2"]
        plain, _ = op(q, k, v)
        again, _ = op(q, k, v)
    assert carrying[2] == "hla2_carried" and torch.equal(plain, again)
    launch.switch("CARRY_DERIVED", False)
    with torch.no_grad():
        written, _ = op(q, k, v)
    assert carrying[-1] == "hla2" and torch.allclose(written, plain, rtol=1e-4, atol=1e-4 * plain.abs().max().item())


def test_the_carried_form_compiles_under_no_grad():
    """The op builds its carried form at its first such call, which may run under torch.no_grad()
    (inference, the benchmark's forward): the check pass's combine-VJP test runs autograd anyway."""
    from hladsl.ir.checks import check_vjp
    from hladsl.ir.pipeline import algebra_compilation
    carried, _ = carried_form(hladsl.compile_spec("hla2", normalize=True))
    with torch.no_grad():
        assert check_vjp(carried) < 1e-10
        assert algebra_compilation(carried).check   # every check of the pass, reported


def test_compiled_calls_take_the_carried_form(carrying):
    """An op made while CARRY_DERIVED is on derives its carried form then, so torch.compile
    (fullgraph) finds it: the compiled call runs it, with eager's values and gradients."""
    op = hladsl.load("hla2", backend="triton", normalize=True, chunk_size=64)   # made now: the switch is on
    assert op._carried
    gen = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(1, 80, 2, 8, generator=gen).abs().requires_grad_() for _ in range(3))
    g = (-0.2 * torch.rand(1, 80, 2, generator=gen)).requires_grad_()

    def f(q, k, v, g):
        return op(q, k, v, g=g)[0]
    got = torch.compile(f, fullgraph=True, backend="aot_eager")(q, k, v, g)
    assert set(carrying) == {"hla2_carried"}
    want = f(q, k, v, g)
    torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-6)
    for a, b in zip(torch.autograd.grad(got.square().sum(), [q, k, v, g]),
                    torch.autograd.grad(want.square().sum(), [q, k, v, g])):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)


def test_a_failing_derivation_warns_and_runs_as_written(carrying, monkeypatch):
    """The carried form is an optimisation: where deriving it raises, making the op warns with
    the reason and its calls run the spec as written; the torch backend derives nothing."""
    def broken(alg):
        raise AssertionError("the rewrite changes the output")
    monkeypatch.setattr(op_module, "carried_compilation", broken)
    from hladsl.api import compile_spec
    compilation = compile_spec("hla2")
    with pytest.warns(UserWarning, match="could not be derived .the rewrite changes the output"):
        op = op_module.Op(compilation, "triton")
    with torch.no_grad():
        op(*(torch.randn(1, 40, 2, 8) for _ in range(3)))
    assert carrying == ["hla2"]
    assert op_module.Op(compilation, "torch")._carried is None
