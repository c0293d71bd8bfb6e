"""Triton source for a chunk program: a state-pass kernel walking the
chunks of one (sequence, head) in order, and an output kernel parallel over
(chunk, sequence·head). ``kernel_context`` lowers the program to a plain,
JSON-serialisable description (names, shapes and the straight-line code of every
term, see ``steps``); ``templates/chunk_kernels.py.jinja`` lays the kernels out
around it. Within a kernel equal subexpressions are computed once (the output
terms of HLA2 share Q Kᵀ). When every state term carries the output's value dim
through unchanged (true of all shipped specs), the state pass can also run one
program per block of that dim (``split``; states without it are recomputed per
block and written by block 0), and of a second dim kept free alike (linear's key dim).

Spec names reach the source only as validated identifiers behind fixed prefixes
(``in_`` token tiles, ``st_``/``nx_`` states in registers, ``init_``/``final_``/
``starts_`` state pointers, ``off_``/``msk_`` state layouts, ``dr_`` derived carries),
so they cannot collide with each other or with the kernels' own names.
"""
from __future__ import annotations

import functools
import math
import os
import re
import warnings

from hladsl.codegen import templates
from hladsl.codegen.prune import prune_dead
from hladsl.codegen.templates import render_template

from hladsl.codegen.steps import Block, Tile, comment
from hladsl.ir.chunk import ChunkProgram, TermProgram
from hladsl.ir.contract import plan
from hladsl.ir.precision import precision_plan
from hladsl.ir.recursion import DELTA, END, START, chunk_terms, free_first, recursion
from hladsl.ir.scan import has_chunk_scan, scan_plan, split_complete_scan, staged_scan
from hladsl.version import __version__
from hladsl.ir.operands import Kind, Operand, exhaustive

TEMPLATE = "chunk_kernels.py.jinja"
_IDENT = re.compile(r"[A-Za-z][A-Za-z0-9_]*\Z")


def _ident(what: str, name: str) -> str:
    if not isinstance(name, str) or not _IDENT.match(name):
        raise ValueError(f"{what} name {name!r} cannot be used in generated code "
                         f"(expected [A-Za-z][A-Za-z0-9_]*)")
    return name


def block_size(n: int) -> int:
    """Tile extent for a dim of size n: a power of two, at least 16 (tl.dot's minimum)."""
    return max(16, 1 << (int(n) - 1).bit_length())


# How a packed power's factor columns x[T, α_r] come out of the token tile (``slot_columns``):
# "dot" (a one-hot dot on the tensor cores, round 23), "gather" (tl.gather of the tile in
# registers), "load" (gathered loads from memory, the code before round 23), "rows" (the
# forward's state and output passes tile the packed dim by row tiles, ``packing.row_tiles``: a
# tile's first p - 1 columns are one column each, its last an aligned slice of the token tile,
# both loaded from memory; other kernels keep the dots; an A/B mode, slower: ``row_tiled``), or
# "auto": in the forward's kernels (``_Lowering.gathers_columns``) gather from tiles at most
# POWER_GATHER_MAX_WIDTH wide, dots elsewhere. Runs 277, 278 (H200, power p = 2 gated, B = 2,
# H = 16, bf16, forward at T = 16k, the same bits): d = 64 dot 3.61 ms, gather 3.16; d = 128 dot
# 38.65, gather 57.46 (state pass 20.05 -> 34.03 ms, output 18.61 -> 23.62); p = 3 at d = 64,
# T = 4k: 23.58 -> 22.27. A/B runs set HLADSL_POWER_COLUMNS (HLADSL_POWER_GATHER=1 is the old
# spelling of "load").
POWER_COLUMN_MODES = ("auto", "dot", "gather", "load", "rows")
POWER_GATHER_MAX_WIDTH = 64
POWER_COLUMNS = os.environ.get("HLADSL_POWER_COLUMNS") or (
    "load" if os.environ.get("HLADSL_POWER_GATHER", "0") == "1" else "auto")
if POWER_COLUMNS not in POWER_COLUMN_MODES:
    raise ValueError(f"HLADSL_POWER_COLUMNS={POWER_COLUMNS!r}: expected one of {', '.join(POWER_COLUMN_MODES)}")
PACKED_TILE = 64   # entries of a packed symmetric dim per tile (state-pass block, output loop step)


def column_pick_macs(program: ChunkProgram) -> int:
    """Multiply-adds a chunk of one head spends in the forward's one-hot column dots
    (``slot_columns``'s "dot": a [C, d] x [d, D] dot a slot; under "auto" where the token tile
    is over POWER_GATHER_MAX_WIDTH wide). Each kernel forms each packed power of an input once
    a chunk (its temps are shared): the output kernel spow(q), the state pass spow(k), counted
    once whatever value-dim blocks the state pass splits into (a bf16 state pass at d = 128
    holds its value dim whole; an fp32 one at few (sequence, head) pairs may split it and
    repeat them: uncounted). The mode is ``_Lowering.column_mode``'s, the one the kernels
    take. Tensor-core work the algebra's products (``ChunkProgram.flops``) do not count; the
    attention-form rule adds it (``launch.chunk_form_macs``)."""
    low = _Lowering(program)
    low.region(low.row_tiled)   # (the state pass and the output kernel walk the same tiles)
    sizes = dict(program.sizes) | {pd.name: pd.size for pd in program.packed}
    kernels = (program.output + program.normalizer, tuple(t for _, ts in program.states for t in ts))
    macs = 0
    for terms in kernels:
        powers = {(o.name, o.packed, o.power) for t in terms for o in t.operands if o.kind == Kind.POWER}
        for name, packed, power in powers:
            if low.column_mode(name, packed) == "dot":
                macs += power * program.chunk * sizes[program.algebra.inputs[name]] * sizes[packed]
    return macs


def constexprs(program: ChunkProgram) -> dict[str, int]:
    """The tl.constexpr arguments shared by both kernels: C, D_<dim>, B_<dim>
    (a packed dim is always tiled: B is its tile, not its padded size)."""
    out = {"C": program.chunk}
    for dim, n in program.sizes:
        out[f"D_{dim}"] = n
        out[f"B_{dim}"] = block_size(n)
    for pd in program.packed:
        out[f"D_{pd.name}"] = pd.size
        out[f"B_{pd.name}"] = min(PACKED_TILE, block_size(pd.size))
    return out


# ir.scan's rewrite of the state pass: a term reading the chunk only through another state's
# delta (HLA2's G += ΔS (ρ C)) multiplies the carried states by that delta's tile, already
# computed for the other state's update: one d x d x dv product instead of two chained
# C x d x dv ones over the chunk's tokens (both fp32-accurate where the precision plan says).
# Off until measured on the H100 (speed, and the bf16 GPU suite; HLADSL_STATE_PASS_READS_DELTAS=1
# turns it on for an A/B run): tested under the interpreter (tests/test_scan.py); the kernels
# the GPU suite verified are those with it off.
STATE_PASS_READS_DELTAS = os.environ.get("HLADSL_STATE_PASS_READS_DELTAS") == "1"


