"""The decode step's plan: the derived serial update X_t = X_{t-1} ⊕ token_t
(``ir.combine.serial``) as contractions, and its split into kernels.

``step_plan`` rewrites every monomial of every serial update, of the output and
of the normalizer into a ``StepTerm``: operands (``ir.operands.Operand``; here a
TOKEN is the token vector x[i] of the current step, CARRY a state -- the previous
one in an update, the current one in an output -- and POWER the packed symmetric
power spow(x)[α]) with a contraction plan from ``ir.contract.plan``, so rank-1
factors are applied as matvecs (k (kᵀ C), never (k kᵀ) C).

Symmetric states. A state whose one symmetric group is only ever filled by p
copies of one token vector (produced), contracted with p copies of one token
vector (consumed, weighted by the multiplicity m(α)) or carried over into a state
of the same packed dim (passed) is held on its packed rows, as it is stored
(power attention's U: C(d+p-1, p) rows, never d^p): a "row state". Any other
symmetric state (HLA2's S, read as S C) is held whole and read/written packed.

Value blocks. Where every state holds the value dim once (``splittable``), programs
own blocks of it. Where some states lack it (HLA2's S, HLA3's SK and SQ, normalizer
states: ``value_free``), their terms are cut out (``bridge_split``): a value term's
contraction tree reads them only through its maximal value-free subtrees that read a
state (HLA2's qᵀS_t, HLA3's kᵀSQ_{t-1} and SK_{t-1}(kᵀSQ_{t-1}), the whole normalizer),
the "bridges": one kernel updates the value-free states and writes each token's
bridges, the value blocks read them as DERIVED operands and hold no value-free state.
"""
from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, replace
from functools import lru_cache
from math import comb

from hladsl.codegen.steps import comment
from hladsl.ir.algebra import Algebra
from hladsl.ir.combine import serial
from hladsl.ir.contract import Plan, Step, plan
from hladsl.ir.operands import Kind, Operand, exhaustive
from hladsl.ir.symmetric import PackedDim, drop_repeated_slots, packed_dim_name

STEP_KINDS = (Kind.TOKEN, Kind.POWER, Kind.CARRY)
# and in a bridged plan's value terms: the bridges, DERIVED operands (bridge_split)
BRIDGED_KINDS = STEP_KINDS + (Kind.DERIVED,)


@dataclass(frozen=True)
class StepTerm:
    coef: float
    rho: int                        # power of ρ_t = exp(g_t)
    operands: tuple[Operand, ...]
    output: tuple[str, ...]         # result indices, in the held layout of the target
    plan: Plan
    source: str                     # the serial monomial, for comments


@dataclass(frozen=True)
class StepPlan:
    algebra: Algebra
    sizes: tuple[tuple[str, int], ...]
    packed: tuple[PackedDim, ...]                            # packed dims of row states
    layouts: tuple[tuple[str, tuple[str, ...]], ...]         # state -> dims as held
    states: tuple[tuple[str, tuple[StepTerm, ...]], ...]     # streaming state -> its update
    output: tuple[StepTerm, ...]
    normalizer: tuple[StepTerm, ...]
    value_dim: str                                            # the output's dim
    derived: tuple[tuple[str, tuple[str, ...]], ...] = ()    # bridge -> its dims (bridge_split)

    def dims_of(self, name: str) -> tuple[str, ...]:
        return dict(self.layouts)[name]

    def row_dim(self, name: str) -> str:
        """The packed dim a row state is held on, '' for a whole state."""
        return next((d for d in self.dims_of(name) if d in self.packed_names()), "")

    def packed_names(self) -> set[str]:
        return {pd.name for pd in self.packed}

    def size(self, dim: str) -> int:
        return (dict(self.sizes) | {pd.name: pd.size for pd in self.packed})[dim]

    def index_dims(self, t: StepTerm) -> dict[str, str]:
        out = {}
        for o in t.operands:
            out.update(_INDEX_DIMS[o.kind](self, o))
        return out


def _token_dims(p: StepPlan, o: Operand):
    return {o.indices[0]: p.algebra.inputs[o.name]}


def _power_dims(p: StepPlan, o: Operand):
    return {o.indices[0]: o.packed}


