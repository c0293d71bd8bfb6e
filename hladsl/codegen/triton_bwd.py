"""Triton source for the backward program (hladsl.ir.backward): the forward
state-pass kernel (recomputes the chunk-start states), and

  cotangent_kernel  (normalized programs) grid (nC, N*H): recomputes num and den,
                    writes dnum = do / (den + eps) and dden = -Σ_e do num / (den + eps)²
  reverse_kernel    grid (N*H, blocks of each packed dim and of the value dim where
                    it splits): walks the chunks last to first with every d-state an
                    fp32 register tile; writes d(end state) of every chunk and d
                    initial state. Where a transpose sums over the value dim, the
                    d-states without it are per-block partial sums in a slot per
                    block (``reverse_partial``), which grad_kernel sums (n_rblocks)
  grad_kernel       grid (nC, N*H), one launch per set of gradient target groups
                    (constexpr TARGETS: one bit per token input, then Λ's own) and part
                    (constexpr PART of PARTS: a run of the group's networks, or the
                    whole group when PARTS == 1); one chunk each, looping over tiles
                    of a packed dim. Groups reuse nothing from each other, and parts
                    nothing from each other, so a program holds only its own tiles
                    (all targets in one program spilled registers on sm_90). A dΛ
                    network extending an input's gradient network runs in that
                    input's group; each launch adds its groups' dΛ (constexpr LAM:
                    the first stores, later ones add, in launch order)
  rdelta_kernel,    (the chunk-parallel reverse pass, ``_reverse_scan``) every chunk's
  rscan_kernel      own part of its d-states at once, then a walk applying only the carry
                    (and forward-delta) networks; in two stages (HLA3) those for the lower
  rstage_kernel,    d-states, then every chunk's increment of the upper ones from the
  rstage_scan_kernel  lower ones' stored chunk ends, then their carries' walk
  fused_bwd_kernel  (programs without packed states) grid (N*H), per set of target
                    groups: the reverse pass and, in the same walk, each chunk's token
                    and Λ gradients from the d-states in registers: no per-chunk
                    d-states in HBM

Each gradient network lowers like a forward term (``_Lowering``, ``steps``);
cotangent tiles are ``ct_num``, ``ct_den``, ``ct_end_<state>`` (d of a chunk-end
state) and ``ct_dr_<derived>``. A packed power's gradient dspow[T, α] goes back
to its token tile through one-hot [B_α, B_dim] matrices (``_dot``), per slot.
"""
from __future__ import annotations

import copy
import re
from pathlib import Path

from hladsl.codegen import templates
from hladsl.codegen.prune import prune_dead
from hladsl.codegen.templates import render_template

from hladsl.codegen.steps import Block, Tile
from hladsl.codegen.triton_gen import _Lowering, kernel_context, kernels, owned_mask, starts_read_as_sdot
from hladsl.ir.precision import precision_plan, quotient_cancelling
from hladsl.ir.backward import (
    PARALLEL,
    REVERSE,
    BackwardProgram,
    GradTerm,
    Target,
    backward_program,
)
from hladsl.ir.chunk import ChunkProgram
from hladsl.ir.operands import Kind
from hladsl.ir.scan import reverse_scan, staged_reverse
from hladsl.version import __version__

TEMPLATE = "chunk_bwd_kernels.py.jinja"


class _TransposingBlock(Block):
    """A ``Block`` that also reuses a contraction computed earlier with its operands
    named or ordered differently (the gradient networks of one term meet the same
    products as transposes: dnum vᵀ for dq, v dnumᵀ for dk)."""

    # d num and d den: their tiles, d num as loaded (raw, and transposed from dnum_ptr), dden's load
    OUTPUT_COTANGENT = re.compile(r"\b(ct_num|ct_den|rawct_num|dnum_ptr|dden_ptr)\b")

    def __init__(self, sizes=None):
        super().__init__(sizes)
        self._products: dict = {}   # canonical (operands, result) -> (var, indices, section)
        # a product with a side v ∘ x, v a vector on a kept index, is v ∘ (the product with x):
        # the product with x is often one computed already (d den's dq: (d den ∘ q) kᵀ = d den ∘ (q kᵀ))
        self.pulls_vectors = False

    def contract(self, a: Tile, b: Tile, out) -> Tile:
        key, names = self._canonical(a, b, out)
        key = (key, self.exact, self.exact_cotangents)   # an exact network does not reuse a rounded product
        hit = self._products.get(key)
        if hit is not None and hit[2] in ("pre", self.section):
            var, canon = hit[0], hit[1]
            back = {c: i for i, c in names.items()}
            self.note(f"[{','.join(out)}] = {a.label()} · {b.label()}   = {var}, computed above")
            return self._ordered(Tile(var, tuple(back[c] for c in canon)), tuple(out))
        if self.pulls_vectors:
            for x, y in ((a, b), (b, a)):
                split = self.vector_factor(x, kept=tuple(out), other=y)
                if split is not None:
                    vector, rest = split
                    self.note(f"[{','.join(out)}] = {x.label()} · {y.label()}   = {vector.label()} · ({rest.label()} · {y.label()})")
                    return self.contract(vector, self.contract(rest, y, out), out)
        r = super().contract(a, b, out)
        self._products[key] = (r.var, tuple(names[i] for i in r.indices), self.section)
        return r

    def vector_factor(self, t: Tile, kept=None, other: Tile | None = None):
        """(v, x) where ``t`` is the elementwise product v ∘ x of a vector v and a tile x over all of
        ``t``'s indices, v's index among ``kept`` and not ``other``'s (it can leave a product of
        ``t`` with ``other``: a summed index stays), or, ``kept`` None, v's index ``other``'s and
        summed (it can move onto ``other``); else None. Only where ``t`` and ``other`` share a
        summed index (a product, not an elementwise step)."""
        hit = self._elementwise.get(t.var)
        if hit is None or other is None:
            return None
        f1, f2, idx = hit
        named = dict(zip(idx, t.indices))    # (CSE may hand the temp out under other index names)
        f1, f2 = (Tile(f.var, tuple(named[i] for i in f.indices)) for f in (f1, f2))
        out = kept if kept is not None else ()
        if not any(i in other.indices and i not in out for i in t.indices):
            return None
        for v, x in ((f1, f2), (f2, f1)):
            if len(v.indices) != 1 or set(x.indices) != set(t.indices):
                continue
            i = v.indices[0]
            if (kept is not None and i in kept and i not in other.indices) or \
                    (kept is None and i in other.indices):
                return v, x
        return None

    def mark(self):
        """What the code so far makes reusable (its temps stay defined)."""
        return (dict(self._known), dict(self._products), set(self._from_dot), set(self._stateful),
                set(self._from_output_cotangent))

    def rewind(self, mark) -> None:
        """Forget what was made reusable after ``mark``: code that follows may run in a
        program where the code since ``mark`` did not (another gradient target's)."""
        known, products, from_dot, stateful, from_ct = mark
        self._known, self._products = dict(known), dict(products)
        self._from_dot, self._stateful = set(from_dot), set(stateful)
        self._from_output_cotangent = set(from_ct)

    @staticmethod
    def _canonical(a: Tile, b: Tile, out):
        first, second = sorted((a, b), key=lambda t: (t.var, t.indices))
        names: dict[str, str] = {}
        for i in first.indices + second.indices:
            names.setdefault(i, f"i{len(names)}")
        key = ((first.var, tuple(names[i] for i in first.indices)),
               (second.var, tuple(names[i] for i in second.indices)),
               frozenset(names[i] for i in out))
        return key, names


