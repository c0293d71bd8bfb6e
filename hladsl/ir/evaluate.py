"""Numeric evaluation of IR polys with torch (float64 checks, references).

``einsum_poly`` evaluates each monomial with one ``torch.einsum``; tensors may
carry leading batch dimensions (written as '...')."""
from __future__ import annotations

import string
from typing import Callable

import torch

from hladsl.ir.expr import Factor, Monomial, Poly

_LETTERS = string.ascii_letters


def letters_for(names) -> dict[str, str]:
    mapping: dict[str, str] = {}
    for name in names:
        if name not in mapping:
            if len(mapping) >= len(_LETTERS):
                raise ValueError("too many indices for einsum")
            mapping[name] = _LETTERS[len(mapping)]
    return mapping


def einsum_monomial(t: Monomial, free: tuple[str, ...], tensor: Callable[[Factor], torch.Tensor],
                    rho: Callable[[str], torch.Tensor] | None = None) -> torch.Tensor:
    """One monomial, contracted pairwise in the planner's order (never a large
    outer product, as a left-to-right einsum of three states would build)."""
    from hladsl.ir.contract import plan
    operands = [tensor(f) for f in t.factors]
    if not operands:
        raise ValueError("constant monomial")
    indices = [f.indices for f in t.factors]
    sizes = {}
    for f, x in zip(t.factors, operands):
        sizes.update(zip(f.indices, x.shape[x.dim() - len(f.indices):]))
    names = letters_for(list(free) + t.indices())
    values = list(zip(operands, indices))
    order = plan(tuple(indices), tuple(free), tuple(sorted(sizes.items())))
    for step in order.steps:
        (a, ia), (b, ib) = values[step.left], values[step.right]
        spec = ("..." + "".join(names[i] for i in ia) + ",..." + "".join(names[i] for i in ib)
                + "->..." + "".join(names[i] for i in step.indices))
        values.append((torch.einsum(spec, a, b), step.indices))
    value, idx = values[order.result]
    out = "..." + "".join(names[i] for i in free)
    value = torch.einsum("..." + "".join(names[i] for i in idx) + "->" + out, value)
    value = value * float(t.coef)
    for seg, power in t.rho:
        r = rho(seg) ** power
        value = value * r.reshape(r.shape + (1,) * len(free))
    return value


def einsum_poly(poly: Poly, tensor: Callable[[Factor], torch.Tensor],
                rho: Callable[[str], torch.Tensor] | None = None) -> torch.Tensor:
    total = None
    for t in poly.terms:
        value = einsum_monomial(t, poly.free, tensor, rho)
        total = value if total is None else total + value
    return total