def _carry_dims(p: StepPlan, o: Operand):
    return dict(zip(o.indices, p.dims_of(o.name)))


def _derived_dims(p: StepPlan, o: Operand):
    return dict(zip(o.indices, dict(p.derived)[o.name]))


_INDEX_DIMS = exhaustive({Kind.TOKEN: _token_dims, Kind.POWER: _power_dims, Kind.CARRY: _carry_dims,
                          Kind.DERIVED: _derived_dims}, "the step plan (index dims)", BRIDGED_KINDS)


# -- the plan ------------------------------------------------------------------------------

def step_plan(alg: Algebra, sizes, only=None) -> StepPlan:
    """The serial update of ``alg`` at dim ``sizes`` ({dim: n} or its items). With
    ``only`` (state names), the updates of those states alone, no output: a
    symmetric state that the outputs read whole may then be a row state (HLA2's S,
    updated alone, is produced by k k and passed: it updates along its packed rows)."""
    return _step_plan(alg, tuple(sorted(dict(sizes).items())),
                      None if only is None else frozenset(only))


@lru_cache(maxsize=64)
def _step_plan(alg: Algebra, sizes, only) -> StepPlan:
    if len(alg.output.free) != 1:
        raise ValueError(f"the step needs an output with one free index, {alg.name} has "
                         f"{alg.output.free}")
    groups = {s.name: s.symmetric for s in alg.streaming}
    updates = {s.name: serial(alg, s) for s in alg.streaming if only is None or s.name in only}
    outputs = [alg.output] + ([alg.normalizer] if alg.normalizer is not None else [])
    polys = list(updates.items()) + ([(None, poly) for poly in outputs] if only is None else [])
    for _, poly in polys:
        for m in poly.terms:
            for f in m.factors:
                if f.kind not in ("input", "state"):
                    raise ValueError(f"the step plan does not handle {f.kind} factors ({f})")
    rows = _row_states(alg, polys, groups)
    packed = _packed_dims(alg, rows, dict(sizes))
    layouts = {}
    for s in alg.streaming:
        held = list(s.dims)
        if s.name in rows:
            (g,) = s.symmetric
            held[g[0]] = packed[(s.dims[g[0]], len(g))].name
            held = list(drop_repeated_slots(held, s.symmetric))
        layouts[s.name] = tuple(held)
    shell = StepPlan(alg, sizes, tuple(packed.values()), tuple(layouts.items()), (), (), (),
                     _value_dim(alg))

    def terms(produces, poly):
        out = []
        for m in poly.terms:
            ops, free = _rewrite(m, poly.free, produces, rows, groups, alg, packed)
            t = StepTerm(float(m.coef), dict(m.rho).get("t", 0), ops, free, None, m.text())
            index_sizes = {i: shell.size(d) for i, d in shell.index_dims(t).items()}
            out.append(replace(t, plan=plan(tuple(o.indices for o in ops), free,
                                             tuple(sorted(index_sizes.items())))))
        return tuple(out)

    return replace(shell, states=tuple((name, terms(name, p)) for name, p in updates.items()),
                   output=terms(None, alg.output) if only is None else (),
                   normalizer=terms(None, alg.normalizer) if alg.normalizer is not None and only is None
                   else ())


def _row_states(alg, polys, groups) -> set[str]:
    """States with one symmetric group whose every use is produce, consume or
    pass: a greatest fixpoint (a row state may only pass into a row state)."""
    rows = {name for name, g in groups.items() if len(g) == 1}
    while True:
        failed = set()
        for produces, poly in polys:
            for m in poly.terms:
                r = _rewrite(m, poly.free, produces, rows, groups, alg)
                if isinstance(r, set):
                    failed |= r
        if not failed:
            return rows
        rows -= failed


def _packed_dims(alg, rows, sizes) -> dict[tuple[str, int], PackedDim]:
    """(base dim, p) -> its packed dim, for the groups of the row states."""
    packed, taken = {}, set(alg.dims)
    for s in alg.streaming:
        if s.name in rows:
            (g,) = s.symmetric
            base, p = s.dims[g[0]], len(g)
            if (base, p) not in packed:
                packed[(base, p)] = PackedDim(packed_dim_name(base, p, taken), base, p,
                                              comb(sizes[base] + p - 1, p))
                taken.add(packed[(base, p)].name)
    return packed


