"""Derivations on the state algebra, all generic:

* ``combine``: X(AB) = ρ_B^{w_X} X(A) + X(B) + Σ cross(Z(B), ρ_B^{w_Y} Y(A))
* ``associativity_defect``: (A⊕B)⊕C − A⊕(B⊕C), expanded and canonicalised
* ``vjp``: reverse-mode rules (dX(AB)) -> (dY(A), dY(B), d log ρ_B) by the
  transpose rule of each multilinear monomial
* ``serial``: the combine with B a single token, X_t = X_{t-1} ⊕ token_t
"""
from __future__ import annotations

from fractions import Fraction

from hladsl.ir.algebra import Algebra, Summary
from hladsl.ir.expr import Factor, Monomial, Poly, fresh_names, substitute


def combine(alg: Algebra, x: Summary, left: str = "A", right: str = "B") -> Poly:
    terms = [Monomial(Fraction(1), (x.factor(left),)).with_rho(right, x.weight),
             Monomial(Fraction(1), (x.factor(right),))]
    for cross in x.crosses:
        factors, rho = [], 0
        for f in cross.factors:
            side = left if f.where == "A" else right
            factors.append(Factor(f.kind, f.name, side, f.indices, f.symmetric))
            if f.where == "A":
                rho += alg.summary(f.name).weight
        terms.append(Monomial(cross.coef, tuple(factors)).with_rho(right, rho))
    return Poly(x.indices, tuple(t for t in terms if t.coef != 0))


def _split_rho(poly: Poly, joint: str, parts: tuple[str, str]) -> Poly:
    def split(t: Monomial) -> Monomial:
        rho = dict(t.rho)
        power = rho.pop(joint, 0)
        out = Monomial(t.coef, t.factors, tuple(sorted(rho.items())))
        for seg in parts:
            out = out.with_rho(seg, power) if power else out
        return out
    return poly.map_terms(split)


def expand(alg: Algebra, poly: Poly, seg: str, left: str, right: str) -> Poly:
    """Every state factor of ``poly`` at segment ``seg`` replaced by its combine over
    (``left``, ``right``)."""
    return substitute(poly, lambda f: (combine(alg, alg.summary(f.name), left, right)
                                       if f.kind == "state" and f.where == seg else None))


def bracketings(alg: Algebra, x: Summary) -> tuple[Poly, Poly]:
    """((A⊕B)⊕C, A⊕(B⊕C)) for summary x, as polys over A, B, C summaries."""
    left = expand(alg, combine(alg, x, "AB", "C"), "AB", "A", "B")
    right = expand(alg, combine(alg, x, "A", "BC"), "BC", "B", "C")
    return left, _split_rho(right, "BC", ("B", "C"))


def associativity_defect(alg: Algebra, x: Summary) -> Poly:
    left, right = bracketings(alg, x)
    return (left + right.scaled(-1)).canonical()


def serial(alg: Algebra, x: Summary) -> Poly:
    """X_t in terms of the previous state (where='prev'), the token's inputs
    (where='t') and ρ_t = exp(g_t)."""
    def token(f: Factor):
        if f.kind == "state" and f.where == "t":
            return alg.summary(f.name).delta
        return None
    return substitute(combine(alg, x, "prev", "t"), token).canonical()


def vjp(alg: Algebra) -> dict[tuple[str, str], Poly]:
    """Cotangent polys keyed by (summary, side) and ('log_rho', 'B'): each a sum
    over every combine term reading that factor, of the term with that factor
    removed and the output cotangent dX(AB) put in its place."""
    out: dict[tuple[str, str], list[Monomial]] = {}
    free_of: dict[tuple[str, str], tuple[str, ...]] = {("log_rho", "B"): ()}
    for x in alg.summaries:
        for term in combine(alg, x).terms:
            taken = set(term.indices()) | set(x.indices)
            seed = Factor("cotangent", x.name, "AB", x.indices)
            for n, f in enumerate(term.factors):
                y = alg.summary(f.name)
                others = term.factors[:n] + term.factors[n + 1:]
                # rename the factor's indices to y's own, others apart from them
                clash = (set(term.indices()) | set(x.indices)) & set(y.indices)
                apart = dict(zip(sorted(clash), fresh_names(taken | set(y.indices), len(clash), "r")))
                moved = Monomial(term.coef, (seed,) + others, term.rho).relabel(apart)
                to_y = dict(zip([apart.get(i, i) for i in f.indices], y.indices))
                key = (y.name, f.where)
                free_of[key] = y.indices
                out.setdefault(key, []).append(moved.relabel(to_y))
            power = dict(term.rho).get("B", 0)
            if power:
                m = Monomial(term.coef * power, (seed,) + term.factors, term.rho)
                out.setdefault(("log_rho", "B"), []).append(m)
    return {k: Poly(free_of[k], tuple(v)).canonical() for k, v in out.items()}