class _BwdLowering(_Lowering):
    """The forward lowering plus cotangent operands and gradient targets."""

    # POWER_COLUMNS "auto" picks the reverse and gradient kernels' packed power columns by
    # one-hot dots at every width: run 278 (H200, power p = 2 gated, d = 64, T = 16k) timed
    # fwd + bwd 19.66 ms with dots everywhere, 24.51 with every kernel gathering
    gathers_columns = False

    def __init__(self, bwd: BackwardProgram):
        super().__init__(bwd.forward)
        p = bwd.forward
        self.bwd = bwd
        self.quotient, _ = quotient_cancelling(bwd)
        # the value dim over whose blocks the reverse pass holds partial sums (while its
        # code is generated): networks reading a whole cotangent (d den) run in block 0
        self.partial_dim: str | None = None
        self.ct_dims = {"num": (None, self.o_dim), "den": (None,)}
        for name, dims in self.state_dims.items():
            self.ct_dims[f"end_{name}"] = tuple(dims)
        for d in p.derived:
            self.ct_dims[f"dr_{d.name}"] = tuple(self.derived_dims[d.name][i] for i in d.poly.free)

    def _cotangent_dims(self, o):
        return dict(zip(o.indices, self.ct_dims[o.name]))

    def _cotangent_tile(self, o, defs):
        tile = Tile(f"ct_{o.name}", o.indices)
        if o.name == "num":   # token-shaped [C, o]: read as the token tiles are (load_cotangents)
            d = self.o_dim
            self.block.raw[tile.var] = "rawct_num"
            self.block.transposed[tile.var] = (
                f"tl.load(dnum_ptr + n * sio_dnum_n + h * sio_dnum_h + (zero64 + i_c) * sio_dnum_c"
                f" + offs_{d}[:, None] + offs_t[None, :] * sio_dnum_t, mask=offs_{d}[:, None] < D_{d},"
                f" other=0.0)")
        return tile

    def region(self) -> None:
        super().region()
        self.block = _TransposingBlock()
        self.block.pulls_vectors = self.merges_last_products

    def target_shape(self, g: GradTerm) -> str:
        """The register-tile shape of ``g``'s accumulator (constexpr extents)."""
        dims = self.target_dims(g)
        return ", ".join("C" if d is None else f"B_{d}" for d in dims)

    def target_dims(self, g: GradTerm) -> tuple:
        if g.target in (Target.TOKEN, Target.POWER):
            return (None, self.input_dim[g.name])
        if g.target is Target.CARRY:
            return tuple(self.state_dims[g.name])
        if g.target is Target.DERIVED:
            return self.ct_dims[f"dr_{g.name}"]
        return (None,) if g.target is Target.LAM else ()

    # networks of one target whose last product shares a factor sum their other factors first
    # (Σ_i X_i · R = (Σ_i X_i) · R: one product for them all; ``_merged_last_products``), vectors
    # moved off a product's sides where they let it (``_TransposingBlock.pulls_vectors``)
    merges_last_products = False

    # -- one gradient network ---------------------------------------------------------------
    def grads(self, grads, acc: str, defs: dict, tiled: frozenset = frozenset()) -> None:
        """Code adding every network of ``grads`` (one target) into ``acc``; a network
        touching a ``tiled`` dim runs in the loop over its tiles, the rest before it."""
        block = self.block
        last_products = []   # (meta, a, b, out, sign, label): deferred where merges_last_products
        for g in grads:
            t = g.term
            dims = self.index_dims(t.operands)
            block.section = "loop" if any(d in tiled for d in dims.values()) else "pre"
            block.exact_cotangents = (g.target.value, g.name) in self.quotient
            block.exact = block.exact_cotangents or self.exact_network(g)
            block.lines.append("")
            block.note(g.text())
            block.note(f"    <- {t.source}")
            sizes = self.sizes(t.operands)
            dim_of = dict(zip(g.indices, self.target_dims(g)))
            sizes.update((i, "C" if dim_of[i] is None else f"B_{dim_of[i]}") for i, _ in g.broadcast)
            block.sizes = sizes
            tiles = [self.operand(o, defs) for o in t.operands]
            steps = t.plan.steps
            deferred = self._defers_last_product(g)
            for s in steps[:-1] if deferred else steps:
                tiles.append(block.contract(tiles[s.left], tiles[s.right], s.indices))
            if deferred:
                s = steps[-1]
                meta = (block.section, block.exact, block.exact_cotangents)
                a, b = self._vector_moved(tiles[s.left], tiles[s.right])
                last_products.append((meta, a, b, (tuple(s.indices), tuple(t.output)),
                                      "-" if t.coef < 0 else "+", g.text()))
                block.note("(its last product summed with its target's others: below)")
                continue
            value = block.reduce(tiles[t.plan.result], t.output).var
            if t.carry_weight:   # the forward term's carry scale exp(W Λ_end)
                value = f"{value} * tl.exp({int(t.carry_weight)} * lam_end)"
            if g.broadcast:
                value = self._broadcast(g, value, sizes)
            if g.target is Target.POWER:
                value = self._power_chain(g, block.define(value))
            mag = abs(float(t.coef))
            value = value if mag == 1.0 else f"{mag!r} * ({value})"
            ct = g.cotangent.name
            if self.partial_dim and ct in ("num", "den") and self.partial_dim not in self.ct_dims[ct]:
                # a whole cotangent without the split dim (d den): block 0 alone adds it
                value = f"tl.where(pid_{self.partial_dim} == 0, {value}, 0.0)"
            block.lines.append(f"{acc} {'-' if t.coef < 0 else '+'}= {value}")
        for (section, exact, exact_ct), shared, others, out, labels in _merged_last_products(last_products):
            block.section, block.exact, block.exact_cotangents = section, exact, exact_ct
            block.lines.append("")
            for label in labels:
                block.note(label)
            sign, first = others[0][0], others[0][1]
            expr = " ".join([first.var] + [f"{'+' if x_sign == sign else '-'} {x.var}" for x_sign, x in others[1:]])
            summed = first if len(others) == 1 else Tile(block.define(expr, "their other factors summed"),
                                                         first.indices)
            value = block.reduce(block.contract(summed, shared, out[0]), out[1]).var
            block.lines.append(f"{acc} {sign}= {value}")
        block.section, block.exact, block.exact_cotangents = "pre", False, False

    def _vector_moved(self, a: Tile, b: Tile) -> tuple[Tile, Tile]:
        """A deferred last product's factors with a vector on a summed index moved off a side
        that is v ∘ x onto the other (Σ_t (v_t x_t,i) y_t,n = Σ_t x_t,i (v_t y_t,n)): x, often a
        token tile as loaded, is then the factor other networks' last products share."""
        for x, y in ((a, b), (b, a)):
            split = self.block.vector_factor(x, other=y)
            if split is not None:
                vector, rest = split
                return rest, self.block.contract(vector, y, y.indices)
        return a, b

    def _defers_last_product(self, g: GradTerm) -> bool:
        """May ``g``'s last product wait to be summed with its target's others? Where the lowering
        merges them and the product is the network's value as it is added (no carry scale,
        broadcast, power chain, coefficient or split-dim guard after it)."""
        t = g.term
        return (self.merges_last_products and bool(t.plan.steps)
                and t.plan.result == len(t.operands) + len(t.plan.steps) - 1
                and set(t.plan.steps[-1].indices) == set(t.output) and not t.carry_weight and not g.broadcast
                and g.target is not Target.POWER and abs(float(t.coef)) == 1.0 and not self.partial_dim)

    def exact_network(self, g: GradTerm) -> bool:
        """A gradient network is as exact as the forward sum whose cotangent it reads."""
        ct = g.cotangent.name
        return self.exact_sum({"num": "num", "den": "den"}.get(ct) or
                              ("nx_" + ct[4:] if ct.startswith("end_") else ct))

    @staticmethod
    def _broadcast(g: GradTerm, value: str, sizes: dict) -> str:
        """``value`` over the network's indices, constant along the ``broadcast`` ones."""
        have = set(g.term.output)
        shape = ", ".join(sizes[i] for i in g.indices)
        if not have:
            return f"tl.zeros(({shape},), dtype=tl.float32) + {value}"
        slots = ", ".join(":" if i in have else "None" for i in g.indices)
        return f"tl.zeros(({shape},), dtype=tl.float32) + ({value})[{slots}]"

    def _power_chain(self, g: GradTerm, dspow: str) -> str:
        """dx[T, i] = Σ_α dspow[T, α] (m(α)) Σ_r [α_r = i] Π_{s≠r} x[T, α_s] for this
        tile of α: per slot r, a [C, B_α] product times a one-hot [B_α, B_i] matrix."""
        block, o = self.block, g.wrt
        pd, x = o.packed, o.name
        base = self.input_dim[x]
        valid = f"offs_{pd} < D_{pd}"
        cols, vals = zip(*(self.slot_columns(x, pd, r) for r in range(int(o.power))))
        if o.weighted:
            dspow = block.define(f"{dspow} * tl.load(pk_{pd}_mult + offs_{pd}, mask={valid}, other=0.0)[None, :]",
                                 "times m(α)")
        parts = []
        for r in range(int(o.power)):
            prod = " * ".join([dspow] + [vals[s] for s in range(int(o.power)) if s != r])
            onehot = block.define(f"tl.where(({cols[r]}[:, None] == offs_{base}[None, :]) & ({valid})[:, None], 1.0, 0.0)",
                                  f"one-hot [α, {base}] of slot {r + 1}")
            # the one-hot side is exact in any dtype: the tensor cores take it as DOT
            parts.append(f"_dot({prod}, {onehot}, DOT, PREC)")
        block.note(f"d{x}[T,i] += Σ_α d{o.text()} Σ_r [α_r = i] Π_(s≠r) {x}[T,α_s]")
        return " + ".join(parts)

    def keeps_free(self, g: GradTerm, dim: str) -> bool:
        dims = self.index_dims(g.term.operands)
        return {i for i, d in dims.items() if d == dim} <= set(g.term.output)