class _Lowering:
    """Walks one chunk program and collects the pieces of the template context."""

    # POWER_COLUMNS "auto" may gather packed power columns here (``slot_columns``), and "rows"
    # walk the state and output passes' packed dims in row tiles (``row_tiled``)
    gathers_columns = True

    def __init__(self, program: ChunkProgram, stage_complete: bool = False):
        self.p = program
        self.alg = alg = program.algebra
        c = program.chunk
        if c < 16 or c & (c - 1):
            raise ValueError(f"Triton chunk kernels need a power-of-two chunk size >= 16, got {c}")
        _ident("mechanism", alg.name)
        self.dims = [_ident("dim", d) for d in alg.dims]
        self.input_dim = {_ident("input", x): _ident("dim", d) for x, d in alg.inputs.items()}
        self.scaled = set(alg.queries)   # loaded times scl_<x>, the call's scale (as torch would)
        self.state_dims = {_ident("summary", s.name): program.state_dims(s.name)
                           for s in alg.streaming}
        self.packed = {_ident("packed dim", pd.name): pd for pd in program.packed}
        self.precision = precision_plan(program)
        # state-pass terms that read the chunk only through another state's delta (ir.scan):
        # lowered as carried states x that delta's tile where the kernel has computed it
        # (the chunk-parallel state pass, ``_chunk_scan``, loads those deltas instead)
        packed = {n for n, _ in program.states if program.is_packed(n)}
        self.scan_plan = scan_plan(program)
        # None where one stage (or none) does; ``stage_complete``: a complete scan in two stages too
        self.staged = staged_scan(program, self.scan_plan, stage_complete)
        terms = self.scan_plan.terms
        self.scan = {(t.state, t.index): t for t in terms
                     if t.role == "scan" and t.delta not in packed and t.state not in packed}
        read = {t.delta for t in self.scan.values()}   # whose delta term keeps its temp
        self.delta_terms = {(t.state, t.index) for t in terms if t.role == "delta" and t.state in read
                            and STATE_PASS_READS_DELTAS}
        self._accs = 0
        self.derived_dims = {}
        for d in program.derived:
            _ident("derived", d.name)
            self.derived_dims[d.name] = self._poly_dims(d.poly)
        (o_index,) = alg.output.free
        # the output's value dim: the one non-packed dim a kernel may split over grid blocks
        self.o_dim = self.index_dims(program.output[0].operands)[o_index]
        self.region()            # the current kernel region (temps, CSE)

    # -- sizes --------------------------------------------------------------------------
    def _poly_dims(self, poly) -> dict[str, str]:
        dims = {}
        for m in poly.terms:
            for f in m.factors:
                if f.kind != "state" or m.rho:
                    raise ValueError(f"derived carry factor {f} is not a plain carried state")
                dims.update(zip(f.indices, self.state_dims[f.name]))
        return dims

    def index_dims(self, operands) -> dict[str, str | None]:
        """index name -> its dim (None for a chunk-time index), for the operands of one term."""
        dims = {}
        for o in operands:
            dims.update(_INDEX_DIMS[o.kind](self, o))
        return dims

    def _token_dims(self, o):
        return {o.indices[0]: None, o.indices[1]: self.input_dim[o.name]}

    def _power_dims(self, o):
        return {o.indices[0]: None, o.indices[1]: o.packed}

    def _carry_dims(self, o):
        return dict(zip(o.indices, self.state_dims[o.name]))

    def _derived_dims(self, o):
        return {i: self.derived_dims[o.name][i] for i in o.indices}

    def _cotangent_dims(self, o):
        raise ValueError("cotangent operands belong to the backward lowering")

    @staticmethod
    def _time_dims(o):
        return {i: None for i in o.indices}

    def sizes(self, operands) -> dict[str, str]:
        """index name -> constexpr tile extent (C or B_<dim>)."""
        return {i: "C" if d is None else f"B_{d}" for i, d in self.index_dims(operands).items()}

    def input_info(self, x: str) -> dict:
        """What a kernel signature and its token loads need of input ``x`` (``scaled``: its
        loaded tile ``raw_<x>`` times the call's scale, ``scaled_load``; "" for no query)."""
        return {"name": x, "dim": self.input_dim[x],
                "scaled": self.scaled_load(x, f"raw_{x}") if x in self.scaled else ""}

    def scaled_load(self, x: str, load: str) -> str:
        """``load`` (a tile of input ``x`` in its dtype) times the call's scale if ``x`` is a
        query, rounded back to the input dtype: for bf16 / fp16 the bits torch's
        ``x * scale`` gives (for fp32 the compiler may fuse the product into an FMA)."""
        # (upcast first: the interpreter's bf16 x fp32-scalar product is garbage)
        return (f"({load}.to(tl.float32) * scl_{x}).to(in_{x}_ptr.dtype.element_ty)"
                if x in self.scaled else load)

    # -- operands -----------------------------------------------------------------------
    def operand(self, o: Operand, defs: dict) -> Tile:
        return _OPERAND_TILE[o.kind](self, o, defs)

    def _token_tile(self, o, defs):
        return self.token_tile(o, f"in_{o.name}", f"raw_{o.name}", f"base_{o.name}")

    def token_tile(self, o, var: str, raw: str, base: str) -> Tile:
        """Token tile ``var`` (fp32) of input ``o.name``: the template loads it and its
        input-dtype twin ``raw`` from the chunk at offset ``base`` (load_chunk); transposed, it
        is loaded so where a product wants it."""
        x, dim = o.name, self.input_dim[o.name]
        self.block.raw[var] = raw
        self.block.tokens_as_loaded.add(raw)
        self.block.transposed[var] = self.scaled_load(x, (
            f"tl.load(in_{x}_ptr + {base} + offs_{dim}[:, None] + offs_t[None, :] * str_{x}_t, "
            f"mask=offs_{dim}[:, None] < D_{dim}, other=0.0)"))
        return Tile(var, o.indices)

    def _power_tile(self, o, defs):
        return self.power(o)

    @staticmethod
    def _carry_tile(o, defs):   # (at the chunk's end: the tile of its update, nx_)
        return Tile(f"{'nx' if o.anchor == 'end' else 'st'}_{o.name}", o.indices)

    @staticmethod
    def _derived_tile(o, defs):
        return Tile(f"dr_{o.name}", o.indices)

    def _mask_tile(self, o, defs):
        rel = {"<=": "le", "<": "lt"}[o.rel]
        var = f"mask_{rel}_w{int(o.weight)}"
        def mask(row, col):   # M[row, col] = [col (<=|<) row] · exp(w (Λ_row − Λ_col))
            keep = self.mask_keep(o.rel, row, col)
            if o.weight:
                return (f"tl.exp(tl.where({keep}, {int(o.weight)} * ({self.mask_gap(row, col)}), "
                        f"float(\"-inf\")))")
            return f"tl.where({keep}, 1.0, 0.0)"
        if var not in defs:
            defs[var] = (comment(o.text()), mask("[:, None]", "[None, :]"))
        self.block.transposed[var] = mask("[None, :]", "[:, None]")   # computed so, not transposed
        return Tile(var, o.indices)

    @staticmethod
    def mask_keep(rel: str, row: str, col: str) -> str:
        """Which [row, col] pairs a mask keeps (``row`` / ``col``: the axes' slots): both in the chunk."""
        return f"offs_t{row} {'>=' if rel == '<=' else '>'} offs_t{col}"

    @staticmethod
    def mask_gap(row: str, col: str) -> str:
        """Λ_row − Λ_col, both in the chunk."""
        return f"lam{row} - lam{col}"

    @staticmethod
    def _decay_tile(o, defs):
        var = f"decay_{'end' if o.anchor == 'end' else 'start'}_w{int(o.weight)}"
        if var not in defs:
            w = int(o.weight)
            expr = f"tl.exp({w} * (lam_end - lam))" if o.anchor == "end" else f"tl.exp({w} * lam)"
            defs[var] = (comment(o.text()), expr)
        return Tile(var, o.indices)

    @staticmethod
    def _cotangent_tile(o, defs):
        return Tile(f"ct_{o.name}", o.indices)

    def power(self, o: Operand) -> Tile:
        """spow(x)[T, α] for the α of this program's block of the packed dim: the product
        of x's columns α_1 .. α_p in fp32, each picked from the tile as loaded (a one-hot dot
        or a register gather) or loaded from memory (``slot_columns``)."""
        block, pd, x = self.block, _ident("packed dim", o.packed), o.name
        valid = f"offs_{pd} < D_{pd}"
        parts = [self.slot_columns(x, pd, r)[1] for r in range(int(o.power))]
        expr = " * ".join(parts)
        if o.weighted:
            expr += f" * tl.load(pk_{pd}_mult + offs_{pd}, mask={valid}, other=0.0)[None, :]"
        why = (f"{o.text()} = " + " ".join(f"{x}[{o.indices[0]},α_{r + 1}]" for r in range(o.power))
               + (" · m(α)" if o.weighted else "") + "   (packed symmetric power, never stored)")
        return Tile(block.define(expr, why), o.indices)

    def slot_columns(self, x: str, pd: str, r: int) -> tuple[str, str]:
        """(the packed indices' slot ``r`` [B_pd], x[T, α_r] [C, B_pd] in fp32) for this tile
        of packed dim ``pd``. The columns come out of the [C, dim] tile already loaded, as
        ``raw_x`` · onehot[dim, α] on the tensor cores, coalesced, where gathered loads of
        x's columns from memory (POWER_COLUMNS "load", the A/B) read them one element at a
        time; "gather" picks them from the tile in registers (``tl.gather``: no tensor-core
        work, the values the dots give bf16 / fp16 tokens; fp32 ones exact), under "auto" in
        the forward's kernels where the tile is at most POWER_GATHER_MAX_WIDTH wide. The dots
        are exact for bf16 / fp16 tokens (one value times 1 per output); fp32 tokens on a GPU
        go through tf32x3 like every other fp32 token product (~22 bits). Where x's dim
        is a dim a kernel may split over blocks (``split_dims``: ``raw_x`` then holds only this
        program's block of it), the columns are gathered from memory.
        With the dots, a dot reading the product is a chain of dots (``Block.chained``): Triton
        3.6 miscompiles such chains on narrow bf16 tiles on the H100 (run 170: illegal addresses
        and wrong gradients with the selection exempted and 16-wide tiles), so the
        narrow-tile rules (``launch.narrow_ok``, ``dot_override``) apply as to any chain. The
        gather makes no chain: the forward's power kernels at d <= 64 then split their value
        dim and keep bf16 tiles where those rules would not (power3's d = 32 GPU cases pass,
        run 279; their time at few (sequence, head) pairs is not measured).
        Measured (H100, power p = 2 gated, B = 2, H = 16, d = 64, bf16, forward): 15.85 -> 3.50
        ms at T = 16k, 60.69 -> 13.81 at 64k (runs 170, 171; ``retention`` 10.58 / 44.25)."""
        block, dim = self.block, self.input_dim[x]
        valid = f"offs_{pd} < D_{pd}"
        mode = self.column_mode(x, pd)
        if mode == "rows":
            return self.row_tile_columns(x, pd, r)
        col = block.define(f"tl.load(pk_{pd}_idx + {r} * D_{pd} + offs_{pd}, mask={valid}, other=0)",
                           f"slot {r + 1} of each packed index of {pd}")
        if mode == "load":
            return col, block.define(self.scaled_load(x, (
                f"tl.load(in_{x}_ptr + base_{x} + offs_t[:, None] * str_{x}_t + {col}[None, :], "
                f"mask=({valid})[None, :], other=0.0)")) + ".to(tl.float32)")
        if mode == "gather":   # padded α pick column 0: zeroed, as the one-hot's empty columns
            # (defensive: m(α), the masked start loads and state stores drop them downstream too)
            return col, block.define(
                f"tl.where(({valid})[None, :], tl.gather(raw_{x}, tl.broadcast_to({col}[None, :], "
                f"(C, B_{pd})), axis=1).to(tl.float32), 0.0)",
                f"{x}[T, α_{r + 1}], the tile's columns picked in registers")
        onehot = block.define(f"tl.where((offs_{dim}[:, None] == {col}[None, :]) & ({valid})[None, :], 1.0, 0.0)",
                              f"one-hot [{dim}, α] of slot {r + 1}")
        return col, block.define(f"_dot(raw_{x}, {onehot}, DOT, PREC)",
                                 f"{x}[T, α_{r + 1}], the tile's columns picked by a dot")

    def tiled_plan(self, t: TermProgram) -> tuple:
        """(steps, result) of a state term's contraction in a row-tiled kernel, costed at the
        tiles the kernel holds: a row-tiled packed dim at its tile, not its size (8256 at
        d = 128). So a per-token weight multiplies the [C, B] power tile, not the [C, dv] value
        tile, which then reaches its dot as loaded (from its pipelined buffer, no fp32 copy:
        RESULTS.md round 48)."""
        dims = self.index_dims(t.operands)
        sizes = (dict(self.p.sizes) | {pd: info.size for pd, info in self.packed.items()}
                 | {pd: min(PACKED_TILE, block_size(self.packed[pd].size)) for pd in self.rows_here})
        p = plan(tuple(o.indices for o in t.operands), t.output,
                 tuple(sorted({(i, self.p.chunk if dims[i] is None else sizes[dims[i]])
                               for o in t.operands for i in o.indices})))
        return p.steps, p.result

    def column_mode(self, x: str, pd: str) -> str:
        """How ``slot_columns`` forms x's columns of packed dim ``pd`` in the current kernel:
        "rows" (its row tiles), "load" (gathered loads: POWER_COLUMNS "load", or x's dim split
        over blocks), "gather" (in registers) or "dot" (one-hot dots on the tensor cores)."""
        if pd in self.rows_here:
            return "rows"
        dim = self.input_dim[x]
        mode = POWER_COLUMNS
        if mode == "auto":
            narrow = block_size(dict(self.p.sizes)[dim]) <= POWER_GATHER_MAX_WIDTH
            mode = "gather" if self.gathers_columns and narrow else "dot"
        if mode == "load" or dim in self.split_dims:
            return "load"
        return "gather" if mode == "gather" else "dot"   # ("rows" outside a row-tiled kernel: dots)

    def row_tile_columns(self, x: str, pd: str, r: int) -> tuple[str, str]:
        """``slot_columns`` in a row tile of ``pd`` (the template's ``row_tile``: its slots'
        indices ``rt_<pd>_<r>`` [one each] for the prefix, ``rt_<pd>_last`` [B_pd] for the last):
        a prefix slot's column is one column of x broadcast over the tile, the last slot's
        the aligned slice x[T, b0 .. b0 + B_pd), both loaded from memory as the query scale
        rounds them (the row-tiled state pass loads no whole token tile of x). Entries not the
        tile's own (offset D_pd) are not zeroed: they reach only masked stores and loads and
        sums weighted by the masked m(α), as the run form's padded entries do."""
        block, dim, last = self.block, self.input_dim[x], self.packed[pd].power - 1
        if r < last:
            load = self.scaled_load(x, f"tl.load(in_{x}_ptr + base_{x} + offs_t * str_{x}_t + rt_{pd}_{r})")
            return f"rt_{pd}_{r}", block.define(
                f"tl.broadcast_to({load}.to(tl.float32)[:, None], (C, B_{pd}))",
                f"{x}[T, α_{r + 1}]: the row tile's one column")
        load = self.scaled_load(x, f"tl.load(in_{x}_ptr + base_{x} + offs_t[:, None] * str_{x}_t + "
                                   f"rt_{pd}_last[None, :], mask=(rt_{pd}_last < D_{dim})[None, :], other=0.0)")
        return f"rt_{pd}_last", block.define(f"{load}.to(tl.float32)", f"{x}[T, α_{r + 1}]: the row tile's aligned slice")

    @functools.cached_property
    def row_tiled(self) -> frozenset[str]:
        """The packed dims the forward's state and output passes walk in row tiles
        (``packing.row_tiles``) instead of runs of 64 packed positions, under POWER_COLUMNS
        "rows" (an A/B mode): no one-hot dots (two a tile beside the one product they feed at
        d = 128), but a tile wastes the entries of its block that are not its own (d = 128,
        p = 2: 192 tiles for 129 runs); never a base dim a kernel splits (its token tile holds
        one block: ``slot_columns`` loads those) nor in the backward's lowering. Measured
        slower than the dots at d = 128 (H200, power p = 2 gated, T = 16k, forward, runs 287,
        288): 33.1 ms with dots, 85.8 with row tiles (state pass 74.0 ms), 44.7 at one pipeline
        stage -- while a hand-written prototype of the same tiles
        (``benchmarks/results/run284_rowtiles.py``, run 285) walks its state pass in 16.1 ms
        at two stages: RESULTS.md, round 44. Those kernels spilled (255 registers, 592 B of
        stack); constexpr token strides, the starts' offsets formed in the walk and
        ``tiled_plan`` removed it (round 48, run 315): 32.7 ms against the dots' 33.2 at 16k
        (state pass ~10 % faster, the table-walking output kernel 20 % slower), 141.6 against
        132.1 at 64k: still the A/B mode."""
        if not self.gathers_columns or POWER_COLUMNS != "rows":
            return frozenset()
        return frozenset(name for name, pd in self.packed.items() if pd.base not in self.split_dims)

    @functools.cached_property
    def split_dims(self) -> frozenset[str]:
        """The non-packed dims some kernel of this program splits over grid blocks: the
        output's value dim (output and reverse passes) and the state pass's splits."""
        return frozenset({self.o_dim} | set(_state_splits(self, self.o_dim))) - set(self.packed)

    # -- code ---------------------------------------------------------------------------
    def region(self, rows: frozenset = frozenset()) -> None:
        """Start a new kernel: temps are numbered afresh, nothing is reused across.
        ``rows``: the packed dims this kernel walks in row tiles (``row_tiled``)."""
        self.block = Block()
        self.rows_here = rows
        self.loop_init: list[str] = []
        self.deltas: dict[str, str] = {}   # state -> the temp holding its chunk delta (ir.scan)

    def terms(self, terms: tuple[TermProgram, ...], acc: str, defs: dict, scale_end=False,
              tiled: frozenset = frozenset(), only: frozenset | None = None,
              precision_of: str | None = None) -> dict[str, str]:
        """Code summing ``terms`` into ``acc``, by section (pre / loop / post, see
        ``steps``); ``scale_end``: state pass (carry weights). Indices of a ``tiled``
        dim are looped over in tiles: every step reading a tile runs in the loop,
        and the first step that sums the index away accumulates across tiles.
        ``only``: the positions of the terms to emit (the others are left out);
        ``precision_of``: the sum (``nx_<state>``, ...) whose precision rules apply, if not ``acc``."""
        block = self.block
        rules = precision_of or acc
        block.exact = self.exact_sum(rules)
        block.exact_tokens = rules[3:] in self.precision.exact_tokens if rules.startswith("nx_") else False
        start = {k: len(v) for k, v in block.sections.items()}
        emitted = 0
        for n, t in enumerate(terms):
            if only is not None and n not in only:
                continue
            head = f"{t.coef:+g} · {t.source}"
            block.section = "pre"
            block.lines.append("")
            block.note(head)
            block.sizes = self.sizes(t.operands)
            looped = {i for i, d in self.index_dims(t.operands).items() if d in tiled}
            name = acc[3:] if scale_end else ""
            scan = self.scan.get((name, n))
            steps, result = self.tiled_plan(t) if scale_end and self.rows_here else (t.plan.steps, t.plan.result)
            tiles, where = [], []
            if scan is not None and scan.delta in self.deltas:
                block.note(f"= carried states x the chunk delta of {scan.delta} "
                           f"({self.deltas[scan.delta]}), not its tokens again (ir.scan)")
                carried = [o for o in t.operands if o.kind in (Kind.CARRY, Kind.DERIVED)]
                tiles = [self.operand(o, defs) for o in carried]
                tiles.append(Tile(self.deltas[scan.delta], scan.delta_indices))
                where = ["pre"] * len(tiles)
                dims, sizes = self.index_dims(t.operands), dict(self.p.sizes)
                p = plan(tuple(x.indices for x in tiles), t.output,
                         tuple(sorted((i, sizes[dims[i]]) for x in tiles for i in x.indices)))
                steps, result = p.steps, p.result
            else:
                for o in t.operands:
                    block.section = "loop" if set(o.indices) & looped else "pre"
                    tiles.append(self.operand(o, defs))
                    where.append(block.section)
            in_loop_noted = False
            for s in steps:
                sides = {where[s.left], where[s.right]}
                if "loop" in sides and "post" in sides:
                    raise ValueError(f"term {t.source}: a tiled contraction meets a finished one")
                block.section = "loop" if "loop" in sides else ("post" if "post" in sides else "pre")
                if block.section == "loop" and not in_loop_noted:
                    block.lines.append("")
                    block.note(f"{head}   (its {','.join(sorted(looped))} tiles)")
                    in_loop_noted = True
                r = block.contract(tiles[s.left], tiles[s.right], s.indices)
                section = block.section
                if section == "loop" and not set(s.indices) & looped:
                    r, section = self._accumulate_tiles(r), "post"
                tiles.append(r)
                where.append(section)
            if where[result] == "loop":
                raise ValueError(f"term {t.source}: the tiled index survives to the result")
            block.section = where[result] if not tiled else "post"
            value = block.reduce(tiles[result], t.output).var
            if (name, n) in self.delta_terms:
                self.deltas[name] = value   # the state's delta (its one token-only term)
            if scale_end and t.carry_weight:
                value = f"{value} * tl.exp({int(t.carry_weight)} * lam_end)"
            self._accumulate(block, acc, value, float(t.coef), first=emitted == 0)
            emitted += 1
        block.section, block.exact, block.exact_tokens = "pre", False, False
        return {k: "\n".join(v[start[k]:]).strip("\n") for k, v in block.sections.items()}

    def exact_sum(self, acc: str) -> bool:
        """Do the products of the sum accumulated in ``acc`` (num, den, nx_<state>,
        dr_<derived>) reading carried states stay fp32 (``ir.precision``)?"""
        plan = self.precision
        if acc in ("num", "den"):
            return plan.exact_output
        kind, _, name = acc.partition("_")
        return name in {"nx": plan.exact_states, "dr": plan.exact_derived}[kind]

    def _accumulate_tiles(self, r: Tile) -> Tile:
        """Σ over the loop's tiles of ``r``: an fp32 accumulator zeroed before the loop."""
        self._accs += 1
        acc = f"acc{self._accs}"
        shape = ", ".join(self.block.sizes[i] for i in r.indices)
        self.loop_init.append(f"{acc} = tl.zeros(({shape}{',' if len(r.indices) == 1 else ''}), "
                              f"dtype=tl.float32)  # [{','.join(r.indices)}]")
        self.block.lines.append(f"{acc} += {r.var}")
        return Tile(acc, r.indices)

    def _keeps_free(self, t: TermProgram, dim: str) -> bool:
        """Every index of ``dim`` in the term is a free index of its result: each
        ``dim`` slice of the result needs only the same slice of its operands."""
        dims = self.index_dims(t.operands)
        return {i for i, d in dims.items() if d == dim} == {i for i in t.output if dims.get(i) == dim}

    def splittable(self, dim: str) -> bool:
        """Can the state pass run one program per block of ``dim``? Yes when no
        state has two ``dim`` slots and every state term keeps ``dim`` free."""
        return all(sum(d == dim for d in self.state_dims[name]) <= 1
                   and all(self._keeps_free(t, dim) for t in terms)
                   for name, terms in self.p.states)

    def output_splittable(self, dim: str) -> bool:
        """The same for the outputs (the fused schedule splits both alike): every
        output term and derived carry keeps ``dim`` free."""
        if not all(self._keeps_free(t, dim) for t in self.p.output + self.p.normalizer):
            return False
        return not self.derived_sums_over(dim)

    def derived_sums_over(self, dim: str) -> bool:
        """Does a derived carry sum over ``dim`` (one of its ``dim`` indices not free)? Then a
        program holding one block of ``dim`` would form only part of it. Read factor by factor:
        a summed index name may stand for ``dim`` in one product and another dim in the next."""
        return any(fd == dim and i not in d.poly.free
                   for d in self.p.derived for m in d.poly.terms for f in m.factors
                   for i, fd in zip(f.indices, self.state_dims[f.name]))

    @staticmethod
    def _accumulate(block: Block, acc: str, value: str, coef: float, first: bool) -> None:
        sign = "-" if coef < 0 else "+"
        mag = abs(float(coef))
        if mag != 1.0:
            value = f"{mag!r} * {value}"
        if first:
            neg = f"-{value}" if value.isidentifier() else f"-({value})"
            block.assign(acc, value if sign == "+" else neg)
        else:
            block.lines.append(f"{acc} {sign}= {value}")

    def derived(self) -> str:
        block = self.block
        block.section = "pre"
        start = len(block.lines)
        for d in self.p.derived:
            block.lines.append("")
            block.note(f"{d.name}[{','.join(d.poly.free)}] = {d.poly.text()}")
            self.state_sum(f"dr_{d.name}", d.poly, {"P": "st_"}, exact_as=f"dr_{d.name}")
        return "\n".join(block.lines[start:]).lstrip("\n")

    def state_sum(self, acc: str, poly, prefix: dict[str, str], exact_as: str, first: bool = True) -> None:
        """``acc`` (+)= ``poly``, a sum of products of state tiles: a factor at ``where`` is the
        tile ``prefix[where] + name`` (st_: carried, nx_: the chunk's end, dl_: its delta); a
        monomial's ρ_B^p (the chunk's decay, ``ir.recursion.DELTA``) is exp(p Λ_end) (gated
        only). Products as precise as ``exact_as``'s."""
        block = self.block
        sizes = dict(self.p.sizes)
        dims = {i: dim for m in poly.terms for f in m.factors
                for i, dim in zip(f.indices, self.state_dims[f.name])}
        block.sizes = {i: f"B_{dim}" for i, dim in dims.items()}
        block.exact = self.exact_sum(exact_as)
        for n, m in enumerate(poly.terms):
            factors = [free_first(f, poly.free) for f in m.factors]
            tiles = [Tile(prefix[f.where] + f.name, f.indices) for f in factors]
            pl = plan(tuple(f.indices for f in factors), poly.free,
                      tuple((i, sizes[dim]) for i, dim in dims.items()))
            for s in pl.steps:
                tiles.append(block.contract(tiles[s.left], tiles[s.right], s.indices))
            value = block.reduce(tiles[pl.result], poly.free).var
            rho = dict(m.rho)
            power = rho.pop(DELTA, 0)
            if rho:
                raise ValueError(f"{acc}: a decay over {sorted(rho)} is not the chunk's (ρ_{DELTA})")
            if power and self.p.gated:
                value = f"{value} * tl.exp({power} * lam_end)"
            self._accumulate(block, acc, value, float(m.coef), first=first and n == 0)
        block.exact = False


