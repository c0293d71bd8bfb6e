"""The state-algebra IR: derivations, checks, broken specs, a spec that is not
shipped, and the naive parallel form, against the independent oracles."""
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import hladsl
from hladsl.errors import AlgebraError, SpecError
from hladsl.frontend.specs import shipped_names
from hladsl.emit import check_report
from hladsl.ir.checks import serial_flops, verify
from hladsl.ir.combine import associativity_defect, serial
from hladsl.runtime.naive import naive_output

from oracles import oracle

ROOT = Path(__file__).resolve().parent.parent
BROKEN = sorted((ROOT / "tests" / "golden" / "broken").glob("*.hla"))


@pytest.mark.parametrize("name", shipped_names())
def test_shipped_specs_verify(name):
    verify(hladsl.compile_spec(name, normalize=True))


@pytest.mark.parametrize("path", BROKEN, ids=lambda p: p.stem)
def test_broken_spec_is_rejected_with_golden_message(path, monkeypatch):
    monkeypatch.chdir(ROOT)
    rel = path.relative_to(ROOT).as_posix()
    with pytest.raises(SpecError) as info:
        check_report(rel)
    assert str(info.value) + "\n" == path.with_suffix(".err").read_text()


def test_at_least_eight_broken_specs():
    assert len(BROKEN) >= 8


def test_broken_spec_via_cli_exits_1_without_traceback():
    path = BROKEN[0].relative_to(ROOT).as_posix()
    proc = subprocess.run([sys.executable, "-m", "hladsl", "check", path], cwd=ROOT,
                          capture_output=True, text=True)
    assert proc.returncode == 1
    assert "Traceback" not in proc.stderr and "decay weight 2" in proc.stderr


def test_paper_decayed_rule_is_rejected_because_of_grading():
    with pytest.raises(AlgebraError, match=r"has decay weight 2 .* but 'G' decays with weight 1"):
        check_report(str(BROKEN[0]))


def test_symbolic_defect_names_missing_terms():
    alg_text = (ROOT / "tests/golden/broken/02_hla3_missing_cross.hla").read_text()
    assert "G1" in alg_text
    with pytest.raises(AlgebraError, match="the combine of 'G1' is not associative"):
        check_report(str(ROOT / "tests/golden/broken/02_hla3_missing_cross.hla"))


def test_hla2_serial_update_is_quadratic_not_cubic():
    alg = hladsl.compile_spec("hla2", normalize=True)
    for d in (32, 64, 128):
        flops = sum(serial_flops(alg, {"d": d, "dv": d}).values())
        assert flops <= 8 * d * d, (d, flops)          # O(d^2 + d dv), far below d^3
    g = serial(alg, alg.summary("G")).text()
    assert "k_t[_0] k_t[i] C@prev[_0,e]" in g and "ρ_t^2 G@prev" in g


def test_erratum_exact_decayed_rule_in_combine():
    alg = hladsl.compile_spec("hla2")
    from hladsl.ir.combine import combine
    text = combine(alg, alg.summary("G")).text()
    assert text == "ρ_B^2 G@A[i,e] + G@B[i,e] + ρ_B S@B[i,j] C@A[j,e]"


def _rand(T, d, dv, seed, gated):
    gen = torch.Generator().manual_seed(seed)
    q, k = (torch.randn(T, d, generator=gen, dtype=torch.float64) for _ in range(2))
    v = torch.randn(T, dv, generator=gen, dtype=torch.float64)
    g = -0.4 * torch.rand(T, generator=gen, dtype=torch.float64) if gated else None
    return q, k, v, g


@pytest.mark.parametrize("name", shipped_names())
@pytest.mark.parametrize("gated", [False, True])
@pytest.mark.parametrize("normalize", [False, True])
def test_naive_parallel_form_matches_oracle(name, gated, normalize):
    alg = hladsl.compile_spec(name, normalize=normalize)
    q, k, v, g = _rand(19, 3, 4, 7, gated)
    ref = oracle(name, q, k, v, g, normalize=normalize)
    out = naive_output(alg, q, k, v, g)
    assert ((out - ref).norm() / ref.norm()).item() <= 1e-9


KEY_KEY = """
# A second-order variant that ships nowhere: o_t = sum_{i<=j<=t} (q_t.k_i)(k_i.k_j) v_j
# with a first-order key sum z that does not decay (weight 0).
mechanism keykey {
  dims d, dv
  input q[d], k[d], v[dv]
  param normalize = false, eps = 1e-6
  state S[i, j] = k[i] k[j]  symmetric(i, j)
  state P[i, e] = k[i] v[e]
  state z[i] = k[i]  decay 0
  state G[i, e] = 0  cross S@B[i, j] P@A[j, e]
  state y[i] = 0  cross S@B[i, j] z@A[j]  decay 1
  output o[e] = q[i] (S[i, j] P[j, e] - G[i, e])
  normalizer = q[i] (S[i, j] z[j] - y[i])
}
"""


def keykey_oracle(q, k, v, g, normalize):
    T = q.shape[0]
    lam = torch.zeros(T, dtype=torch.float64) if g is None else torch.cumsum(g, 0)
    out = torch.zeros(T, v.shape[1], dtype=torch.float64)
    den = torch.zeros(T, dtype=torch.float64)
    for t in range(T):
        for j in range(t + 1):
            for i in range(j + 1):
                w = (q[t] @ k[i]) * (k[i] @ k[j])
                out[t] += w * torch.exp(2 * lam[t] - lam[i] - lam[j]) * v[j]
                den[t] += w * torch.exp(lam[t] - lam[i])      # z does not decay
    return out / (den[:, None] + 1e-6) if normalize else out