def _merged_last_products(products) -> list:
    """``grads``' deferred last products grouped: members share one factor tile (the same temp,
    the same index names), their other factors have the same indices, and they have the same
    output, section and precision. [(meta, shared tile, [(sign, other tile)], out, labels)]; a
    product with no partner is a group of one."""
    groups: list = []   # [meta, out, (shared, other) orientations still open, members (sign, a, b), labels]
    for meta, a, b, out, sign, label in products:
        for grp in groups:
            if grp[0] != meta or grp[1] != out:
                continue
            fits = [(s, o) for s, o in grp[2] if any(x == s and y.indices == o.indices for x, y in ((a, b), (b, a)))]
            if fits:
                grp[2] = fits[:1]
                grp[3].append((sign, a, b))
                grp[4].append(label)
                break
        else:
            groups.append([meta, out, [(b, a), (a, b)], [(sign, a, b)], [label]])
    merged = []
    for meta, out, orientations, members, labels in groups:
        shared = orientations[0][0]
        merged.append((meta, shared, [(sign, b if a == shared else a) for sign, a, b in members], out, labels))
    return merged


def _group(grads, key) -> dict:
    out: dict = {}
    for g in grads:
        out.setdefault(key(g), []).append(g)
    return out


def _carried(grads) -> set[str]:
    return {o.name for g in grads for o in g.term.operands if o.kind is Kind.CARRY}


