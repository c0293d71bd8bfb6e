"""Context parallelism from the combine: one long sequence split over the ranks
of a ``torch.distributed`` group, for any spec. Reached as
``op(q, k, v, ..., cp_group=group, cp_strategy="auto"|"gather"|"relay")``, which calls

    o_shard, final = cp_call(op, {"q": q, "k": k, "v": v}, g, scale, initial_state,
                             output_final_state, cu_seqlens, group, strategy="auto")

* Rank r passes its contiguous shard [B, T_r, H, ·] of the same sequences (ranks in
  group order, T_r may differ, T_r ≥ 1) and gets its shard of the output.
* ``cu_seqlens`` (B = 1) describes the GLOBAL packed batch, identical on every rank.
  A sequence may start and end anywhere; only one crossing a shard boundary carries
  state across it.
* ``initial_state`` ({summary: [N, H, *shape]}, the op's layout) is read on the
  group's first rank only (other ranks may pass None); its gradient arrives there.
* ``output_final_state``: False; True or "last": the final state on the group's
  last rank, None elsewhere; "broadcast": on every rank.
* Autograd spans the ranks: when any rank differentiates, every rank must run
  ``loss.backward()`` on a loss that reaches its ``o_shard`` (``torch.autograd.grad``
  with a subset of inputs may skip a rank's part of the exchange and hang the others) (the exchange of state gradients
  hangs off it as a pass-through, so that no rank skips a collective).
* Bad arguments raise ValueError on every rank (shapes and flags are exchanged
  first), never a hang.

Strategies (``cp_plan_text`` explains the choice for given sizes):
* gather: each rank forms its shard's segment tuple (``ir.segment.gathered``: the
  streaming summaries and the combine-only ones the combine reads on the B side,
  plus log ρ), one all-gather, then folds the preceding segments onto the initial
  state with the derived combine (evaluated from ``ir.combine.combine``) and runs
  its shard from that carry. Backward, dense (``_FinalGrads``): the segment pass runs
  without autograd; every rank computes its own part of its carry's gradient (its
  op's reverse pass alone, ``Op.carry_grad_impl``), one all-gather, folds the later
  ranks' parts back to its end through the combine's transpose and runs its op's one
  backward with that as its final state's gradient. Varlen (and finals on every
  rank): the fold's VJP, a reduce-scatter, and the segment pass differentiated.
* relay: rank r receives its carry from rank r−1, runs its shard from it and sends
  its end state on; nothing combine-only is materialised. Backward: state
  gradients travel back rank to rank. Ranks run one after another.

Costs (what to improve next; benchmarks/RESULTS.md round 14: hla2 at 128k over two
GPUs, fwd + bwd, 0.78x one GPU gated, 0.89x ungated): the reverse pass runs twice (own
part, then inside the backward), every rank's scans walk only its (sequence, head) pairs
(16 at B = 1, H = 16), and the segment pass (dense: the state pass alone,
``Op.final_state_impl``) is a third state pass per rank. The
relay runs whole shards one after another; with per-chunk state starts exposed it
could send its end state before its outputs.
"""
from __future__ import annotations

import weakref
from dataclasses import dataclass
from itertools import pairwise

import torch
import torch.distributed as dist

from hladsl.ir.algebra import Algebra
from hladsl.ir.combine import combine
from hladsl.ir.evaluate import einsum_poly
from hladsl.ir.pipeline import algebra_compilation
from hladsl.ir.segment import gathered, segment_algebra
from hladsl.runtime.packing import pack, packed_shape, unpack
from hladsl.runtime.validate import check_inputs, check_state, value_checks

STRATEGIES = ("auto", "gather", "relay")
# auto: gather while each rank receives at most this many bytes of segment tuples
GATHER_BUDGET_BYTES = 256 << 20


# -- planning (sizes only: also what `hladsl compile --emit cp` prints) -----------------

def _bytes(alg: Algebra, names, sizes: dict[str, int], rows: int, elem: int) -> dict[str, int]:
    out = {}
    for name in names:
        n = rows * elem
        for extent in packed_shape(alg.summary(name), sizes):
            n *= extent
        out[name] = n
    return out


def choose_strategy(alg: Algebra, sizes: dict[str, int], world: int, rows: int = 1,
                    elem: int = 4) -> tuple[str, str]:
    """(strategy, reason). ``rows``: sequences × heads crossing a boundary."""
    tuple_bytes = sum(_bytes(alg, [s.name for s in gathered(alg)], sizes, rows, elem).values())
    received = world * tuple_bytes
    if received <= GATHER_BUDGET_BYTES:
        return "gather", (f"gather: each rank gathers {world} x {_human(tuple_bytes)} = "
                          f"{_human(received)} <= budget {_human(GATHER_BUDGET_BYTES)}")
    return "relay", (f"relay: gather would move {world} x {_human(tuple_bytes)} = "
                     f"{_human(received)} per rank > budget {_human(GATHER_BUDGET_BYTES)}")