def _value_dim(alg) -> str:
    """The dim of the output's free index."""
    (o_index,) = alg.output.free
    for m in alg.output.terms:
        for f in m.factors:
            if o_index in f.indices:
                return (alg.inputs[f.name] if f.kind == "input"
                        else alg.summary(f.name).dims[f.indices.index(o_index)])
    raise ValueError(f"{alg.name}'s output index {o_index} is not read from any factor")


def _operand(f) -> Operand:
    if f.kind == "input":
        return Operand(Kind.TOKEN, f.name, f.indices)
    return Operand(Kind.CARRY, f.name, f.indices)


def _rewrite(m, free, produces, rows, groups, alg, packed=None):
    """(operands, result indices) of monomial ``m`` with the row states in
    ``rows`` on their packed rows, or the set of row states whose use here is
    neither produce, consume nor pass. Without ``packed`` only checks."""
    ops = [_operand(f) for f in m.factors]
    uses = Counter(i for o in ops for i in o.indices)
    out = tuple(free)
    powers: dict[int, tuple] = {}     # first token operand -> (α, weighted, p); others dropped
    dropped: set[int] = set()
    carries: dict[int, tuple[str, ...]] = {}
    failed: set[str] = set()
    target = groups[produces][0] if produces in rows else None
    target_slots = [out[s] for s in target] if target else []
    alpha = target_slots[0] if target else None
    fed = False
    for k, o in enumerate(ops):
        if o.kind is not Kind.CARRY or o.name not in rows:
            continue
        (g,) = groups[o.name]
        slots = [o.indices[s] for s in g]
        idx = list(o.indices)
        if (target and set(slots) == set(target_slots) and len(set(slots)) == len(slots)
                and all(uses[i] == 1 for i in slots) and _same_kind(o.name, produces, alg, groups)):
            fed = True                               # pass: rows into the same rows
            idx[g[0]] = alpha
        else:
            found = _token_group(ops, slots, uses, out, consumed=True)
            if found is None:
                failed.add(o.name)
                continue
            powers[found[0]] = (slots[0], True, len(g))
            dropped.update(found[1:])
        carries[k] = drop_repeated_slots(idx, (g,))
    if target and not fed:
        found = _token_group(ops, target_slots, uses, out, consumed=False)
        if found is None:
            failed.add(produces)
        else:
            powers[found[0]] = (alpha, False, len(target))
            dropped.update(found[1:])
    if failed:
        return failed
    if packed is None:
        return None
    new = []
    for k, o in enumerate(ops):
        if k in dropped:
            continue
        if k in powers:
            a, weighted, p = powers[k]
            pd = packed[(alg.inputs[o.name], p)]
            new.append(Operand(Kind.POWER, o.name, (a,), packed=pd.name, power=p, weighted=weighted))
        elif k in carries:
            new.append(replace(o, indices=tuple(carries[k])))
        else:
            new.append(o)
    if target:
        out = drop_repeated_slots(out, (target,))
    return tuple(new), out


def _same_kind(a, b, alg, groups) -> bool:
    """Both row states' groups run over the same dim with the same p."""
    sa, sb = alg.summary(a), alg.summary(b)
    return (sa.dims[groups[a][0][0]], len(groups[a][0])) == (sb.dims[groups[b][0][0]], len(groups[b][0]))


def _token_group(ops, slots, uses, free, consumed: bool):
    """The p token operands of one input carrying ``slots`` one each (each index
    used by its token and, when consumed, by the state; never kept), or None."""
    if len(set(slots)) != len(slots):
        return None
    if consumed and any(i in free for i in slots):
        return None
    found = []
    for i in slots:
        owners = [k for k, o in enumerate(ops) if o.kind is Kind.TOKEN and o.indices == (i,)]
        if len(owners) != 1 or uses[i] != (2 if consumed else 1):
            return None
        found.append(owners[0])
    if len({ops[k].name for k in found}) != 1:
        return None
    return found


