"""The attention form of a chunk program: its output as pairwise sums over earlier tokens.

A call with no initial state starts every carried state at zero, so with the whole
sequence as one chunk every term reading a carried state or a derived carry vanishes and
the output is its in-chunk terms alone. Where each of those is *pairwise* -- it reads the
output's token t and at most one earlier token n, joined by one mask M[t, n] =
[n rel t] exp(W (Λ_t − Λ_n)) -- the output can be computed as attention is: query blocks
in parallel, each summing over the key blocks at or before it, with no state at all
(linear and power attention; not HLA2 / HLA3, whose in-chunk terms sum over pairs of
earlier tokens). Its work grows with T² where the chunk form's grows with T times the
state size, so it wins where the state is large and the sequence short: power attention at
d = 128 holds 8256 x 128 numbers a head (``attention_macs`` / ``chunk_macs``; the launch
layer's ``use_attention_form`` decides, adding the chunk form's column dots: ``chunk_form_macs``).
"""
from __future__ import annotations

from dataclasses import dataclass, replace

from hladsl.ir.backward import GradTerm, Target, backward_program
from hladsl.ir.chunk import ChunkProgram, TermProgram, operand_sizes
from hladsl.ir.contract import plan
from hladsl.ir.operands import Kind

_STATEFUL = (Kind.CARRY, Kind.DERIVED)   # zero at a stateless call's start: such terms vanish


@dataclass(frozen=True)
class AttentionForm:
    """The terms of a program's output and normaliser that survive zero carried states, each
    pairwise or of token t alone (``time_indices`` tells which)."""
    output: tuple[TermProgram, ...]
    normalizer: tuple[TermProgram, ...]


def attention_form(program: ChunkProgram) -> AttentionForm | None:
    """The program's attention form, or None where a surviving term is not pairwise
    (``why_not`` says which)."""
    return None if why_not(program) else AttentionForm(*(
        tuple(t for t in terms if not _vanishes(t)) for terms in (program.output, program.normalizer)))


@dataclass(frozen=True)
class AttentionBackward:
    """The backward of the attention form: the networks of the backward program
    (``ir.backward``) that survive zero carried states and no state cotangent, each the
    transpose of a surviving forward term with respect to one of its operands, split by
    where its target lies. ``query``: at the forward term's token t (dq, dΛ_t, and every
    network of a term of token t alone), summed over the key chunks as the forward sums;
    ``key``: at its earlier token n (dk, dv, dΛ_n), summed over the query chunks at or
    after n's."""
    query: tuple[GradTerm, ...]
    key: tuple[GradTerm, ...]


def attention_backward(program: ChunkProgram) -> AttentionBackward | None:
    """The backward of ``program``'s attention form, or None where it has none. No network
    targets a carried state (the call has none) or Λ_end (only carried terms read it).

    A pairwise dΛ network is planned to its pair products [t, n] and then summed over the
    other token (``_pair_summed``), not as the backward program plans it (a row dot on its
    input's gradient): each pair adds +W·A[t, n] at t (the query kernel) and −W·A[t, n] at n
    (the key kernel), and dg sums them over every later token of the sequence, where all but
    the pairs straddling each position cancel -- to fp32 rounding only if both kernels sum the
    same products of the same bf16 operands (their masks' chunk gaps are summed in opposite
    orders: they may differ in the last bits). As a row dot on dq (query side) or dk (key side)
    each carries that gradient's bf16 rounding: linear, gated and normalised, bf16, T = 8192,
    dg's RMS ratio 1.2e-2 (run 295; 3.6e-3 from the pair products, run 299)."""
    if attention_form(program) is None:
        return None
    bwd = backward_program(program)
    query, key = [], []
    for g in bwd.output + bwd.normalizer:
        if g.target in (Target.CARRY, Target.DERIVED) or _vanishes(g.term):
            continue
        if g.target not in (Target.TOKEN, Target.LAM):
            raise ValueError(f"{g.text()}: a surviving network of the attention form targets {g.target}")
        t = g.cotangent.indices[0]   # d num[T, e] and d den[T] are indexed by the query's token
        if g.target is Target.LAM:
            if not pairwise_network(g):   # (Λ enters a surviving term only through its mask)
                raise ValueError(f"{g.text()}: a dΛ network of the attention form without an earlier token")
            g = _pair_summed(program, g, t)
        (query if g.indices[0] == t else key).append(g)
    return AttentionBackward(tuple(query), tuple(key))


