"""Packed symmetric states in the chunk program: power attention's state is
never held as d^p entries, and its φ tiles are expanded on the fly.

A summary declared symmetric in a group of p slots over a dim of size n is held
by its C(n+p-1, p) entries with non-decreasing indices (the storage layout of
``runtime.packing``) whenever every use of it in the chunk program is one of:

  produce   p token factors of one input at one time fill the group:
            Σ_T x[T,i1]...x[T,ip] ...  ->  spow(x)[T,α] ...      (α = the packed index)
  consume   the group is contracted with p copies of one token vector, in an output term
            (not a state's update: the state pass is split over every packed dim):
            x[T,i1]...x[T,ip] X[i1..ip,...]  ->  Σ_α m(α) spow(x)[T,α] X[α,...]
  pass      the group of a packed carried state fills the group of the result
            (the carry term X@P of X's own update)

where spow(x)[T,α] = x[T,α_1]...x[T,α_p] and m(α) = p!/Π(multiplicities)! counts
the full index tuples a packed entry stands for. The p token tiles become one
[C, D_packed] tile that kernels form on the fly (p column selections and p-1 products),
never the d^p tensor. A state with any other use (HLA2's S, read as S C) stays
unpacked. Deciding is a greatest fixpoint: a packed state may only pass into a
packed one.
"""
from __future__ import annotations

import itertools
from collections import Counter
from dataclasses import dataclass, replace
from math import comb, factorial

from hladsl.ir.contract import plan
from hladsl.ir.operands import Kind, Operand, exhaustive


@dataclass(frozen=True)
class PackedDim:
    name: str      # the dim name kernels use (D_<name>, offs_<name>)
    base: str      # the dim of every slot of the group
    power: int     # p
    size: int      # C(n + p - 1, p)


def multiplicities(n: int, p: int) -> list[int]:
    """m(α) for the packed entries of a p-group over n, in storage order."""
    out = []
    for combo in itertools.combinations_with_replacement(range(n), p):
        m = factorial(p)
        for c in Counter(combo).values():
            m //= factorial(c)
        out.append(m)
    return out


def drop_repeated_slots(items, groups) -> tuple:
    """``items`` (one per slot) without the slots a packed group folds into its first."""
    gone = {s for g in groups for s in g[1:]}
    return tuple(x for k, x in enumerate(items) if k not in gone)


def packed_dim_name(base: str, p: int, taken) -> str:
    name = f"{base}_pow{p}"
    while name in taken:
        name += "_"
    return name


