"""``hladsl check``: every verification of a spec's state algebra.

symbolic associativity   (A⊕B)⊕C and A⊕(B⊕C) expanded to canonical monomials
random associativity     the same identity in float64 on random tensors
grading                  every cross term has its summary's decay weight (lowering)
symmetry                 a summary declared symmetric(...) really is
VJP                      the derived reverse-mode rules against torch.autograd
"""
from __future__ import annotations

import itertools

import torch

from hladsl.errors import AlgebraError
from hladsl.ir.algebra import Algebra, Summary
from hladsl.ir.combine import bracketings, combine, serial, vjp
from hladsl.ir.contract import plan
from hladsl.ir.evaluate import einsum_poly
from hladsl.ir.expr import Poly

CHECK_DIMS = {"d": 3, "dv": 2}


def _fail(alg: Algebra, x: Summary | None, message: str) -> AlgebraError:
    return AlgebraError(message, x.pos if x is not None else None, path=alg.name)


def check_associativity(alg: Algebra) -> None:
    for x in alg.summaries:
        left, right = bracketings(alg, x)
        defect = (left + right.scaled(-1)).canonical()
        if defect.terms:
            raise _fail(alg, x, (
                f"the combine of '{x.name}' is not associative: (A⊕B)⊕C − A⊕(B⊕C) = "
                f"{defect.text()}\n  (A⊕B)⊕C = {left.canonical().text()}\n  A⊕(B⊕C) = "
                f"{right.canonical().text()}\n  A cross term of '{x.name}' is missing or reads "
                f"a summary from the wrong segment."))


def check_symmetry(alg: Algebra) -> None:
    for x in alg.summaries:
        body = Poly(x.indices, tuple(combine(alg, x).terms[2:]) + x.delta.terms)
        for group in x.symmetric:
            a, b = x.indices[group[0]], x.indices[group[1]]
            swapped = body.map_terms(lambda t: t.relabel({a: b, b: a}))
            if (body + swapped.scaled(-1)).canonical().terms:
                raise _fail(alg, x, f"'{x.name}' is declared symmetric in ({a}, {b}) but its delta "
                                    f"or cross terms are not: {body.canonical().text()}")


def _random_state(alg: Algebra, x: Summary, gen, dims) -> torch.Tensor:
    shape = tuple(dims[d] for d in x.dims)
    t = torch.randn(shape, generator=gen, dtype=torch.float64)
    for group in x.symmetric:   # symmetrise over the group's slots
        perm_sum = torch.zeros_like(t)
        perms = list(itertools.permutations(group))
        for p in perms:
            order = list(range(t.dim()))
            for slot, src in zip(group, p):
                order[slot] = src
            perm_sum = perm_sum + t.permute(order)
        t = perm_sum / len(perms)
    return t


def _dims_for(alg: Algebra) -> dict[str, int]:
    return {d: CHECK_DIMS.get(d, 2) for d in alg.dims}


def numeric_associativity(alg: Algebra, seed: int = 0) -> float:
    gen = torch.Generator().manual_seed(seed)
    dims = _dims_for(alg)
    tensors = {(x.name, seg): _random_state(alg, x, gen, dims) for x in alg.summaries for seg in "ABC"}
    rho = {seg: torch.rand((), generator=gen, dtype=torch.float64) * 0.5 + 0.5 for seg in "ABC"}
    worst = 0.0
    for x in alg.summaries:
        left, right = bracketings(alg, x)
        lv = einsum_poly(left, lambda f: tensors[(f.name, f.where)], rho.__getitem__)
        rv = einsum_poly(right, lambda f: tensors[(f.name, f.where)], rho.__getitem__)
        err = float((lv - rv).norm() / lv.norm().clamp_min(1e-300))
        if err > 1e-10:
            raise _fail(alg, x, f"random float64 check: the combine of '{x.name}' is not associative "
                                f"(relative difference {err:.2e})")
        worst = max(worst, err)
    return worst


def check_vjp(alg: Algebra, seed: int = 1) -> float:
    with torch.enable_grad():   # a spec may be compiled under torch.no_grad() (an op built mid-call)
        return _check_vjp(alg, seed)


def _check_vjp(alg: Algebra, seed: int) -> float:
    gen = torch.Generator().manual_seed(seed)
    dims = _dims_for(alg)
    leaves = {(x.name, seg): _random_state(alg, x, gen, dims).requires_grad_()
              for x in alg.summaries for seg in "AB"}
    log_rho = torch.tensor(-0.3, dtype=torch.float64, requires_grad=True)
    rho = {"B": log_rho.exp()}
    cot = {x.name: torch.randn(tuple(dims[d] for d in x.dims), generator=gen, dtype=torch.float64)
           for x in alg.summaries}
    loss = sum((einsum_poly(combine(alg, x), lambda f: leaves[(f.name, f.where)], rho.__getitem__)
                * cot[x.name]).sum() for x in alg.summaries)
    grads = torch.autograd.grad(loss, list(leaves.values()) + [log_rho], allow_unused=True)
    auto = dict(zip(list(leaves) + [("log_rho", "B")], grads))
    rules = vjp(alg)

    def lookup(f):
        return cot[f.name] if f.kind == "cotangent" else leaves[(f.name, f.where)].detach()
    worst = 0.0
    for key, want in auto.items():
        poly = rules.get(key)
        got = (einsum_poly(poly, lookup, lambda s: rho[s].detach()) if poly is not None and poly.terms
               else torch.zeros_like(want if want is not None else log_rho))
        want = torch.zeros_like(got) if want is None else want
        err = float((got - want).norm() / want.norm().clamp_min(1e-12))
        if err > 1e-10:
            raise _fail(alg, None, f"the derived VJP for d{key[0]}@{key[1]} disagrees with "
                                   f"torch.autograd (relative error {err:.2e})")
        worst = max(worst, err)
    return worst


def serial_flops(alg: Algebra, dims: dict[str, int]) -> dict[str, int]:
    """Per-token FLOPs of the derived serial update (best contraction order)."""
    out = {}
    for x in alg.streaming:
        total = 0
        for t in serial(alg, x).terms:
            sizes = {}
            for f in t.factors:
                if f.kind == "input":
                    sizes[f.indices[0]] = dims[alg.inputs[f.name]]
                else:
                    sizes.update((i, dims[d]) for i, d in zip(f.indices, alg.summary(f.name).dims))
            total += plan(tuple(f.indices for f in t.factors), x.indices,
                          tuple(sorted(sizes.items()))).flops
        out[x.name] = total
    return out


def verify(alg: Algebra) -> list[str]:
    """Run every check; return report lines (raises AlgebraError on a failure)."""
    lines = [f"decay grading ... ok ({', '.join(f'{x.name}:{x.weight}' for x in alg.summaries)})"]
    check_associativity(alg)
    lines.append(f"associativity, symbolic ({len(alg.summaries)} summaries) ... ok")
    err = numeric_associativity(alg)
    lines.append(f"associativity, random float64 (max rel. difference {err:.1e}) ... ok")
    check_symmetry(alg)
    if any(x.symmetric for x in alg.summaries):
        lines.append("declared symmetries ... ok")
    err = check_vjp(alg)
    lines.append(f"combine VJP vs torch.autograd, float64 (max rel. error {err:.1e}) ... ok")
    return lines
