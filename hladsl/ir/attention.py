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
layer's ``use_attention_form`` decides).
"""
from __future__ import annotations

from dataclasses import dataclass

from hladsl.ir.chunk import ChunkProgram, TermProgram
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
    shares one; the launch rule's ratio is measured on these counts.)"""
    blocks = -(-length // program.chunk)
    pairs = blocks * (blocks + 1) // 2
    return sum(t.plan.flops * (pairs if time_indices(t)[1] else blocks)
               for t in form.output + form.normalizer)


def chunk_macs(program: ChunkProgram, length: int) -> int:
    """Multiply-adds of the chunk form's forward over the same: every output, normaliser
    and state term once a chunk (``ChunkProgram.flops``)."""
    return sum(program.flops().values()) * -(-length // program.chunk)