_INDEX_DIMS = exhaustive({
    Kind.TOKEN: _Lowering._token_dims, Kind.POWER: _Lowering._power_dims,
    Kind.CARRY: _Lowering._carry_dims, Kind.DERIVED: _Lowering._derived_dims,
    Kind.MASK: lambda self, o: _Lowering._time_dims(o),
    Kind.DECAY: lambda self, o: _Lowering._time_dims(o),
    Kind.COTANGENT: lambda self, o: self._cotangent_dims(o)},   # the backward lowering overrides it
    "the Triton lowering (index dims)")

_OPERAND_TILE = exhaustive({
    Kind.TOKEN: lambda self, o, defs: self._token_tile(o, defs),
    Kind.POWER: _Lowering._power_tile,
    Kind.CARRY: lambda self, o, defs: _Lowering._carry_tile(o, defs),
    Kind.DERIVED: lambda self, o, defs: _Lowering._derived_tile(o, defs),
    Kind.MASK: lambda self, o, defs: self._mask_tile(o, defs),
    Kind.DECAY: lambda self, o, defs: _Lowering._decay_tile(o, defs),
    Kind.COTANGENT: lambda self, o, defs: self._cotangent_tile(o, defs)},
    "the Triton lowering (operand tiles)")


def _layout(dims, offsets: dict | None = None) -> tuple[str, str, str]:
    """(offset, mask, numel) expressions of a contiguous state tile over ``dims``; ``offsets``:
    a dim's offsets variable where it is not ``offs_<dim>``."""
    r = len(dims)
    offs, masks = [], []
    for k, dim in enumerate(dims):
        slots = "" if r == 1 else "[" + ", ".join(":" if j == k else "None" for j in range(r)) + "]"
        stride = " * ".join(f"D_{x}" for x in dims[k + 1:])
        var = (offsets or {}).get(dim, f"offs_{dim}")
        offs.append(f"{var}{slots}" + (f" * {stride}" if stride else ""))
        masks.append(f"({var}{slots} < D_{dim})")
    numel = " * ".join(f"D_{x}" for x in dims)
    return " + ".join(offs), " & ".join(masks), numel if r == 1 else f"({numel})"


