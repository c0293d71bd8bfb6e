"""The derived serial recurrence X_t = X_{t-1} ⊕ token_t, run token by token:
the inference path (``Op.step``) and a reference for tests."""
from __future__ import annotations

import torch

from hladsl.ir.algebra import Algebra
from hladsl.ir.combine import serial
from hladsl.ir.evaluate import einsum_poly
from hladsl.ir.expr import Factor


def serial_polys(alg: Algebra):
    return {s.name: serial(alg, s) for s in alg.streaming}


def step(alg: Algebra, polys, state: dict[str, torch.Tensor], tokens: dict[str, torch.Tensor],
         g: torch.Tensor | None):
    """One token: state -> (new state, numerator, denominator or None).

    tokens: name -> [..., dim]; state: name -> [..., *full shape]; g: [...] or None."""
    like = next(iter(tokens.values()))

    def prev(f: Factor):
        return state[f.name] if f.kind == "state" else tokens[f.name]

    rho = (lambda seg: torch.exp(g)) if g is not None else (lambda seg: torch.ones_like(like[..., 0]))
    new = {name: einsum_poly(p, prev, rho) for name, p in polys.items()}

    def now(f: Factor):
        return new[f.name] if f.kind == "state" else tokens[f.name]
    num = einsum_poly(alg.output, now)
    den = einsum_poly(alg.normalizer, now) if alg.normalizer is not None else None
    return new, num, den