class _Packer:
    def __init__(self, program):
        self.program = program
        alg = program.algebra
        self.sizes = dict(program.sizes)
        self.groups = {s.name: s.symmetric for s in alg.streaming if s.symmetric}
        self.dims = {s.name: s.dims for s in alg.streaming}
        self.in_derived = program.derived_reads()
        self.packed_dims: dict[tuple[str, int], PackedDim] = {}
        taken = set(alg.dims)
        for name, groups in self.groups.items():
            for g in groups:
                base, p = self.dims[name][g[0]], len(g)
                if (base, p) not in self.packed_dims:
                    pd = PackedDim(packed_dim_name(base, p, taken), base, p,
                                   comb(self.sizes[base] + p - 1, p))
                    taken.add(pd.name)
                    self.packed_dims[(base, p)] = pd

    # -- one term -------------------------------------------------------------------
    def rewrite(self, term, packed: set[str], produces: str | None):
        """The term with packed operands, or the set of states whose use here fails."""
        ops = list(term.operands)
        failed: set[str] = set()
        replace_tokens: dict[int, tuple] = {}   # token operand -> (power operand, or None: drop)
        new_carry: dict[int, tuple] = {}
        output = tuple(term.output)
        uses = Counter(i for o in ops for i in o.indices)
        for k, o in enumerate(ops):
            if o.kind is not Kind.CARRY or o.name not in packed:
                continue
            idx = list(o.indices)
            for g in self.groups[o.name]:
                slots = [o.indices[s] for s in g]
                if produces in packed and set(slots) <= set(output) and \
                        self._output_group(produces, output, slots):
                    continue                      # pass: a packed group into a packed group
                if produces is not None:
                    # consumed by a state's update: the state pass runs one program per block
                    # of every packed dim, so none can sum over one (HLA3's carried W0 reads
                    # SQ(A) against a product of segment B's tokens)
                    failed.add(o.name)
                    break
                tokens = self._token_group(ops, slots, uses, output)
                if tokens is None:
                    failed.add(o.name)
                    break
                self._mark(replace_tokens, ops, tokens, slots[0], True, o.name, g)
            if o.name in failed:
                continue
            new_carry[k] = drop_repeated_slots(idx, self.groups[o.name])
        if produces in packed:
            for g in self.groups[produces]:
                slots = [output[s] for s in g]
                fed = any(o.kind is Kind.CARRY and o.name in packed
                          and any({o.indices[s] for s in g2} == set(slots) for g2 in self.groups[o.name])
                          for o in ops)
                if not fed:
                    tokens = self._token_group(ops, slots, uses, None)
                    if tokens is None:
                        failed.add(produces)
                        continue
                    self._mark(replace_tokens, ops, tokens, slots[0], False, produces, g)
            output = drop_repeated_slots(output, self.groups[produces])
        if failed:
            return failed
        new_ops = []
        for k, o in enumerate(ops):
            if k in replace_tokens:
                if replace_tokens[k] is not None:
                    new_ops.append(replace_tokens[k])
            elif k in new_carry:
                new_ops.append(replace(o, indices=new_carry[k]))
            else:
                new_ops.append(o)
        if len(new_ops) == len(ops) and output == term.output:
            return term
        return self._replanned(term, tuple(new_ops), output, packed)

    def _token_group(self, ops, slots, uses, consumed_from: tuple | None):
        """The p token operands of one input at one time carrying ``slots`` (each
        slot index used by one token and, when consumed, by the state itself), or None."""
        if len(set(slots)) != len(slots):
            return None
        if consumed_from is not None and any(i in consumed_from for i in slots):
            return None          # a consumed group must be summed, not kept
        expected = 1 if consumed_from is None else 2
        found = []
        for i in slots:
            owners = [k for k, o in enumerate(ops) if o.kind is Kind.TOKEN and o.indices[1] == i]
            if len(owners) != 1 or uses[i] != expected:
                return None
            found.append(owners[0])
        first = ops[found[0]]
        if any(ops[k].name != first.name or ops[k].indices[0] != first.indices[0] for k in found):
            return None
        return found

    def _output_group(self, produces, output, slots):
        return any({output[s] for s in g} == set(slots) for g in self.groups[produces])

    def _mark(self, replace_tokens, ops, tokens, alpha, weighted, state, group):
        base, p = self.dims[state][group[0]], len(group)
        pd = self.packed_dims[(base, p)]
        head = ops[tokens[0]]
        replace_tokens[tokens[0]] = Operand(Kind.POWER, head.name, (head.indices[0], alpha),
                                                 packed=pd.name, power=p, weighted=weighted)
        for k in tokens[1:]:
            replace_tokens[k] = None

    def _replanned(self, term, operands, output, packed):
        sizes = {}
        for o in operands:
            sizes.update(self.index_sizes(o, packed))
        p = plan(tuple(o.indices for o in operands), output, tuple(sorted(sizes.items())))
        return replace(term, operands=operands, output=output, plan=p)

    def index_sizes(self, o, packed) -> dict[str, int]:
        return _INDEX_SIZES[o.kind](self, o, packed)

    def _token_sizes(self, o, packed):
        alg = self.program.algebra
        return {o.indices[0]: self.program.chunk, o.indices[1]: self.sizes[alg.inputs[o.name]]}

    def _power_sizes(self, o, packed):
        return {o.indices[0]: self.program.chunk, o.indices[1]: self._pd(o.packed).size}

    def _carry_sizes(self, o, packed):
        return dict(zip(o.indices, self.layout(o.name, packed)[1]))

    def _derived_sizes(self, o, packed):
        (d,) = [d for d in self.program.derived if d.name == o.name]
        return {i: self.sizes[dim] for m in d.poly.terms for f in m.factors
                for i, dim in zip(f.indices, self.dims[f.name]) if i in o.indices}

    def _time_sizes(self, o, packed):
        return {i: self.program.chunk for i in o.indices}

    def _no_sizes(self, o, packed):
        raise ValueError(f"{o.kind} operands do not occur in the forward program")

    def _pd(self, name) -> PackedDim:
        return next(pd for pd in self.packed_dims.values() if pd.name == name)

    def layout(self, state: str, packed) -> tuple[tuple[str, ...], tuple[int, ...]]:
        """(dim names, sizes) of a state as the program holds it."""
        dims = list(self.dims[state])
        if state in packed:
            for g in self.groups[state]:
                dims[g[0]] = self.packed_dims[(dims[g[0]], len(g))].name
            dims = list(drop_repeated_slots(dims, self.groups[state]))
        sizes = {pd.name: pd.size for pd in self.packed_dims.values()} | self.sizes
        return tuple(dims), tuple(sizes[d] for d in dims)


_INDEX_SIZES = exhaustive({
    Kind.TOKEN: _Packer._token_sizes, Kind.POWER: _Packer._power_sizes,
    Kind.CARRY: _Packer._carry_sizes, Kind.DERIVED: _Packer._derived_sizes,
    Kind.MASK: _Packer._time_sizes, Kind.DECAY: _Packer._time_sizes,
    Kind.COTANGENT: _Packer._no_sizes}, "symmetric packing (index sizes)")


def pack_symmetric(program):
    """``program`` with every symmetric state whose uses all allow it held packed."""
    packer = _Packer(program)
    packed = set(packer.groups) - packer.in_derived
    while True:
        failed = set()
        for produces, terms in _all_terms(program):
            for t in terms:
                r = packer.rewrite(t, packed, produces)
                if isinstance(r, set):
                    failed |= r
        if not failed:
            break
        packed -= failed
    def rewritten(terms, produces):
        return tuple(packer.rewrite(t, packed, produces) for t in terms)
    used = {packer.packed_dims[(packer.dims[s][g[0]], len(g))] for s in packed
            for g in packer.groups[s]}
    return replace(
        program,
        output=rewritten(program.output, None),
        normalizer=rewritten(program.normalizer, None),
        states=tuple((name, rewritten(ts, name)) for name, ts in program.states),
        layouts=tuple((s, packer.layout(s, packed)[0]) for s, _ in program.states),
        packed=tuple(sorted(used, key=lambda pd: pd.name)))


def _all_terms(program):
    yield None, program.output
    yield None, program.normalizer
    yield from program.states
