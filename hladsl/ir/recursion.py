"""A derived carry's own recursion over chunks, from the combine.

A derived carry W is a polynomial of carried states (HLA2's W0 = S C - G). Expanding
W(A⊕B) by each state's combine and taking away ρ_B^w W(A) leaves terms in the chunk's
deltas (where B) and the carried states (where A); a term X@A ρ_B^{w_X} Y@B beside
X@B Y@B, for a state X whose combine has no cross term (X(A⊕B) = ρ_B^{w_X} X(A) + X(B)),
folds into X@N Y@B, with X@N the state at the chunk's end. HLA2:

    W0(A⊕B) = ρ_B^2 W0(A) + S@N[i,j] C@B[j,e] - G@B[i,e]

one d x d x dv product a chunk where carrying G took two (G += ρ ΔS C, W0 = S C - G). A
state that the recursion does not read, that W holds as a lone linear term (G) and that
nothing else reads, need not be carried at all: the scan recovers it from W at the end
(G = S C - W0). ``recursion`` derives this and proves it (``check``: the recursion with
each X@N expanded by the combine equals W(A⊕B) expanded, symbolically), or returns None.

The trade: W itself accumulates without cancellation (HLA2's final G at T = 65536 is ~30x
closer to float64 than the two-pass schedule's), but a recovered state carries the rounding
of its recovery, an absolute error of the order of its other terms (|S| |C| eps for G): a
G that is exactly 0, or an initial G passed through an empty sequence, comes back within
that, not bit for bit. Limits: the dropped state must appear as W's lone term with W's own
index order (a transposed ``G[e, i]`` gets no recursion), and the codegen takes a recursion
only where it needs fewer products (``codegen.triton_gen._derived_recursion``).

``chunk_terms`` writes the recursion's increment as terms of one chunk (each delta by its
state's own chunk terms): what a two-stage scan computes for every chunk at once, so that
its second stage walks W elementwise instead of the state it drops
(``codegen.triton_gen._staged_recursion``).
"""
from __future__ import annotations

from dataclasses import dataclass, replace
from fractions import Fraction

from hladsl.ir.algebra import Algebra
from hladsl.ir.chunk import ChunkProgram, TermProgram, operand_sizes
from hladsl.ir.combine import expand
from hladsl.ir.contract import plan
from hladsl.ir.expr import Monomial, Poly, canonical_key, fresh_names
from hladsl.ir.operands import Kind, Operand

START, END, DELTA = "A", "N", "B"   # the carried state at the chunk start / end, the chunk's delta


@dataclass(frozen=True)
class Recursion:
    name: str            # the derived carry
    free: tuple[str, ...]   # its indices, as ``terms`` and ``rest`` name them
    weight: int          # W(A) decays by ρ_B^weight over the chunk
    terms: Poly          # the rest of W(A⊕B): factors where START, END or DELTA; ρ_B powers
    dropped: str         # the state the scan need not carry ("" where none)
    dropped_coef: Fraction = Fraction(1)
    rest: Poly | None = None   # W's other terms (where 'P'): dropped = (W - rest) / dropped_coef

    def text(self, indices: tuple[str, ...] | None = None) -> str:
        """The recursion in one line; ``indices``: W's own index names (for ``free``). Summed
        indices print as s0, s1, ... (the program's own are _0, _1, ...)."""
        shown = self.terms.map_terms(lambda m: m.relabel(
            {i: f"s{i[1:]}" for i in m.dummies(self.free) if i.startswith("_")}))
        terms = shown.text()
        line = (f"{self.name}(A⊕B) = ρ_B^{self.weight} {self.name}(A)"
                + (f" - {terms[1:]}" if terms.startswith("-") else f" + {terms}"))
        if indices:
            line += "   (" + ", ".join(f"{w} = {i}" for w, i in zip(self.free, indices)) + ")"
        if self.dropped:
            line += f"   ({self.dropped} not carried: recovered from {self.name} at the end)"
        return line


def increment(alg: Algebra, poly: Poly, weight: int) -> Poly:
    """W(A⊕B) - ρ_B^weight W(A), every state of W(A⊕B) expanded by its combine."""
    joint = expand(alg, poly.at("AB"), "AB", START, DELTA)
    return joint + poly.at(START).map_terms(lambda m: m.with_rho(DELTA, weight)).scaled(-1)


def _key(m: Monomial, free) -> tuple:
    return canonical_key(m, free), m.coef