def splittable(p: StepPlan) -> bool:
    """Can programs own blocks of the value dim, each needing only its own block?
    Yes when every state holds it exactly once and every term keeps it free. A
    state without it would have to be recomputed by every block, and the block
    that writes it back in place could overwrite it before another block has read
    it (``shared_splittable`` is the way around that)."""
    return not value_free(p) and _value_blocks_own(p)


def value_free(p: StepPlan) -> tuple[str, ...]:
    """The states that do not hold the value dim (HLA2's S, every normalizer state)."""
    return tuple(name for name, _ in p.states if p.value_dim not in p.dims_of(name))


def shared_splittable(p: StepPlan) -> bool:
    """Can programs own blocks of the value dim while sharing the value-free
    states? Yes when some states lack the value dim, the others hold it once and
    every term keeps it free: a block then forms the value-free states' new values
    from their old ones without another block's data (no value-free state's update
    reads a state with the value dim: its result lacks the dim, so such a read
    would sum over it), and the last block to finish writes them."""
    return bool(value_free(p)) and _value_blocks_own(p)


def _value_blocks_own(p: StepPlan) -> bool:
    """Every state holding the value dim holds it once, every term keeps it free."""
    dv = p.value_dim
    if any(list(p.dims_of(name)).count(dv) > 1 for name, _ in p.states):
        return False
    terms = [t for _, ts in p.states for t in ts] + list(p.output) + list(p.normalizer)
    return all({i for i, d in p.index_dims(t).items() if d == dv} <= set(t.output) for t in terms)


def serial_text(alg: Algebra) -> list[str]:
    """The serial equations as ``hladsl compile --emit serial`` prints them."""
    lines = [f"{x.name}_t[{','.join(x.indices)}] = {serial(alg, x).text()}".replace("@prev", "_{t-1}")
             for x in alg.streaming]
    lines.append(f"{alg.output_name}_t = {alg.output.text()}   (states at t, inclusive)")
    if alg.normalizer is not None:
        lines.append(f"den_t = {alg.normalizer.text()};  o_t = num_t / (den_t + eps)")
    return [comment(line) for line in lines]


# -- the bridge split ------------------------------------------------------------------------

@dataclass(frozen=True)
class Bridge:
    """A value-free contraction that value terms read: the sum of ``terms`` (one
    subtree of a value term, or the whole normalizer), over the states before the
    token ("st", in an update) or after it ("nx", in an output)."""
    name: str
    terms: tuple[StepTerm, ...]
    prefix: str
    dims: tuple[str, ...]


@dataclass(frozen=True)
class BridgeSplit:
    free: StepPlan                  # the value-free states' updates alone
    value: StepPlan                 # the other states' updates and the outputs, bridges DERIVED
    bridges: tuple[Bridge, ...]


def bridge_split(p: StepPlan) -> BridgeSplit | None:
    """``p`` cut at its bridges, or None where it does not apply: no value-free
    state, a value-free state or a bridge on packed rows, a bridge of more than one
    dim, or value blocks that would not own their block (``_value_blocks_own``).
    Equal bridges of different terms (HLA3's kᵀSQ_{t-1} in G1's and G3's updates)
    are one."""
    free = set(value_free(p))
    if not free or not _value_blocks_own(p) or any(p.row_dim(n) for n in free):
        return None
    found: dict = {}
    states = tuple((name, tuple(_cut(p, t, free, "st", found) for t in terms))
                   for name, terms in p.states if name not in free)
    output = tuple(_cut(p, t, free, "nx", found) for t in p.output)
    normalizer = ()
    if p.normalizer:
        den = found["den"] = Bridge(f"br{len(found)}", p.normalizer, "nx", ())
        normalizer = (StepTerm(1.0, 0, (Operand(Kind.DERIVED, den.name, ()),), (), Plan((), 0, 0),
                               f"den_t = {den.name}"),)
    bridges = tuple(found.values())
    # a bridge is a vector or a scalar per token (a tile of more dims, a state itself,
    # would be written and read back every token: no split is cheaper)
    if any(len(b.dims) > 1 or set(b.dims) & p.packed_names() for b in bridges):
        return None
    derived = tuple((b.name, b.dims) for b in bridges)
    return BridgeSplit(
        replace(p, states=tuple((n, ts) for n, ts in p.states if n in free), output=(), normalizer=(),
                derived=derived),
        replace(p, states=states, output=output, normalizer=normalizer, derived=derived), bridges)