def owned_mask(name: str, dims, splits, mask: str = "msk_", expr: str | None = None) -> str:
    """The store mask of a tile ``name`` over ``dims`` in a kernel split over ``splits``
    (its load mask is ``mask`` + ``name``, or the expression ``expr``): a tile lacking a split
    dim is computed by every block of it and written by block 0."""
    load = f"({expr})" if expr is not None else f"{mask}{name}"
    owner = " & ".join(f"(pid_{d} == 0)" for d in splits if d not in dims)
    return f"tl.where({owner}, {load}, False)" if owner else load


def _defs(defs: dict) -> list[dict]:
    return [{"var": var, "text": text, "expr": expr} for var, (text, expr) in defs.items()]


def kernel_context(program: ChunkProgram, stage_complete: bool = False, every_start: bool = False) -> dict:
    """Everything the template needs, as plain data (also the cache key's program part).
    ``stage_complete``: a complete chunk scan runs in two stages (``ir.scan.staged_scan``; the
    module a forward running its own state pass takes where ``launch.forward_module`` says).
    ``every_start``: its second stage carries every state, never a derived carry in a state's
    place (the backward's state pass: it reads every state's chunk starts)."""
    low = _Lowering(program, stage_complete)
    alg = program.algebra

    def inputs_of(terms):
        names = dict.fromkeys(o.name for t in terms for o in t.operands
                              if o.kind in (Kind.TOKEN, Kind.POWER))
        return [low.input_info(x) for x in names]

    out_terms = program.output + program.normalizer
    # states with chunk-start buffers: those the output kernel reads, and those a two-stage
    # scan's second stage reads (``_second_stage``)
    stage_reads = low.staged.reads if low.staged else ()
    read = dict.fromkeys([o.name for t in out_terms for o in t.operands if o.kind is Kind.CARRY]
                         + sorted(program.derived_reads()) + list(stage_reads))
    (o_index,) = alg.output.free
    o_dim = low.index_dims(program.output[0].operands)[o_index]
    splits = _state_splits(low, o_dim)
    tiled = sorted({d for s in alg.streaming if s.name in read for d in low.state_dims[s.name]
                    if d in low.packed})
    if len(tiled) > 1:
        raise ValueError(f"the output kernel loops over one packed dim; {alg.name} reads {tiled}")
    states = []
    for s in alg.streaming:
        dims = low.state_dims[s.name]
        if not dims:
            raise ValueError(f"summary {s.name} has no indices: scalar states are not supported")
        off, msk, numel = _layout(dims)
        states.append({"name": s.name, "index": ",".join(s.indices), "dims": list(dims),
                       "off": off, "msk": msk, "own": owned_mask(s.name, dims, splits),
                       "numel": numel, "read": s.name in read,
                       "tiled": any(d in tiled for d in dims)})
        if low.row_tiled:   # the row-tiled state pass's start stores: offsets formed in the walk
            walk_off, walk_msk, _ = _layout(dims, {pd: f"w_offs_{pd}" for pd in low.row_tiled})
            states[-1].update(walk_off=walk_off, walk_own=owned_mask(s.name, dims, splits, expr=walk_msk))
    state_defs, out_defs = {}, {}
    state_code = []
    low.region(low.row_tiled)
    for name, terms in program.states:
        code = low.terms(terms, f"nx_{name}", state_defs, scale_end=True)
        state_code.append({"name": name, "code": code["pre"]})
    state_chained = low.block.chained
    low.region(low.row_tiled)
    derived_code = low.derived()
    num = low.terms(program.output, "num", out_defs, tiled=frozenset(tiled))
    den = (low.terms(program.normalizer, "den", out_defs, tiled=frozenset(tiled))
           if program.normalizer else {"pre": "", "loop": "", "post": ""})
    output_chained = low.block.chained
    packed = [{"name": pd.name, "base": pd.base, "power": pd.power, "size": pd.size,
               "rows": pd.name in low.row_tiled} for pd in program.packed]
    loop = None
    if tiled:
        loop = {"dim": tiled[0], "init": low.loop_init,
                "code": "\n\n".join(c for c in (num["loop"], den["loop"]) if c)}
    output_text = "\n".join([derived_code, num["pre"], num["loop"], num["post"],
                             den["pre"], den["loop"], den["post"]])
    for st in states:   # (the second stage's reads stay fp32: its products are the state pass's)
        st["starts_sdot"] = (read_only_as_sdot(output_text, f"st_{st['name']}")
                             and st["name"] not in stage_reads)
    chunk_scan = _chunk_scan(low, program, states, splits)   # fresh kernel regions
    if chunk_scan:
        chunk_scan.update(_derived_starts(low, program, states, splits, "\n".join(
            [num["pre"], num["loop"], num["post"], den["pre"], den["loop"], den["post"]]), chunk_scan,
            stage_complete and not every_start))
        walks_derived = bool(chunk_scan["stage"] and chunk_scan["stage"]["derived"])
        chunk_scan["stored"] = [s["name"] for s in chunk_scan["states"]
                                if s["read"] and not (walks_derived and s["name"] in chunk_scan["derived_only"])]
    fused = _fused(low, program, splits, o_dim)   # a fresh kernel region: last
    return {
        "name": alg.name,
        "chunk": program.chunk,
        "sizes": [[d, n] for d, n in program.sizes],
        "dims": low.dims + [pd["name"] for pd in packed],
        "packed": packed,
        "gated": program.gated,
        "normalize": bool(program.normalizer),
        "state_inputs": inputs_of([t for _, ts in program.states for t in ts]),
        "output_inputs": inputs_of(out_terms),
        "states": states,
        "state_defs": _defs(state_defs),
        "state_code": state_code,
        "output_defs": _defs(out_defs),
        "output_lam_end": any("lam_end" in expr for _, expr in out_defs.values()),
        "derived_code": derived_code,
        "output_pre": "\n\n".join(c for c in (num["pre"], den["pre"]) if c),
        "output_loop": loop,
        "output_post": "\n".join(c for c in (num["post"], den["post"]) if c),
        "o_dim": o_dim,
        "splits": splits,
        "state_chained_dots": state_chained,
        "output_chained_dots": output_chained,
        "fused": fused,
        "chunk_scan": chunk_scan,
        "stageable_scan_macs": _stageable_scan_macs(program, low.scan_plan) if not stage_complete else 0,
        "output_text": comment(f"{alg.output_name}[{o_index}] = {alg.output.text()}"),
        "normalizer_text": comment(alg.normalizer.text()) if alg.normalizer is not None else "",
    }