def _human(n: int) -> str:
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if n < 1024 or unit == "TiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return f"{n} B"


def cp_plan_text(algebra: Algebra, sizes: dict[str, int], world_size: int, heads: int = 1,
                 batch: int = 1, elem: int = 4) -> str:
    """What context parallelism moves for this algebra and these sizes, and why
    ``strategy="auto"`` picks what it picks (bytes per rank per forward; the
    backward moves the same amounts the other way)."""
    rows = heads * batch
    streaming = [s.name for s in algebra.streaming]
    tuple_names = [s.name for s in gathered(algebra)]
    seg = _bytes(algebra, tuple_names, sizes, rows, elem)
    state = _bytes(algebra, streaming, sizes, rows, elem)
    dims = ", ".join(f"{k} = {v}" for k, v in sizes.items())
    lines = [(f"# {algebra.name}: context parallelism over {world_size} ranks "
              f"({dims}; {heads} head(s) x {batch} sequence(s); {elem}-byte states)"), "",
             "segment tuple (gather):"]
    for name in tuple_names:
        role = "streaming" if name in streaming else "combine-only, read on the B side"
        shape = "x".join(str(e) for e in packed_shape(algebra.summary(name), sizes))
        lines.append(f"  {name:<8}{'[' + shape + ']':<16}{_human(seg[name]):>12}  {role}")
    tuple_bytes, state_bytes = sum(seg.values()), sum(state.values())
    lines += [f"  {'log rho':<24}{_human(rows * elem):>12}  (gated only)",
              f"  total {_human(tuple_bytes)} per rank", "",
              (f"gather: sends {_human(tuple_bytes)} and gathers {world_size} x "
               f"{_human(tuple_bytes)} = {_human(world_size * tuple_bytes)} per rank "
               "(one all-gather, its own included), ranks run in parallel"),
              (f"relay:  sends and receives one state, {_human(state_bytes)} per rank "
               f"({', '.join(streaming)}), ranks run one after another"), ""]
    _, reason = choose_strategy(algebra, sizes, world_size, rows, elem)
    lines.append(f"auto -> {reason}")
    return "\n".join(lines) + "\n"


@dataclass(frozen=True)
class _Piece:
    seq: int        # global sequence index
    start: int      # local token range [start, end)
    end: int
    carried: bool   # continues a sequence from the previous rank
    ends_here: bool  # the sequence's last token is on this rank


@dataclass(frozen=True)
class _Plan:
    rank: int
    world: int
    strategy: str
    names: tuple[str, ...]           # streaming summaries (the op's state)
    tuple_names: tuple[str, ...]     # gathered segment tuple
    n_seq: int
    pieces: tuple[_Piece, ...]       # local sequences, in order
    varlen: bool
    incoming: bool                   # some rows carry in from rank − 1
    outgoing: bool                   # some rows carry on to rank + 1
    chain: tuple[int, ...]           # gather: ranks whose segments fold into the carry
    chain_seqs: tuple[int, ...]      # their sequence rows (init rows of the fold)
    has_init: bool
    share_init: bool                 # initial_state broadcast from the first rank
    gated: bool
    final_mode: str | None           # None, "last", "broadcast"
    exchange_finals: bool
    empty_seqs: tuple[int, ...]      # zero-length sequences: final = initial state row
    wants_grad: bool                 # some rank differentiates: every rank joins the backward

    @property
    def init_here(self) -> bool:
        return self.has_init and (self.rank == 0 or self.share_init)


def _pieces(bounds, offsets, lengths, rank):
    lo, hi = offsets[rank], offsets[rank] + lengths[rank]
    out = []
    for n, (a, b) in enumerate(pairwise(bounds)):
        s, e = max(a, lo), min(b, hi)
        if s < e:
            out.append(_Piece(n, s - lo, e - lo, a < lo, b <= hi))
    return out


def _owner(offsets, lengths, position):
    """The rank holding global token ``position``."""
    for r, (o, t) in enumerate(zip(offsets, lengths)):
        if o <= position < o + t:
            return r
    raise ValueError(position)


