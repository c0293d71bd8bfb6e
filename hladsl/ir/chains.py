"""Chain normal form: a summary or the output as a sum over ordered token times.

Unrolling the combine over single tokens turns every summary of a segment
into a sum of *trees* of token times: a node carries token factors (a delta),
its children are strictly earlier times (the A-side factors of a cross term),
and each node decays by exp(w (Λ_anchor − Λ_node)) with w its own weight.
Expanding every tree into the weak orders of its nodes gives *chains*
n0 ⋚ n1 ⋚ ... ⋚ anchor, a canonical form in which equal terms cancel exactly
(HLA2's S C − G leaves i ≤ j ≤ t); pairs that differ only by '<' versus '='
are merged back into '≤'.

For a chunk, the carried prefix P enters through the combine P ⊕ L: carry
factors are state tensors (where='P') decayed by ρ_L^{carry_weight}.
"""
from __future__ import annotations

import itertools
from dataclasses import dataclass, replace
from fractions import Fraction

from hladsl.ir.algebra import Algebra, Summary
from hladsl.ir.combine import combine
from hladsl.ir.expr import Factor, Monomial, Poly, canonical_key, instantiate

ANCHOR = "t"


@dataclass(frozen=True)
class ChainTerm:
    """coef · carry factors · Π_nodes token factors, summed over token times
    ordered as a forest below the anchor: node i relates to ``parents[i]``
    (another node, or -1 for the anchor) by ``rels[i]`` ∈ {'<', '<='}. A chain
    n0 ⋚ n1 ⋚ ... ⋚ anchor is the special case parents[i] = i + 1.

    ``factors`` hold token inputs (where = 'n0', 'n1', ... or 't' for the anchor
    token) and carry states (where = 'P'). ``weights[i]`` is node i's decay
    weight; carry factors decay by ρ^{carry_weight} from the chunk start. For a
    state pass the anchor is the chunk end (no token) and a root's rel is ''.
    """

    coef: Fraction
    factors: tuple[Factor, ...]
    weights: tuple[int, ...]
    parents: tuple[int, ...]
    rels: tuple[str, ...]
    carry_weight: int
    free: tuple[str, ...]

    @property
    def nodes(self) -> int:
        return len(self.weights)

    def children(self, n: int) -> list[int]:
        return [c for c, p in enumerate(self.parents) if p == n]

    def subtree_weight(self, n: int) -> int:
        return self.weights[n] + sum(self.subtree_weight(c) for c in self.children(n))

    @property
    def carry(self) -> tuple[Factor, ...]:
        return tuple(f for f in self.factors if f.where == "P")

    def renumbered(self, order: list[int]) -> "ChainTerm":
        """Node order[k] becomes node k."""
        new_of = {old: new for new, old in enumerate(order)}
        factors = tuple(replace(f, where=f"n{new_of[int(f.where[1:])]}")
                        if f.kind == "input" and f.where.startswith("n") else f for f in self.factors)
        return replace(self, factors=factors,
                       weights=tuple(self.weights[o] for o in order),
                       parents=tuple(-1 if self.parents[o] < 0 else new_of[self.parents[o]]
                                     for o in order),
                       rels=tuple(self.rels[o] for o in order))

    def key(self):
        best = None
        for order in itertools.permutations(range(self.nodes)):
            t = self.renumbered(list(order))
            factors, _ = canonical_key(Monomial(Fraction(1), t.factors), t.free)
            k = (factors, t.weights, t.parents, t.rels, t.carry_weight)
            if best is None or k < best:
                best = k
        return best

    def text(self) -> str:
        rels = []
        for n in range(self.nodes):
            parent = ANCHOR if self.parents[n] < 0 else f"n{self.parents[n]}"
            rels.append(f"n{n} in chunk" if not self.rels[n] else f"n{n} {self.rels[n]} {parent}")
        decay = [f"w(n{n})={w}" for n, w in enumerate(self.weights) if w]
        if self.carry_weight:
            decay.append(f"w(P)={self.carry_weight}")
        mono = Monomial(self.coef, self.factors).text()
        where = ", ".join(rels) if self.nodes else "carry only"
        return f"{mono}   [{where}{'; ' + ', '.join(decay) if decay else ''}]"


# -- raw trees -----------------------------------------------------------------

@dataclass(frozen=True)
class _Node:
    label: str
    weight: int
    parent: str          # another node label, or the anchor
    rel: str             # '<' to a node; '<=' to a token anchor; '' to a chunk end


@dataclass(frozen=True)
class _Raw:
    mono: Monomial
    nodes: tuple[_Node, ...]