def read_only_as_sdot(code: str, var: str) -> bool:
    """Does ``code`` read ``var`` only as an operand of ``_dot(.., .., SDOT, PREC)`` (the
    innermost dot around each occurrence)? Then the output kernel rounds it to SDOT before
    any use, and its chunk-start values may be stored so (``runtime.launch.starts_dtype``:
    half the bytes for bf16, the same result)."""
    text = "\n".join(line for line in code.splitlines() if not line.lstrip().startswith("#"))
    uses = [m.start() for m in re.finditer(rf"\b{re.escape(var)}\b", text)]
    if not uses:
        return False
    calls = []     # (start, end, SDOT?, end of the second argument) of every _dot call
    for m in re.finditer(r"\b_dot\(", text):
        args, end = _call_args(text, m.end())
        operands_end = m.end() + len(args[0]) + 1 + len(args[1]) if len(args) == 4 else m.start()
        calls.append((m.start(), end, len(args) == 4 and args[2].strip() == "SDOT", operands_end))
    for pos in uses:
        around = [c for c in calls if c[0] < pos < c[1]]
        if not around:
            return False
        start, _, sdot, operands_end = max(around)    # the innermost call
        if not sdot or pos > operands_end:
            return False
        if not any(a.strip() in (var, f"tl.trans({var})") for a in _call_args(text, start + 5)[0][:2]):
            return False   # an operand computed from it (var * decay, a helper's result) is not it
    return True


def starts_read_as_sdot(sources, names, inner_products: bool = False) -> frozenset[str]:
    """The states of ``names`` whose chunk starts (``starts_<name>``) every kernel of the
    module texts ``sources`` only stores, or loads as ``st_<name>`` and reads only as SDOT dot
    operands (``read_only_as_sdot``): stored in SDOT they give those kernels the same bits in
    half the bytes (``runtime.launch.starts_dtype``). Any other use -- an exact product, an
    elementwise read, a load under another name -- keeps them fp32. ``inner_products``: also
    where the only other reads are sums of the start times its own chunk-end cotangent, a
    statement of their own (``_end_inner_product``: gated programs' dΛ scalars <ct_end_X,
    st_X>), which then read the starts rounded (not the same bits: ``launch.rounded_starts``)."""
    ok = set(names)
    for source in sources:
        for kernel in re.split(r"^@triton\.jit\n", source, flags=re.M)[1:]:
            signature = re.match(r"def \w+\(", kernel)
            if signature is None:   # not a function as the templates write them: nothing is known
                return frozenset()
            _, head = _call_args(kernel, signature.end())
            body = "\n".join(line for line in kernel[head:].splitlines()[1:]
                             if not line.lstrip().startswith("#"))
            for name in sorted(ok):
                ptr = re.escape(f"starts_{name}")
                uses = re.findall(rf"^.*\b{ptr}\b.*$", body, flags=re.M)
                # a statement of its own: the store's pointer, the load's whole right-hand side
                stores = [u for u in uses if re.match(rf"\s*tl\.store\({ptr}\b", u)
                          and len(re.findall(rf"\b{ptr}\b", u)) == 1]
                loads = [u for u in uses if _whole_load(u, f"st_{name}", f"starts_{name}")]
                rest = "\n".join(line for line in body.splitlines() if line not in loads
                                 and not (inner_products and _end_inner_product(line, name)))
                if len(stores) + len(loads) != len(uses) or (
                        loads and not read_only_as_sdot(rest, f"st_{name}")):
                    ok.discard(name)
    return frozenset(ok)


def _end_inner_product(line: str, name: str) -> bool:
    """Is ``line`` ``tN = tl.sum(...tl.sum(ct_end_X * st_X, axis=..)..)`` and nothing more: a
    temp summing the elementwise product of X's start with its own chunk-end cotangent?"""
    cast = r"(\.to\(tl\.float32\))?"
    product = rf"(ct_end_{name}{cast} \* st_{name}{cast}|st_{name}{cast} \* ct_end_{name}{cast})"
    return re.fullmatch(rf"\s*t\d+ = (tl\.sum\()+{product}(, axis=\d+\))+\s*", line) is not None


