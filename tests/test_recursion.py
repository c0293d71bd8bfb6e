"""ir.recursion: a derived carry's own recursion over chunks, derived from the combine and
proved symbolically (the codegen's use of it: tests/test_chunk_scan.py)."""
from dataclasses import replace
from fractions import Fraction
from pathlib import Path

import pytest
import torch

import hladsl
from hladsl.ir.pipeline import chunk_program
from hladsl.ir.recursion import check, recursion

# HLA2's first two summaries: the opening of the test specs built on them (and tests/test_chunk_scan.py's)
S_AND_C = """
  dims d, dv
  input q[d], k[d], v[dv]
  state S[i, j] = k[i] k[j]  symmetric(i, j)
  state C[i, e] = q[i] v[e]
"""
CUBIC = "mechanism cubic {" + S_AND_C + """  output o[e] = q[i] S[i, j] S[j, l] C[l, e]
}
"""


def _derived(spec, **params):
    alg = hladsl.compile_spec(spec, **params)
    program = chunk_program(alg, 16, tuple((x, 8) for x in alg.dims), True)
    return alg, {d.name: d.poly for d in program.derived}


def test_hla2_carries_w0_by_one_product_a_chunk_and_drops_g():
    alg, derived = _derived("hla2", normalize=True)
    w0 = recursion(alg, "W0", derived["W0"], set())
    assert w0.weight == 2 and w0.dropped == "G" and w0.dropped_coef == -1
    assert w0.terms.text() == "C@B[_0,w1] S@N[_0,w0] - G@B[w0,w1]"
    assert w0.rest.text() == "C@P[_1,w1] S@P[w0,_1]"
    wn0 = recursion(alg, "Wn0", derived["Wn0"], set())
    assert (wn0.dropped, wn0.terms.text()) == ("h", "S@N[_0,w0] m@B[_0] - h@B[w0]")
    # a state something else reads stays carried
    assert recursion(alg, "W0", derived["W0"], {"G"}).dropped == ""


def test_the_proof_rejects_a_wrong_recursion():
    alg, derived = _derived("hla2")
    good = recursion(alg, "W0", derived["W0"], set())
    check(alg, derived["W0"], good)
    for bad in (replace(good, weight=1),
                replace(good, terms=type(good.terms)(good.free, good.terms.terms[:1])),
                replace(good, terms=good.terms.map_terms(lambda m: m.scaled(Fraction(2))))):
        with pytest.raises(AssertionError, match="the recursion of W0 is wrong"):
            check(alg, derived["W0"], bad)


def test_the_recursion_prints_in_the_derived_carrys_own_indices():
    alg, derived = _derived("hla2")
    text = recursion(alg, "W0", derived["W0"], set()).text(derived["W0"].free)
    assert text == ("W0(A⊕B) = ρ_B^2 W0(A) + C@B[s0,w1] S@N[s0,w0] - G@B[w0,w1]   (w0 = _0, w1 = e)"
                    "   (G not carried: recovered from W0 at the end)")
    alg, derived = _derived("hla3")
    assert " W0(A) - G1@B" in recursion(alg, "W0", derived["W0"], set()).text()   # (not "+ -")


def test_no_recursion_where_a_term_reads_two_carried_states(tmp_path):
    """W = S S C: W(A⊕B) holds S@A S@A C@B, which no single product of carried states and
    a delta gives. HLA3's W0 has one (every term one carried state), which the codegen never
    meets: HLA3's scan runs in two stages, without derived starts, and its terms read 4-index
    combine-only states (X1@B, Y3@B, ...) that have no delta buffers."""
    path = tmp_path / "cubic.hla"
    path.write_text(CUBIC)
    alg, derived = _derived(str(path))
    assert recursion(alg, "W0", derived["W0"], set()) is None
    alg, derived = _derived("hla3")
    rec = recursion(alg, "W0", derived["W0"], set())
    assert rec.dropped == "G1"
    # its deltas of combine-only states (X1@B, ...) are no chunk terms: none (once a KeyError)
    from hladsl.ir.recursion import chunk_terms
    assert chunk_terms(chunk_program(alg, 16, tuple((x, 8) for x in alg.dims), True), rec) is None


