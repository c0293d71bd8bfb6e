"""The torch op: ``hladsl.load(spec)(q, k, v, ...) -> (o, final_state)``.

CPU tensors run the chunk program through torch (every step differentiable,
so autograd gives the backward). The forward on CUDA runs the generated
Triton kernels where available (hladsl.codegen), falling back to the same torch
chunk program; the backward currently always uses the torch chunk program.
"""
from __future__ import annotations

import torch

from hladsl.ir.algebra import Algebra
from hladsl.ir.chunk import chunk_program
from hladsl.runtime import chunk_torch
from hladsl.runtime.packing import pack, packed_shape, unpack
from hladsl.runtime.serial_torch import serial_polys, step
from hladsl.runtime.validate import check_inputs, check_state


class Op:
    def __init__(self, algebra: Algebra, chunk_size: int = 64):
        self.algebra = algebra
        self.chunk_size = chunk_size
        self.state_names = tuple(s.name for s in algebra.streaming)

    def __repr__(self) -> str:
        return f"hladsl.load({self.algebra.name!r}) -> state {list(self.state_names)}"

    # -- public --------------------------------------------------------------------
    def __call__(self, q, k, v, g=None, scale=None, initial_state=None, output_final_state=False,
                 cu_seqlens=None):
        """q, k: [B, T, H, d]; v: [B, T, H, dv]; g: [B, T, H] log gates (<= 0) or None;
        scale multiplies q (default d^-0.5). Returns (o [B, T, H, dv] in q's dtype,
        final_state dict {summary: [N, H, *shape]} fp32 (fp64 for fp64 inputs), or None).
        Symmetric summaries are stored packed. With cu_seqlens (B = 1) each
        sequence runs alone and N is the number of sequences."""
        alg = self.algebra
        dims = check_inputs(alg, q, k, v, g, scale, cu_seqlens)
        n_seq = q.shape[0] if cu_seqlens is None else cu_seqlens.numel() - 1
        if initial_state is not None:
            check_state(alg, initial_state, n_seq, q.shape[2], dims, q.device)
        scale = q.shape[-1] ** -0.5 if scale is None else float(scale)
        compute = torch.float64 if q.dtype == torch.float64 else torch.float32
        tokens = {"q": q.to(compute) * scale, "k": k.to(compute), "v": v.to(compute)}
        gates = None if g is None else g.to(compute)
        if cu_seqlens is not None:
            tokens, gates, index = _to_padded(tokens, gates, cu_seqlens)
        init = self._unpacked_state(initial_state, tokens["q"], dims, compute)
        o, final = self._forward(tokens, gates, init, dims, compute)
        if cu_seqlens is not None:
            o = o.reshape(-1, *o.shape[2:])[index].unsqueeze(0)
        final_state = None
        if output_final_state:
            final_state = {name: pack(alg.summary(name), final[name], dims) for name in self.state_names}
        return o.to(q.dtype), final_state

    def state_shapes(self, d: int, dv: int) -> dict[str, tuple[int, ...]]:
        dims = {self.algebra.inputs["q"]: d, self.algebra.inputs["v"]: dv}
        return {s.name: packed_shape(s, dims) for s in self.algebra.streaming}

    def serial(self, q, k, v, g=None, scale=None, initial_state=None):
        """The derived serial recurrence, token by token (inference path / reference)."""
        alg = self.algebra
        dims = check_inputs(alg, q, k, v, g, scale, None)
        if initial_state is not None:
            check_state(alg, initial_state, q.shape[0], q.shape[2], dims, q.device)
        scale = q.shape[-1] ** -0.5 if scale is None else float(scale)
        compute = torch.float64 if q.dtype == torch.float64 else torch.float32
        tokens = {"q": q.to(compute) * scale, "k": k.to(compute), "v": v.to(compute)}
        state = self._unpacked_state(initial_state, tokens["q"], dims, compute)
        polys = serial_polys(alg)
        outs = []
        for t in range(q.shape[1]):
            tok = {name: x[:, t] for name, x in tokens.items()}
            state, num, den = step(alg, polys, state, tok, None if g is None else g[:, t].to(compute))
            outs.append(num if den is None else num / (den.unsqueeze(-1) + alg.eps))
        o = torch.stack(outs, dim=1)
        return o.to(q.dtype), {n: pack(alg.summary(n), state[n], dims) for n in self.state_names}

    # -- internals -------------------------------------------------------------------
    def _unpacked_state(self, initial_state, like, dims, dtype):
        n, h = like.shape[0], like.shape[2]
        out = {}
        for s in self.algebra.streaming:
            if initial_state is None:
                shape = tuple(dims[d] for d in s.dims)
                out[s.name] = like.new_zeros((n, h) + shape, dtype=dtype)
            else:
                out[s.name] = unpack(s, initial_state[s.name].to(dtype), dims)
        return out

    def _forward(self, tokens, gates, init, dims, compute):
        alg = self.algebra
        B, T, H, _ = tokens["q"].shape
        C = min(self.chunk_size, max(16, 1 << (T - 1).bit_length()))
        n_chunks = max(1, -(-T // C))
        pad = n_chunks * C - T
        program = chunk_program(alg, C, tuple(sorted(dims.items())), gates is not None)
        tiles = {}
        for name, x in tokens.items():
            x = torch.nn.functional.pad(x, (0, 0, 0, 0, 0, pad))
            tiles[name] = x.reshape(B, n_chunks, C, H, -1).permute(0, 3, 1, 2, 4)
        lam = None
        if gates is not None:
            g = torch.nn.functional.pad(gates, (0, 0, 0, pad))
            lam = g.reshape(B, n_chunks, C, H).permute(0, 3, 1, 2).cumsum(-1)
        starts, final = chunk_torch.state_pass(program, tiles, lam, init, compute)
        num = chunk_torch.outputs(program, program.output, tiles, lam, starts, compute)
        if alg.normalizer is not None:
            den = chunk_torch.outputs(program, program.normalizer, tiles, lam, starts, compute)
            num = num / (den.unsqueeze(-1) + alg.eps)
        o = num.permute(0, 2, 3, 1, 4).reshape(B, n_chunks * C, H, -1)[:, :T]
        return o, final


def _to_padded(tokens, gates, cu_seqlens):
    """Varlen [1, T, ...] -> padded [N, Tmax, ...] plus the gather index back."""
    bounds = cu_seqlens.tolist()
    lengths = [b - a for a, b in zip(bounds, bounds[1:])]
    t_max = max(max(lengths), 1)
    device = tokens["q"].device
    rows = []
    for n, (a, length) in enumerate(zip(bounds, lengths)):
        rows.append(torch.arange(length, device=device) + n * t_max)
    index = torch.cat(rows) if rows else torch.zeros(0, dtype=torch.long, device=device)
    src = torch.cat([torch.arange(a, a + l, device=device) for a, l in zip(bounds, lengths)])
    out = {}
    for name, x in tokens.items():
        flat = x.new_zeros((len(lengths) * t_max,) + x.shape[2:])
        flat = flat.index_copy(0, index, x[0, src])
        out[name] = flat.reshape(len(lengths), t_max, *x.shape[2:])
    g = None
    if gates is not None:
        flat = gates.new_zeros((len(lengths) * t_max,) + gates.shape[2:])
        g = flat.index_copy(0, index, gates[0, src]).reshape(len(lengths), t_max, *gates.shape[2:])
    return out, g, index
