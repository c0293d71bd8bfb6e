"""Runs the backward program (hladsl.ir.backward) with torch: a small einsum
interpreter over the gradient networks, every tile with leading batch dims
[N, H, (nC,)]. The reference for the Triton backward kernels (the op's torch
path differentiates the torch chunk program with torch.func instead).

  1. recompute the chunk-start states (chunk_torch.state_pass) and, when
     normalized, num and den: dnum = do / (den + eps), dden = -Σ_e do num / (den + eps)²;
  2. the carry gradients of the output terms, all chunks at once (derived
     carries sent on to the carries through their polys);
  3. the reverse state pass: dend_last = d final, dstart_c = (2 at chunk c) +
     the state terms transposed w.r.t. their carries (cotangent dend_c),
     dend_(c-1) = dstart_c, d initial = dstart_0;
  4. the token and Λ gradients of every term, all chunks at once.
"""
from __future__ import annotations

import torch

from hladsl.ir.backward import (
    PARALLEL,
    GradTerm,
    Target,
    backward_program,
    cotangent_name,
    output_size,
)
from hladsl.ir.chunk import ChunkProgram
from hladsl.ir.evaluate import letters_for
from hladsl.ir.operands import Kind, exhaustive
from hladsl.runtime import chunk_torch
from hladsl.runtime.packing import combos, multiplicity


class GradEnv(chunk_torch.Env):
    """The forward operands plus the cotangents (name -> tensor)."""

    def __init__(self, tokens, lam, carry, chunk, dtype, derived=None, cotangents=None):
        super().__init__(tokens, lam, carry, chunk, dtype, derived)
        self.cotangents = cotangents or {}

    def cotangent(self, name):
        return self.cotangents[name]


_OPERAND = exhaustive({
    Kind.TOKEN: lambda env, o: env.token(o.name),
    Kind.POWER: lambda env, o: env.power(o.name, o.packed, o.power, o.weighted),
    Kind.CARRY: lambda env, o: env.carry(o.name),
    Kind.DERIVED: lambda env, o: env.derived(o.name),
    Kind.MASK: lambda env, o: env.mask(o.rel, o.weight),
    Kind.DECAY: lambda env, o: env.decay(o.anchor, o.weight),
    Kind.COTANGENT: lambda env, o: env.cotangent(o.name)}, "the torch backward (operands)")


def evaluate(g: GradTerm, env: GradEnv) -> torch.Tensor:
    """One gradient network in its plan's order; [..., *g.indices]."""
    t = g.term
    names = letters_for([i for o in t.operands for i in o.indices] + list(t.output))
    values = [(_OPERAND[o.kind](env, o), o.indices) for o in t.operands]
    for s in t.plan.steps:
        (a, ia), (b, ib) = values[s.left], values[s.right]
        spec = (f"...{''.join(names[i] for i in ia)},...{''.join(names[i] for i in ib)}"
                f"->...{''.join(names[i] for i in s.indices)}")
        values.append((torch.einsum(spec, a, b), s.indices))
    value, idx = values[t.plan.result]
    have, want = "".join(names[i] for i in idx), "".join(names[i] for i in t.output)
    if have != want:
        value = torch.einsum(f"...{have}->...{want}", value)
    value = value * t.coef
    if t.carry_weight and env.lam is not None:   # the forward term's carry scale exp(W Λ_end)
        end = env.lam[..., -1]
        value = value * torch.exp(t.carry_weight * end).reshape(
            end.shape + (1,) * len(t.output))
    for i, n in g.broadcast:   # constant along an index no operand carries
        value = value.unsqueeze(-1).expand(*value.shape, n)
    have = tuple(t.output) + tuple(i for i, _ in g.broadcast)
    if have != g.indices:
        value = value.permute(*range(value.dim() - len(have)),
                              *(value.dim() - len(have) + have.index(i) for i in g.indices))
    return value


def _add(acc: dict, key, value):
    acc[key] = value if key not in acc else acc[key] + value


