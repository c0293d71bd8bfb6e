"""Chunk program: every chain term of the output and of each streaming
summary, as a tensor network over [C, ·] tiles with a contraction plan.

Operands of a term are ``ir.operands.Operand`` (tokens, carried states, masks
between consecutive times, decays to the chunk end or from its start).
Carry-only output terms are summed into derived carry tensors first (HLA2's
W_P = S_P C_P − G_P): one matmul per chunk instead of one per term.
"""
from __future__ import annotations

from dataclasses import dataclass
from fractions import Fraction

from hladsl.ir.algebra import Algebra
from hladsl.ir.chains import ANCHOR, ChainTerm
from hladsl.ir.contract import Plan, plan
from hladsl.ir.expr import Monomial, Poly, canonical_key
from hladsl.ir.operands import Kind, Operand, exhaustive
from hladsl.ir.symmetric import PackedDim


@dataclass(frozen=True)
class TermProgram:
    coef: float
    operands: tuple[Operand, ...]
    output: tuple[str, ...]
    plan: Plan
    carry_weight: int              # state pass: result scaled by exp(W Λ_end)
    source: str                    # the chain term, for comments


@dataclass(frozen=True)
class Derived:
    """A per-chunk tensor summed from carried states (free: its indices)."""
    name: str
    poly: Poly


@dataclass(frozen=True)
class ChunkProgram:
    algebra: Algebra
    chunk: int
    sizes: tuple[tuple[str, int], ...]
    gated: bool
    derived: tuple[Derived, ...]
    output: tuple[TermProgram, ...]
    normalizer: tuple[TermProgram, ...]
    states: tuple[tuple[str, tuple[TermProgram, ...]], ...]   # streaming summary -> terms
    layouts: tuple[tuple[str, tuple[str, ...]], ...] = ()       # summary -> dims as held
    packed: tuple[PackedDim, ...] = ()                           # packed symmetric dims

    def state_dims(self, name: str) -> tuple[str, ...]:
        """The dims of a streaming summary as the program holds it (packed groups
        are one dim of ``packed``)."""
        return dict(self.layouts)[name]

    def state_shape(self, name: str) -> tuple[int, ...]:
        sizes = dict(self.sizes) | {pd.name: pd.size for pd in self.packed}
        return tuple(sizes[d] for d in self.state_dims(name))

    def is_packed(self, name: str) -> bool:
        return any(d in {pd.name for pd in self.packed} for d in self.state_dims(name))

    def masks_per_output_term(self) -> int:
        """The most [C, C] masks (decay tiles exp(W(Λ_t − Λ_s)) where gated) one output or
        normalizer term multiplies: 1 for a first-order mechanism (linear), more where a term
        pairs several tokens of the chunk (HLA2's second-order terms)."""
        return max((sum(o.kind is Kind.MASK for o in t.operands) for t in self.output + self.normalizer),
                   default=0)

    def derived_reads(self) -> frozenset[str]:
        """The states the derived carries read."""
        return frozenset(f.name for d in self.derived for m in d.poly.terms for f in m.factors)

    def flops(self) -> dict[str, int]:
        return {"output": sum(t.plan.flops for t in self.output + self.normalizer),
                "state": sum(t.plan.flops for _, ts in self.states for t in ts)}


def _time(where: str) -> str:
    return "T" + where


def _operands(term: ChainTerm, token_anchor: bool, carry_factors, gated: bool) -> list[Operand]:
    ops = []
    for f in term.factors:
        if f.kind == "input":
            ops.append(Operand(Kind.TOKEN, f.name, (_time(f.where), f.indices[0])))
    ops.extend(carry_factors)
    for n in range(term.nodes):   # one mask per forest edge; decay telescoped along it
        here, parent = _time(f"n{n}"), term.parents[n]
        weight = term.subtree_weight(n) if gated else 0
        if parent >= 0:
            ops.append(Operand(Kind.MASK, "", (_time(f"n{parent}"), here), term.rels[n], weight))
        elif token_anchor:
            ops.append(Operand(Kind.MASK, "", (_time(ANCHOR), here), term.rels[n], weight))
        elif weight:
            ops.append(Operand(Kind.DECAY, "", (here,), weight=weight, anchor="end"))
    if token_anchor and term.carry_weight and gated:
        ops.append(Operand(Kind.DECAY, "", (_time(ANCHOR),), weight=term.carry_weight, anchor="start"))
    return ops


