"""The carried form of an algebra: each derived carry that has a recursion written as a summary.

An output reads a sum of carried-state products at its own token (HLA2: o = qᵀ W with
W = S C - G). ``ir.recursion`` derives W's own combine and drops a state W holds alone (G);
here that combine becomes a summary of its own -- its token delta is W of one token, its
cross terms the recursion's terms that read segment A:

    W(A⊕B) = ρ_B² W(A) + W(B) + ρ_B S(A) C(B)      (HLA2; h likewise for the normaliser)

and the output reads W. The two algebras compute the same outputs (``carried_form`` proves
it symbolically; the new summaries' combines go through the usual associativity proofs),
but the carried form's streaming states (S, W) hold no cancelling sum: its products need no
fp32-accurate dots and its backward's d-states no cancelling parts. H100, B = 2, H = 16,
d = 64, bf16, fwd + bwd at T = 65536 (benchmarks/RESULTS.md round 33): 7.88 ms against the
two-pass form's 15.50 (fla 3.40).

Its state is not the user's (S, C, m, G, h for HLA2): C and m become combine-only and G, h
are gone, so only calls with no state in or out can run it as they stand.
"""
from __future__ import annotations

from dataclasses import dataclass, replace
from fractions import Fraction

from hladsl.frontend.graph import descendants
from hladsl.ir.algebra import Algebra, Summary
from hladsl.ir.chunk import carry_group
from hladsl.ir.combine import combine
from hladsl.ir.expr import Factor, Monomial, Poly, canonical_key, fresh_names, substitute
from hladsl.ir.recursion import DELTA, START, increment, recursion


@dataclass(frozen=True)
class CarriedSummary:
    """One derived carry made a summary: its name, the poly of the user's states it stands
    for (free: its indices), the state it replaces (``dropped``) and the product summaries
    its cross terms read (``_Summaries._product``: HLA3's Z0..Z2; none for HLA2's)."""
    name: str
    poly: Poly
    dropped: str
    products: tuple[str, ...] = ()


@dataclass(frozen=True)
class _Group:
    """Output terms sharing their token factors: anchor × Σ (state products)."""
    anchor: tuple[Factor, ...]
    inner_free: tuple[str, ...]
    terms: tuple[Monomial, ...]     # the state parts, with their coefficients


def _groups(poly: Poly) -> list[_Group]:
    """``poly``'s terms grouped as ``ir.chunk`` groups an output's carry-only terms: by their
    token factors and the indices those share with the states (and by decay weight, via the
    states read: a group of mixed weights has no recursion)."""
    groups: dict = {}
    for m in poly.terms:
        anchor = tuple(f for f in m.factors if f.kind == "input")
        states = tuple(f for f in m.factors if f.kind != "input")
        key = carry_group(anchor, states, poly.free)
        groups.setdefault(key, (anchor, key[1], []))[2].append(Monomial(m.coef, states))
    return [_Group(a, f, tuple(t)) for a, f, t in groups.values()]


class _Summaries:
    """Summaries made from polys of the algebra's states (``make``): a cross term of one that
    reads several summaries of segment B (no summary's combine does) reads instead their
    product, itself a summary made so (HLA3's ρ_B SK(A) SQ(B) P(B): a combine-only Z(B) =
    SQ(B) P(B)), once per product."""

    def __init__(self, alg: Algebra, taken: set[str]):
        self.alg, self.taken = alg, taken
        self.made: list[Summary] = []       # dependency order: a product before what reads it
        self._products: dict = {}           # a product's canonical key -> its summary's name

    def _dims(self, poly: Poly) -> tuple[str, ...]:
        def dim(i):
            f = next(f for m in poly.terms for f in m.factors if i in f.indices)
            return self.alg.summary(f.name).dims[f.indices.index(i)]
        return tuple(dim(i) for i in poly.free)

    def make(self, name: str, poly: Poly, weight: int) -> Summary | None:
        """The summary X = ``poly`` (state factors at 'P', of decay weight ``weight``): its delta
        ``poly`` of one token, its cross terms X(A⊕B) - ρ_B^w X(A) - X(B) expanded by the
        combines; None where a term has no segment-A factor or a ρ power no combine gives."""
        alg = self.alg
        delta = substitute(poly, lambda f: alg.summary(f.name).delta if f.kind == "state" else None)
        cross = (increment(alg, poly, weight) + poly.at(DELTA).scaled(-1)).canonical()
        crosses = []
        for m in cross.terms:
            a_side = [f for f in m.factors if f.where == START]
            b_side = [f for f in m.factors if f.where == DELTA]
            if not a_side or not b_side or dict(m.rho) != {DELTA: sum(alg.summary(f.name).weight for f in a_side)}:
                return None   # (the combine's ρ power of a cross term is its A side's weight)
            if len(b_side) > 1:
                product = self._product(b_side, {i for f in a_side for i in f.indices} | set(poly.free))
                if product is None:
                    return None
                b_side = [product]
            crosses.append(Monomial(m.coef, tuple(a_side) + tuple(b_side)))
        summary = Summary(name, poly.free, self._dims(poly), weight, Poly(poly.free, delta.canonical().terms),
                          tuple(crosses))
        self.made.append(summary)
        return summary

    def products(self) -> list[str]:
        """The product summaries made, in the order made."""
        return list(self._products.values())

    def _product(self, factors: list[Factor], outside: set[str]) -> Factor | None:
        """The factor Z@B[...] standing for the product of ``factors`` (at B), summed over the
        indices only they hold; Z made where it is new."""
        free = tuple(dict.fromkeys(i for f in factors for i in f.indices if i in outside))
        poly = Poly(free, (Monomial(Fraction(1), tuple(replace(f, where="P") for f in factors)),))
        own = tuple(f"z{n}" for n in range(len(free)))
        key = canonical_key(poly.renamed(own).terms[0], own)
        name = self._products.get(key)
        if name is None:
            (name,) = fresh_names(self.taken, 1, "Z")
            weight = sum(self.alg.summary(f.name).weight for f in factors)
            if self.make(name, poly.renamed(own), weight) is None:
                return None
            self._products[key] = name
        return Factor("state", name, DELTA, free)


