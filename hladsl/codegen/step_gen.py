"""The decode step: the derived serial update
X_t = X_{t-1} ⊕ token_t (``ir.combine.serial``) as a plan of contractions, and
that plan as one generated Triton kernel.

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

The kernel (``step_source``, template ``templates/step_kernel.py.jinja``): one
program per (batch row, head[, block of the value dim]). Phase 1 holds every
whole state in fp32 registers and walks the T tokens; each packed dim then gets
a loop over blocks of its rows, each block walking the T tokens again (a row
state's update reads only the same rows, the token and ρ_t). Outputs of row
states are summed over the blocks in a [T, value block] accumulator.

Shared split (``shared_splittable``): where some states lack the value dim (HLA2's
S, every normalizer state), programs may still own blocks of it: every block reads
those value-free states' old values and forms the new ones in registers for its
outputs, without writing them; the last block of a (row, head) to finish --
counted by an atomic per (state row, head) -- then updates them in place from
their old values, which no block has written (one launch;
``runtime.launch.step_value_block`` picks the block). That update is planned on
its own (``step_plan(..., only=...)``): without the outputs, a symmetric state
the outputs read whole (HLA2's S) is a row state, updated along its contiguous
packed rows. Run 106 (H100): hla2 0.55 -> 0.72 of copy bandwidth, hla3_masked
0.54 -> 0.70, hla3 0.41 -> 0.53.
"""
from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, replace
from functools import lru_cache
from math import comb

from hladsl.codegen import templates
from hladsl.codegen.templates import render_template

from hladsl.codegen.steps import Block, Tile, comment
from hladsl.codegen.triton_gen import _ident
from hladsl.ir.algebra import Algebra
from hladsl.ir.combine import serial
from hladsl.ir.contract import Plan, plan
from hladsl.ir.operands import Kind, Operand, exhaustive
from hladsl.ir.symmetric import PackedDim, drop_repeated_slots, packed_dim_name
from hladsl.version import __version__

TEMPLATE = "step_kernel.py.jinja"
STEP_KINDS = (Kind.TOKEN, Kind.POWER, Kind.CARRY)
PACKED_ROWS = 64     # default rows of a packed dim per block


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


_INDEX_DIMS = exhaustive({Kind.TOKEN: _token_dims, Kind.POWER: _power_dims, Kind.CARRY: _carry_dims},
                         "the step plan (index dims)", STEP_KINDS)


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


# -- the kernel -----------------------------------------------------------------------------

class _Region:
    """Straight-line code of one token-loop body (phase 1, or one packed dim's
    block): token loads, ρ powers, every update, the outputs and their store."""

    def __init__(self, plan: StepPlan, gated: bool, temps: int, row_dim: str = ""):
        self.plan, self.gated, self.row_dim = plan, gated, row_dim
        self.block = Block()
        self.block._temps = temps          # temps numbered apart from other regions
        self.inputs: dict[str, str] = {}   # token inputs loaded as whole vectors
        self.rhos: set[int] = set()
        self.weighted = False

    def tile(self, o: Operand, state_prefix: str) -> Tile:
        return _TILE[o.kind](self, o, state_prefix)

    def _token(self, o, prefix):
        self.inputs[o.name] = self.plan.algebra.inputs[o.name]
        return Tile(f"in_{o.name}", o.indices)

    def _carry(self, o, prefix):
        return Tile(f"{prefix}_{o.name}", o.indices)

    def _power(self, o, prefix):
        """spow(x)[α] on this block's rows: p gathered loads of x's feature row."""
        pd, x = o.packed, o.name
        parts = [self.block.define(
            f"tl.load(in_{x}_ptr + base_{x} + t * str_{x}_t + pkc_{pd}_{r} * str_{x}_f, "
            f"mask=valid_{pd}, other=0.0).to(ACC) * scl_{x}") for r in range(o.power)]
        expr = " * ".join(parts)
        if o.weighted:
            self.weighted = True
            expr += f" * pkm_{pd}"
        why = f"{o.text()} = " + " ".join(f"{x}[α_{r + 1}]" for r in range(o.power)) + \
            (" · m(α)" if o.weighted else "") + "   (packed rows, never d^p)"
        return Tile(self.block.define(expr, why), o.indices)

    def terms(self, terms, target: str, state_prefix: str) -> None:
        """``target`` = Σ terms (each contracted in its plan's order)."""
        block = self.block
        for n, t in enumerate(terms):
            block.sizes = {i: f"B_{d}" for i, d in self.plan.index_dims(t).items()}
            tiles = [self.tile(o, state_prefix) for o in t.operands]
            for s in t.plan.steps:
                tiles.append(_contract(block, tiles[s.left], tiles[s.right], s.indices))
            value = block.reduce(tiles[t.plan.result], t.output).var
            factors = ([repr(abs(t.coef))] if abs(t.coef) != 1 else []) + \
                ([f"rho{t.rho}"] if t.rho and self.gated else [])
            if t.rho and self.gated:
                self.rhos.add(t.rho)
            expr = " * ".join(factors + [value])
            if n == 0:
                block.assign(target, expr if t.coef > 0 else f"-({expr})")
            else:
                block.assign(target, f"{target} {'+' if t.coef > 0 else '-'} {expr}")