def backward_context(program: ChunkProgram, stage_complete: bool = False) -> dict:
    """Everything the backward template needs (plain data; with the forward context
    under ``forward``, its states' ``read`` set to what the backward reads).
    ``stage_complete``: the variant whose recomputed state pass is the forward's complete
    chunk scan in two stages (``kernel_context``'s), which keeps no forward delta, so its
    reverse pass is the two-stage one (``ir.scan.staged_reverse``) where the program has it."""
    bwd = backward_program(program)
    low = _BwdLowering(bwd)
    fwd = copy.deepcopy(kernel_context(program, stage_complete, every_start=True))
    packed = set(low.packed)
    every = list(bwd.all_terms())
    reverse = [g for g in every if g.target in REVERSE]
    parallel = [g for g in every if g.target in PARALLEL]
    uses_derived = any(o.kind is Kind.DERIVED for g in parallel for o in g.term.operands)
    derived_states = program.derived_reads()
    read_reverse = _carried(reverse)
    read_parallel = _carried(parallel) | (derived_states if uses_derived else set())
    for s in fwd["states"]:
        s["read"] = s["name"] in read_reverse | read_parallel

    # -- reverse state pass: d-states in registers, split over every packed dim and,
    # where every transpose keeps it free, the output's value dim ----------------------------
    splits = sorted(packed)
    if len(splits) > 2:
        raise ValueError(f"the reverse pass splits over at most two packed dims, {program.algebra.name} "
                         f"has {splits}")
    for g in reverse:
        for pd in splits:
            if not low.keeps_free(g, pd):
                raise ValueError(f"{g.term.source}: its transpose sums over the packed dim {pd}, "
                                 f"which the reverse pass splits over")
    partial: list[str] = []
    if len(splits) < 2 and all(list(dims).count(low.o_dim) <= 1 for dims in low.state_dims.values()):
        if all(low.keeps_free(g, low.o_dim) for g in reverse):
            splits.append(low.o_dim)
        elif not splits and _sums_split_partially(low, reverse, low.o_dim):
            splits.append(low.o_dim)
            partial = [n for n, dims in low.state_dims.items() if low.o_dim not in dims]
            low.partial_dim = low.o_dim
    low.region()
    rdefs: dict = {}
    derived_code, reverse_code, written = _reverse_code(low, reverse, rdefs)
    reverse_chained = low.block.chained
    low.partial_dim = None

    # -- gradient pass: parallel over chunks and gradient targets (one input each, and Λ),
    # looping over the tiles of a packed dim. Each target's code is generated in a region of
    # its own (nothing shared across targets: a program computes only the targets it is
    # launched for, recomputing shared products such as Q Kᵀ rather than holding every
    # target's tiles live at once) --------------------------------------------------------------
    tiled = sorted({d for g in parallel for d in low.index_dims(g.term.operands).values() if d in packed})
    if len(tiled) > 1:
        raise ValueError(f"the gradient kernel loops over one packed dim; {program.algebra.name} "
                         f"needs {tiled}")
    gdefs: dict = {}
    ct_states = {o.name[4:] for g in parallel for o in g.term.operands
                 if o.kind is Kind.COTANGENT and o.name.startswith("end_")}
    # without a loop over tiles, the states and whole d-states the networks read are loaded
    # where a part first reads them, under the test of the networks reading them (``_guarded``),
    # not at the kernel's top: a part's [d, dv] fp32 tiles are live only from their first use.
    # (A derived carry's states load at its group's start; partial-sum d-states at the top.)
    lazy = {} if tiled else _lazy_loads(fwd["states"], read_parallel, ct_states - set(partial))
    groups = _grad_groups(low, parallel, gdefs, frozenset(tiled), list(low.input_dim), program.gated, lazy)

    # -- the fused schedule (no packed states): one program per (sequence, head) walks the
    # chunks last to first, each chunk's token gradients from the d-states in registers ----
    fused = None
    if not packed:
        low.region()
        fdefs: dict = {}
        lines = low.block.lines
        f_derived = low.derived() if uses_derived else ""
        mark = len(lines)
        _reverse_code(low, reverse, fdefs)
        f_reverse = "\n".join(lines[mark:]).strip("\n")
        shared = low.block.mark()   # each target's code may reuse the reverse code's products only
        by_key = _group(parallel, _group_key)
        f_groups = []
        for key in _group_keys(list(low.input_dim), program.gated, by_key):
            low.block.rewind(shared)
            mark = len(lines)
            accs, f_inits = _grad_code(low, by_key.get(key, []), fdefs, frozenset())
            f_groups.append({**_group_info(low, key, accs), "code": "\n".join(f_inits + lines[mark:]).strip("\n")})
        fused = {"defs": _defs(fdefs), "derived": f_derived, "reverse": f_reverse,
                 "groups": f_groups, "chained_dots": low.block.chained,
                 "reads": sorted(read_reverse | read_parallel)}

    loop_dim = tiled[0] if tiled else None

    def info(name, **extra):
        s = next(s for s in fwd["states"] if s["name"] == name)
        return {**s, "gtiled": loop_dim in s["dims"], **extra}

    def own(name):   # the reverse pass writes a d-state from block 0 of each split it lacks
        # (a partial sum's block 0 alone loads d final state: the blocks' sum is the d-state)
        return owned_mask(name, info(name)["dims"], splits)

    all_inputs = [low.input_info(x) for x in low.input_dim]
    states = [s["name"] for s in fwd["states"]]
    return {
        "forward": fwd,
        "name": program.algebra.name,
        # ir.precision rule 5: every product reading a state or d-state fp32-accurate (SDOT)
        "exact_state_reads": precision_plan(program).exact_backward,
        # d-states whose cotangent products the quotient rule makes exact (they sum nearly
        # cancelling parts: kept fp32 in HBM, launch.d_states_dtype)
        "cancelling_d_states": bool(low.quotient),
        "o_dim": low.o_dim,
        "inputs": all_inputs,
        "reverse_splits": splits,
        # d-states each block of the value split holds a partial sum of (per-block buffers,
        # summed by their readers); empty where every block computes them whole
        "reverse_partial": partial,
        "reverse_states": [info(n, own=own(n)) for n in states],
        "reverse_reads": [info(n) for n in states if n in read_reverse],
        "reverse_defs": _defs(rdefs),
        "reverse_derived": derived_code,
        "reverse_code": reverse_code,
        "reverse_written": written,
        "reverse_chained_dots": reverse_chained,
        "grad_chained_dots": any(g["chained"] for g in groups),
        "grad_reads": [info(n, lazy=f"st_{n}" in lazy) for n in states if n in read_parallel],
        "grad_cts": [info(n, lazy=f"ct_end_{n}" in lazy) for n in states if n in ct_states],
        "grad_defs": _defs(gdefs),
        "grad_loop_dim": loop_dim,
        # a tensor-core dtype dot on the loop's tiles (launch.dot_override guards narrow ones)
        "grad_loop_dot": any(re.search(r", DOT, PREC\)|, PREC, DOT\)", g["code"]["loop"])   # (a split: bf16 dots too)
                             for g in groups),
        "grad_groups": groups,
        "fused": None if fused is None else {**fused, "reads": [info(n) for n in fused["reads"]]},
        "reverse_scan": _reverse_scan(low, bwd, fwd, info),   # fresh kernel regions
        # the reverse pass splits in two stages: what a module whose state pass runs the
        # complete scan in two stages runs after it (launch.backward_module)
        "staged_reverse": staged_reverse(bwd) is not None,
    }