def carried_form(alg: Algebra) -> tuple[Algebra, tuple[CarriedSummary, ...]] | None:
    """``alg`` with every derived carry of its output and normaliser that has a recursion
    dropping a state written as a summary (see the module), and those summaries; None where
    no derived carry has one."""
    polys = [p for p in (alg.output, alg.normalizer) if p is not None]
    groups = [(n, g) for n, p in enumerate(polys) for g in _groups(p)]
    crossed = {f.name for s in alg.summaries for c in s.crosses for f in c.factors}
    taken = {s.name for s in alg.summaries} | set(alg.inputs)
    made: dict[int, tuple[tuple[Summary, ...], CarriedSummary]] = {}   # its summaries, W last
    for k, (_, g) in enumerate(groups):
        if len(g.terms) < 2:
            continue
        poly = Poly(g.inner_free, tuple(m.at("P") for m in g.terms))
        elsewhere = crossed | {f.name for j, (_, h) in enumerate(groups) if j != k for m in h.terms
                               for f in m.factors}
        rec = recursion(alg, "W", poly, elsewhere)
        if rec is None or not rec.dropped:
            continue
        (name,) = fresh_names(taken, 1, "W")
        builder = _Summaries(alg, taken)
        if builder.make(name, poly.renamed(rec.free), rec.weight) is not None:
            made[k] = (tuple(builder.made), CarriedSummary(name, Poly(g.inner_free, g.terms), rec.dropped,
                                                           tuple(builder.products())))
    if not made:
        return None
    rebuilt = [[] for _ in polys]
    for k, (n, g) in enumerate(groups):
        if k in made:
            w = Factor("state", made[k][1].name, "", g.inner_free)
            rebuilt[n].append(Monomial(Fraction(1), g.anchor + (w,)))
        else:
            rebuilt[n] += [Monomial(m.coef, g.anchor + m.factors) for m in g.terms]
    new = [Poly(p.free, tuple(ts)) for p, ts in zip(polys, rebuilt)]
    carried = replace(
        alg, name=f"{alg.name}_carried",
        summaries=alg.summaries + tuple(s for new, _ in made.values() for s in new),
        output=new[0], normalizer=new[1] if alg.normalizer is not None else None)
    read = descendants(carried.graph(), "<out>")   # the dropped states and what only they read go
    carried = replace(carried, summaries=tuple(s for s in carried.summaries if s.name in read))
    forms = tuple(c for _, c in made.values())
    for before, after in zip(polys, new):
        _check_same_output(before, after, forms)
    return carried, forms


def _check_same_output(before: Poly, after: Poly, forms: tuple[CarriedSummary, ...]) -> None:
    """``after`` with each carried summary expanded back into its poly is ``before``: a proof
    (raises AssertionError where the rewrite is wrong)."""
    by_name = {c.name: c.poly for c in forms}
    back = substitute(after, lambda f: by_name.get(f.name) if f.kind == "state" else None)
    difference = (back + before.scaled(-1)).canonical()
    if difference.terms:
        raise AssertionError(f"carried form changes the output by {difference.text()}")


def carried_text(alg: Algebra) -> str:
    """``--emit carried``: the carried form's summaries, combines and output, or why none."""
    found = carried_form(alg)
    if found is None:
        return (f"# {alg.name}: no derived carry of its output has a recursion that drops a state "
                "(ir.recursion): it runs as written\n")
    carried, forms = found
    lines = [f"# {alg.name}, carried form: each derived carry that has a recursion is a summary; "
             "the outputs are the same (proved symbolically), its streaming states "
             f"{', '.join(s.name for s in carried.streaming)}"]
    for c in forms:
        s = carried.summary(c.name)
        lines += [f"{c.name}[{','.join(s.indices)}] = {c.poly.renamed(s.indices).text()}   (replaces {c.dropped})",
                  f"  token delta: {s.delta.text()}",
                  f"  combine: {c.name}(A⊕B) = {combine(carried, s).text()}"]
    lines.append(f"{carried.output_name}[{','.join(carried.output.free)}] = {carried.output.text()}")
    if carried.normalizer is not None:
        lines.append(f"normalizer = {carried.normalizer.text()}")
    combine_only = [s.name for s in carried.summaries if s not in carried.streaming]
    if combine_only:
        lines.append(f"combine-only (never carried): {', '.join(combine_only)}")
    return "\n".join(lines) + "\n"