def _contract(block: Block, a: Tile, b: Tile, out) -> Tile:
    """Σ a · b over the indices not in ``out``, as a broadcast product and sums
    (matvecs and outer products, the step's only contractions). The larger
    tile keeps its axis order (no layout change of a state tile); the result's
    axes are in that order, ``Block.reduce`` orders them at the end of a term."""
    out = tuple(out)
    a, b = (_presum(block, a, b, out), _presum(block, b, a, out))
    orders = []
    for big, small in ((a, b), (b, a)):
        if len(big.indices) >= len(small.indices):
            orders.append(list(big.indices) + [i for i in small.indices if i not in big.indices])
    union = next((u for u in orders if [i for i in u if i in out] == list(out)), orders[0])
    parts = []
    for t in (a, b):
        own = [i for i in union if i in t.indices]
        expr = block.arrange(t, own)
        if own and len(own) < len(union):
            expr += "[" + ", ".join(":" if i in t.indices else "None" for i in union) + "]"
        parts.append(expr)
    expr = " * ".join(parts)
    for axis in range(len(union) - 1, -1, -1):
        if union[axis] not in out:
            expr = f"tl.sum({expr}, axis={axis})"
    kept = tuple(i for i in union if i in out)
    summed = [i for i in union if i not in out]
    why = f"[{','.join(kept)}] = {a.label()} · {b.label()}" + \
        (f"   (sum over {','.join(summed)})" if summed else "")
    return Tile(block.define(expr, why), kept)


def _presum(block: Block, t: Tile, other: Tile, out) -> Tile:
    """Indices only ``t`` has and the result drops are summed before the product."""
    keep = tuple(i for i in t.indices if i in out or i in other.indices)
    return t if keep == t.indices else block.reduce(t, keep)


_TILE = exhaustive({Kind.TOKEN: _Region._token, Kind.POWER: _Region._power, Kind.CARRY: _Region._carry},
                   "the Triton step lowering (operand tiles)", STEP_KINDS)


def _slot(k: int, r: int) -> str:
    return "" if r == 1 else "[" + ", ".join(":" if j == k else "None" for j in range(r)) + "]"


def _layout(plan: StepPlan, name: str) -> dict:
    """Offsets (storage strides str_<name>_<axis>), load mask and store mask of a
    state's held tile. A whole symmetric state is stored packed: its group of two
    slots (i, j) reads packed position _sym2(i, j) and writes only i <= j."""
    s = plan.algebra.summary(name)
    held = plan.dims_of(name)
    r = len(held)
    offs = [f"offs_{d}{_slot(k, r)}" for k, d in enumerate(held)]
    valid = [f"({o} < D_{d})" for o, d in zip(offs, held)]
    terms, keep = [], []
    if plan.row_dim(name):
        terms = [f"{o} * str_{name}_{k}" for k, o in enumerate(offs)]
    else:
        heads = {g[0]: g for g in s.symmetric}
        folded = {k for g in s.symmetric for k in g[1:]}
        axis = 0
        for k, o in enumerate(offs):
            if k in folded:
                continue
            if k in heads:
                g = heads[k]
                if len(g) != 2:
                    raise ValueError(f"the step kernel holds {name} whole; it supports symmetric "
                                     f"groups of two slots there, not {len(g)}")
                a, b = offs[g[0]], offs[g[1]]
                terms.append(f"_sym2({a}, {b}, D_{held[k]}) * str_{name}_{axis}")
                keep.append(f"({a} <= {b})")
            else:
                terms.append(f"{o} * str_{name}_{axis}")
            axis += 1
    axes = len(s.dims) - sum(len(g) - 1 for g in s.symmetric)     # storage axes after [N, H]
    return {"off": " + ".join(terms), "ld": " & ".join(valid), "st": " & ".join(valid + keep),
            "axes": axes, "dims": list(held), "index": ",".join(s.indices)}


def _reads(terms) -> set[str]:
    return {o.name for t in terms for o in t.operands if o.kind is Kind.CARRY}