def power_chain_rule(x: torch.Tensor, dspow: torch.Tensor, p: int, weighted: bool) -> torch.Tensor:
    """dx[..., i] = Σ_α dspow[..., α] (m(α)) Σ_r [α_r = i] Π_{s≠r} x[..., α_s]."""
    n = x.shape[-1]
    index = combos(n, p).to(x.device)
    if weighted:
        dspow = dspow * multiplicity(n, p).to(device=x.device, dtype=dspow.dtype)
    dx = torch.zeros_like(x)
    for r in range(p):
        part = dspow
        for s in range(p):
            if s != r:
                part = part * x[..., index[:, s]]
        dx = dx.index_add(-1, index[:, r], part)
    return dx


def check_backward_args(program: ChunkProgram, tiles, lam, init_states, grad_o, grad_final,
                        state_rows: int | None = None, zero_init_ok: bool = False) -> None:
    """ValueError naming the argument whose tensor does not fit ``program``. ``state_rows``:
    the states' leading dim where it is not the tiles' N (varlen: one row per sequence).
    ``zero_init_ok``: ``init_states`` may be None (the Triton kernels then start from zeros)."""
    alg, sizes = program.algebra, dict(program.sizes)
    missing = sorted(set(alg.inputs) - set(tiles))
    if missing:
        raise ValueError(f"tiles: missing input(s) {', '.join(missing)}")
    first = tiles[next(iter(alg.inputs))]
    if first.dim() != 5 or first.shape[3] != program.chunk:
        raise ValueError(f"tiles: expected [N, H, nC, C = {program.chunk}, dim], got {list(first.shape)}")
    lead = tuple(first.shape[:4])
    for x, dim in alg.inputs.items():
        if tuple(tiles[x].shape) != lead + (sizes[dim],):
            raise ValueError(f"tiles[{x!r}]: expected {list(lead + (sizes[dim],))}, got {list(tiles[x].shape)}")
    if program.gated != (lam is not None):
        raise ValueError("lam must be given exactly when the chunk program is gated")
    if lam is not None and tuple(lam.shape) != lead:
        raise ValueError(f"lam: expected {list(lead)}, got {list(lam.shape)}")
    dv = output_size(program)
    if tuple(grad_o.shape) != lead + (dv,):
        raise ValueError(f"grad_o: expected {list(lead + (dv,))}, got {list(grad_o.shape)}")
    for what, states in (("init_states", init_states), ("grad_final", grad_final or {})):
        if states is None and zero_init_ok:   # no initial state: the kernels' HAS_INIT = False
            continue
        if states is None:
            raise ValueError(f"{what}: expected a dict of states, got None")
        for name, _ in program.states:
            x = states.get(name)
            if x is None and what == "grad_final":
                continue
            want = (lead[0] if state_rows is None else state_rows, lead[1]) + program.state_shape(name)
            if x is None or tuple(x.shape) != want:
                got = "missing" if x is None else list(x.shape)
                raise ValueError(f"{what}[{name!r}]: expected {list(want)}, got {got}")