def _make_plan(alg, strategy, rank, world, lengths, batch, heads, sizes, elem, bounds,
               has_init, gated, final_mode, wants_grad) -> _Plan:
    offsets = [sum(lengths[:r]) for r in range(world)]
    varlen = bounds is not None
    if varlen:
        pieces = _pieces(bounds, offsets, lengths, rank)
        n_seq = len(bounds) - 1
        incoming, outgoing = pieces[0].carried, not pieces[-1].ends_here
        chain, chain_seqs = (), ()
        if incoming:
            seq = pieces[0].seq
            chain = tuple(range(_owner(offsets, lengths, bounds[seq]), rank))
            chain_seqs = (seq,)
        ends = {n: _owner(offsets, lengths, b - 1) for n, (a, b) in enumerate(pairwise(bounds))
                if b > a}
        empty = tuple(n for n, (a, b) in enumerate(pairwise(bounds)) if a == b)
        off_last = empty or any(r != world - 1 for r in ends.values())
        rows = heads
    else:
        last = rank == world - 1
        pieces = [_Piece(b, 0, lengths[rank], rank > 0, last) for b in range(batch)]
        n_seq, incoming, outgoing = batch, rank > 0, rank < world - 1
        chain, chain_seqs = tuple(range(rank)), tuple(range(batch))
        empty, off_last = (), False
        rows = heads * batch
    if strategy == "auto":
        strategy = choose_strategy(alg, sizes, world, rows, elem)[0]
    names = tuple(s.name for s in alg.streaming)
    # rows of initial_state are needed off the first rank for a fold from it or for
    # a sequence starting there
    share = has_init and world > 1 and (strategy == "gather" or varlen)
    return _Plan(rank, world, strategy, names, tuple(s.name for s in gathered(alg)), n_seq,
                 tuple(pieces), varlen, incoming, outgoing, chain, chain_seqs, has_init, share,
                 gated, final_mode, final_mode == "broadcast" or (final_mode == "last" and off_last),
                 empty, wants_grad)


# -- flat tensors ----------------------------------------------------------------------

def _flat(states: dict, names) -> torch.Tensor:
    return torch.cat([states[n].reshape(-1) for n in names])


def _unflat(flat: torch.Tensor, shapes: dict[str, tuple[int, ...]]) -> dict[str, torch.Tensor]:
    out, at = {}, 0
    for name, shape in shapes.items():
        n = 1
        for e in shape:
            n *= e
        out[name] = flat[at:at + n].reshape(shape)
        at += n
    return out


def _numel(shapes) -> int:
    total = 0
    for shape in shapes.values():
        n = 1
        for e in shape:
            n *= e
        total += n
    return total


class _Ctx:
    """What the exchange functions need besides tensors (not a tensor: autograd
    Functions take it as a plain argument)."""

    def __init__(self, alg, plan, group, dims, heads, rows, dtype, device):
        self.alg, self.plan, self.group, self.dims = alg, plan, group, dims
        self.heads, self.rows, self.dtype, self.device = heads, rows, dtype, device
        # dense gather: later ranks' gradients reach this rank's tokens through its op's
        # final state (_FinalGrads), not through its segment pass (run without autograd)
        self.via_finals = plan.strategy == "gather" and not plan.varlen and not plan.exchange_finals
        self.gathered = None   # the segment tuples of every rank (gather), for _FinalGrads
        self.init_flat = None  # the initial state's rows where this rank holds them, for _FinalGrads

    def shapes(self, names, rows):
        return {n: (rows, self.heads) + packed_shape(self.alg.summary(n), self.dims) for n in names}

    def global_rank(self, r):
        return dist.get_global_rank(self.group, r) if self.group is not None else r

    def zeros(self, n):
        return torch.zeros(n, dtype=self.dtype, device=self.device)


# -- the carry-in: gather or relay, plus initial-state rows ------------------------------

def _assemble(ctx: _Ctx, init: dict | None, carry: dict | None) -> dict[str, torch.Tensor]:
    """The op's initial state for the local pieces: carried rows from ``carry``
    (rows in piece order), the rest from ``init`` or zero."""
    plan = ctx.plan
    out = {}
    for name in plan.names:
        shape = ctx.shapes([name], 1)[name][1:]
        zero = torch.zeros(shape, dtype=ctx.dtype, device=ctx.device)
        rows, m = [], 0
        for p in plan.pieces:
            if p.carried:
                rows.append(carry[name][m])
                m += 1
            else:
                rows.append(init[name][p.seq] if init is not None else zero)
        out[name] = torch.stack(rows)
    return out


def _fold(ctx: _Ctx, init: dict | None, segments: list[dict], log_rhos: list) -> dict:
    """init ⊕ X_0 ⊕ X_1 ⊕ ... with the derived combine, on full (unpacked) states.
    ``init`` rows: the chain's sequence rows of the initial state (packed)."""
    alg, plan, dims = ctx.alg, ctx.plan, ctx.dims
    polys = {n: combine(alg, alg.summary(n)) for n in plan.names}
    full = {n: (unpack(alg.summary(n), init[n], dims) if init is not None else
                torch.zeros((ctx.rows, ctx.heads) + tuple(dims[d] for d in alg.summary(n).dims),
                            dtype=ctx.dtype, device=ctx.device))
            for n in plan.names}
    for seg, log_rho in zip(segments, log_rhos):
        full = _combine(polys, full, {n: unpack(alg.summary(n), x, dims) for n, x in seg.items()},
                        torch.exp(log_rho))
    return {n: pack(alg.summary(n), x, dims) for n, x in full.items()}