def _whole_load(line: str, var: str, ptr: str) -> bool:
    """Is ``line`` ``var = tl.load(ptr ...)`` and nothing more (but a trailing comment)?"""
    m = re.match(rf"\s*{re.escape(var)} = tl\.load\({re.escape(ptr)}\b", line)
    if not m:
        return False
    try:
        _, end = _call_args(line, m.end() - len(ptr))
    except ValueError:   # the call goes on past the line
        return False
    return line[end:].strip() == "" or line[end:].lstrip().startswith("#")


def _call_args(text: str, pos: int) -> tuple[list[str], int]:
    """The top-level comma-separated arguments of the call whose "(" ends just before
    ``pos``, and the index after its ")"."""
    depth, args, begin = 0, [], pos
    for i in range(pos, len(text)):
        ch = text[i]
        if ch in "([":
            depth += 1
        elif ch in ")]":
            if depth == 0:
                args.append(text[begin:i])
                return args, i + 1
            depth -= 1
        elif ch == "," and depth == 0:
            args.append(text[begin:i])
            begin = i + 1
    raise ValueError("unbalanced call in generated code")


def _fused(low: _Lowering, program: ChunkProgram, splits, o_dim) -> dict | None:
    """The single-kernel schedule: one program per (sequence·head[, value block])
    walks the chunks, computing each chunk's outputs from the states in registers
    and then the next states -- no chunk-start states in HBM, and the output and
    state terms share subexpressions (Q Kᵀ, ...). Not for packed states (their
    tiles are spread over programs)."""
    if program.packed:
        return None
    low.region()
    defs = {}
    derived_code = low.derived()
    num = low.terms(program.output, "num", defs)["pre"]
    den = low.terms(program.normalizer, "den", defs)["pre"] if program.normalizer else ""
    state_code = [{"name": name, "code": low.terms(terms, f"nx_{name}", defs, scale_end=True)["pre"]}
                  for name, terms in program.states]
    split = o_dim if o_dim in splits and low.output_splittable(o_dim) else ""
    terms = program.output + program.normalizer + tuple(t for _, ts in program.states for t in ts)
    names = dict.fromkeys(o.name for t in terms for o in t.operands if o.kind is Kind.TOKEN)
    # store masks of its own split alone: the state pass may split over a second dim it does not
    own = {name: owned_mask(name, low.state_dims[name], [split]) for name in low.state_dims} if split else {}
    return {"split": split, "own": own, "defs": _defs(defs), "derived_code": derived_code, "num_code": num,
            "den_code": den, "state_code": state_code,
            "inputs": [low.input_info(x) for x in names],
            "chained_dots": low.block.chained}


def _chunk_scan(low: _Lowering, program: ChunkProgram, states: list[dict], splits) -> dict | None:
    """The chunk-parallel state pass (``ir.scan``), where every state-pass term is a
    carry, a delta or a scan term: ``delta_kernel`` computes every chunk's deltas at once
    (each state's token-only terms, from zero: parallel over chunks, the token work of
    the walk), then ``scan_kernel`` walks the chunks applying only the carry terms and
    the scan terms -- carried states times another state's delta tile, read back from
    HBM (HLA2's G += ΔS (ρ C): one d x d x dv product a chunk, no token loads, no chained
    dots, so its value dim can be split over many programs). Where a term walks the tokens
    (HLA3's terms through its four-index combine-only states) the pass runs in two stages
    (``ir.scan.staged_scan``, ``stage``): those kernels for the lower states, then
    ``stage_kernel`` (every chunk's increment of the upper states, from the lower states'
    stored chunk starts) and ``stage_scan_kernel``. None where neither applies or a state is
    packed. Chunk summaries no state holds (``ir.scan.AuxDelta``: AHLA's Σ k qᵀ) are per-chunk
    buffers beside the deltas (``buffers``: every one the delta kernel writes)."""
    plan, staged = low.scan_plan, low.staged
    if staged is None and not has_chunk_scan(program, plan):
        return None
    role = {(t.state, t.index): t.role for t in plan.terms}
    def positions(name, terms, roles):
        return frozenset(n for n in range(len(terms)) if role[(name, n)] in roles)

    walked = [(name, terms) for name, terms in program.states if staged is None or name in staged.lower]
    aux = plan.aux if staged is None else ()   # (an upper state's aux terms are its increment's)
    low.region()
    delta_defs, delta_code = {}, []
    for name, terms in walked:
        keep = positions(name, terms, ("delta",))
        if keep:
            code = low.terms(terms, f"nx_{name}", delta_defs, scale_end=True, only=keep)["pre"]
            delta_code.append({"name": name, "code": code})
    for a in aux:   # its products as precise as the state update reading it
        code = low.terms((a.term,), f"ax_{a.name}", delta_defs, precision_of=f"nx_{a.state}")["pre"]
        delta_code.append({"name": a.name, "code": code})
    delta_chained = low.block.chained
    with_delta = [c["name"] for c in delta_code if c["name"] in low.state_dims]

    buffers = _delta_buffers(program, states, with_delta)
    sizes = dict(program.sizes)
    for a in aux:
        off, msk, numel = _layout(a.dims)
        buffers.append({"name": a.name, "index": "", "var": f"ax_{a.name}", "dims": list(a.dims), "off": off,
                        "msk": msk, "numel": numel, "shape": [sizes[d] for d in a.dims],
                        "own": owned_mask(a.name, a.dims, splits)})
    scan_code, scan_chained = _scan_code(low, walked, positions, buffers, with_delta)
    # A group of chunks is one chunk to the scan (the combine is associative): its walk from
    # zero gives its deltas, which the two-level scan (launch.scan_groups) walks. That needs
    # every state a term other than the carry grows to have a delta buffer, and no chunk
    # summary outside the states (an AuxDelta has no combine to build a group's from), and a
    # start buffer for every state (the walk over the groups writes each group's start there);
    # and one stage (the second stage's increments read the first's per-chunk starts).
    grown = {name for name, terms in program.states if len(positions(name, terms, ("scan", "delta")))}
    groupable = (staged is None and not aux and grown <= set(with_delta) and all(s["read"] for s in states))
    # A two-stage scan's first stage whose updates are each state's decayed carry plus its own
    # delta (no product: HLA3's SK, SQ, P; HLA2's S, C) walks every state element alone: its scan
    # kernel splits the states' flat layout over programs (``flat``), instead of holding the
    # value-free ones whole in every block (HLA3's two 128 x 128 at d = 128 spilled: 18 ms of
    # its 44 ms forward at T = 16k). (One stage keeps its tiles: its derived starts read them.)
    flat = staged is not None and not any(positions(name, terms, ("scan",)) for name, terms in walked)
    return {"deltas": with_delta, "buffers": buffers, "aux": [a.name for a in aux], "groupable": groupable,
            "states": [s for s in states if s["name"] in dict(walked)], "reads": [], "delta_reads": [],
            "derived": [], "parts": False, "flat": flat,
            "delta_defs": _defs(delta_defs), "delta_code": delta_code,
            "delta_chained_dots": delta_chained, "scan_code": scan_code,
            "scan_chained_dots": scan_chained,
            "stage": _second_stage(low, program, states, staged, positions) if staged else None}


def _stageable_scan_macs(program: ChunkProgram, plan) -> int:
    """A complete chunk scan's sequential MACs a chunk and head (``ScanPlan.scan_macs``) where
    it also splits into two stages, else 0: what ``launch.forward_module`` weighs."""
    return plan.scan_macs if split_complete_scan(program, plan) else 0


def _delta_buffers(program: ChunkProgram, states: list[dict], names) -> list[dict]:
    """The per-chunk buffers of the states ``names`` (a delta or increment each, laid out as
    the state)."""
    return [{**s, "var": f"nx_{s['name']}", "shape": list(program.state_shape(s["name"]))}
            for s in states if s["name"] in names]


def _scan_code(low: _Lowering, walked, positions, buffers: list[dict], with_delta,
               writer: str = "the chunk's own delta (delta_kernel)") -> tuple[list[dict], bool]:
    """A scan kernel's update of each state in ``walked``: its carry and scan terms, the
    latter reading the per-chunk ``buffers`` (``dl_<name>``), plus its own delta (or
    increment) where it has one. Returns the code and whether it chains dots."""
    low.region()
    low.deltas = {b["name"]: f"dl_{b['name']}" for b in buffers}   # scan terms read these tiles
    defs, code_of = {}, []
    for name, terms in walked:
        keep = positions(name, terms, ("carry", "scan"))
        code = low.terms(terms, f"nx_{name}", defs, scale_end=True, only=keep)["pre"] if keep else ""
        if name in with_delta:
            code += (f"\nnx_{name} += dl_{name}" if keep else f"nx_{name} = dl_{name}") + \
                f"  # + {writer}"
        code_of.append({"name": name, "code": code.strip("\n")})
    if defs:
        raise ValueError(f"{low.alg.name}: a carry or scan term of the state pass reads the tokens")
    return code_of, low.block.chained