def _reverse_scan(low: _BwdLowering, bwd, fwd: dict, info) -> dict | None:
    """The chunk-parallel reverse pass: ``rdelta_kernel`` sums every chunk's parallel d-state
    networks at once (d num / d den through the outputs and derived carries, reading the
    chunk-start states), then ``rscan_kernel`` walks the chunks last to first applying only
    the carry networks and, in one stage (``ir.scan.reverse_scan``), the scan networks
    (chunk-end cotangent x a forward chunk delta: no token load, no chained dot, so its value
    dim can be split). In two stages (``ir.scan.staged_reverse``: HLA3's, and any program's
    after the complete scan in two stages, ``backward_context(stage_complete=True)``), those two kernels
    run the lower d-states alone and ``stage`` holds the second's: ``rstage_kernel``, every
    chunk's increment of each upper d-state (its parallel and cross networks, the latter
    reading the lower d-states' stored chunk ends and the chunk-start states), one launch a
    state (``PART``), and ``rstage_scan_kernel``, the upper carries' walk; no forward delta
    is read. None where neither split applies, or one stage's forward deltas do not exist
    (the forward has no one-stage chunk scan)."""
    split = reverse_scan(bwd) if fwd["chunk_scan"] and not fwd["chunk_scan"]["stage"] else None
    states = [s["name"] for s in fwd["states"]]
    if split is not None:
        buffers = {b["name"]: b for b in fwd["chunk_scan"]["buffers"]}
        first = _rdelta_context(low, list(split.parallel), states, info)
        ctx = {**first, **_rscan_context(low, bwd, list(split.carry + split.scan), states, first["written"],
                                         info, [buffers[n] for n in split.deltas], flat_ok=False)}
        # a group's map d(end) -> d(start) is one step's at the group's forward delta, where
        # a step reads forward deltas alone (no start states) that the forward groups
        # and every d-state has a part buffer (a group's own part of each is what it passes on)
        ctx.update(starts=[info(n) for n in states if n in split.starts], stage=None,
                   groupable=fwd["chunk_scan"]["groupable"] and not split.starts and set(states) <= set(
                       s["name"] for s in ctx["written"]))
        return ctx
    staged = staged_reverse(bwd)
    if staged is None:
        return None
    lower, upper = list(staged.lower), list(staged.upper)
    first = _rdelta_context(low, list(staged.networks(lower)), states, info)
    ctx = {**first, **_rscan_context(low, bwd, list(staged.carries(lower)), lower, first["written"], info),
           "starts": [], "groupable": False}
    # the second stage: one part a state, each in a region of its own (their tiles never
    # live together; d W0 is recomputed by each part that reads it)
    defs: dict = {}
    parts, chained = [], False
    for name in upper:
        low.region()
        derived, code, _ = _reverse_code(low, list(staged.networks([name])), defs)
        parts.append({"name": name, "state": info(name), "code": "\n\n".join(c for c in (derived, code) if c)})
        chained = chained or low.block.chained
    read = _carried(staged.networks(upper))
    stage = {"reads": [info(n) for n in states if n in read], "cts": [info(n) for n in staged.reads],
             "written": [info(n) for n in upper], "parts": True, "delta_defs": _defs(defs), "derived": "",
             "delta_code": parts, "delta_chained_dots": chained, "starts": [], "groupable": False}
    stage.update(_rscan_context(low, bwd, list(staged.carries(upper)), upper, stage["written"], info))
    ctx["stage"] = stage
    return ctx


def _rdelta_context(low: _BwdLowering, parallel: list, states: list, info) -> dict:
    """``rdelta_kernel``'s code: every chunk's own part of the d-states that ``parallel``
    writes, at once."""
    low.region()
    defs: dict = {}
    derived, code, written = _reverse_code(low, parallel, defs)
    read = _carried(parallel)
    return {"reads": [info(n) for n in states if n in read], "cts": [], "parts": False,
            "written": [info(n) for n in states if n in written], "delta_defs": _defs(defs), "derived": derived,
            "delta_code": code, "delta_chained_dots": low.block.chained}