def _combine(polys, a: dict, b: dict, rho_b: torch.Tensor) -> dict:
    """A ⊕ B for the summaries of ``polys`` (full states; B holds the gathered tuple)."""
    def operand(f):
        return a[f.name] if f.where == "A" else b[f.name]
    return {n: einsum_poly(poly, operand, lambda side: rho_b) for n, poly in polys.items()}


def _init_rows(ctx, init, seqs):
    return None if init is None else {n: x[list(seqs)] for n, x in init.items()}


class _CarryIn(torch.autograd.Function):
    """Forward: initial-state rows from the first rank (when shared), the carry
    from the previous rank (relay) or the gathered segments folded (gather); the
    op's initial state for this rank's pieces. Backward: the same traffic reversed, or,
    dense gather (``via_finals``), the first rank's initial-state gradient alone (the
    later ranks' reached it through _FinalGrads). Its output always feeds the op, so
    every rank runs its backward."""

    @staticmethod
    def forward(fctx, ctx: _Ctx, anchor: torch.Tensor, init_flat: torch.Tensor,
                seg_flat: torch.Tensor):
        plan = ctx.plan
        init_shapes = ctx.shapes(plan.names, plan.n_seq)
        if plan.share_init:
            if plan.rank != 0:
                init_flat = ctx.zeros(_numel(init_shapes))
            init_flat = init_flat.contiguous()
            dist.broadcast(init_flat, src=ctx.global_rank(0), group=ctx.group)
        gathered_flat = carry_flat = None
        if plan.strategy == "gather":
            gathered_flat = ctx.gathered = _all_gather(ctx, seg_flat)
        elif plan.incoming:
            carry_flat = ctx.zeros(_numel(ctx.shapes(plan.names, ctx.rows)))
            dist.recv(carry_flat, src=ctx.global_rank(plan.rank - 1), group=ctx.group)
        fctx.ctx = ctx
        ctx.init_flat = init_flat if plan.init_here else None
        fctx.save_for_backward(init_flat if plan.init_here else None, gathered_flat)
        rows = _CarryIn.rows(ctx, init_flat if plan.init_here else None, gathered_flat, carry_flat)
        return _flat(rows, plan.names)

    @staticmethod
    def rows(ctx, init_flat, gathered_flat, carry_flat):
        plan = ctx.plan
        init = _unflat(init_flat, ctx.shapes(plan.names, plan.n_seq)) if init_flat is not None else None
        carry = None
        if carry_flat is not None:
            carry = _unflat(carry_flat, ctx.shapes(plan.names, ctx.rows))
        elif gathered_flat is not None and plan.incoming:
            segs, log_rhos = [], []
            for r in plan.chain:
                seg, log_rho = _split_segment(ctx, gathered_flat[r])
                segs.append(seg)
                log_rhos.append(log_rho)
            carry = _fold(ctx, _init_rows(ctx, init, plan.chain_seqs), segs, log_rhos)
        return _assemble(ctx, init, carry)

    @staticmethod
    def backward(fctx, d_rows):
        ctx = fctx.ctx
        plan = ctx.plan
        init_flat, gathered_flat = fctx.saved_tensors
        if ctx.via_finals:
            # the carry's gradient went back through the earlier ranks' final states
            # (_FinalGrads): only the first rank's rows -- the initial state -- pass it on,
            # whole (no collective: every rank takes this branch)
            if plan.rank > 0 or init_flat is None:
                return None, None, None, None
            with torch.enable_grad():
                init_leaf = init_flat.detach().requires_grad_()
                rows = _flat(_CarryIn.rows(ctx, init_leaf, None, None), plan.names)
                d_init, = torch.autograd.grad(rows, [init_leaf], d_rows, allow_unused=True)
            return None, None, torch.zeros_like(init_flat) if d_init is None else d_init, None
        leaves = [x.detach().requires_grad_() for x in (init_flat, gathered_flat) if x is not None]
        it = iter(leaves)
        init_leaf = next(it) if init_flat is not None else None
        gathered_leaf = next(it) if gathered_flat is not None else None
        d_init = d_gathered = d_carry = None
        if plan.strategy == "relay" and plan.incoming:
            carry_leaf = ctx.zeros(_numel(ctx.shapes(plan.names, ctx.rows))).requires_grad_()
            leaves.append(carry_leaf)
        else:
            carry_leaf = None
        if leaves:
            with torch.enable_grad():
                rows = _flat(_CarryIn.rows(ctx, init_leaf, gathered_leaf, carry_leaf), plan.names)
                grads = (torch.autograd.grad(rows, leaves, d_rows, allow_unused=True)
                         if rows.requires_grad else [None] * len(leaves))   # all rows zero
            grads = [torch.zeros_like(x) if gx is None else gx for x, gx in zip(leaves, grads)]
            it = iter(grads)
            d_init = next(it) if init_leaf is not None else None
            d_gathered = next(it) if gathered_leaf is not None else None
            d_carry = next(it) if carry_leaf is not None else None
        if d_carry is not None:   # relay: the carry's gradient goes back to rank − 1
            dist.send(d_carry.contiguous(), dst=ctx.global_rank(plan.rank - 1), group=ctx.group)
        d_seg = None
        if d_gathered is not None:   # gather: every rank's gradient for my segment, summed
            d_seg = _reduce_scatter(ctx, d_gathered)
        if plan.share_init:
            dist.reduce(d_init, dst=ctx.global_rank(0), group=ctx.group)
            if plan.rank != 0:
                d_init = None
        return None, None, d_init, d_seg