def _second_stage(low: _Lowering, program: ChunkProgram, states: list[dict], staged, positions) -> dict:
    """``stage_kernel`` and ``stage_scan_kernel`` of a two-stage chunk scan: every term of an
    upper state but its carry, per chunk from the lower states' chunk starts (the walking
    state pass's own code for those terms, their precision included), then the walk of the
    upper states' carries plus those increments. The increments are lowered one state at a
    time, and again one term at a time where a state has several, each launched alone
    (``PART``, a constexpr: one compiled variant a part; ``part_sets``: the parts of each way,
    which ``launch.STAGE_PARTS`` picks): held in one program, HLA3's G1, G2, G3 spill 4280 B a
    thread at 255 registers (sm_90, 8 warps, ``benchmarks/compile_probe.py hla3 --schedule
    scan``); a later term of a state adds its state's earlier ones from HBM (``accumulate``)."""
    upper = [(name, terms) for name, terms in program.states if name in staged.upper]
    buffers = _delta_buffers(program, states, staged.upper)
    defs, code_of, chained = {}, [], False
    keeps = [positions(name, terms, ("delta", "scan", "walk")) for name, terms in upper]
    by_term = [[frozenset([n]) for n in sorted(keep)] for keep in keeps]
    ways = {"state": [[keep] for keep in keeps]}
    ways["term"] = by_term if any(len(t) > 1 for t in by_term) else None
    part_sets = {}
    for way, split in ways.items():
        if split is None:   # one term a state: the same parts
            part_sets[way] = part_sets["state"]
            continue
        part_sets[way] = []
        for (name, terms), buffer, parts in zip(upper, buffers, split):
            for k, part in enumerate(parts):
                low.region()
                part_sets[way].append(len(code_of))
                code_of.append({"name": name, "buffer": buffer, "accumulate": k > 0,
                                "code": low.terms(terms, f"nx_{name}", defs, scale_end=True, only=part)["pre"]})
                chained = chained or low.block.chained
    carry_only = lambda name, terms, roles: positions(name, terms, ("carry",))   # noqa: E731
    scan_code, scan_chained = _scan_code(low, upper, carry_only, [], staged.upper,
                                         "the chunk's increment (stage_kernel)")
    # its walk is each state's decayed carry plus its increment: flat, as the first stage's
    # (HLA3's G1..G3 at d = 128: 1.8 ms of its 16k forward in value blocks, run 202)
    return {"deltas": list(staged.upper), "buffers": buffers, "aux": [], "groupable": False, "parts": True,
            "part_sets": part_sets, "flat": not any(_dots(c["code"]) for c in scan_code),
            "states": [s for s in states if s["name"] in staged.upper],
            "stored": [s["name"] for s in states if s["name"] in staged.upper and s["read"]],
            "reads": [s for s in states if s["name"] in staged.reads], "delta_reads": [], "derived": [],
            "delta_defs": _defs(defs), "delta_code": code_of, "delta_chained_dots": chained,
            "scan_code": scan_code, "scan_chained_dots": scan_chained}


NO_RECURSION = {"recursion_code": "", "recover_code": "", "dropped": [], "recursions": {}}
NO_DERIVED_STARTS = {"derived_starts": [], "derived_only": [], "derived_scan_code": "", "sdot_beside_derived": [],
                     "derived_kernel": None, **NO_RECURSION}


def _derived_starts(low: _Lowering, program: ChunkProgram, states: list[dict], splits, output_body: str,
                    chunk_scan: dict, walk_derived: bool) -> dict:
    """Where the output kernel reads some states only through derived carries (HLA2's C and G,
    only in W0 = S C - G) and the derived carries take no more bytes than those states, the
    one-level scan computes the derived carries at each chunk start (where it holds the states)
    and stores them instead (``derived_starts``; the output kernel then loads them, skipping
    their contraction, and never reads the states in ``derived_only``); empty entries where that
    does not apply. Each is stored in the output's SDOT where that kernel reads it only as an
    SDOT dot operand (``starts_sdot``, as the states' chunk starts), and so are the states it
    then reads only so (``sdot_beside_derived``: the output kernel rounds them as loaded). In two
    stages the second walks the derived carries by their recursion where it can and
    ``walk_derived`` (the forward-only module of a complete scan; not where it serves the
    backward, which reads every state's starts), else ``derived_kernel`` forms them at every
    chunk start at once from the starts both stages stored (``_derived_kernel``). The derived
    code is lowered afresh, its temps renamed (``dt``) so that they cannot meet the scan's own."""
    none = dict(NO_DERIVED_STARTS)
    read = [st for st in states if st["read"] and not st["tiled"]]
    only = [st["name"] for st in read if not re.search(rf"\bst_{st['name']}\b", output_body)]
    if not program.derived or not only or any(st["tiled"] for st in states if st["read"]):
        return none
    if any(low.derived_sums_over(dim) for dim in splits):
        return none   # each block of the scan would hold a part of the sum
    size = dict(program.sizes)
    derived = []
    for d in program.derived:
        dims = [low.derived_dims[d.name][i] for i in d.poly.free]
        off, msk, numel = _layout(dims)
        derived.append({"name": f"dr_{d.name}", "dims": dims, "off": off, "msk": msk, "numel": numel,
                        "own": owned_mask(f"dr_{d.name}", dims, splits, mask="dmsk_"),
                        "shape": [size[x] for x in dims],
                        "starts_sdot": read_only_as_sdot(output_body, f"dr_{d.name}")})
    elements = lambda dims: math.prod(size[x] for x in dims)   # noqa: E731
    if sum(elements(d["dims"]) for d in derived) > sum(elements(st["dims"]) for st in read if st["name"] in only):
        return none
    low.region()
    code = re.sub(r"\bt(\d+)\b", r"dt\1", low.derived())
    found = {"derived_starts": derived, "derived_only": only, "derived_scan_code": code, "derived_kernel": None}
    chained = low.block.chained
    # states the output then reads only as SDOT operands (HLA2's S: in W0's contraction no more)
    beside = [st["name"] for st in read if st["name"] not in only
              and read_only_as_sdot(output_body, f"st_{st['name']}")]
    if chunk_scan["stage"]:   # the second stage walks the derived carries, or a kernel forms them
        staged = _staged_recursion(low, program, states, splits, chunk_scan, only, derived) \
            if walk_derived else None
        if staged:
            return {**found, "sdot_beside_derived": [], **staged}
        return {**found, "sdot_beside_derived": beside, **NO_RECURSION,
                "derived_kernel": _derived_kernel(program, states, chained)}
    return {**found, "sdot_beside_derived": beside,
            **_derived_recursion(low, program, chunk_scan, only, splits, code)}


def _derived_kernel(program: ChunkProgram, states: list[dict], chained: bool) -> dict:
    """``derived_kernel`` of a two-stage scan whose second stage walks the states, not the
    derived carries (HLA3's W0 = SK SQ P - G1 - G2 - G3, whose recursion's chunk terms hold two
    deltas at once): after both stages, one program a chunk (and block of the state pass's
    split dims, over which no derived carry sums) forms the derived carries from the stored
    chunk starts and stores them, so the output kernel neither holds the states they read
    whole in fp32 nor forms their fp32-accurate products (at d = 128 HLA3's output kernel held
    six 128 x 128 fp32 tiles). ``reads``: the states the derived carries read."""
    return {"reads": [st for st in states if st["name"] in program.derived_reads()], "chained_dots": chained}


def _dots(code: str) -> int:
    return len(re.findall(r"\b_dot\(", code))


def _dropping_recursions(program: ChunkProgram, elsewhere: set[str]) -> list | None:
    """Each derived carry's recursion (``ir.recursion``) where every one drops a state, each
    a different one that no recursion reads carried; else None (also where a proof fails: a
    warning, as the recursion is only a faster schedule). ``elsewhere``: states something
    besides the derived carries reads (never dropped)."""
    out = []
    for d in program.derived:
        others = {f.name for e in program.derived if e is not d for m in e.poly.terms for f in m.factors}
        try:
            rec = recursion(program.algebra, d.name, d.poly, elsewhere | others)
        except AssertionError as exc:
            warnings.warn(f"{program.algebra.name}: {exc}; the scan forms {d.name} from the states instead")
            return None
        if rec is None or not rec.dropped:
            return None
        out.append(rec)
    dropped = [r.dropped for r in out]
    if len(set(dropped)) < len(dropped) or any(
            f.name in dropped for r in out for m in r.terms.terms for f in m.factors if f.where != DELTA):
        return None
    return out


def _unsplittable(low: _Lowering, program: ChunkProgram, rec, splits) -> bool:
    """Does ``rec`` read a packed state, or sum over a split dim (each block of a kernel
    split over it would hold a part of the sum)?"""
    factors = [f for m in rec.terms.terms for f in m.factors]
    summed = {dim for f in factors for i, dim in zip(f.indices, low.state_dims[f.name]) if i not in rec.free}
    return any(program.is_packed(f.name) for f in factors) or bool(summed & set(splits))


def _recovery(low: _Lowering, recursions) -> dict:
    """The code (temps ``vt``) forming each dropped state from its derived carry where the walk
    ends (``st_<dropped>``, from ``dr_<derived>`` and the other states' ``st_`` tiles), and what
    the template and ``--emit chunk`` show of the recursions."""
    low.region()
    block = low.block
    for r in recursions:
        x, acc = r.dropped, f"rc_{r.dropped}"
        block.note(f"{x} = ({r.name} - ({r.rest.text() if r.rest.terms else '0'})) / {r.dropped_coef}")
        if r.rest.terms:
            low.state_sum(acc, r.rest, {"P": "st_"}, f"dr_{r.name}")
            block.assign(f"st_{x}", f"(dr_{r.name} - {acc}) * {float(1 / r.dropped_coef)!r}")
        else:
            block.assign(f"st_{x}", f"dr_{r.name} * {float(1 / r.dropped_coef)!r}")
    polys = {d.name: d.poly for d in low.p.derived}
    return {"recover_code": re.sub(r"\bt(\d+)\b", r"vt\1", "\n".join(block.lines)),
            "dropped": [r.dropped for r in recursions],
            "recursions": {r.name: r.text(polys[r.name].free) for r in recursions}}