def _rscan_context(low: _BwdLowering, bwd, walked: list, states: list, written: list, info,
                   deltas: list | None = None, flat_ok: bool = True) -> dict:
    """A reverse scan kernel's code: its d-states ``states`` walked last to first through the
    ``walked`` networks (carry, and one stage's scan networks reading the forward chunk
    ``deltas``), each chunk's own part (``written``, by the delta kernel before it) added.
    ``flat_ok``: it may walk flat layouts (not the one-stage scan: its groups' walks split)."""
    # a walk of carry networks alone (each d-state's decayed chunk-end cotangent) is
    # elementwise: it walks the flat layouts in blocks, as the forward's flat scans do
    flat = flat_ok and not deltas and all(map(_elementwise, walked))
    low.region()
    scan_defs: dict = {}
    for b in deltas or []:   # a forward chunk summary no state holds: its axes' dims
        low.state_dims.setdefault(b["name"], tuple(b["dims"]))
    _, scan_code, scan_written = _reverse_code(low, walked, scan_defs, flat)
    if scan_defs:
        raise ValueError(f"{bwd.forward.algebra.name}: a carry or scan network of the reverse pass "
                         f"reads the tokens")
    has_part = {s["name"] for s in written}
    ends = {}
    for name in states:
        parts = ([f"ds_{name}"] if name in scan_written else []) + ([f"rdl_{name}"] if name in has_part else [])
        # (a part alone is cast: it may be stored in bf16, launch.d_states_dtype, and the carry is fp32)
        ends[name] = (" + ".join(parts) if len(parts) > 1 else f"{parts[0]}.to(tl.float32)") if parts \
            else f"tl.zeros_like(ct_end_{name})"
    o = low.o_dim
    splits = [o] if all(list(low.state_dims[n]).count(o) <= 1 for n in states) and all(
        low.keeps_free(g, o) for g in walked) else []
    # a d-state every program of the scan reads and writes in its own tiles alone (it has
    # every split dim; flat: every one) may have its chunk-end cotangents written over its
    # parts: each chunk's part is loaded before a barrier, its cotangent stored after it
    # (run-time's choice)
    in_place = [n for n in states if n in has_part and (flat or all(d in low.state_dims[n] for d in splits))]
    return {"deltas": deltas or [], "in_place": in_place, "splits": splits, "flat": flat, "scan_code": scan_code,
            "scan_chained_dots": low.block.chained,
            "states": [info(n, own=owned_mask(n, low.state_dims[n], splits), end=ends[n]) for n in states]}


def _sums_split_partially(low: _BwdLowering, reverse, dim: str) -> bool:
    """Can the reverse pass split over blocks of ``dim`` with every d-state lacking ``dim``
    held as a per-block partial sum? The pass is linear in the cotangents, so it can where
    a block's value columns enter a network only through its cotangent: each network has
    at most one index of ``dim``, and that one is the cotangent's (d num's value column, a
    value-dim d-state's). Kept free, it maps the block's columns to the same columns of a
    value-dim target; summed, it adds the block's share to a d-state without ``dim``
    (HLA2: dS += dW Cᵀ). A network without ``dim`` maps its cotangent linearly: a partial
    sum to a partial sum, and d den, the one whole cotangent without it, in block 0 alone
    (``_BwdLowering.partial_dim``)."""
    for g in reverse:
        dims = low.index_dims(g.term.operands)
        along = [i for i, d in dims.items() if d == dim]
        if len(along) > 1 or (along and along[0] not in g.cotangent.indices):
            return False
    return True


def _elementwise(g: GradTerm) -> bool:
    """Is ``g`` its own d-state's chunk-end cotangent, scaled (a carry network: no other
    operand, no index moved or broadcast)?"""
    ops = g.term.operands
    return (len(ops) == 1 and ops[0].name == f"end_{g.name}" and ops[0].indices == g.term.output
            and not g.broadcast)


def _reverse_code(low: _BwdLowering, reverse, defs, flat: bool = False) -> tuple[str, str, list[str]]:
    """(code of the derived carries' gradients ct_dr_*, code of the chunk-start
    d-states ds_*, the states it writes), appended to the current block. ``flat``: the
    d-states' accumulators take their chunk-end cotangents' shape (a walk of flat blocks)."""
    block = low.block
    first = len(block.lines)
    to_derived = _group([g for g in reverse if g.target is Target.DERIVED], lambda g: g.name)
    for d in low.p.derived:
        if d.name in to_derived:
            acc = f"ct_dr_{d.name}"
            block.assign(acc, f"tl.zeros(({low.target_shape(to_derived[d.name][0])},), dtype=tl.float32)")
            low.grads(to_derived[d.name], acc, defs)
    derived = "\n".join(block.lines[first:]).strip("\n")
    start = len(block.lines)
    to_carry = _group([g for g in reverse if g.target is Target.CARRY], lambda g: g.name)
    for name, grads in to_carry.items():
        acc = f"ds_{name}"
        block.lines.append("")
        block.assign(acc, f"tl.zeros_like(ct_end_{name})" if flat else
                     f"tl.zeros(({low.target_shape(grads[0])},), dtype=tl.float32)")
        low.grads(grads, acc, defs)
    return derived, "\n".join(block.lines[start:]).strip("\n"), sorted(to_carry)


_ACC = {Target.TOKEN: "dx_{}", Target.POWER: "dx_{}", Target.LAM: "dlam", Target.LAM_END: "dlam_end"}


def _grad_code(low: _BwdLowering, parallel, defs, tiled) -> tuple[list[str], list[str]]:
    """Appends the token and Λ gradient code to the current block; returns the
    accumulators and the lines that zero them (for the caller to place)."""
    accs, inits = _accumulators(low, parallel)
    for (target, name), grads in _group(parallel, lambda g: (g.target, g.name)).items():
        low.grads(grads, _ACC[target].format(name), defs, tiled)
    return accs, inits


def _accumulators(low: _BwdLowering, grads) -> tuple[list[str], list[str]]:
    """The accumulators ``grads`` add into, in order of first use, and the lines zeroing them."""
    accs, inits = [], []
    for g in grads:
        acc = _ACC[g.target].format(g.name)
        if acc not in accs:
            accs.append(acc)
            init = "tl.sum(tl.zeros((C,), dtype=tl.float32), axis=0)" if g.target is Target.LAM_END else \
                f"tl.zeros(({low.target_shape(g)},), dtype=tl.float32)"
            inits.append(f"{acc} = {init}")
    return accs, inits


