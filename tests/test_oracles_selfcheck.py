"""Sanity checks of the brute-force oracles in tests/oracles.py (float64)."""
import math

import pytest
import torch

try:
    from oracles import NAMES, hla3_algorithm3, oracle
except ImportError:  # tests/ collected as a package
    from tests.oracles import NAMES, hla3_algorithm3, oracle

TS = [1, 5, 17]
D, DV = 3, 4


def rel(a, b):
    return ((a - b).norm() / b.norm().clamp_min(1e-300)).item()


def inputs(T, seed=0):
    torch.manual_seed(seed + 1000 * T)
    q = torch.randn(T, D, dtype=torch.float64)
    k = torch.randn(T, D, dtype=torch.float64)
    v = torch.randn(T, DV, dtype=torch.float64)
    g = torch.log(torch.empty(T, dtype=torch.float64).uniform_(0.6, 1.0))
    return q, k, v, g


def dense_parts(q, k, g):
    """A = Q K^T, L causal (incl. diagonal), D[t,s] = exp(Lam_t - Lam_s) on L, 0 above."""
    T = q.shape[0]
    L = torch.ones(T, T, dtype=torch.float64).tril()
    lam = torch.zeros(T, dtype=torch.float64) if g is None else torch.cumsum(g, 0)
    diff = (lam[:, None] - lam[None, :]).masked_fill(L == 0, -math.inf)
    return q @ k.T, L, torch.exp(diff)


# ---------------------------------------------------------------- hla3 ----

@pytest.mark.parametrize("T", TS)
@pytest.mark.parametrize("normalize", [False, True])
def test_hla3_matches_paper_algorithm3(T, normalize):
    q, k, v, _ = inputs(T)
    ref = hla3_algorithm3(q, k, v, normalize=normalize, eps=1e-6)
    assert rel(oracle("hla3", q, k, v, normalize=normalize, eps=1e-6), ref) < 1e-12


def test_hla3_differs_from_natural_masked_form():
    q, k, v, _ = inputs(17)
    assert rel(oracle("hla3", q, k, v), oracle("hla3_masked", q, k, v)) > 1e-2


@pytest.mark.parametrize("T", TS)
@pytest.mark.parametrize("gated", [False, True])
def test_hla3_masked_dense(T, gated):
    # with decay: exp(3Lt - Li - Lu - Lj) = D[t,i] * D[u,j] * D[t,u]^2
    q, k, v, g = inputs(T)
    g = g if gated else None
    A, L, Dm = dense_parts(q, k, g)
    dense = ((((L * A * Dm) @ (L * A).T) * L * Dm**2) @ (L * A * Dm)) @ v
    assert rel(oracle("hla3_masked", q, k, v, g), dense) < 1e-12


@pytest.mark.parametrize("T", TS)
def test_hla3_decayed_graded_serial(T):
    """Algorithm 3 with the exact graded decay (S, P weight 1; G weight 3):
    G <- gamma^3 G + gamma^2 (cross term)."""
    q, k, v, g = inputs(T)
    d, dv = D, DV
    SK, SQ, P = torch.zeros(d, d).double(), torch.zeros(d, d).double(), torch.zeros(d, dv).double()
    F = torch.zeros(d, dv).double()  # G1 + G2 + G3
    o = torch.zeros(T, dv).double()
    for t in range(T):
        r = torch.exp(g[t])
        qt, kt, vt = q[t], k[t], v[t]
        cross = (torch.outer(kt, (SQ @ kt) @ P) + torch.outer(SK @ qt, qt @ P)
                 + torch.outer(SK @ (SQ @ kt), vt))
        F = r**3 * F + r**2 * cross
        SK = r * SK + torch.outer(kt, kt)
        SQ = r * SQ + torch.outer(qt, qt)
        P = r * P + torch.outer(kt, vt)
        o[t] = qt @ (SK @ SQ @ P - F)
    assert rel(oracle("hla3", q, k, v, g), o) < 1e-12


# ---------------------------------------------------------- hla2 / ahla ----

@pytest.mark.parametrize("T", TS)
@pytest.mark.parametrize("gated", [False, True])
def test_hla2_dense(T, gated):
    q, k, v, g = inputs(T)
    g = g if gated else None
    A, L, Dm = dense_parts(q, k, g)
    dense = ((((L * A * Dm) @ (L * A).T) * L * Dm) @ v)
    assert rel(oracle("hla2", q, k, v, g), dense) < 1e-12


@pytest.mark.parametrize("T", TS)
@pytest.mark.parametrize("gated", [False, True])
def test_ahla_dense(T, gated):
    q, k, v, g = inputs(T)
    g = g if gated else None
    A, L, Dm = dense_parts(q, k, g)
    dense = ((L * A * Dm) @ (L * A * Dm)) @ v
    assert rel(oracle("ahla", q, k, v, g), dense) < 1e-12


@pytest.mark.parametrize("T", TS)
def test_ahla_paper_algorithm2(T):
    q, k, v, g = inputs(T)
    P, E = torch.zeros(D, DV).double(), torch.zeros(D, DV).double()
    o = torch.zeros(T, DV).double()
    for t in range(T):
        r = torch.exp(g[t])
        P = r * P + torch.outer(k[t], v[t])
        E = r * E + torch.outer(k[t], q[t] @ P)
        o[t] = q[t] @ E
    assert rel(oracle("ahla", q, k, v, g), o) < 1e-12


