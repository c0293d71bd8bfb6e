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
    names = letters_for(list(free) + t.indices())
    operands, specs = [], []
    for f in t.factors:
        operands.append(tensor(f))
        specs.append("..." + "".join(names[i] for i in f.indices))
    out = "..." + "".join(names[i] for i in free)
    value = torch.einsum(",".join(specs) + "->" + out, *operands) if operands else None
    scale = float(t.coef)
    for seg, power in t.rho:
        r = rho(seg) ** power
        value = r if value is None else value * r.reshape(r.shape + (1,) * len(free))
    if value is None:
        raise ValueError("constant monomial")
    return value * scale


def einsum_poly(poly: Poly, tensor: Callable[[Factor], torch.Tensor],
                rho: Callable[[str], torch.Tensor] | None = None) -> torch.Tensor:
    total = None
    for t in poly.terms:
        value = einsum_monomial(t, poly.free, tensor, rho)
        total = value if total is None else total + value
    return total