def _parted_code(low: _BwdLowering, grads, units: list[int], defs, tiled,
                 loads: dict) -> tuple[list[str], list[str], dict]:
    """(accumulators, their zeroing lines, code by section -- before the loop over ``tiled``
    and in it) of one target group, for the program computing part PART of PARTS
    (runs of the group's network ``units``, ``_network_units``; the launcher sums the parts'
    gradients).
    The networks are lowered in order, each product once (a network reuses what the ones
    before it computed), and each line runs under a constexpr test of whether a network of
    this part needs it -- its own, or a later one reusing it: a program computes its
    networks' products (exactly those while PARTS <= the networks: ``_part_test``), those
    they share once. PARTS == 1: the whole group. ``loads``:
    state tiles loaded (their lines) before the first line reading them, under its test."""
    block = low.block
    accs, inits = _accumulators(low, grads)
    sections = ("pre", "loop")
    first = {sec: len(block.sections[sec]) for sec in sections}
    owner: dict = {sec: [] for sec in sections}
    for n, g in zip(units, grads):
        before = {sec: len(block.sections[sec]) for sec in sections}
        low.grads([g], _ACC[g.target].format(g.name), defs, tiled)
        for sec in sections:
            owner[sec] += [n] * (len(block.sections[sec]) - before[sec])
    lines = {sec: block.sections[sec][first[sec]:] for sec in sections}
    return accs, inits, _guarded(lines, owner, max(units) + 1 if units else 0, loads)


def _network_units(grads) -> list[int]:
    """The part-split unit of each network of a group: a dΛ network riding with an input's
    gradient (``_rider``) joins the unit of the gradient network it extends (its operands but
    the extended one, differentiating that one) -- it reads that network's products and adds
    one row dot, so a part holding it apart would recompute them all. A term reading an input
    twice (k k) has its other gradient network between the two."""
    units, own, count = [], {}, 0
    for g in grads:
        n = own.get((g.wrt, g.term.operands[:-1])) if g.target in _LAM and g.name else None
        if n is None:
            n, count = count, count + 1
            own[(g.wrt, g.term.operands)] = n   # (the nearest one before a rider)
        units.append(n)
    return units


_DEFINES = re.compile(r"(t\d+) = ")
_TEMPS = re.compile(r"\bt\d+\b")


def _guarded(lines: dict, owner: dict, count: int, loads: dict | None = None) -> dict:
    """``lines`` (by section; ``owner``: the network that emitted each) with each run of
    lines needed by the same networks under one test of PART (none where every network
    needs them). A line is needed by its network and by every network needing a temp it
    defines; the loop's lines are read first (they read temps of the section before it).
    ``loads``: a tile name -> the lines loading it, put before the first line reading it
    and needed by every network that reads it."""
    loads = loads or {}
    lazy = re.compile(r"\b(" + "|".join(map(re.escape, loads)) + r")\b") if loads else None
    need: dict[str, set] = {}
    needed: dict = {}
    for sec in ("loop", "pre"):
        sets: list = [None] * len(lines[sec])
        for i in reversed(range(len(lines[sec]))):
            line = lines[sec][i].strip()
            if not line or line.startswith("#"):
                continue
            defined = _DEFINES.match(line)
            nets = {owner[sec][i]} | (need.get(defined.group(1), set()) if defined else set())
            sets[i] = frozenset(nets)
            read = line[defined.end():] if defined else line
            for t in _TEMPS.findall(read) + (lazy.findall(read) if lazy else []):
                need.setdefault(t, set()).update(nets)
        following = frozenset(range(count))   # a comment goes with the line after it
        for i in reversed(range(len(sets))):
            following = sets[i] = sets[i] if sets[i] is not None else following
        needed[sec] = sets
    out, loaded = {}, set()
    for sec in lines:
        placed = []
        for line, nets in zip(lines[sec], needed[sec]):
            first = [v for v in dict.fromkeys(lazy.findall(line)) if v not in loaded] if lazy and \
                not line.lstrip().startswith("#") else []
            at = len(placed)   # before the first reader and the comments that go with it
            while at and (not placed[at - 1][0].strip() or placed[at - 1][0].lstrip().startswith("#")):
                at -= 1
            for v in first:   # loaded just before its first reader, for every network reading it
                loaded.add(v)
                placed[at:at] = [(x, frozenset(need[v])) for x in loads[v]]
                at += len(loads[v])
            placed.append((line, nets))
        body: list[str] = []
        current = None
        def guarded(nets) -> bool:
            # a group of one network is tested too: a launch's PARTS follows its largest group,
            # and a line every network needs, run in every part, would add that network PARTS times
            return len(nets) < count or count == 1
        for line, nets in placed:
            if nets != current:
                current = nets
                if guarded(nets):
                    body.append(f"if {_part_test(nets, count)}:  # network{'s' if len(nets) > 1 else ''} "
                                f"{', '.join(str(n + 1) for n in sorted(nets))} of {count}")
            indent = "    " if guarded(nets) else ""
            body.append(indent + line if line.strip() else "")
        out[sec] = "\n".join(body).strip("\n")
    return out


def _lazy_loads(states: list[dict], reads, cts) -> dict:
    """The gradient kernel's load lines of the chunk-start states ``reads`` (``st_``) and
    the chunk-end d-states ``cts`` (``ct_end_``, whole: no per-block slots), by tile name."""
    loads = {}
    for s in states:
        n = s["name"]
        layout = [f"off_{n} = {s['off']}", f"msk_{n} = {s['msk']}"]
        at = f"(crow * n_chunks + i_c) * {s['numel']} + off_{n}, mask=msk_{n}, other=0.0)"
        if n in reads:
            loads[f"st_{n}"] = layout + [f"st_{n} = tl.load(starts_{n} + {at}  # {n} at the chunk start"]
        if n in cts:
            loads[f"ct_end_{n}"] = layout + [f"ct_end_{n} = tl.load(dends_{n} + {at}  # d{n} at the chunk end"]
    return loads


def _part_test(nets, count: int) -> str:
    """A constexpr test of whether part PART of PARTS holds a network of ``nets`` (network n
    is in part (n * PARTS) // count, a monotone map): per run a..b of consecutive networks,
    whether PART lies between the parts of a and b; a sum (a constexpr int) over the runs.
    Exact while PARTS <= count (every part holds a network); past it (a launch's PARTS
    follows its largest group) a part between two holding no network of its own may run a
    run's shared lines too: wasted work, never a wrong sum (it adds no network)."""
    runs: list[list[int]] = []
    for n in sorted(nets):
        if runs and n == runs[-1][1] + 1:
            runs[-1][1] = n
        else:
            runs.append([n, n])
    tests = [f"({a} * PARTS) // {count} == PART" if a == b else
             f"(({a} * PARTS) // {count} <= PART) * (PART <= ({b} * PARTS) // {count})" for a, b in runs]
    return tests[0] if len(tests) == 1 else " + ".join(f"({t})" for t in tests)


