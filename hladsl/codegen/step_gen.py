"""The decode step as generated Triton kernels (template
``templates/step_kernel.py.jinja``), from its plan (``codegen.step_plan``).

``step_kernel``: one program per (batch row, head[, block of the value dim]).
Phase 1 holds every whole state in fp32 registers and walks the T tokens; each
packed dim then gets a loop over blocks of its rows, each block walking the T
tokens again (a row state's update reads only the same rows, the token and ρ_t).
Outputs of row states are summed over the blocks in a [T, value block] accumulator.

Shared split (``shared_splittable``): where some states lack the value dim (HLA2's
S, every normalizer state), programs may still own blocks of it: every block reads
those value-free states' old values and forms the new ones in registers for its
outputs, without writing them; the last block of a (row, head) to finish --
counted by an atomic per (state row, head) -- then updates them in place from
their old values, which no block has written (one launch). That update is planned
on its own (``step_plan(..., only=...)``): without the outputs, a symmetric state
the outputs read whole (HLA2's S) is a row state, updated along its contiguous
packed rows. Run 106 (H100): hla2 0.55 -> 0.72 of copy bandwidth, hla3_masked
0.54 -> 0.70, hla3 0.41 -> 0.53.

Bridged split (``step_plan.bridge_split``): ``free_kernel``, one program per (row,
head), updates the value-free states in place and writes every token's bridges to
a scratch row [B, T, H, BR_W] (the state dtype); ``value_kernel``, over value blocks, holds only
the states with the value dim and reads the bridges (DERIVED operands) back.
"""
from __future__ import annotations

import math

from hladsl.codegen import templates
from hladsl.codegen.step_plan import (BRIDGED_KINDS, StepPlan, bridge_split, serial_text,
                                      shared_splittable, splittable, step_plan, value_free)
from hladsl.codegen.steps import Block, Tile
from hladsl.codegen.templates import render_template
from hladsl.codegen.triton_gen import _ident
from hladsl.ir.algebra import Algebra
from hladsl.ir.operands import Kind, Operand, exhaustive
from hladsl.version import __version__

TEMPLATE = "step_kernel.py.jinja"
PACKED_ROWS = 64     # default rows of a packed dim per block


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

    def _bridge(self, o, prefix):
        """A bridge of this token, as free_kernel wrote it."""
        off, mask = bridge_layout(self.plan, o.name)
        expr = f"tl.load({_BRIDGE_ROW} + {off}" + (f", mask={mask}, other=0.0)" if mask else ")")
        return Tile(self.block.define(expr, f"{o.text()} from free_kernel"), o.indices)

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


_TILE = exhaustive({Kind.TOKEN: _Region._token, Kind.POWER: _Region._power, Kind.CARRY: _Region._carry,
                    Kind.DERIVED: _Region._bridge}, "the Triton step lowering (operand tiles)",
                   BRIDGED_KINDS)


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
    # a [n, n] symmetric state held whole loads its upper triangle (row i's j >= i are
    # contiguous packed positions: coalesced) and adds the transpose in registers; the
    # whole tile gathered from min/max positions took hla2's free_kernel 36 µs, this 10
    # (S alone, B = 64, H = 16, d = 64, H100, run 114; a copy of its bytes: 4.4). It is
    # stored as it is loaded: i <= j
    tri = ""
    if r == 2 and not plan.row_dim(name) and s.symmetric == ((0, 1),):
        # row i's packed positions as a linear function of j (no min/max, whose
        # offsets the compiler cannot see are contiguous: 39 µs -> 11 there, run 116)
        tri = f"{offs[0]} == {offs[1]}"
        terms = [f"_upper({offs[0]}, {offs[1]}, D_{held[0]}) * str_{name}_0"]
    return {"off": " + ".join(terms), "ld": " & ".join(valid), "st": " & ".join(valid + keep),
            "tri": tri, "axes": axes, "dims": list(held), "index": ",".join(s.indices)}


# a token's row of bridges in the scratch [B, T, H, BR_W]
_BRIDGE_ROW = "br_ptr + ((b * T + t) * H + h) * BR_W"


def bridge_layout(plan: StepPlan, name: str) -> tuple[str, str]:
    """(offset in a token's row of bridges, mask or '') of bridge ``name`` (a vector
    over one dim or a scalar: ``bridge_split``), the bridges one after another."""
    start = []
    for other, dims in plan.derived:
        if other == name:
            break
        start.append(f"D_{dims[0]}" if dims else "1")
    dims = dict(plan.derived)[name]
    parts = ["(" + " + ".join(start) + ")"] if start else []
    parts += [f"offs_{d}" for d in dims]
    return " + ".join(parts) or "0", " & ".join(f"(offs_{d} < D_{d})" for d in dims)


def bridge_width(plan: StepPlan) -> int:
    """Elements of a token's row of bridges (in the state dtype)."""
    sizes = dict(plan.sizes)
    return sum(math.prod(sizes[d] for d in dims) for _, dims in plan.derived)


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
        **_bridged_context(plan, gated),
    }


def _bridged_context(plan: StepPlan, gated: bool) -> dict:
    """The bridged split's kernels (free_kernel, value_kernel), where it applies."""
    split = bridge_split(plan)
    if split is None:
        return {"bridges": [], "bridge_width": 0, "free_names": [], "value_names": [],
                "value_packed": [], "bridge_free_regions": [], "bridge_value_regions": []}
    return {"bridges": [{"name": b.name, "dims": list(b.dims)} for b in split.bridges],
            "bridge_width": bridge_width(split.free),
            "free_names": [n for n, _ in split.free.states],
            "value_names": [n for n, _ in split.value.states],
            "value_packed": [pd.name for pd in split.value.packed],   # free_kernel walks none
            "bridge_free_regions": _regions(split.free, gated, split.bridges),
            "bridge_value_regions": _regions(split.value, gated)}


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


def _regions(plan: StepPlan, gated: bool, bridges=()) -> list[dict]:
    """The token-loop bodies of ``plan``'s states and outputs: whole states first,
    then one per packed dim (a plan of some states alone, ``step_plan(only=...)``,
    gives their updates without output code: the shared split's last block).
    ``bridges`` (free_kernel's, over whole states): each computed after the updates
    and stored to this token's row of bridges."""
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
        if not names and not any(outs.values()) and not (bridges and rd == ""):
            continue
        region = _Region(plan, gated, temps, rd)
        for name in names:
            region.block.lines.append("")
            region.block.note(equations[name])
            region.terms(dict(plan.states)[name], f"nx_{name}", "st")
        for br in bridges if rd == "" else ():
            region.block.lines.append("")
            region.block.note(f"{br.name}[{','.join(br.dims)}] = " + " + ".join(t.source for t in br.terms)
                              + ("   (the normalizer)" if not br.dims and plan.algebra.normalizer else "")
                              + f"   (states {'before' if br.prefix == 'st' else 'after'} the token)")
            region.terms(br.terms, br.name, br.prefix)
            off, mask = bridge_layout(plan, br.name)
            region.block.lines.append(f"tl.store({_BRIDGE_ROW} + {off}, {br.name}"
                                      + (f", mask={mask})" if mask else ")"))
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
