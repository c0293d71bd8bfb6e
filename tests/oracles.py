"""Brute-force float64 reference oracles for the shipped hladsl mechanisms.

Written directly from DESIGN.md §3 as explicit masked sums over token indices,
independently of any compiler code (imports only torch, math, itertools).

Conventions (single head, 0-based token indices):
    q, k: [T, d], v: [T, dv], g: None or [T] log gates (<= 0)
    A[t, s] = q_t . k_s,   Lam_t = sum_{s <= t} g_s   (inclusive cumulative sum)
    e(t, s) = exp(Lam_t - Lam_s)   (the decay of a weight-1 factor from time s to t)
All sums run over token indices <= t. With ``normalize`` the output is
num / (den + eps), den being the same sum with v replaced by the all-ones vector
of length 1 (one scalar per t).

Paper errata (DESIGN §4) are *not* copied: decay follows the graded algebra
(e.g. hla2 weight exp(2 Lam_t - Lam_i - Lam_j)), and ``hla3`` is the tied-max
set that the paper's Algorithm 3 actually computes, not Theorem 7.1's claim.
"""
import math

import torch

NAMES = ("linear", "hla2", "ahla", "hla3", "hla3_masked", "power")


def _log_cumsum(g, T):
    """Lam_t = sum_{s<=t} g_s, or zeros when g is None (no decay)."""
    if g is None:
        return torch.zeros(T, dtype=torch.float64)
    g = torch.as_tensor(g, dtype=torch.float64).reshape(-1)
    if g.shape[0] != T:
        raise ValueError(f"g must have shape [T]={T}, got {tuple(g.shape)}")
    return torch.cumsum(g, 0)


def _dec(lam, t):
    """[t+1] vector e(t, s) = exp(Lam_t - Lam_s) for s = 0..t."""
    return torch.exp(lam[t] - lam[: t + 1])


# --------------------------------------------------------------------------
# numerators (v may be [T, 1] of ones, which gives the denominator)
# --------------------------------------------------------------------------

def _linear(q, k, v, lam, **_):
    """linear: o_t = sum_{j<=t} A[t,j] v_j e(t,j).  Dense masked matrix form."""
    T = q.shape[0]
    t_idx = torch.arange(T)
    causal = t_idx[:, None] >= t_idx[None, :]                       # L[t, j] = j <= t
    diff = (lam[:, None] - lam[None, :]).masked_fill(~causal, -math.inf)
    W = (q @ k.T) * torch.exp(diff)                                  # zero above diagonal
    return W @ v


def _power(q, k, v, lam, p=2, **_):
    """power: o_t = sum_{j<=t} A[t,j]^p v_j e(t,j).  Per-t loop."""
    T, dv = q.shape[0], v.shape[1]
    o = torch.zeros(T, dv, dtype=torch.float64)
    for t in range(T):
        s = t + 1
        w = (k[:s] @ q[t]) ** p * _dec(lam, t)                       # [j]
        o[t] = w @ v[:s]
    return o


def _hla2(q, k, v, lam, ridge=0.0, **_):
    """hla2: o_t = sum_{i<=j<=t} A[t,i] (k_i.q_j) v_j exp(2 Lam_t - Lam_i - Lam_j)
              + ridge * sum_{j<=t} (q_t.q_j) v_j e(t,j)."""
    T, dv = q.shape[0], v.shape[1]
    o = torch.zeros(T, dv, dtype=torch.float64)
    for t in range(T):
        s = t + 1
        e = _dec(lam, t)
        a = (k[:s] @ q[t]) * e                                       # [i]: A[t,i] e(t,i)
        B = k[:s] @ q[:s].T                                          # [i,j]: k_i . q_j
        mask = torch.ones(s, s, dtype=torch.bool).triu()             # i <= j
        c = (a[:, None] * B * mask).sum(0) * e                       # [j]
        if ridge:
            c = c + ridge * (q[:s] @ q[t]) * e
        o[t] = c @ v[:s]
    return o


def _ahla(q, k, v, lam, **_):
    """ahla: o_t = sum_{j<=i<=t} A[t,i] A[i,j] v_j e(t,j)   (i does not decay)."""
    T, dv = q.shape[0], v.shape[1]
    o = torch.zeros(T, dv, dtype=torch.float64)
    for t in range(T):
        s = t + 1
        a = k[:s] @ q[t]                                             # [i]: A[t,i]
        B = q[:s] @ k[:s].T                                          # [i,j]: A[i,j]
        mask = torch.ones(s, s, dtype=torch.bool).tril()             # j <= i
        c = (a[:, None] * B * mask).sum(0) * _dec(lam, t)            # [j]
        o[t] = c @ v[:s]
    return o


def _triple(q, k, v, lam, mask_fn):
    """o_t = sum_{(i,u,j) in mask_fn(t)} (q_t.k_i)(k_i.q_u)(q_u.k_j) v_j
             * exp(3 Lam_t - Lam_i - Lam_u - Lam_j),  i, u, j <= t."""
    T, dv = q.shape[0], v.shape[1]
    o = torch.zeros(T, dv, dtype=torch.float64)
    for t in range(T):
        s = t + 1
        e = _dec(lam, t)
        a = (k[:s] @ q[t]) * e                                       # [i]
        B = (k[:s] @ q[:s].T) * e[None, :]                           # [i,u]: k_i.q_u e(t,u)
        C = (q[:s] @ k[:s].T) * e[None, :]                           # [u,j]: q_u.k_j e(t,j)
        W = a[:, None, None] * B[:, :, None] * C[None, :, :]         # [i,u,j]
        c = (W * mask_fn(s)).sum((0, 1))                             # [j]
        o[t] = c @ v[:s]
    return o