def _cut(p: StepPlan, t: StepTerm, free: set[str], prefix: str, found: dict) -> StepTerm:
    """``t`` with each maximal value-free subtree of its contraction tree that reads a
    state replaced by a DERIVED operand, its bridge (recorded in ``found``)."""
    n, steps, dims = len(t.operands), t.plan.steps, p.index_dims(t)

    def leaves(node):
        if node < n:
            return [node]
        s = steps[node - n]
        return leaves(s.left) + leaves(s.right)

    def indices(node):
        return t.operands[node].indices if node < n else steps[node - n].indices

    def value_free_leaf(k):
        o = t.operands[k]
        return all(dims[i] != p.value_dim for i in o.indices) and (o.kind is not Kind.CARRY or o.name in free)

    def reads_state(node):
        return any(t.operands[k].kind is Kind.CARRY for k in leaves(node))

    def size(node):
        n_elements = 1
        for i in indices(node):
            n_elements *= p.size(dims[i])
        return n_elements

    def is_bridge(node):
        if not (all(map(value_free_leaf, leaves(node))) and reads_state(node)):
            return False
        if node < n:
            return True
        # a product that grows the tile (k[a] (kᵀSQ)[b], an outer product of two
        # state reads) is left to the value blocks: the bridges are its sides that read
        # a state
        s = steps[node - n]
        return size(node) <= max(size(c) for c in (s.left, s.right) if reads_state(c))

    def bridge(node) -> Operand:
        sub = _subterm(t, node, leaves(node), indices(node))
        key = (prefix, _canonical(sub))
        if key not in found:
            found[key] = Bridge(f"br{len(found)}", (sub,), prefix,
                                tuple(dims[i] for i in indices(node)))
        return Operand(Kind.DERIVED, found[key].name, indices(node))

    return _rebuild(t, lambda node: bridge(node) if is_bridge(node) else None)


def _rebuild(t: StepTerm, replaced) -> StepTerm:
    """``t`` with the subtrees for which ``replaced(node)`` gives an operand replaced by it."""
    n, steps = len(t.operands), t.plan.steps
    ops: list[Operand] = []
    new_steps: list[tuple] = []

    def visit(node):
        leaf = replaced(node)
        if leaf is not None or node < n:
            ops.append(leaf if leaf is not None else t.operands[node])
            return ("op", len(ops) - 1)
        s = steps[node - n]
        left, right = visit(s.left), visit(s.right)
        new_steps.append((left, right, s.indices, s.flops))
        return ("step", len(new_steps) - 1)

    root = visit(t.plan.result)

    def ref(r):
        return r[1] if r[0] == "op" else len(ops) + r[1]
    out = tuple(Step(ref(a), ref(b), idx, f) for a, b, idx, f in new_steps)
    return replace(t, operands=tuple(ops), plan=Plan(out, sum(s.flops for s in out), ref(root)))


def _subterm(t: StepTerm, node: int, under: list[int], out) -> StepTerm:
    """The subtree of ``t`` at ``node`` as a term of its own (coefficient 1, no ρ)."""
    n = len(t.operands)
    keep = {k: j for j, k in enumerate(under)}
    steps: list[Step] = []

    def visit(x):
        if x < n:
            return keep[x]
        s = t.plan.steps[x - n]
        a, b = visit(s.left), visit(s.right)
        steps.append(Step(a, b, s.indices, s.flops))
        return len(under) + len(steps) - 1

    root = visit(node)
    ops = tuple(t.operands[k] for k in under)
    return StepTerm(1.0, 0, ops, tuple(out), Plan(tuple(steps), sum(s.flops for s in steps), root),
                    " ".join(o.text() for o in ops))


def _canonical(t: StepTerm) -> tuple:
    """``t`` up to the names of its indices."""
    names: dict[str, int] = {}

    def c(idx):
        return tuple(names.setdefault(i, len(names)) for i in idx)
    ops = tuple(replace(o, indices=c(o.indices)) for o in t.operands)
    return ops, tuple((s.left, s.right, c(s.indices)) for s in t.plan.steps), c(t.output), t.plan.result
