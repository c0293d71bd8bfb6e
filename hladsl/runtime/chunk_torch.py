"""Executes a chunk program with torch: the CPU path of the op and the
reference for the generated kernels. Every tile carries leading batch dims
[N, H, (chunks)]; each plan step is one pairwise ``torch.einsum``."""
from __future__ import annotations

import torch

from hladsl.ir.chunk import ChunkProgram, Operand, TermProgram
from hladsl.ir.evaluate import einsum_poly, letters_for


class _Tiles:
    """Operand tensors of one chunk (or all chunks at once, batched)."""

    def __init__(self, tokens, lam, carry, derived, chunk, dtype):
        self.tokens, self.lam, self.carry, self.derived = tokens, lam, carry, derived
        self.chunk, self.dtype = chunk, dtype
        self._cache = {}

    def __call__(self, op: Operand) -> torch.Tensor:
        if op.kind == "token":
            return self.tokens[op.name]
        if op.kind == "carry":
            return self.carry[op.name]
        if op.kind == "derived":
            return self.derived[op.name]
        if op.kind == "eye":
            raise AssertionError("eye is eliminated before chunk programs")
        key = (op.kind, op.rel, op.weight, op.anchor)
        if key not in self._cache:
            self._cache[key] = self._make(op)
        return self._cache[key]

    def _make(self, op: Operand) -> torch.Tensor:
        c = self.chunk
        if op.kind == "mask":
            device = next(iter(self.tokens.values())).device
            rows = torch.arange(c, device=device)
            keep = rows[:, None] >= rows[None, :] if op.rel == "<=" else rows[:, None] > rows[None, :]
            if self.lam is None or op.weight == 0:
                return keep.to(self.dtype)
            diff = op.weight * (self.lam[..., :, None] - self.lam[..., None, :])
            return torch.exp(diff.masked_fill(~keep, float("-inf")))
        if op.anchor == "end":
            return torch.exp(op.weight * (self.lam[..., -1:] - self.lam))
        return torch.exp(op.weight * self.lam)


def run_term(term: TermProgram, tiles: _Tiles) -> torch.Tensor:
    names = letters_for([i for o in term.operands for i in o.indices] + list(term.output))
    values: list[tuple[torch.Tensor, tuple[str, ...]]] = [
        (tiles(o), o.indices) for o in term.operands]
    for step in term.plan.steps:
        (a, ia), (b, ib) = values[step.left], values[step.right]
        spec = ("..." + "".join(names[i] for i in ia) + ",..." + "".join(names[i] for i in ib)
                + "->..." + "".join(names[i] for i in step.indices))
        values.append((torch.einsum(spec, a, b), step.indices))
    result, idx = values[term.plan.result]
    extra = [i for i in idx if i not in term.output]
    if extra:   # a single-operand term: sum its time index away
        lead = result.dim() - len(idx)
        result = result.sum(dim=[lead + idx.index(i) for i in extra])
        idx = tuple(i for i in idx if i not in extra)
    return _permute(result, idx, term.output) * term.coef


def _permute(value, idx, want):
    if tuple(idx) == tuple(want):
        return value
    lead = value.dim() - len(idx)
    order = list(range(lead)) + [lead + idx.index(i) for i in want]
    return value.permute(order)


def derive(program: ChunkProgram, carry: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """The derived carry tensors (sums of carried-state contractions) of every chunk."""
    return {d.name: einsum_poly(d.poly, lambda f: carry[f.name]) for d in program.derived}


def state_pass(program: ChunkProgram, tokens, lam, initial: dict[str, torch.Tensor], dtype):
    """Sequential over chunks: the state at the start of every chunk, and the final one.

    tokens: name -> [N, H, nC, C, dim]; lam: [N, H, nC, C] in-chunk cumulative log gates."""
    n_chunks = next(iter(tokens.values())).shape[2]
    local_only = {}
    all_tiles = _Tiles(tokens, lam, {}, {}, program.chunk, dtype)
    for name, terms in program.states:   # terms without carry: all chunks at once
        parts = [run_term(t, all_tiles) for t in terms
                 if not any(o.kind in ("carry", "derived") for o in t.operands)]
        local_only[name] = sum(parts) if parts else None
    state = dict(initial)
    starts = {name: [] for name, _ in program.states}
    for c in range(n_chunks):
        for name in starts:
            starts[name].append(state[name])
        tiles = _Tiles({k: v[:, :, c] for k, v in tokens.items()},
                       None if lam is None else lam[:, :, c], state, {}, program.chunk, dtype)
        end = None if lam is None else lam[:, :, c, -1]
        new = {}
        for name, terms in program.states:
            total = local_only[name][:, :, c] if local_only[name] is not None else 0
            for t in terms:
                if any(o.kind == "carry" for o in t.operands):
                    value = run_term(t, tiles)
                    if t.carry_weight and end is not None:
                        value = value * torch.exp(t.carry_weight * end).reshape(
                            end.shape + (1,) * (value.dim() - end.dim()))
                    total = total + value
            new[name] = total
        state = new
    stacked = {name: torch.stack(v, dim=2) for name, v in starts.items()}
    return stacked, state


def outputs(program: ChunkProgram, terms, tokens, lam, chunk_starts, dtype) -> torch.Tensor:
    """All chunks in parallel: Σ terms at every token, given each chunk's carry-in."""
    derived = derive(program, chunk_starts)
    tiles = _Tiles(tokens, lam, chunk_starts, derived, program.chunk, dtype)
    total = None
    for t in terms:
        value = run_term(t, tiles)
        total = value if total is None else total + value
    return total