def _tied_max_mask(s):
    """[i,u,j] in [0,s)^3 whose largest index occurs at least twice."""
    r = torch.arange(s)
    i, u, j = r[:, None, None], r[None, :, None], r[None, None, :]
    mx = torch.maximum(torch.maximum(i, u), j)
    count = (i == mx).long() + (u == mx).long() + (j == mx).long()
    return count >= 2


def _natural_mask(s):
    """[i,u,j] in [0,s)^3 with i <= u and j <= u."""
    r = torch.arange(s)
    i, u, j = r[:, None, None], r[None, :, None], r[None, None, :]
    return (i <= u) & (j <= u)


def _hla3(q, k, v, lam, **_):
    """hla3 (paper Algorithm 3, tied max): o_t = sum over (i,u,j) <= t whose largest
    index occurs at least twice of (q_t.k_i)(k_i.q_u)(q_u.k_j) v_j
    exp(3 Lam_t - Lam_i - Lam_u - Lam_j)."""
    return _triple(q, k, v, lam, _tied_max_mask)


def _hla3_masked(q, k, v, lam, **_):
    """hla3_masked: o_t = sum_{u<=t} sum_{i<=u} sum_{j<=u} (q_t.k_i)(q_u.k_i)(q_u.k_j) v_j
    exp(3 Lam_t - Lam_i - Lam_u - Lam_j)  ( = ((L.A)(L.A)^T . L)(L.A) V without decay)."""
    return _triple(q, k, v, lam, _natural_mask)


_ORACLES = {
    "linear": _linear,
    "hla2": _hla2,
    "ahla": _ahla,
    "hla3": _hla3,
    "hla3_masked": _hla3_masked,
    "power": _power,
}


def oracle(name: str, q, k, v, g=None, *, normalize=False, eps=1e-6, ridge=0.0, p=2) -> torch.Tensor:
    """Reference output o [T, dv] (float64) of mechanism ``name`` for one head.

    q, k: [T, d]; v: [T, dv]; g: None or [T] log gates (Lam = cumsum(g)).
    ``ridge`` applies to hla2 only, ``p`` (1..4) to power only.
    normalize: return num / (den + eps), den = same sum with v -> ones([T, 1]).
    """
    if name not in _ORACLES:
        raise ValueError(f"unknown mechanism {name!r}; expected one of {NAMES}")
    if ridge and name != "hla2":
        raise ValueError("ridge is only defined for hla2")
    if name == "power" and p not in (1, 2, 3, 4):
        raise ValueError(f"power needs p in 1..4, got {p!r}")
    q, k, v = (torch.as_tensor(x, dtype=torch.float64) for x in (q, k, v))
    if q.dim() != 2 or k.shape != q.shape or v.dim() != 2 or v.shape[0] != q.shape[0]:
        raise ValueError(f"bad shapes q{tuple(q.shape)} k{tuple(k.shape)} v{tuple(v.shape)}")
    T = q.shape[0]
    lam = _log_cumsum(g, T)
    fn = _ORACLES[name]
    num = fn(q, k, v, lam, ridge=ridge, p=p)
    if not normalize:
        return num
    den = fn(q, k, torch.ones(T, 1, dtype=torch.float64), lam, ridge=ridge, p=p)
    return num / (den + eps)


def hla3_algorithm3(q, k, v, *, normalize=False, eps=1e-6) -> torch.Tensor:
    """Literal transcription of the HLA paper's Algorithm 3 (gamma = 1, no decay).

    Serial loop over tokens with S^K, S^Q, P^KV, m^K, G1..G3, h1..h3;
    o_t = q_t^T (S^K S^Q P - G1 - G2 - G3), den = q_t^T (S^K S^Q m - h1 - h2 - h3).
    Used only to validate DESIGN's tied-max reading of ``hla3``.
    """
    q, k, v = (torch.as_tensor(x, dtype=torch.float64) for x in (q, k, v))
    T, d = q.shape
    dv = v.shape[1]
    SK = torch.zeros(d, d, dtype=torch.float64)
    SQ = torch.zeros(d, d, dtype=torch.float64)
    P = torch.zeros(d, dv, dtype=torch.float64)
    m = torch.zeros(d, dtype=torch.float64)
    G1, G2, G3 = (torch.zeros(d, dv, dtype=torch.float64) for _ in range(3))
    h1, h2, h3 = (torch.zeros(d, dtype=torch.float64) for _ in range(3))
    o = torch.zeros(T, dv, dtype=torch.float64)
    for t in range(T):
        qt, kt, vt = q[t], k[t], v[t]
        SK_prev, SQ_prev, P_prev, m_prev = SK, SQ, P, m
        SK = SK_prev + torch.outer(kt, kt)
        SQ = SQ_prev + torch.outer(qt, qt)
        P = P_prev + torch.outer(kt, vt)
        m = m_prev + kt
        u1 = SQ_prev @ kt
        G1 = G1 + torch.outer(kt, u1 @ P_prev)
        h1 = h1 + kt * (u1 @ m_prev)
        a2 = SK_prev @ qt
        G2 = G2 + torch.outer(a2, qt @ P_prev)
        h2 = h2 + a2 * (qt @ m_prev)
        u3 = SQ_prev @ kt
        a3 = SK_prev @ u3
        G3 = G3 + torch.outer(a3, vt)
        h3 = h3 + a3
        y = SK @ qt
        z = SQ @ y
        termA = z @ P
        o[t] = termA - qt @ G1 - qt @ G2 - qt @ G3
        if normalize:
            denvec = SK @ (SQ @ m) - h1 - h2 - h3
            o[t] = o[t] / (qt @ denvec + eps)
    return o