def _all_gather(ctx, flat):
    """flat [L] on every rank -> [W, L]."""
    flat = flat.contiguous()
    if dist.get_backend(ctx.group) == "nccl":
        out = flat.new_empty((ctx.plan.world, flat.numel()))
        dist.all_gather_into_tensor(out, flat, group=ctx.group)
        return out
    parts = [torch.empty_like(flat) for _ in range(ctx.plan.world)]
    dist.all_gather(parts, flat, group=ctx.group)
    return torch.stack(parts)


def _reduce_scatter(ctx, stacked):
    """stacked [W, L] on every rank -> Σ_ranks stacked[my rank]."""
    if dist.get_backend(ctx.group) == "nccl":
        out = torch.empty_like(stacked[0])
        dist.reduce_scatter_tensor(out, stacked.contiguous(), group=ctx.group)
        return out
    total = stacked.contiguous().clone()   # gloo has no reduce_scatter: all-reduce and slice
    dist.all_reduce(total, group=ctx.group)
    return total[ctx.plan.rank]


def _split_segment(ctx, flat):
    plan = ctx.plan
    shapes = ctx.shapes(plan.tuple_names, ctx.rows)
    n = _numel(shapes)
    seg = _unflat(flat[:n], shapes)
    if plan.gated:
        log_rho = flat[n:].reshape(ctx.rows, ctx.heads)
    else:
        log_rho = torch.zeros((ctx.rows, ctx.heads), dtype=flat.dtype, device=flat.device)
    return seg, log_rho


# -- after the op: relay send, final states ------------------------------------------------

class _SendOn(torch.autograd.Function):
    """Relay: o passes through; the end state goes to rank + 1, and its gradient
    comes back from there in the backward (hung off o so that it always runs)."""

    @staticmethod
    def forward(fctx, ctx: _Ctx, o, end_flat):
        dist.send(end_flat.contiguous(), dst=ctx.global_rank(ctx.plan.rank + 1), group=ctx.group)
        fctx.ctx, fctx.n = ctx, end_flat.numel()
        return o.view_as(o)

    @staticmethod
    def backward(fctx, d_o):
        ctx = fctx.ctx
        d_end = ctx.zeros(fctx.n)
        dist.recv(d_end, src=ctx.global_rank(ctx.plan.rank + 1), group=ctx.group)
        return None, d_o, d_end


class _FinalGrads(torch.autograd.Function):
    """Dense gather, backward: this rank's op gets, as its final state's gradient, the
    gradient of the next rank's carry, so that one backward of its op gives its tokens'
    whole gradients (no segment pass to differentiate). Every rank first computes its own
    part of its carry's gradient -- from its outputs alone, the op's reverse pass without
    gradient kernels (``Op.carry_grad_impl``; the last rank's with the user's final-state
    gradient too: its whole carry gradient) --, one all-gather, then each folds the later
    ranks' parts back to its own end: d carry_s = own_s + J_sᵀ d carry_(s+1), J_s the
    combine's derivative in its A side at rank s's segment tuple (linear: the gathered
    tuple alone fixes it). o and the final state pass through."""

    @staticmethod
    def forward(fctx, ctx: _Ctx, op, call: tuple, o, final_flat):
        fctx.ctx, fctx.op, fctx.call = ctx, op, call
        return o.view_as(o), final_flat.view_as(final_flat)

    @staticmethod
    def backward(fctx, d_o, d_final):
        ctx, op, (tokens, g, scale, start) = fctx.ctx, fctx.op, fctx.call
        plan = ctx.plan
        shapes = ctx.shapes(plan.names, len(plan.pieces))
        last = plan.rank == plan.world - 1
        # the last rank's part is its carry's whole gradient: it has the user's final-state one
        ends = _unflat(d_final, shapes) if last and d_final is not None else None
        if plan.rank == 0 and not last:   # no rank reads the first one's part: zeros, not a pass
            own_flat = ctx.zeros(_numel(shapes))
        else:
            own = op.carry_grad_impl(tokens, g, scale, [start[n] for n in plan.names], d_o,
                                     None if ends is None else [ends[n] for n in plan.names])
            own_flat = _flat({n: x.to(ctx.dtype) for n, x in zip(plan.names, own)}, plan.names)
        parts = _all_gather(ctx, own_flat)
        if last:
            return None, None, None, d_o, d_final
        carries = _carries(ctx, plan.world - 1)
        d = parts[-1]
        for r in range(plan.world - 2, plan.rank, -1):
            d = parts[r] + _carry_transpose(ctx, r, carries[r], d, shapes)
        return None, None, None, d_o, d.to(d_final.dtype if d_final is not None else ctx.dtype)