def _group_keys(inputs, gated, by_key: dict) -> list[tuple]:
    """The gradient target groups, in launch-bit order: each token input, then Λ where gated
    and some dΛ network rides with no input (or none exists: the group stores zeros)."""
    keys = [("x", x) for x in inputs]
    riding = any(g.target in _LAM for key in keys for g in by_key.get(key, []))
    keys += [("lam", None)] if gated and (("lam", None) in by_key or not riding) else []
    if not set(by_key) <= set(keys):   # a network in no group would be lost: a compiler bug
        raise RuntimeError(f"gradient networks of no target group: {sorted(set(by_key) - set(keys), key=str)}")
    return keys


_LAM = (Target.LAM, Target.LAM_END)


def _group_key(g: GradTerm) -> tuple:
    """A dΛ network rides with the input whose gradient network it extends (``_rider``):
    in that group it reuses the gradient's products and adds one row dot, where a dΛ group
    of its own recomputed every one of them (hla3's: 41 networks, as many as dq's and dk's)."""
    return ("lam", None) if g.target in _LAM and not g.name else ("x", g.name)


def _group_info(low: _BwdLowering, key, accs) -> dict:
    kind, name = key
    acc = "dlam" if kind == "lam" else f"dx_{name}"
    dim = None if kind == "lam" else low.input_dim[name]
    return {"input": name, "acc": acc, "dim": dim, "shape": "C," if dim is None else f"C, B_{dim}",
            # what it adds to the launch's dΛ: its dlam [C] (the Λ group's, zeros without
            # networks) and dΛ_end (at the chunk's last position)
            "dlam": kind == "lam" or "dlam" in accs, "lam_end": "dlam_end" in accs,
            "zero": acc not in accs}


def _grad_groups(low: _BwdLowering, parallel, defs, tiled, inputs, gated, lazy: dict) -> list[dict]:
    """One gradient target group per token input (its dx, and the dΛ networks riding with
    it: ``_group_key``) and, where gated, one for the dΛ and dΛ_end networks riding with no
    input (zeros where none exists and none rides; left out where every one rides): each
    group's code (derived carries, accumulators, the networks
    before and inside the loop over ``tiled``, for part PART of PARTS: ``_parted_code``)
    lowered in a fresh region. A group without networks stores zeros. ``lazy``: the
    load lines of the state tiles the code loads where it reads them (before the derived
    carries those read)."""
    by_key = _group(parallel, _group_key)
    groups, temps = [], 0
    for key in _group_keys(inputs, gated, by_key):
        low.region()
        low.block._temps = temps   # temps numbered on across groups: one may run after another
        grads = by_key.get(key, [])
        reads_derived = any(o.kind is Kind.DERIVED for g in grads for o in g.term.operands)
        derived = low.derived() if reads_derived else ""
        early = [v for v in lazy if re.search(rf"\b{v}\b", derived)]
        derived = "\n".join([line for v in early for line in lazy[v]] + ([derived] if derived else []))
        units = _network_units(grads)
        accs, inits, code = _parted_code(low, grads, units, defs, tiled,
                                         {v: x for v, x in lazy.items() if v not in early})
        groups.append({**_group_info(low, key, accs), "derived": derived,
                       "networks": len(set(units)),   # the units parts split
                       # full-width matmuls of the whole group (the loop's run on narrow tiles)
                       "matmuls": code["pre"].count("_dot("),
                       "inits": "\n".join(inits), "code": code, "chained": low.block.chained})
        temps = low.block._temps
    return groups


def _defs(defs: dict) -> list[dict]:
    return [{"var": var, "text": text, "expr": expr} for var, (text, expr) in defs.items()]


def template_text() -> str:
    return templates.template_text(TEMPLATE, "chunk_kernels.py.jinja")


def render(context: dict, version: str) -> str:
    return prune_dead(render_template(TEMPLATE, version=version, bwd=context, **context["forward"]))


def triton_bwd_source(program: ChunkProgram, stage_complete: bool = False) -> str:
    """The Python/Triton module of ``program``'s backward (what ``--emit triton_bwd`` prints)."""
    return render(backward_context(program, stage_complete), __version__)


def generation_error(program: ChunkProgram) -> str | None:
    """Why ``program``'s forward or backward kernels cannot be generated, None where they can
    (the contexts only: nothing is rendered or compiled)."""
    from hladsl.codegen.triton_gen import kernel_context
    try:
        kernel_context(program)
        backward_context(program)
    except ValueError as exc:
        return str(exc)
    return None


_MODULES: dict[tuple, tuple] = {}   # (id(program), variant) -> (program, module, context)


def _starts_sdot(program: ChunkProgram, module, context: dict) -> dict:
    """The states whose chunk starts the backward may store in its state-dot dtype
    (``triton_gen.starts_read_as_sdot``), read so by every kernel of this module and of the
    forward's module, whose output kernel reads the starts a training forward kept:
    ``starts_sdot`` (the same bits) and ``starts_sdot_rounded`` (read besides in dΛ's inner
    products, ``launch.rounded_starts``)."""
    sources = [Path(m.__file__).read_text(encoding="utf-8") for m in (module, kernels(program)[0])]
    names = [s["name"] for s in context["forward"]["states"] if s["read"]]
    return {"starts_sdot": starts_read_as_sdot(sources, names),
            "starts_sdot_rounded": starts_read_as_sdot(sources, names, inner_products=True)}


def backward_kernels(program: ChunkProgram, stage_complete: bool = False):
    """(module, context) for ``program``'s backward, rendered once and disk-cached;
    ``stage_complete``: the variant whose state pass runs the complete scan in two stages."""
    hit = _MODULES.get((id(program), stage_complete))
    if hit is None or hit[0] is not program:
        from hladsl.codegen.cache import cache_key, load_module
        context = backward_context(program, stage_complete)
        key = cache_key(context, template_text())
        module = load_module(f"{context['name']}_bwd", key, lambda: render(context, __version__))
        context = {**context, **_starts_sdot(program, module, context)}
        hit = _MODULES[(id(program), stage_complete)] = (program, module, context)
    return hit[1], hit[2]