class _Labels:
    def __init__(self):
        self.n = 0

    def new(self) -> str:
        self.n += 1
        return f"s{self.n}"


def _local(alg: Algebra, x: Summary, indices, parent: str, rel: str, labels: _Labels,
           taken: set[str]) -> list[_Raw]:
    """Trees of summary x over the local tokens before (rel) ``parent``."""
    out: list[_Raw] = []
    for delta in instantiate(x.delta, indices, taken):
        s = labels.new()
        out.append(_Raw(delta.at(s), (_Node(s, x.weight, parent, rel),)))
    for cross in x.crosses:
        cross = instantiate(Poly(x.indices, (cross,)), indices, taken)[0]
        b = next(f for f in cross.factors if f.where == "B")
        z = alg.summary(b.name)
        s = labels.new()
        z_terms = [_Raw(m.at(s), (_Node(s, z.weight, parent, rel),))
                   for m in instantiate(z.delta, b.indices, taken)]
        options = [z_terms]
        for f in cross.factors:
            if f.where == "A":
                options.append(_local(alg, alg.summary(f.name), f.indices, s, "<", labels, taken))
        for combo in itertools.product(*options):
            mono = Monomial(cross.coef, ())
            nodes: tuple[_Node, ...] = ()
            for raw in combo:
                mono, nodes = mono.times(raw.mono), nodes + raw.nodes
            out.append(_Raw(mono, nodes))
    return out


def _with_carry(alg: Algebra, poly: Poly, anchor_rel: str, carry: bool) -> list[_Raw]:
    """Expand a poly over inclusive states into raw trees (state = P ⊕ L)."""
    labels = _Labels()
    results = [_Raw(Monomial(t.coef, tuple(f for f in t.factors if f.kind != "state"), t.rho), ())
               for t in poly.terms]
    per_term_states = [[f for f in t.factors if f.kind == "state"] for t in poly.terms]
    out: list[_Raw] = []
    for base, states in zip(results, per_term_states):
        taken = set(base.mono.indices()) | {i for f in states for i in f.indices} | set(poly.free)
        options = []
        for f in states:
            x = alg.summary(f.name)
            choices: list[_Raw] = []
            for term in instantiate(combine(alg, x, "P", "L"), f.indices, taken):
                choices.extend(_expand_local_factors(alg, term, anchor_rel, labels, taken, carry))
            options.append(choices)
        for combo in itertools.product(*options):
            mono, nodes = base.mono, base.nodes
            for raw in combo:
                mono, nodes = mono.times(raw.mono), nodes + raw.nodes
            out.append(_Raw(mono, nodes))
    return out


def _expand_local_factors(alg, term: Monomial, anchor_rel, labels, taken, carry) -> list[_Raw]:
    if not carry and any(f.where == "P" for f in term.factors):
        return []
    base = Monomial(term.coef, tuple(f for f in term.factors if f.where == "P"), term.rho)
    options = [[_Raw(base, ())]]
    for f in term.factors:
        if f.where == "L":
            options.append(_local(alg, alg.summary(f.name), f.indices, ANCHOR, anchor_rel, labels, taken))
    out = []
    for combo in itertools.product(*options):
        mono, nodes = Monomial(Fraction(1), ()), ()
        for raw in combo:
            mono, nodes = mono.times(raw.mono), nodes + raw.nodes
        out.append(_Raw(mono, nodes))
    return out


# -- weak orders -----------------------------------------------------------------

def _weak_orders(nodes: tuple[_Node, ...]):
    """Ordered partitions of the nodes with every child strictly before its parent."""
    labels = {n.label for n in nodes}
    children = {n.label: {c.label for c in nodes if c.parent == n.label} for n in nodes}

    def rec(placed: frozenset, remaining: frozenset):
        if not remaining:
            yield ()
            return
        ready = [n for n in sorted(remaining) if children[n] <= placed]
        for size in range(1, len(ready) + 1):
            for block in itertools.combinations(ready, size):
                for rest in rec(placed | set(block), remaining - set(block)):
                    yield (block,) + rest
    yield from rec(frozenset(), frozenset(labels))


def _linearise(raw: _Raw, free: tuple[str, ...], token_anchor: bool) -> list[ChainTerm]:
    by_label = {n.label: n for n in raw.nodes}
    carry_weight = dict(raw.mono.rho).get("L", 0)
    out = []
    for blocks in _weak_orders(raw.nodes):
        tails = [False, True] if token_anchor and blocks else [False]
        for merge_last in tails:
            if merge_last and any(by_label[n].parent != ANCHOR for n in blocks[-1]):
                continue
            chain = blocks[:-1] if merge_last else blocks
            where = {n: f"n{b}" for b, block in enumerate(chain) for n in block}
            if merge_last:
                where.update({n: ANCHOR for n in blocks[-1]})
            factors = tuple(replace(f, where=where.get(f.where, f.where)) for f in raw.mono.factors)
            weights = tuple(sum(by_label[n].weight for n in block) for block in chain)
            k = len(chain)
            root_rel = "<" if token_anchor else ""
            out.append(ChainTerm(raw.mono.coef, factors, weights,
                                 tuple(range(1, k)) + (-1,) if k else (),
                                 ("<",) * (k - 1) + (root_rel,) if k else (),
                                 carry_weight, free))
    return out


