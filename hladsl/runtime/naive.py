"""Naive parallel evaluation of the output from its chain normal form: every
chain term as one dense masked einsum over [T, T] order masks (O(T^k)): a
second reference, independent of contraction plans and of the state pass."""
from __future__ import annotations

import torch

from hladsl.ir.algebra import Algebra
from hladsl.ir.chains import ANCHOR, ChainTerm, output_chains
from hladsl.ir.evaluate import letters_for


def _order(rel: str, T: int, like) -> torch.Tensor:
    r = torch.arange(T, device=like.device)
    return (r[:, None] > r[None, :] if rel == "<" else r[:, None] >= r[None, :]).to(like.dtype)


def _term(term: ChainTerm, tokens, lam, T: int) -> torch.Tensor:
    like = tokens["q"]
    times = [f"n{i}" for i in range(term.nodes)] + [ANCHOR]
    names = letters_for(["time_" + w for w in times] + [i for f in term.factors for i in f.indices]
                        + list(term.free))
    specs, operands = [], []
    for f in term.factors:
        specs.append(names["time_" + f.where] + names[f.indices[0]])
        operands.append(tokens[f.name])
    for i in range(term.nodes):   # order relation of each node to its parent (or t)
        parent = ANCHOR if term.parents[i] < 0 else f"n{term.parents[i]}"
        specs.append(names["time_" + parent] + names["time_" + times[i]])
        operands.append(_order(term.rels[i], T, like))
        if lam is not None and term.weights[i]:   # node i decays to the anchor t
            specs.append(names["time_" + ANCHOR] + names["time_" + times[i]])
            operands.append(torch.exp(term.weights[i] * (lam[:, None] - lam[None, :])).tril())
    out = names["time_" + ANCHOR] + "".join(names[i] for i in term.free)
    return float(term.coef) * torch.einsum(",".join(specs) + "->" + out, *operands)


def naive_output(alg: Algebra, q, k, v, g=None) -> torch.Tensor:
    """One head, no initial state: q, k [T, d], v [T, dv], g [T] -> o [T, dv]."""
    tokens = {"q": q, "k": k, "v": v}
    lam = None if g is None else torch.cumsum(g, 0)
    T = q.shape[0]
    num = sum(_term(t, tokens, lam, T) for t in output_chains(alg, carry=False))
    if alg.normalizer is None:
        return num
    den = sum(_term(t, tokens, lam, T) for t in output_chains(alg, alg.normalizer, carry=False))
    return num / (den.unsqueeze(-1) + alg.eps)