def _carries(ctx: _Ctx, upto: int) -> list[torch.Tensor]:
    """Every rank's carry below ``upto`` (packed storage layout, flat), as the forward's
    _CarryIn formed it there: the initial state's rows folded with the segments before."""
    plan = ctx.plan
    init = None
    if ctx.init_flat is not None:
        init = _init_rows(ctx, _unflat(ctx.init_flat, ctx.shapes(plan.names, plan.n_seq)), plan.chain_seqs)
    carries, carry = [], init
    for r in range(upto):
        carries.append(_fold(ctx, carry, [], []))   # (the zero state where there is no init)
        seg, log_rho = _split_segment(ctx, ctx.gathered[r])
        carry = _fold(ctx, carries[-1], [seg], [log_rho])
    return [_flat(c, plan.names) for c in carries]


def _carry_transpose(ctx: _Ctx, s: int, carry, d, shapes) -> torch.Tensor:
    """J_sᵀ d: the transpose of A -> A ⊕ X_s at rank s's ``carry`` (packed storage layout,
    flat), X_s its gathered segment tuple. (A combine may multiply two summaries of its A
    side -- HLA3's --, so J_s is taken at the carry itself.)"""
    alg, plan, dims = ctx.alg, ctx.plan, ctx.dims
    polys = {n: combine(alg, alg.summary(n)) for n in plan.names}
    seg, log_rho = _split_segment(ctx, ctx.gathered[s])
    b = {n: unpack(alg.summary(n), x, dims) for n, x in seg.items()}
    rho = torch.exp(log_rho)

    def step(a_flat):
        a = {n: unpack(alg.summary(n), x, dims) for n, x in _unflat(a_flat, shapes).items()}
        out = _combine(polys, a, b, rho)
        return _flat({n: pack(alg.summary(n), x, dims) for n, x in out.items()}, plan.names)
    _, pull = torch.func.vjp(step, carry)
    return pull(d)[0]


class _Finals(torch.autograd.Function):
    """Final states of sequences ending on any rank, summed onto the last rank
    (or every rank, "broadcast"); o passes through so that the backward always runs."""

    @staticmethod
    def forward(fctx, ctx: _Ctx, o, contrib_flat):
        total = contrib_flat.contiguous().clone()
        if ctx.plan.final_mode == "broadcast":
            dist.all_reduce(total, group=ctx.group)
        else:
            dist.reduce(total, dst=ctx.global_rank(ctx.plan.world - 1), group=ctx.group)
        fctx.ctx = ctx
        return o.view_as(o), total

    @staticmethod
    def backward(fctx, d_o, d_total):
        ctx = fctx.ctx
        d = d_total.contiguous().clone()
        if ctx.plan.final_mode == "broadcast":
            dist.all_reduce(d, group=ctx.group)
        else:
            dist.broadcast(d, src=ctx.global_rank(ctx.plan.world - 1), group=ctx.group)
        return None, d_o, d


# -- the call ---------------------------------------------------------------------------------

_SEGMENT_OPS: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def _segment_op(op):
    """The op that carries the whole segment tuple (``op`` itself when every
    gathered summary streams)."""
    seg_alg = segment_algebra(op.algebra)
    if seg_alg is op.algebra:
        return op
    hit = _SEGMENT_OPS.get(op)
    if hit is None or hit.algebra is not seg_alg:
        # schedule left at "auto": the carried combine-only summaries may be packed
        # (hla3_masked's QQ), which the fused schedule does not take
        hit = type(op)(algebra_compilation(seg_alg), chunk_size=op.chunk_size, backend=op.backend)
        _SEGMENT_OPS[op] = hit
    return hit


def _check_cu_seqlens(cu_seqlens, batch, total) -> list[int]:
    if not isinstance(cu_seqlens, torch.Tensor) or cu_seqlens.dim() != 1 or \
            cu_seqlens.dtype not in (torch.int32, torch.int64) or cu_seqlens.numel() < 2:
        raise ValueError("cu_seqlens must be a 1-D int32/int64 tensor [0, ..., T] over the "
                         "whole sharded sequence")
    if batch != 1:
        raise ValueError(f"with cu_seqlens the batch size must be 1, got B = {batch}")
    bounds = [int(x) for x in cu_seqlens.tolist()]
    if total is None:
        total = bounds[-1]
    if bounds[0] != 0 or bounds[-1] != total or any(b < a for a, b in pairwise(bounds)):
        raise ValueError(f"cu_seqlens must be non-decreasing from 0 to the total length over all "
                         f"ranks ({total}), got {bounds}")
    return bounds


