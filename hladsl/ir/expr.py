"""Tensor expressions in index notation: the IR's node types.

A ``Poly`` is a sum of ``Monomial``s over fixed free indices; a monomial is a
coefficient times a product of ``Factor``s (each a tensor with index labels)
times powers of segment decays ρ. Indices repeated in a monomial are summed.
Everything is immutable and hashable; ``canonical()`` gives a form in which
equal monomials compare equal (dummy indices renamed, factors ordered), which is
what symbolic checks and term cancellation rely on.
"""
from __future__ import annotations

import itertools
from dataclasses import dataclass, replace
from fractions import Fraction
from typing import Callable, Iterable

Coef = Fraction


@dataclass(frozen=True, order=True)
class Factor:
    """A tensor with index labels.

    kind: 'input' (a token vector), 'state' (a summary), 'eye' (Kronecker delta),
    'cotangent' (a VJP seed). ``where`` says which segment or time the tensor
    belongs to: 'A'/'B'/'C' in combines, 'P' for a carried state, a time label
    for token inputs. ``symmetric`` lists groups of index slots the tensor is
    symmetric in (used by canonicalisation only).
    """

    kind: str
    name: str
    where: str
    indices: tuple[str, ...]
    symmetric: tuple[tuple[int, ...], ...] = ()

    def relabel(self, mapping: dict[str, str]) -> "Factor":
        return replace(self, indices=tuple(mapping.get(i, i) for i in self.indices))

    def __str__(self) -> str:
        where = f"@{self.where}" if self.where and self.kind != "input" else ""
        time = f"_{self.where}" if self.kind == "input" and self.where else ""
        prefix = "d" if self.kind == "cotangent" else ""
        return f"{prefix}{self.name}{time}{where}[{','.join(self.indices)}]"


@dataclass(frozen=True)
class Monomial:
    coef: Coef
    factors: tuple[Factor, ...]
    rho: tuple[tuple[str, int], ...] = ()   # ((segment, power), ...), sorted, powers > 0

    def indices(self) -> list[str]:
        return [i for f in self.factors for i in f.indices]

    def dummies(self, free: Iterable[str]) -> set[str]:
        free = set(free)
        return {i for i in self.indices() if i not in free}

    def scaled(self, c) -> "Monomial":
        return replace(self, coef=self.coef * Coef(c))

    def times(self, other: "Monomial") -> "Monomial":
        return Monomial(self.coef * other.coef, self.factors + other.factors,
                        _merge_rho(self.rho, other.rho))

    def with_rho(self, segment: str, power: int) -> "Monomial":
        return replace(self, rho=_merge_rho(self.rho, ((segment, power),)))

    def relabel(self, mapping: dict[str, str]) -> "Monomial":
        return replace(self, factors=tuple(f.relabel(mapping) for f in self.factors))

    def at(self, where: str, only: int | None = None) -> "Monomial":
        """Every factor (or the factor at position ``only``) moved to segment / time ``where``."""
        return replace(self, factors=tuple(replace(f, where=where) if only in (None, k) else f
                                           for k, f in enumerate(self.factors)))

    def text(self) -> str:
        parts = []
        for seg, power in self.rho:
            parts.append(f"ρ_{seg}" + (f"^{power}" if power != 1 else ""))
        parts += [str(f) for f in self.factors]
        body = " ".join(parts) or "1"
        if self.coef == 1:
            return body
        if self.coef == -1:
            return "-" + body
        return f"{self.coef} {body}"


def _merge_rho(a, b):
    powers: dict[str, int] = {}
    for seg, p in a + b:
        powers[seg] = powers.get(seg, 0) + p
    return tuple(sorted((s, p) for s, p in powers.items() if p))


@dataclass(frozen=True)
class Poly:
    free: tuple[str, ...]
    terms: tuple[Monomial, ...] = ()

    def __add__(self, other: "Poly") -> "Poly":
        assert sorted(self.free) == sorted(other.free), (self.free, other.free)
        return Poly(self.free, self.terms + other.terms)

    def scaled(self, c) -> "Poly":
        return Poly(self.free, tuple(t.scaled(c) for t in self.terms))

    def map_terms(self, fn: Callable[[Monomial], Monomial]) -> "Poly":
        return Poly(self.free, tuple(fn(t) for t in self.terms))

    def at(self, where: str) -> "Poly":
        return self.map_terms(lambda t: t.at(where))

    def renamed(self, free: tuple[str, ...]) -> "Poly":
        """The same poly with its free indices called ``free``."""
        return Poly(free, tuple(t.relabel(dict(zip(self.free, free))) for t in self.terms))

    def canonical(self) -> "Poly":
        """Collect equal monomials (after canonical dummy renaming); drop zeros."""
        acc: dict[tuple, Coef] = {}
        for t in self.terms:
            key = canonical_key(t, self.free)
            acc[key] = acc.get(key, Coef(0)) + t.coef
        terms = tuple(Monomial(c, factors, rho) for (factors, rho), c in sorted(acc.items(), key=repr)
                      if c != 0)
        return Poly(self.free, terms)

    def text(self) -> str:
        if not self.terms:
            return "0"
        out = ""
        for n, t in enumerate(self.terms):
            s = t.text()
            if n == 0:
                out = s
            elif s.startswith("-"):
                out += " - " + s[1:]
            else:
                out += " + " + s
        return out