def test_the_increment_as_chunk_terms():
    """``chunk_terms``: HLA2's W0(A⊕B) - ρ² W0(A) as terms of one chunk for the two-stage scan's
    stage_kernel -- S at the chunk's end (a carried operand anchored at the end, oriented as W0's
    definition reads S: free index first) times C's own chunk term (q v, decayed to the end),
    minus G's -- and ``--emit chunk`` names both scans that take the recursion."""
    from hladsl.cli import main
    from hladsl.ir.recursion import chunk_terms
    alg = hladsl.compile_spec("hla2")
    program = chunk_program(alg, 16, (("d", 8), ("dv", 8)), True)
    (w0,) = program.derived
    terms = chunk_terms(program, recursion(alg, "W0", w0.poly, set()))
    assert [t.coef for t in terms] == [1.0, -1.0] and all(t.output == ("w0", "w1") for t in terms)
    carried = [o for o in terms[0].operands if o.kind == "carry"]
    assert [(o.name, o.indices, o.anchor) for o in carried] == [("S", ("w0", "_0"), "end")]
    assert sorted(o.name for o in terms[0].operands if o.kind == "token") == ["q", "v"]
    assert not any(o.kind == "carry" for o in terms[1].operands)   # G's own chunk term: tokens only
    assert sorted(o.name for o in terms[1].operands if o.kind == "token") == ["k", "k", "q", "v"]
    import contextlib
    import io
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        main(["compile", "hla2", "--emit", "chunk"])
    assert ("the one-stage and two-stage forward scans carry it by its own recursion (ir.recursion): "
            "W0(A⊕B) = ρ_B^2 W0(A)") in out.getvalue()


W_FORM = Path(__file__).resolve().parents[1] / "benchmarks" / "exp" / "hla2w.hla"


@pytest.mark.parametrize("normalize", [False, True])
@pytest.mark.parametrize("gated", [False, True])
def test_hla2_with_its_derived_carry_as_a_state(gated, normalize):
    """HLA2 written with its derived carry W0 = S C - G as a state, whose combine is the recursion
    ``recursion`` derives (W(A⊕B) = ρ_B² W(A) + W(B) + ρ_B S(A) C(B); the normaliser's h likewise):
    the oracle's outputs and gradients of q, k, v and the log gates, from the float64 torch path
    (1e-9) and from the generated kernels under the interpreter (float32, 1e-4). Its kernels carry
    no cancelling state: fwd + bwd 2x faster than hla2's (benchmarks/RESULTS.md, round 33), the
    form a derived-carry rewrite of a spec would run."""
    from oracles import oracle
    torch.manual_seed(7)
    T, d = 40, 8
    base = [torch.randn(T, d, dtype=torch.float64) for _ in range(3)]
    base = [x.abs() if normalize else x for x in base] + [-0.2 * torch.rand(T, dtype=torch.float64)]   # den off 0

    def grads(fn, dtype):
        xs = [x.detach().to(dtype).clone().requires_grad_() for x in base]
        o = fn(*xs).double()
        torch.autograd.backward(o, torch.ones_like(o) + torch.arange(o.numel(), dtype=o.dtype).view_as(o) / o.numel())
        return [o.detach()] + [x.grad.double() for x in (xs if gated else xs[:3])]

    def reference(q, k, v, g):
        return oracle("hla2", q, k, v, g if gated else None, normalize=normalize)
    expected = grads(reference, torch.float64)
    for backend, dtype, tol in (("torch", torch.float64, 1e-9), ("triton", torch.float32, 1e-4)):
        op = hladsl.load(str(W_FORM), backend=backend, normalize=normalize)

        def run(q, k, v, g):
            out = op(q[None, :, None], k[None, :, None], v[None, :, None], g=g[None, :, None] if gated else None,
                     scale=1.0)
            return (out[0] if isinstance(out, tuple) else out)[0, :, 0]
        for name, got, want in zip(("o", "dq", "dk", "dv", "dg"), grads(run, dtype), expected):
            err = ((got - want).norm() / want.norm()).item()
            assert err < tol, f"{backend} {name}: {err:.2e}"