def kernel_context(plan: StepPlan, gated: bool) -> dict:
    """Everything the template needs, as plain data (also the cache key's part)."""
    alg = plan.algebra
    _ident("mechanism", alg.name)
    for x, d in alg.inputs.items():
        _ident("input", x), _ident("dim", d)
    for s in alg.streaming:
        _ident("summary", s.name)
    for pd in plan.packed:
        _ident("packed dim", pd.name)
    _check_phases(plan)
    shared = shared_splittable(plan)
    free = list(value_free(plan)) if shared else []
    # the shared split's last block updates the value-free states alone: on packed rows
    # where they are symmetric (no gather of the other half; the same storage)
    free_plan = step_plan(alg, dict(plan.sizes), only=free) if free else None
    # one entry a name: packed_dim_name gives one (base, power) the same name in both plans
    packed = list({pd.name: {"name": pd.name, "base": pd.base, "power": pd.power, "size": pd.size}
                   for pd in (*plan.packed, *(free_plan.packed if free_plan else ()))}.values())
    return {
        "name": alg.name,
        "sizes": [[d, n] for d, n in plan.sizes],
        "dims": list(alg.dims) + [pd["name"] for pd in packed],
        "inputs": [{"name": x, "dim": d} for x, d in alg.inputs.items()],
        "packed": packed,
        "gated": gated,
        "normalize": bool(plan.normalizer),
        "states": [{"name": s.name, **_layout(plan, s.name)} for s in alg.streaming],
        "regions": _regions(plan, gated),
        "direct": not plan.packed,
        "value_dim": plan.value_dim,
        "split": splittable(plan),
        "shared": shared,
        "free": free,
        "free_states": [{"name": n, **_layout(free_plan, n)} for n in free],
        "free_regions": _regions(free_plan, gated) if free else [],
        "equations": serial_text(alg),
    }


def _check_phases(plan: StepPlan) -> None:
    """Whole states and each packed dim's row states must update apart (a row
    block walks the tokens on its own), and an output term may read one row
    state only (its sum over the blocks is then a sum of block sums)."""
    for name, terms in plan.states:
        rd = plan.row_dim(name)
        bad = sorted(n for n in _reads(terms) if plan.row_dim(n) != rd)
        if bad:
            raise ValueError(f"the step kernel updates {name} {'on rows of ' + rd if rd else 'whole'}"
                             f", but its update reads {', '.join(bad)}")
    for t in plan.output + plan.normalizer:
        kinds = {plan.row_dim(n) for n in _reads([t])}
        if len(kinds) > 1 or (kinds - {""} and len(_reads([t])) > 1):
            raise ValueError(f"the step kernel sums an output term over one row state at a time; "
                             f"{t.source} reads {sorted(_reads([t]))}")


def _regions(plan: StepPlan, gated: bool) -> list[dict]:
    """The token-loop bodies of ``plan``'s states and outputs: whole states first,
    then one per packed dim (a plan of some states alone, ``step_plan(only=...)``,
    gives their updates without output code: the shared split's last block)."""
    alg = plan.algebra
    equations = {s.name: line for s, line in zip(alg.streaming, serial_text(alg))}
    names_of = [name for name, _ in plan.states]
    groups = [("", [n for n in names_of if not plan.row_dim(n)])]
    groups += [(pd.name, [n for n in names_of if plan.row_dim(n) == pd.name]) for pd in plan.packed]
    regions, temps = [], 0
    for rd, names in groups:
        outs = {key: tuple(t for t in terms if {plan.row_dim(n) for n in _reads([t])} <= {rd}
                           and (rd == "" or _reads([t])))
                for key, terms in (("num", plan.output), ("den", plan.normalizer))}
        if not names and not any(outs.values()):
            continue
        region = _Region(plan, gated, temps, rd)
        for name in names:
            region.block.lines.append("")
            region.block.note(equations[name])
            region.terms(dict(plan.states)[name], f"nx_{name}", "st")
        for key, terms in outs.items():
            if terms:
                region.block.lines.append("")
                region.block.note(f"{key}_t = " + "".join(
                    (" - " + t.source[1:] if t.source.startswith("-") else " + " + t.source)
                    if n else t.source for n, t in enumerate(terms)))
                region.terms(terms, key, "nx")
        temps = region.block._temps
        regions.append({"row_dim": rd, "states": names, "code": region.block.text(),
                        "inputs": [{"name": x, "dim": d} for x, d in region.inputs.items()],
                        "rhos": sorted(region.rhos), "num": bool(outs["num"]),
                        "den": bool(outs["den"]), "outputs": bool(plan.output),
                        "weighted": region.weighted})
    return regions


def template_text() -> str:
    return templates.template_text(TEMPLATE)


def render(context: dict, version: str) -> str:
    return render_template(TEMPLATE, version=version, **context)


def step_source(alg: Algebra, sizes, gated: bool) -> str:
    """The Python/Triton module source of ``alg``'s decode step (uncached)."""
    return render(kernel_context(step_plan(alg, sizes), gated), __version__)


_MODULES: dict = {}


def step_kernel(alg: Algebra, sizes, gated: bool):
    """(module, context): the imported module with ``step_kernel`` (rendered once,
    then served from the disk cache, hladsl.codegen.cache)."""
    key = (id(alg), tuple(sorted(dict(sizes).items())), bool(gated))
    hit = _MODULES.get(key)
    if hit is None or hit[0] is not alg:
        from hladsl.codegen.cache import cache_key, load_module
        context = kernel_context(step_plan(alg, sizes), gated)
        module = load_module(f"{context['name']}_step", cache_key(context, template_text()),
                             lambda: render(context, __version__))
        hit = _MODULES[key] = (alg, module, context)
    return hit[1], hit[2]