def _final_mode(value):
    if value is None or value is False:
        return None
    if value is True or value == "last":
        return "last"
    if value == "broadcast":
        return "broadcast"
    raise ValueError(f"output_final_state must be False, True, 'last' or 'broadcast', got {value!r}")


_META = ["T", "B", "H", "d", "dv", "initial_state", "g", "requires_grad", "dtype", "error"]


def _metadata(tokens, g, has_init, wants_grad, error, group):
    """All-gather each rank's shapes and flags, so that every rank knows the shard
    lengths and every rank raises when any rank's inputs are bad (rather than the
    others hanging in the next collective)."""
    names = list(tokens)
    q, v = tokens[names[0]], tokens[names[-1]]
    B, T, H, d = q.shape
    dtypes = [torch.float16, torch.bfloat16, torch.float32, torch.float64]
    mine = torch.tensor([T, B, H, d, v.shape[-1], int(has_init), int(g is not None),
                         int(wants_grad), dtypes.index(q.dtype), int(error is not None)],
                        dtype=torch.long, device=q.device)
    world = dist.get_world_size(group)
    parts = [torch.empty_like(mine) for _ in range(world)]
    dist.all_gather(parts, mine, group=group)
    rows = [p.tolist() for p in parts]
    if error is not None:
        raise error
    bad = [r for r, row in enumerate(rows) if row[-1]]
    if bad:
        raise ValueError(f"context parallelism: rank(s) {bad} of the group rejected their inputs")
    for col, label in enumerate(_META[1:-1], start=1):
        if label in ("initial_state", "requires_grad"):
            continue   # initial_state: the first rank's counts; requires_grad: any rank's
        if len({row[col] for row in rows}) > 1:
            raise ValueError(f"context parallelism: ranks disagree on {label} "
                             f"({[row[col] for row in rows]}); every rank must pass the same "
                             "batch, heads, dims, dtype and gating")
    lengths = [row[0] for row in rows]
    if min(lengths) < 1:
        raise ValueError(f"context parallelism: every rank needs at least one token, got shard "
                         f"lengths {lengths}")
    return lengths, bool(rows[0][5]), any(row[7] for row in rows)


def _check_local(op, tokens, g, scale, initial_state, cu_seqlens, rank):
    """This rank's own checks (before any communication): the dim sizes."""
    alg = op.algebra
    dims = check_inputs(alg, tokens, g, scale, None,
                        data_checks=value_checks(tokens[op.inputs[0]]))   # no host sync on CUDA
    q = tokens[op.inputs[0]]
    if cu_seqlens is not None:
        _check_cu_seqlens(cu_seqlens, q.shape[0], None)
    if initial_state is not None and rank == 0:
        n_seq = q.shape[0] if cu_seqlens is None else cu_seqlens.numel() - 1
        check_state(alg, initial_state, n_seq, q.shape[2], dims, q.device)
    return dims