# -- cancellation and '<' + '=' -> '<=' --------------------------------------------

def _merge_into_parent(term: ChainTerm, n: int) -> ChainTerm:
    """Node n at the same time as its parent (or as the anchor token)."""
    p = term.parents[n]
    keep = [m for m in range(term.nodes) if m != n]
    factors = []
    for f in term.factors:
        if f.kind == "input" and f.where == f"n{n}":
            f = replace(f, where=ANCHOR if p < 0 else f"n{p}")
        factors.append(f)
    weights = list(term.weights)
    if p >= 0:
        weights[p] += weights[n]
    parents = [p if q == n else q for q in term.parents]
    merged = replace(term, factors=tuple(factors), weights=tuple(weights), parents=tuple(parents))
    return merged.renumbered(keep)


def _with_rel(term: ChainTerm, n: int, rel: str) -> ChainTerm:
    return replace(term, rels=term.rels[:n] + (rel,) + term.rels[n + 1:])


def _swap_leaf(term: ChainTerm, a: int) -> ChainTerm | None:
    """For a leaf a with a <= b = parent(a), b's only child: the term with a and
    b exchanged and the leaf edge strict (b < a). Together the two cover a and
    b unordered below b's old parent."""
    b = term.parents[a]
    if b < 0 or term.children(a) or term.children(b) != [a] or term.rels[a] != "<=":
        return None
    swapped = term.renumbered([b if m == a else a if m == b else m for m in range(term.nodes)])
    # renumbering exchanged the contents of a and b but also their edges: restore
    parents, rels = list(term.parents), list(term.rels)
    rels[a] = "<"
    return replace(swapped, parents=tuple(parents), rels=tuple(rels))


def _unordered(term: ChainTerm, a: int) -> ChainTerm:
    b = term.parents[a]
    parents = list(term.parents)
    parents[a] = term.parents[b]
    rels = list(term.rels)
    rels[a] = term.rels[b]
    return replace(term, parents=tuple(parents), rels=tuple(rels))


def simplify(terms: list[ChainTerm]) -> list[ChainTerm]:
    table: dict = {}
    for t in terms:
        k = t.key()
        if k in table:
            table[k] = replace(table[k], coef=table[k].coef + t.coef)
        else:
            table[k] = t
    table = {k: t for k, t in table.items() if t.coef != 0}
    changed = True
    while changed:
        changed = False
        for k, t in list(table.items()):
            if k not in table:
                continue
            for n in range(t.nodes):
                if t.rels[n] == "<":      # '<' plus '=' is '<='
                    partner = _merge_into_parent(t, n)
                    merged = _with_rel(t, n, "<=")
                else:                     # a <= b plus b < a is a, b unordered
                    partner = _swap_leaf(t, n)
                    merged = _unordered(t, n) if partner is not None else None
                if partner is None:
                    continue
                pk = partner.key()
                if pk != k and pk in table and table[pk].coef == t.coef:
                    del table[pk], table[k]
                    table[merged.key()] = merged
                    changed = True
                    break
    return sorted(table.values(), key=lambda t: (t.nodes, len(t.carry), repr(t.key())))


# -- public derivations --------------------------------------------------------------

def output_chains(alg: Algebra, poly: Poly | None = None, carry: bool = True) -> list[ChainTerm]:
    """The output (or normalizer) at token t of a chunk, state = P ⊕ L_t."""
    poly = alg.output if poly is None else poly
    raws = _with_carry(alg, poly, "<=", carry)
    terms = [c for r in raws for c in _linearise(r, poly.free, token_anchor=True)]
    return simplify(terms)


def summary_chains(alg: Algebra, x: Summary, carry: bool = True) -> list[ChainTerm]:
    """x(P ⊕ chunk) with the chunk's tokens all before its end (the state pass)."""
    poly = Poly(x.indices, (Monomial(Fraction(1), (x.factor(""),)),))
    raws = _with_carry(alg, poly, "", carry)
    terms = [c for r in raws for c in _linearise(r, poly.free, token_anchor=False)]
    return simplify(terms)