def _pair_summed(program: ChunkProgram, g: GradTerm, query: str) -> GradTerm:
    """The dΛ network ``g`` contracted to its pair first, [t, n] on the query side and [n, t]
    on the key side (each kernel's orientation of its pair tiles: no transpose), then summed
    over the other token in fp32 (its term's ``output`` keeps the target's index). Its
    operands in one order on both sides, so both plan the same products."""
    ops = tuple(sorted(g.term.operands, key=lambda o: o.text()))
    (mask,) = [o for o in ops if o.kind is Kind.MASK]
    (key,) = [i for i in mask.indices if i != query]
    pair = (query, key) if g.indices[0] == query else (key, query)
    sizes = operand_sizes(program, ops)
    pl = plan(tuple(o.indices for o in ops), pair, tuple(sorted((i, sizes[i]) for i in sizes)))
    return replace(g, name="", wrt=None, term=replace(g.term, operands=ops, plan=pl))


def pairwise_network(g: GradTerm) -> bool:
    """Does a network of the attention backward read an earlier token (through its mask),
    not the query's token alone?"""
    return any(o.kind is Kind.MASK for o in g.term.operands)


def why_not(program: ChunkProgram) -> str:
    """'' where the program has an attention form, else the first term that is not pairwise
    and why."""
    for t in program.output + program.normalizer:
        if _vanishes(t):
            continue
        reason = _not_pairwise(t)
        if reason:
            return f"{t.source}: {reason}"
    if not [t for t in program.output if not _vanishes(t)]:
        return "no output term reads the tokens"
    return ""


def _vanishes(t: TermProgram) -> bool:
    return any(o.kind in _STATEFUL for o in t.operands)


def _times(t: TermProgram) -> set[str]:
    """The term's chunk-time indices, read off its operands: a token tile's first index, a
    mask's or a decay's indices."""
    out = set()
    for o in t.operands:
        if o.kind in (Kind.TOKEN, Kind.POWER):
            out.add(o.indices[0])
        elif o.kind in (Kind.MASK, Kind.DECAY):
            out.update(o.indices)
    return out


def time_indices(t: TermProgram) -> tuple[str, str | None]:
    """(the query's time index, the key's or None) of a pairwise term."""
    (query,) = [i for i in t.output if i in _times(t)]
    keys = sorted({o.indices[0] for o in t.operands if o.kind is Kind.TOKEN} - {query})
    return query, (keys[0] if keys else None)


def _not_pairwise(t: TermProgram) -> str:
    times = [i for i in t.output if i in _times(t)]
    if len(times) != 1:
        return "its result is not indexed by one token"
    for o in t.operands:
        if o.kind not in (Kind.TOKEN, Kind.MASK):
            return f"it reads a {o.kind.value} operand ({o.text()})"
    query = times[0]
    keys = {o.indices[0] for o in t.operands if o.kind is Kind.TOKEN} - {query}
    masks = [o for o in t.operands if o.kind is Kind.MASK]
    if len(keys) > 1:
        return f"it sums over {len(keys)} earlier tokens ({', '.join(sorted(keys))}), not one"
    if keys and (len(masks) != 1 or masks[0].indices != (query, *keys)):
        return "its earlier token is not joined to the query by one mask M[t, n]"
    if not keys and masks:
        return "a mask without an earlier token"
    return ""


def attention_macs(form: AttentionForm, program: ChunkProgram, length: int) -> int:
    """Multiply-adds of the attention form over one head of a sequence of ``length``
    tokens, in blocks of ``program.chunk``: each pairwise term's planned MACs on one
    [C, C] block pair, times the block pairs at or below the diagonal. (Planned, as
    ``chunk_macs`` counts them: power's p products q·k count p times where the kernel
    shares one; the launch rule's ratio is measured on these counts, the chunk form's with its
    column dots added: ``runtime.launch.chunk_form_macs``.)"""
    blocks = -(-length // program.chunk)
    pairs = blocks * (blocks + 1) // 2
    return sum(t.plan.flops * (pairs if time_indices(t)[1] else blocks)
               for t in form.output + form.normalizer)


def chunk_macs(program: ChunkProgram, length: int) -> int:
    """Multiply-adds of the chunk form's forward over the same: every output, normaliser
    and state term once a chunk (``ChunkProgram.flops``): the algebra's products, not the
    one-hot dots that pick a wide tile's packed columns (``codegen.triton_gen.column_pick_macs``)."""
    return sum(program.flops().values()) * -(-length // program.chunk)