def _carry_ops(term: ChainTerm):
    return [Operand(Kind.CARRY, f.name, f.indices) for f in term.factors if f.where == "P"]


def _program(term: ChainTerm, operands, output, ctx, token_anchor, extra=()) -> TermProgram:
    alg, dims, chunk, gated = ctx
    sizes = index_sizes(tuple(term.factors) + tuple(extra), alg, dims)
    sizes.update((i, chunk) for o in operands for i in o.indices if i.startswith("T"))
    p = plan(tuple(o.indices for o in operands), output, tuple(sorted(sizes.items())))
    carry_weight = 0 if token_anchor or not gated else term.carry_weight
    return TermProgram(float(term.coef), tuple(operands), output, p, carry_weight, term.text())


def carry_group(anchor, carry, free) -> tuple[tuple, tuple[str, ...]]:
    """(the key of an output term's token factors ``anchor``, the indices its carried factors
    ``carry`` share with them and the output's ``free`` ones): terms with equal keys read one sum
    of carried-state products, a derived carry (here; ``ir.carried``: a summary of its own)."""
    interface = tuple(sorted({i for f in anchor for i in f.indices} | set(free)))
    inner_free = tuple(i for i in interface if any(i in f.indices for f in carry))
    return canonical_key(Monomial(Fraction(1), anchor), interface), inner_free


def _output_programs(alg, poly, chains, sizes, derived: list[Derived], prefix: str, gated: bool):
    out_index = (_time(ANCHOR),) + poly.free
    programs, groups = [], {}

    def direct(term):   # the term's own operands, carried states included
        return _program(term, _operands(term, True, _carry_ops(term), gated), out_index, sizes, True)

    for term in chains:
        if term.nodes == 0 and term.carry:
            # carry only: anchor tokens x (sum of carry contractions) -> derived tensor
            anchor = tuple(f for f in term.factors if f.kind == "input")
            carry = tuple(f for f in term.factors if f.kind != "input")
            anchor_key, inner_free = carry_group(anchor, carry, poly.free)
            key = (anchor_key, inner_free, term.carry_weight)
            groups.setdefault(key, (term, anchor, inner_free, []))[3].append(
                Monomial(term.coef, carry))
            continue
        programs.append(direct(term))
    shared = []
    for group in groups.values():
        term, _, _, monos = group
        if len(monos) == 1 and len(monos[0].factors) == 1:   # one carried state: read it directly
            programs.append(direct(term))
        else:
            shared.append(group)
    for n, (term, anchor, inner_free, monos) in enumerate(shared):
        name = f"{prefix}{n}"
        derived.append(Derived(name, Poly(inner_free, tuple(monos))))
        rep = ChainTerm(Fraction(1), anchor, (), (), (), term.carry_weight, poly.free)
        ops = _operands(rep, True, [Operand(Kind.DERIVED, name, inner_free)], gated)
        text = f"{Monomial(Fraction(1), anchor).text()} {name}[{','.join(inner_free)}]   [carry only]"
        extra = [f for m in monos for f in m.factors]
        prog = _program(rep, ops, out_index, sizes, True, extra)
        programs.insert(n, TermProgram(1.0, prog.operands, prog.output, prog.plan, 0, text))
    return tuple(programs)


@dataclass(frozen=True)
class Chains:
    """The chain normal forms a chunk program is built from (ir.chains)."""
    output: tuple[ChainTerm, ...]
    normalizer: tuple[ChainTerm, ...] | None
    states: tuple[tuple[str, tuple[ChainTerm, ...]], ...]