def _derived_recursion(low: _Lowering, program: ChunkProgram, cs: dict, only, splits,
                       derived_code: str) -> dict:
    """Where each derived carry has a recursion over chunks that drops a state
    (``ir.recursion``: HLA2's W0' = ρ² W0 + S' ΔC - ΔG, G not carried) and the recursions
    take fewer products a step than forming the derived carries from the states and updating
    the dropped ones (HLA2: 1 against 2), the one-stage scan under STORE_DERIVED carries the
    derived carries instead: ``recursion_code`` after the state updates (temps ``rt``), the
    dropped states (``dropped``) not updated, and ``recover_code`` (``_recovery``) for the
    final states. NO_RECURSION entries where that does not apply: a state the recursion needs
    has no delta or start in the scan, is packed, or a term sums over a split dim. "Fewer
    products" counts dot calls, a heuristic that is right where the products are all
    d x d x dv (HLA2's)."""
    scan_code = {c["name"]: c["code"] for c in cs["scan_code"]}
    reads = {x: {y for y, code in scan_code.items() if y != x and re.search(rf"\bst_{x}\b", code)}
             for x in scan_code}
    recursions = _dropping_recursions(program, {x for x in scan_code if x not in only or reads[x]})
    if recursions is None or any(
            _unsplittable(low, program, r, splits)
            or any(f.name not in cs["deltas"] for m in r.terms.terms for f in m.factors if f.where == DELTA)
            or any(f.name not in scan_code for m in r.terms.terms for f in m.factors if f.where != DELTA)
            for r in recursions):
        return dict(NO_RECURSION)
    low.region()
    block = low.block
    for r in recursions:
        block.note(r.text())
        if program.gated:
            block.assign(f"dr_{r.name}", f"dr_{r.name} * tl.exp({r.weight} * lam_end)")
        low.state_sum(f"dr_{r.name}", r.terms, {START: "st_", END: "nx_", DELTA: "dl_"}, f"dr_{r.name}",
                      first=False)
    code = re.sub(r"\bt(\d+)\b", r"rt\1", "\n".join(block.lines))
    if _dots(code) >= _dots(derived_code) + sum(_dots(scan_code[r.dropped]) for r in recursions):
        return dict(NO_RECURSION)
    return {"recursion_code": code, **_recovery(low, recursions)}


def _staged_recursion(low: _Lowering, program: ChunkProgram, states: list[dict], splits, cs: dict,
                      only, derived: list[dict]) -> dict | None:
    """The second stage of a two-stage scan walking the derived carries instead of the upper
    states, where each derived carry's recursion drops one and together they drop them all
    (HLA2: W0 drops G, Wn0 drops h): ``stage_kernel`` computes every chunk's increment
    W(A⊕B) - ρ^w W(A) at once (``ir.recursion.chunk_terms``: S at the chunk's end -- its start
    from the first stage plus its delta -- times C's chunk terms, minus G's: the products the
    upper states' increments took), ``stage_scan_kernel`` walks W elementwise, stores it at
    each chunk start for the output kernel (which then forms no S C - G: at d = 128 its
    costliest product) and recovers the dropped states at the end from the first stage's
    final states. None where that does not apply: the output reads an upper state itself, a
    recursion reads a state the first stage does not scan or whose delta it does not keep,
    or sums over a split dim."""
    staged = low.staged
    if not set(staged.upper) <= set(only):
        return None
    recursions = _dropping_recursions(program, {x for x in low.state_dims if x not in only})
    if recursions is None or sorted(r.dropped for r in recursions) != sorted(staged.upper):
        return None
    terms_of = {}
    for r in recursions:
        at = {(f.name, f.where) for m in r.terms.terms for f in m.factors}   # (a state may be read at several)
        terms_of[r.name] = chunk_terms(program, r)
        if (terms_of[r.name] is None or _unsplittable(low, program, r, splits)
                or any(x not in staged.lower for x, where in at if where != DELTA)
                or any(x not in cs["deltas"] for x, where in at if where == END)):
            return None
    order = [name for name, _ in program.states]
    carried = [o for ts in terms_of.values() for t in ts for o in t.operands if o.kind is Kind.CARRY]
    ends = [x for x in order if any(o.name == x and o.anchor == "end" for o in carried)]
    starts = [x for x in order if any(o.name == x and not o.anchor for o in carried)]
    if set(starts + ends) & set(only):
        return None   # (the first stage stores no chunk start of a state the output reads only through W)
    roles = {(t.state, t.index): t.role for t in low.scan_plan.terms}
    states_of = dict(program.states)
    entry = {d["name"]: d for d in derived}
    free = {d.name: d.poly.free for d in program.derived}
    defs, code_of, chained = {}, [], False
    for r in recursions:
        low.region()
        lines = ["# " + comment(r.text(free[r.name]))]
        for x in ends:   # (its first-stage update: carry and delta, no cross term -- ir.recursion's fold)
            keep = frozenset(n for n in range(len(states_of[x])) if roles[(x, n)] == "carry")
            lines += [f"# {x} at the chunk's end: its start (scan_kernel) and its delta (delta_kernel)",
                      low.terms(states_of[x], f"nx_{x}", defs, scale_end=True, only=keep)["pre"].strip("\n"),
                      f"nx_{x} += dl_{x}"]
        lines.append(low.terms(terms_of[r.name], f"nx_dr_{r.name}", defs, scale_end=True,
                               precision_of=f"dr_{r.name}")["pre"].strip("\n"))
        chained = chained or low.block.chained
        d = entry[f"dr_{r.name}"]
        buffer = {**d, "var": f"nx_dr_{r.name}", "index": "", "own": owned_mask(d["name"], d["dims"], splits)}
        code_of.append({"name": r.name, "buffer": buffer, "accumulate": False, "code": "\n".join(lines)})
    named = {s["name"]: s for s in states}
    walked = [x for x in order if x in staged.upper or x in program.derived_reads()]
    weight = {r.name: r.weight for r in recursions}
    every = list(range(len(code_of)))
    stage = {"deltas": [c["buffer"]["name"] for c in code_of], "buffers": [c["buffer"] for c in code_of],
             "aux": [], "groupable": False, "parts": True, "part_sets": {"state": every, "term": every}, "flat": False,
             "states": [named[x] for x in staged.upper],    # (W's tiles are the size of the states it drops)
             "reads": [named[x] for x in order if x in set(starts) | set(ends)],
             "delta_reads": [b for b in cs["buffers"] if b["name"] in ends],
             "delta_defs": _defs(defs), "delta_code": code_of, "delta_chained_dots": chained,
             "scan_code": [], "scan_chained_dots": False,
             "derived": [{**entry[f"dr_{r.name}"], "weight": weight[r.name]} for r in recursions],
             "walked": [named[x] for x in walked]}
    return {"stage": stage, "recursion_code": "", **_recovery(low, recursions)}


def _state_splits(low: _Lowering, o_dim: str) -> list[str]:
    """Dims the state pass splits over grid axes 1 and 2: every packed dim (a
    packed state is never held whole), then, while fewer than two, each dim the
    program allows -- the output's value dim first, then the others in their
    declared order (linear's key dim: its S[i, e] walks in d x dv tiles, as fla's
    chunk_fwd_h, instead of every dv block loading the whole k tile)."""
    splits = []
    for pd in low.packed:
        if not low.splittable(pd):
            raise ValueError(f"the state pass of {low.alg.name} contracts over the packed dim {pd}; "
                             f"it can only be split over it")
        splits.append(pd)
    if len(splits) > 2:
        raise ValueError(f"the state pass splits over at most two dims, {low.alg.name} needs {splits}")
    for dim in [o_dim] + [d for d in low.alg.dims if d != o_dim and d not in low.packed]:
        if len(splits) < 2 and low.splittable(dim):
            splits.append(dim)
    return splits


def template_text() -> str:
    return templates.template_text(TEMPLATE)


def render(context: dict, version: str) -> str:
    return prune_dead(render_template(TEMPLATE, version=version, **context))


def generate(program: ChunkProgram) -> str:
    """The Python/Triton module source for ``program`` (uncached)."""
    return render(kernel_context(program), __version__)


_MODULES: dict[tuple, tuple] = {}   # (id(program), variant) -> (program, module, context); hashing
                                    # a program walks every term, too slow per launch


def kernels(program: ChunkProgram, stage_complete: bool = False):
    """(module, context): the imported module with ``state_pass_kernel`` and
    ``output_kernel`` for ``program`` (rendered once, then served from the disk
    cache, see hladsl.codegen.cache) and the context it was rendered from.
    ``stage_complete``: the variant whose complete chunk scan runs in two stages."""
    hit = _MODULES.get((id(program), stage_complete))
    if hit is None or hit[0] is not program:
        from hladsl.codegen.cache import cache_key, load_module
        context = kernel_context(program, stage_complete)
        key = cache_key(context, template_text())
        module = load_module(context["name"], key, lambda: render(context, __version__))
        hit = _MODULES[(id(program), stage_complete)] = (program, module, context)
    return hit[1], hit[2]