def fresh_names(taken: set[str], count: int, stem: str = "x") -> list[str]:
    out, n = [], 0
    while len(out) < count:
        name = f"{stem}{n}"
        if name not in taken:
            out.append(name)
            taken.add(name)
        n += 1
    return out


def instantiate(poly: Poly, free: tuple[str, ...], taken: set[str]) -> list[Monomial]:
    """The terms of ``poly`` with its free indices renamed to ``free`` and its
    dummies renamed apart from ``taken`` (which is updated)."""
    out = []
    mapping0 = dict(zip(poly.free, free))
    for t in poly.terms:
        dummies = sorted(t.dummies(poly.free))
        new = fresh_names(taken, len(dummies), "s")
        mapping = dict(mapping0)
        mapping.update(zip(dummies, new))
        out.append(t.relabel(mapping))
    return out


def substitute(poly: Poly, rule: Callable[[Factor], Poly | None]) -> Poly:
    """Replace every factor f for which ``rule(f)`` gives a Poly by that Poly
    (its free indices bound to f's indices), expanding products."""
    terms: list[Monomial] = []
    for t in poly.terms:
        taken = set(t.indices()) | set(poly.free)
        partial = [Monomial(t.coef, (), t.rho)]
        for f in t.factors:
            replacement = rule(f)
            if replacement is None:
                partial = [p.times(Monomial(Coef(1), (f,))) for p in partial]
                continue
            pieces = instantiate(replacement, f.indices, taken)
            partial = [p.times(q) for p in partial for q in pieces]
        terms.extend(partial)
    return Poly(poly.free, tuple(terms))


# -- canonical form -----------------------------------------------------------

def _factor_sort_key(f: Factor, free: set[str]):
    # Invariant under dummy renaming: which slots carry which free index.
    return (f.kind, f.name, f.where, len(f.indices),
            tuple(i if i in free else "" for i in f.indices))


def _slot_orders(f: Factor):
    """All index orders of f equivalent under its symmetric slot groups."""
    if not f.symmetric:
        yield f.indices
        return
    groups = [list(g) for g in f.symmetric]
    for perms in itertools.product(*(itertools.permutations(g) for g in groups)):
        idx = list(f.indices)
        for g, perm in zip(groups, perms):
            for slot, src in zip(g, perm):
                idx[slot] = f.indices[src]
        yield tuple(idx)


def canonical_key(t: Monomial, free: Iterable[str]):
    """(factors, rho) with factors ordered and dummies renamed canonically; the
    minimum over the orderings that invariant sorting cannot distinguish."""
    free = set(free)
    factors = sorted(t.factors, key=lambda f: _factor_sort_key(f, free))
    groups = [list(g) for _, g in itertools.groupby(factors, key=lambda f: _factor_sort_key(f, free))]
    best = None
    for arrangement in itertools.product(*(itertools.permutations(g) for g in groups)):
        ordered = [f for g in arrangement for f in g]
        for variants in itertools.product(*(_slot_orders(f) for f in ordered)):
            mapping: dict[str, str] = {}
            out = []
            for f, idx in zip(ordered, variants):
                new = []
                for i in idx:
                    if i in free:
                        new.append(i)
                    else:
                        if i not in mapping:
                            mapping[i] = f"_{len(mapping)}"
                        new.append(mapping[i])
                out.append(replace(f, indices=tuple(new)))
            key = tuple(out)
            if best is None or key < best:
                best = key
    return (best or (), t.rho)


def eliminate_eye(t: Monomial, free: Iterable[str]) -> Monomial | None:
    """Contract Kronecker deltas away: eye[i,j] X[..j..] -> X[..i..]. Returns
    None if an eye is left with both indices free (nothing to contract)."""
    free = set(free)
    while True:
        eyes = [f for f in t.factors if f.kind == "eye"]
        if not eyes:
            return t
        e = eyes[0]
        a, b = e.indices
        rest = tuple(f for f in t.factors if f is not e)
        if b not in free:
            t = Monomial(t.coef, rest, t.rho).relabel({b: a})
        elif a not in free:
            t = Monomial(t.coef, rest, t.rho).relabel({a: b})
        else:
            return None