def build_chunk_program(alg: Algebra, chains: Chains, chunk: int,
                        dim_sizes: tuple[tuple[str, int], ...], gated: bool = True) -> ChunkProgram:
    """The chunk program (every state unpacked) for these dim sizes; ``gated=False``
    drops every decay (no gates: masks are plain 0/1 and carries do not decay)."""
    size_items = (alg, dict(dim_sizes), chunk, gated)
    derived: list[Derived] = []
    output = _output_programs(alg, alg.output, chains.output, size_items, derived, "W", gated)
    normalizer = (_output_programs(alg, alg.normalizer, chains.normalizer, size_items, derived,
                                   "Wn", gated)
                  if alg.normalizer is not None else ())
    states = []
    for name, terms in chains.states:
        x = alg.summary(name)
        states.append((name, tuple(
            _program(t, _operands(t, False, _carry_ops(t), gated), x.indices, size_items, False)
            for t in terms)))
    layouts = tuple((s.name, s.dims) for s in alg.streaming)
    return ChunkProgram(alg, chunk, dim_sizes, gated, tuple(derived), output, normalizer,
                        tuple(states), layouts)


def index_sizes(term_factors, alg: Algebra, dims: dict[str, int]) -> dict[str, int]:
    sizes = {}
    for f in term_factors:
        if f.kind == "input":
            sizes[f.indices[0]] = dims[alg.inputs[f.name]]
        elif f.kind == "state":
            s = alg.summary(f.name)
            sizes.update((i, dims[d]) for i, d in zip(f.indices, s.dims))
    for f in term_factors:   # eye[i, j]: both indices share the dim of whichever is known
        if f.kind == "eye":
            a, b = f.indices
            sizes.setdefault(a, sizes.get(b))
            sizes.setdefault(b, sizes.get(a))
    return sizes


# -- sizes of the indices of a term's operands -----------------------------------------
def _token_sizes(p: ChunkProgram, o: Operand) -> dict:
    return {o.indices[0]: p.chunk, o.indices[1]: dict(p.sizes)[p.algebra.inputs[o.name]]}


def _power_sizes(p: ChunkProgram, o: Operand) -> dict:
    (pd,) = [pd for pd in p.packed if pd.name == o.packed]
    return {o.indices[0]: p.chunk, o.indices[1]: pd.size}


def _carry_sizes(p: ChunkProgram, o: Operand) -> dict:
    return dict(zip(o.indices, p.state_shape(o.name)))


def _derived_sizes(p: ChunkProgram, o: Operand) -> dict:
    (d,) = [d for d in p.derived if d.name == o.name]
    return {i: n for i, n in poly_sizes(p, d.poly).items() if i in o.indices}


def _time_sizes(p: ChunkProgram, o: Operand) -> dict:
    return {i: p.chunk for i in o.indices}


def _no_sizes(p: ChunkProgram, o: Operand) -> dict:
    return {}    # a cotangent's indices are the term's output: sized by the other operands


_OPERAND_SIZES = exhaustive({Kind.TOKEN: _token_sizes, Kind.POWER: _power_sizes, Kind.CARRY: _carry_sizes,
                             Kind.DERIVED: _derived_sizes, Kind.MASK: _time_sizes, Kind.DECAY: _time_sizes,
                             Kind.COTANGENT: _no_sizes}, "index sizes")


def operand_sizes(p: ChunkProgram, operands) -> dict[str, int]:
    """The extent of every index of ``operands`` (a cotangent's: sized by the others)."""
    sizes = {}
    for o in operands:
        sizes.update(_OPERAND_SIZES[o.kind](p, o))
    return sizes


def poly_sizes(p: ChunkProgram, poly) -> dict:
    sizes = dict(p.sizes)
    out = {}
    for m in poly.terms:
        for f in m.factors:
            if f.kind != "state" or m.rho:
                raise ValueError(f"derived carry factor {f} is not a plain carried state")
            out.update((i, sizes[d]) for i, d in zip(f.indices, p.algebra.summary(f.name).dims))
    return out