def backward_torch(program: ChunkProgram, tiles: dict[str, torch.Tensor], lam: torch.Tensor | None,
                   init_states: dict[str, torch.Tensor], grad_o: torch.Tensor,
                   grad_final: dict[str, torch.Tensor] | None, eps: float):
    """tiles: input -> [N, H, nC, C, dim]; lam: [N, H, nC, C] (None iff ungated);
    init_states / grad_final: summary -> [N, H, *program.state_shape] (a missing
    grad_final entry is zero); grad_o: [N, H, nC, C, dv]. Computes in the tiles'
    dtype. Returns (d_tiles {input: [N, H, nC, C, dim]}, d_lam [N, H, nC, C] or
    None, d_init {summary: [N, H, *shape]})."""
    check_backward_args(program, tiles, lam, init_states, grad_o, grad_final)
    bwd = backward_program(program)
    dtype = grad_o.dtype
    module = chunk_torch.torch_module(program)
    starts, _ = chunk_torch.state_pass(program, tiles, lam, init_states, dtype)
    env = GradEnv(tiles, lam, starts, program.chunk, dtype)
    env.derived_values = module.derived(env)
    ct = _output_cotangents(program, tiles, lam, starts, grad_o, eps, dtype)
    env.cotangents.update(ct)

    # 2. carry gradients of the output terms, every chunk
    from_outputs: dict[str, torch.Tensor] = {}
    d_derived: dict[str, torch.Tensor] = {}
    for g in bwd.output + bwd.normalizer:
        if g.target is Target.CARRY:
            _add(from_outputs, g.name, evaluate(g, env))
        elif g.target is Target.DERIVED:
            _add(d_derived, g.name, evaluate(g, env))
    for name, grads in bwd.derived:
        if name in d_derived:
            env.cotangents[cotangent_name("derived", name)] = d_derived[name]
            for g in grads:
                _add(from_outputs, g.name, evaluate(g, env))

    # 3. reverse state pass
    n_chunks = grad_o.shape[2]
    dend = {name: (grad_final or {}).get(name) for name, _ in bwd.states}
    dend = {name: torch.zeros_like(init_states[name]) if x is None else x.to(dtype)
            for name, x in dend.items()}
    ends = {name: [None] * n_chunks for name in dend}
    for c in reversed(range(n_chunks)):
        for name in dend:
            ends[name][c] = dend[name]
        chunk_env = GradEnv({k: v[:, :, c] for k, v in tiles.items()},
                            None if lam is None else lam[:, :, c],
                            {k: v[:, :, c] for k, v in starts.items()}, program.chunk, dtype,
                            cotangents={cotangent_name("end", name): dend[name]
                                        for name in dend})
        dstart = {name: x[:, :, c] for name, x in from_outputs.items()}
        for _, grads in bwd.states:
            for g in grads:
                if g.target is Target.CARRY:
                    _add(dstart, g.name, evaluate(g, chunk_env))
        dend = {name: dstart.get(name, torch.zeros_like(dend[name])) for name in dend}
    d_init = dend

    # 4. token and Λ gradients, every chunk
    for name, per_chunk in ends.items():
        env.cotangents[cotangent_name("end", name)] = torch.stack(per_chunk, dim=2)
    d_tiles = {name: torch.zeros_like(x, dtype=dtype) for name, x in tiles.items()}
    d_lam = None if lam is None else torch.zeros_like(lam, dtype=dtype)
    for g in bwd.all_terms():
        if g.target in PARALLEL:
            _PARALLEL[g.target](g, evaluate(g, env), env, d_tiles, d_lam)
    return d_tiles, d_lam, d_init


def _output_cotangents(program, tiles, lam, starts, grad_o, eps, dtype) -> dict:
    if not program.normalizer:
        return {"num": grad_o}
    num = chunk_torch.outputs(program, "output", tiles, lam, starts, dtype)
    den = chunk_torch.outputs(program, "normalizer", tiles, lam, starts, dtype)
    d_num, d_den = chunk_torch.quotient_cotangents(grad_o, num, den + eps)
    return {"num": d_num, "den": d_den}


def _token(g, value, env, d_tiles, d_lam):
    d_tiles[g.name] += value


def _power(g, value, env, d_tiles, d_lam):
    o = g.wrt
    d_tiles[g.name] += power_chain_rule(env.token(g.name), value, o.power, o.weighted)


def _lam(g, value, env, d_lam_tiles, d_lam):
    d_lam += value


def _lam_end(g, value, env, d_tiles, d_lam):
    d_lam[..., -1] += value


def gate_grad(d_lam: torch.Tensor) -> torch.Tensor:
    """dg from dΛ, Λ being the in-chunk cumulative sum of g: the reverse cumulative
    sum of dΛ within each chunk (last axis)."""
    return d_lam.flip(-1).cumsum(-1).flip(-1)


_PARALLEL = {Target.TOKEN: _token, Target.POWER: _power, Target.LAM: _lam, Target.LAM_END: _lam_end}