@pytest.mark.parametrize("gated", [False, True])
@pytest.mark.parametrize("normalize", [False, True])
def test_unshipped_spec_goes_through_the_whole_pipeline(tmp_path, gated, normalize):
    path = tmp_path / "keykey.hla"
    path.write_text(KEY_KEY)
    assert "OK" in check_report(str(path))
    op = hladsl.load(str(path), normalize=normalize)
    op.chunk_size = 16
    q, k, v, g = _rand(40, 3, 2, 3, gated)
    ref = keykey_oracle(q, k, v, g, normalize)
    def batched(x):
        return None if x is None else x[None, :, None]
    o, _ = op(batched(q), batched(k), batched(v), g=batched(g), scale=1.0)
    assert ((o[0, :, 0] - ref).norm() / ref.norm()).item() <= 1e-9
    s, _ = op.serial(batched(q), batched(k), batched(v), g=batched(g), scale=1.0)
    assert ((s[0, :, 0] - ref).norm() / ref.norm()).item() <= 1e-9
    assert ((naive_output(op.algebra, q, k, v, g) - ref).norm() / ref.norm()).item() <= 1e-9


@pytest.mark.parametrize("name", shipped_names())
def test_no_associativity_defect(name):
    alg = hladsl.compile_spec(name, normalize=True)
    assert all(not associativity_defect(alg, x).terms for x in alg.summaries)


@pytest.mark.parametrize("emit", ["ir", "combine", "serial", "vjp", "chains", "chunk", "torch", "triton"])
def test_cli_emits(emit):
    proc = subprocess.run([sys.executable, "-m", "hladsl", "compile", "hla2", "--emit", emit],
                          cwd=ROOT, capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr
    assert "hla2" in proc.stdout


def test_hla2_chunk_program_is_design_three_terms():
    from hladsl.ir.pipeline import chunk_program
    prog = chunk_program(hladsl.compile_spec("hla2"), 64, (("d", 64), ("dv", 64)), True)
    sources = [t.source for t in prog.output]
    assert len(sources) == 3
    assert "carry only" in sources[0]                         # Q W_P
    assert "S@P" in sources[1] and "n0 <= t" in sources[1]    # ((Q S_P) Q^T ⊙ L) V
    assert "n0 <= n1, n1 <= t" in sources[2]                 # ((QK^T)((KQ^T)⊙U))⊙L) V
    assert prog.derived[0].poly.text() == "-G@P[_0,e] + C@P[_1,e] S@P[_0,_1]"


MIXED_DECAY = """
mechanism linear_mix0 {
  dims d, dv
  input q[d], k[d], v[dv]
  param normalize = false, eps = 1e-6, beta = 0.5
  state S[i, e] = k[i] v[e]
  state U[i, e] = k[i] v[e]  decay 0
  state z[i] = k[i]
  state u[i] = k[i]  decay 0
  output o[e] = q[i] (S[i, e] + beta U[i, e])
  normalizer = q[i] (z[i] + beta u[i])
}
"""


@pytest.mark.parametrize("normalize", [False, True])
def test_same_delta_different_decays(tmp_path, normalize):
    """The diagonal (n0 = t) terms of S and U coincide while their n0 < t terms
    differ: the merged diagonal is a local term, not a carry."""
    path = tmp_path / "mix.hla"
    path.write_text(MIXED_DECAY)
    op = hladsl.load(str(path), normalize=normalize)
    op.chunk_size = 16
    q, k, v, g = _rand(40, 3, 2, 5, True)
    lam = torch.cumsum(g, 0)
    keep = torch.tril(torch.ones(40, 40, dtype=torch.float64))
    w = (q @ k.T) * keep * (torch.exp(lam[:, None] - lam[None, :]) * keep + 0.5)
    ref = w @ v
    if normalize:
        ref = ref / (w.sum(1, keepdim=True) + 1e-6)
    def b(x):
        return x[None, :, None]
    o, _ = op(b(q), b(k), b(v), g=b(g), scale=1.0)
    assert ((o[0, :, 0] - ref).norm() / ref.norm()).item() <= 1e-9


# G reads C at segment A in one cross term and at B in another: C must be carried.
C_AT_BOTH_SIDES = """mechanism c_at_both_sides {
  dims d, dv
  input q[d], k[d], v[dv]
  state S[i, j] = k[i] k[j]  symmetric(i, j)
  state C[i, e] = q[i] v[e]
  state G[i, e] = 0  cross S@B[i, j] C@A[j, e] + S@A[i, j] C@B[j, e]
  output o[e] = q[i] G[i, e]
}
"""


def test_a_state_read_at_both_segments_streams(tmp_path):
    """Algebra.graph keeps every segment a summary's cross terms read another at: C, read at A
    by one of G's terms and at B by the other (the output reads only G), streams (it once kept
    the last side only, B, so C was combine-only and the chunk path raised KeyError). The float64
    chunk path matches the brute-force token sums."""
    path = tmp_path / "c_at_both_sides.hla"
    path.write_text(C_AT_BOTH_SIDES)
    alg = hladsl.compile_spec(str(path))
    assert alg.graph().succ["G"]["C"]["sides"] == {"A", "B"}
    assert [s.name for s in alg.streaming] == ["S", "C", "G"]
    gen = torch.Generator().manual_seed(1)
    q, k, v = (torch.randn(50, 4, generator=gen, dtype=torch.float64) for _ in range(3))
    g = -0.1 * torch.rand(50, generator=gen, dtype=torch.float64)
    o, _ = hladsl.load(str(path), backend="torch", chunk_size=16)(q[None, :, None], k[None, :, None],
                                                                 v[None, :, None], g=g[None, :, None], scale=1.0)
    want = naive_output(alg, q, k, v, g)
    assert ((o[0, :, 0] - want).norm() / want.norm()).item() < 1e-12