def hla2_serial(q, k, v, g, *, exact, ridge=0.0, normalize=False, eps=1e-6):
    """HLA2 serial loop. exact: G = r^2 G + r k k^T C_prev (DESIGN §4.1);
    else the paper's printed rule G = r G + k k^T C_prev. Same for h."""
    T, d = q.shape
    S, C, G = torch.zeros(d, d).double(), torch.zeros(d, DV).double(), torch.zeros(d, DV).double()
    m, h = torch.zeros(d).double(), torch.zeros(d).double()
    o = torch.zeros(T, DV).double()
    for t in range(T):
        r = torch.exp(g[t])
        qt, kt = q[t], k[t]
        if exact:
            G = r**2 * G + r * torch.outer(kt, kt @ C)
            h = r**2 * h + r * kt * (kt @ m)
        else:
            G = r * G + torch.outer(kt, kt @ C)
            h = r * h + kt * (kt @ m)
        S = r * S + torch.outer(kt, kt)
        C = r * C + torch.outer(qt, v[t])
        m = r * m + qt
        Seff = S + ridge * torch.eye(d).double()
        o[t] = qt @ (Seff @ C - G)
        if normalize:
            o[t] = o[t] / (qt @ (Seff @ m - h) + eps)
    return o


@pytest.mark.parametrize("T", TS)
@pytest.mark.parametrize("const", [True, False])
@pytest.mark.parametrize("ridge,normalize", [(0.0, False), (0.0, True), (0.3, False), (0.3, True)])
def test_hla2_exact_decayed_serial(T, const, ridge, normalize):
    q, k, v, g = inputs(T)
    if const:
        g = torch.full((T,), math.log(0.8), dtype=torch.float64)
    ref = hla2_serial(q, k, v, g, exact=True, ridge=ridge, normalize=normalize)
    out = oracle("hla2", q, k, v, g, ridge=ridge, normalize=normalize)
    assert rel(out, ref) < 1e-12


def test_hla2_paper_decay_rule_is_wrong():
    """HLA §4.3 prints G_t = gamma G_{t-1} + k k^T C_{t-1}: does not match (erratum 4.1)."""
    T = 17
    q, k, v, _ = inputs(T)
    g = torch.full((T,), math.log(0.8), dtype=torch.float64)
    ref = oracle("hla2", q, k, v, g)
    assert rel(hla2_serial(q, k, v, g, exact=True), ref) < 1e-12
    assert rel(hla2_serial(q, k, v, g, exact=False), ref) > 0.1


# ------------------------------------------------------- linear / power ----

@pytest.mark.parametrize("T", TS)
@pytest.mark.parametrize("gated", [False, True])
def test_power_p1_is_linear(T, gated):
    q, k, v, g = inputs(T)
    g = g if gated else None
    assert rel(oracle("power", q, k, v, g, p=1), oracle("linear", q, k, v, g)) < 1e-12


@pytest.mark.parametrize("T", TS)
@pytest.mark.parametrize("p", [2, 3, 4])
def test_power_dense(T, p):
    q, k, v, g = inputs(T)
    A, L, Dm = dense_parts(q, k, g)
    assert rel(oracle("power", q, k, v, g, p=p), (L * A**p * Dm) @ v) < 1e-12


@pytest.mark.parametrize("T", TS)
def test_linear_constant_gate_recurrence(T):
    q, k, v, _ = inputs(T)
    gamma = 0.9
    g = torch.full((T,), math.log(gamma), dtype=torch.float64)
    S = torch.zeros(D, DV).double()
    o = torch.zeros(T, DV).double()
    for t in range(T):
        S = gamma * S + torch.outer(k[t], v[t])
        o[t] = q[t] @ S
    assert rel(oracle("linear", q, k, v, g), o) < 1e-12


# ----------------------------------------------------------- normalize ----

@pytest.mark.parametrize("T", TS)
@pytest.mark.parametrize("name", NAMES)
def test_normalize_divides_by_den(T, name):
    q, k, v, g = inputs(T)
    eps = 1e-3
    num = oracle(name, q, k, v, g)
    den = oracle(name, q, k, torch.ones(T, 1, dtype=torch.float64), g)
    out = oracle(name, q, k, v, g, normalize=True, eps=eps)
    assert out.shape == (T, DV) and out.dtype == torch.float64
    assert rel(out, num / (den + eps)) < 1e-12


def test_linear_den_explicit():
    T = 5
    q, k, v, g = inputs(T)
    lam = torch.cumsum(g, 0)
    den = torch.stack([sum((q[t] @ k[j]) * torch.exp(lam[t] - lam[j]) for j in range(t + 1))
                       for t in range(T)])
    num = oracle("linear", q, k, v, g)
    out = oracle("linear", q, k, v, g, normalize=True, eps=1e-6)
    assert rel(out, num / (den[:, None] + 1e-6)) < 1e-12


def test_bad_arguments():
    q, k, v, _ = inputs(5)
    with pytest.raises(ValueError):
        oracle("nope", q, k, v)
    with pytest.raises(ValueError):
        oracle("power", q, k, v, p=5)
    with pytest.raises(ValueError):
        oracle("linear", q, k, v, ridge=0.1)