def recursion(alg: Algebra, name: str, poly: Poly, read_elsewhere: set[str]) -> Recursion | None:
    """W = ``poly`` (state factors where 'P') as a recursion over chunks, or None where a
    term of W(A⊕B) - ρ^w W(A) reads two carried states at once or W is not homogeneous in
    decay. ``read_elsewhere``: states something besides W reads (they stay carried)."""
    free = tuple(f"w{n}" for n in range(len(poly.free)))
    poly = poly.renamed(free)
    weights = {sum(alg.summary(f.name).weight for f in m.factors) for m in poly.terms}
    if len(weights) != 1 or any(m.rho for m in poly.terms):
        return None
    (weight,) = weights
    delta = poly.at(DELTA).canonical()
    cross = (increment(alg, poly, weight) + delta.scaled(-1)).canonical()
    if any(sum(f.where == START for f in m.factors) != 1 for m in cross.terms):
        return None
    # X@A ρ^{w_X} Y@B + X@B Y@B -> X@N Y@B where X's combine has no cross term
    left = {_key(m, free): m for m in cross.terms}
    terms = []
    for m in delta.terms:
        for k, f in enumerate(m.factors):
            x = alg.summary(f.name)
            if x.crosses:
                continue
            key = _key(m.at(START, only=k).with_rho(DELTA, x.weight), free)
            if key in left:
                del left[key]
                m = m.at(END, only=k)
                break
        terms.append(m)
    walked = Poly(free, tuple(terms) + tuple(left.values())).canonical()
    carried = {f.name for m in walked.terms for f in m.factors if f.where in (START, END)}
    dropped, coef, rest = "", Fraction(1), None
    for n, m in enumerate(poly.terms):
        (f, *more) = m.factors
        if (not more and f.name not in carried | read_elsewhere and tuple(f.indices) == free
                and sum(g.name == f.name for t in poly.terms for g in t.factors) == 1):
            dropped, coef = f.name, Fraction(m.coef)
            rest = Poly(free, poly.terms[:n] + poly.terms[n + 1:])
            break
    found = Recursion(name, free, weight, walked, dropped, coef, rest)
    check(alg, poly, found)
    return found


def check(alg: Algebra, poly: Poly, rec: Recursion) -> None:
    """ρ_B^w W(A) + terms, each X@N expanded by its combine, is W(A⊕B) expanded: a proof, not
    a test (raises AssertionError where the derivation is wrong). ``poly``: W as the chunk
    program holds it (its indices are renamed to ``rec.free``)."""
    walked = expand(alg, rec.terms, END, START, DELTA)
    defect = (increment(alg, poly.renamed(rec.free), rec.weight) + walked.scaled(-1)).canonical()
    if defect.terms:
        raise AssertionError(f"the recursion of {rec.name} is wrong by {defect.text()}")


def free_first(f, free):
    """Factor ``f`` with the indices of each symmetric slot group reordered, free ones first:
    the same tensor (the group's slots are interchangeable) in the orientation W's own
    definition reads it (HLA2's W0 = S[w0,_1] C[_1,w1]; its recursion's S@N[_0,w0] C@B[_0,w1]
    becomes S@N[w0,_0] C@B[_0,w1]), so a product needs no transpose and a state held
    asymmetric all the same (an initial state as given) enters W as W's definition has it."""
    idx = list(f.indices)
    for group in f.symmetric:
        slots = sorted(group)
        names = sorted((idx[s] for s in slots), key=lambda i: i not in free)
        for slot, name in zip(slots, names):
            idx[slot] = name
    return replace(f, indices=tuple(idx))


def chunk_terms(program: ChunkProgram, rec: Recursion) -> tuple[TermProgram, ...] | None:
    """``rec``'s increment W(A⊕B) - ρ_B^w W(A) as state-pass terms of one chunk: in each
    monomial the one DELTA factor Y@B becomes Y's token-only terms (Y's own summary of the
    chunk, scaled to its end: the chunk program's delta of Y), a START factor the carried
    state, an END factor the carried state at the chunk's end (``anchor="end"``), ρ_B^p a
    carry weight p (gated programs: ρ is 1 without gates). HLA2: S@N[w0,s] (k[n,s] v[n,w1]) -
    (G's chunk terms). None where a monomial has no DELTA factor or several, or Y is no state
    the chunk program holds (a combine-only one) or has no token-only term."""
    states = dict(program.states)
    out = []
    for m in rec.terms.terms:
        deltas = [f for f in m.factors if f.where == DELTA]
        rho = dict(m.rho)
        weight = rho.pop(DELTA, 0)
        if len(deltas) != 1 or rho or deltas[0].name not in states:
            return None
        (y,) = deltas
        weight = weight if program.gated else 0
        carried = tuple(Operand(Kind.CARRY, f.name, free_first(f, rec.free).indices,
                                anchor="end" if f.where == END else "")
                        for f in m.factors if f.where != DELTA)
        own = [t for t in states[y.name]
               if not any(o.kind in (Kind.CARRY, Kind.DERIVED) for o in t.operands)]
        if not own:
            return None
        for t in own:
            taken = set(m.indices()) | set(rec.free)
            inner = [i for o in t.operands for i in o.indices if i not in t.output]
            names = dict(zip(t.output, y.indices))
            names.update(zip(dict.fromkeys(inner), fresh_names(taken, len(set(inner)), "y")))
            operands = carried + tuple(replace(o, indices=tuple(names[i] for i in o.indices)) for o in t.operands)
            sizes = operand_sizes(program, operands)
            pl = plan(tuple(o.indices for o in operands), rec.free, tuple(sorted(sizes.items())))
            out.append(TermProgram(float(m.coef) * t.coef, operands, rec.free, pl, weight,
                                   f"{m.text()}, {y.name}@B = {t.source}"))
    return tuple(out)