def cp_call(op, tokens: dict, g=None, scale=None, initial_state=None, output_final_state=False,
            cu_seqlens=None, group=None, strategy: str = "auto"):
    """``op`` over a sequence sharded across ``group`` (see the module docstring).
    Returns (o_shard, final_state or None)."""
    if strategy not in STRATEGIES:
        raise ValueError(f"cp_strategy must be one of {STRATEGIES}, got {strategy!r}")
    if not dist.is_available() or not dist.is_initialized():
        raise ValueError("cp_group needs torch.distributed initialised (init_process_group)")
    mode = _final_mode(output_final_state)
    missing = sorted(set(op.inputs) - set(tokens))
    if missing:
        raise ValueError(f"tokens must hold {', '.join(op.inputs)}; missing {missing}")
    tokens = {n: tokens[n] for n in op.inputs}
    alg = op.algebra
    q = tokens[op.inputs[0]]
    rank, world = dist.get_rank(group), dist.get_world_size(group)
    error, dims = None, {}
    try:
        dims = _check_local(op, tokens, g, scale, initial_state, cu_seqlens, rank)
    except ValueError as exc:
        error = exc
    has_init_here = initial_state is not None and rank == 0
    wants_grad = (any(x.requires_grad for x in tokens.values()) or (g is not None and g.requires_grad)
                  or (error is None and has_init_here
                      and any(x.requires_grad for x in initial_state.values())))
    lengths, has_init, wants_grad = _metadata(tokens, g, has_init_here, wants_grad, error, group)
    B, _, H, _ = q.shape
    bounds = None if cu_seqlens is None else _check_cu_seqlens(cu_seqlens, B, sum(lengths))
    dtype = torch.float64 if q.dtype == torch.float64 else torch.float32
    elem = torch.tensor([], dtype=dtype).element_size()
    plan = _make_plan(alg, strategy, rank, world, lengths, B, H, dims, elem, bounds, has_init,
                      g is not None, mode, wants_grad)
    rows = B if bounds is None else 1
    ctx = _Ctx(alg, plan, group, dims, H, rows, dtype, q.device)

    init_flat = (_flat({n: initial_state[n].to(dtype) for n in plan.names}, plan.names)
                 if has_init_here else ctx.zeros(0))
    if plan.strategy != "gather":
        seg_flat = ctx.zeros(0)
    else:   # via_finals: no autograd, _FinalGrads carries its gradient
        seg_flat = _segment_flat(op, ctx, tokens, g, scale, differentiable=not ctx.via_finals)
    # the anchor makes the carry-in require grad on every rank when any rank
    # differentiates, so that every rank joins the backward's collectives
    anchor = torch.zeros(0, dtype=dtype, device=q.device, requires_grad=plan.wants_grad)
    start = _CarryIn.apply(ctx, anchor, init_flat, seg_flat)
    start = _unflat(start, ctx.shapes(plan.names, len(plan.pieces)))

    local_cu = None
    if bounds is not None:
        local_cu = torch.tensor([0] + [p.end for p in plan.pieces], dtype=cu_seqlens.dtype,
                                device=cu_seqlens.device)
    o, final = op(**tokens, g=g, scale=scale, initial_state=start, output_final_state=True,
                  cu_seqlens=local_cu)
    if ctx.via_finals and plan.wants_grad:
        call = ([x.detach() for x in tokens.values()], None if g is None else g.detach(),
                scale, {n: x.detach() for n, x in start.items()})
        o, final_flat = _FinalGrads.apply(ctx, op, call, o, _flat(final, plan.names))
        final = _unflat(final_flat, ctx.shapes(plan.names, len(plan.pieces)))
    if plan.strategy == "relay" and plan.outgoing:
        out_rows = [m for m, p in enumerate(plan.pieces) if not p.ends_here]
        o = _SendOn.apply(ctx, o, _flat({n: final[n][out_rows] for n in plan.names}, plan.names))
    if mode is None:
        return o, None
    if not plan.exchange_finals:   # every sequence ends on the last rank, in order
        return o, (final if rank == world - 1 else None)
    o, total = _Finals.apply(ctx, o, _flat(_contributions(ctx, final, init_flat), plan.names))
    if mode == "last" and rank != world - 1:
        return o, None
    return o, _unflat(total, ctx.shapes(plan.names, plan.n_seq))


def _contributions(ctx, final, init_flat):
    """[N, H, ...] per summary: rows of sequences ending on this rank (and, on the
    first rank, zero-length sequences' initial states), zero elsewhere."""
    plan = ctx.plan
    init = None
    if plan.rank == 0 and plan.has_init:
        init = _unflat(init_flat, ctx.shapes(plan.names, plan.n_seq))
    out = {}
    for name in plan.names:
        shape = ctx.shapes([name], plan.n_seq)[name]
        rows = [None] * plan.n_seq
        for m, p in enumerate(plan.pieces):
            if p.ends_here:
                rows[p.seq] = final[name][m]
        if plan.rank == 0:
            for n in plan.empty_seqs:
                rows[n] = init[name][n] if init is not None else None
        zero = torch.zeros(shape[1:], dtype=ctx.dtype, device=ctx.device)
        out[name] = torch.stack([zero if r is None else r.to(ctx.dtype) for r in rows])
    return out


def _segment_flat(op, ctx, tokens, g, scale, differentiable: bool = True):
    """This rank's segment tuple of its outgoing rows (zeros when none go out),
    flattened, with log ρ appended when gated (``differentiable`` False: without autograd)."""
    plan = ctx.plan
    shapes = ctx.shapes(plan.tuple_names, ctx.rows)
    if not plan.outgoing:
        return ctx.zeros(_numel(shapes) + (ctx.rows * ctx.heads if plan.gated else 0))
    if plan.varlen:
        a = plan.pieces[-1].start
        tokens = {n: x[:, a:] for n, x in tokens.items()}
        g = None if g is None else g[:, a:]
    seg_op = _segment_op(op)
    if differentiable:
        _, seg = seg_op(**tokens, g=g, scale=scale, output_final_state=True)
    else:   # the state pass alone, no output kernel, no autograd
        with torch.no_grad():
            seg = dict(zip(seg_op.state_names, seg_op.final_state_impl(
                [tokens[n] for n in seg_op.inputs], g, scale, [])))
    flat = _flat({n: seg[n].to(ctx.dtype) for n in plan.tuple_names}, plan.tuple_names)
    if plan.gated:
        flat = torch.cat([flat, g.to(ctx.dtype).sum(1).reshape(-1)])
    return flat if differentiable else flat.detach()
