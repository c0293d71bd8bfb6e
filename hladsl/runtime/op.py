"""The torch op: ``hladsl.load(spec)(q, k, v, ...) -> (o, final_state)``.

CPU tensors run the chunk program through torch (every step differentiable,
so autograd gives the backward). On CUDA tensors the forward runs the generated
Triton kernels (hladsl.codegen); the backward is not generated yet: it
recomputes the torch chunk program and differentiates it (correct, slower).
``op.backend = "torch"`` forces the torch path everywhere; ``op.schedule``
("auto", "two_pass", "fused") picks the Triton schedule.
"""
from __future__ import annotations

import torch

from hladsl.errors import SpecError
from hladsl.ir.algebra import Algebra
from hladsl.ir.chunk import chunk_program
from hladsl.runtime import chunk_torch
from hladsl.runtime.packing import pack, packed_shape, unpack
from hladsl.runtime.serial_torch import serial_polys, step
from hladsl.runtime.validate import check_inputs, check_state


OP_INPUTS = ("q", "k", "v")


class Op:
    def __init__(self, algebra: Algebra, chunk_size: int = 64, backend: str = "auto"):
        unknown = sorted(set(algebra.inputs) - set(OP_INPUTS))
        if unknown or not {"q", "v"} <= set(algebra.inputs):
            raise SpecError(f"the op takes token inputs {', '.join(OP_INPUTS)} (DESIGN section 6); "
                            f"{algebra.name} declares {', '.join(algebra.inputs)}", path=algebra.name)
        self.algebra = algebra
        self.chunk_size = chunk_size
        self.backend = backend   # "auto": Triton on CUDA tensors, torch elsewhere; "torch": always torch
        self.schedule = "auto"   # Triton: "two_pass", "fused" or "auto" (see triton_run.forward_triton)
        self.state_names = tuple(s.name for s in algebra.streaming)
        self._fitting_chunk: dict = {}   # (dims, dtype, gated, chunk asked) -> chunk that fits
        from hladsl.runtime.custom_op import register
        self.custom_op = register(self)   # the op as torch.compile sees it

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
        if torch.compiler.is_compiling():   # one opaque custom-op call in the graph
            from hladsl.runtime.custom_op import compiled_call
            return compiled_call(self, q, k, v, g, scale, initial_state, output_final_state,
                                 cu_seqlens)
        return self.eager(q, k, v, g, scale, initial_state, output_final_state, cu_seqlens)

    def eager(self, q, k, v, g=None, scale=None, initial_state=None, output_final_state=False,
              cu_seqlens=None):
        """The op without the torch.compile routing (same signature)."""
        # the Triton kernels read bf16/fp16 tiles as they are (fp32 accumulation)
        dims, tokens, compute = self._prepare(q, k, v, g, scale, initial_state, cu_seqlens,
                                              keep_dtype=self._use_triton(q))
        gates = None if g is None else g.to(compute)
        if cu_seqlens is not None:
            tokens, gates, index = _to_padded(tokens, gates, cu_seqlens)
        init = self._packed_state(initial_state, tokens["q"], dims, compute)
        o, final = self._forward(tokens, gates, init, dims, compute)
        if cu_seqlens is not None:
            o = o.reshape(-1, *o.shape[2:])[index].unsqueeze(0)
        return o.to(q.dtype), (final if output_final_state else None)

    def step(self, q, k, v, g=None, scale=None, state=None, state_indices=None, backend=None):
        """Decode: the serial update over q's T tokens (runtime.step.run_step). state
        ({summary: [N, H, *shape]}, as op(...)'s final state) is updated in place;
        a zero state is made when None. Returns (o in q's dtype, state)."""
        from hladsl.runtime.step import run_step
        # g's values (finite, <= 0) are not checked while a CUDA graph is being
        # captured: reading them would sync with the host (run_step checks its shape)
        capturing = q.is_cuda and torch.cuda.is_current_stream_capturing()
        dims = check_inputs(self.algebra, q, k, v, None if capturing else g, scale, None)
        n = q.shape[0] if state is None or state_indices is None else \
            next(iter(state.values())).shape[0]
        if state is not None:
            check_state(self.algebra, state, n, q.shape[2], dims, q.device)
        scale = q.shape[-1] ** -0.5 if scale is None else float(scale)
        compute = torch.float64 if q.dtype == torch.float64 else torch.float32
        if state is None:
            state = {name: q.new_zeros((n, q.shape[2]) + shape, dtype=compute)
                     for name, shape in self.state_shapes(q.shape[-1], v.shape[-1]).items()}
        if backend is None:
            backend = "triton" if self._use_triton(q) else "torch"
        tokens = {"q": q * scale, "k": k, "v": v}
        o = run_step(self.algebra, {x: tokens[x] for x in self.algebra.inputs}, g, state,
                     state_indices, backend)
        return o.to(q.dtype), state

    def state_shapes(self, d: int, dv: int) -> dict[str, tuple[int, ...]]:
        dims = {self.algebra.inputs["q"]: d, self.algebra.inputs["v"]: dv}
        return {s.name: packed_shape(s, dims) for s in self.algebra.streaming}

    def serial(self, q, k, v, g=None, scale=None, initial_state=None):
        """The derived serial recurrence, token by token (inference path / reference)."""
        alg = self.algebra
        dims, tokens, compute = self._prepare(q, k, v, g, scale, initial_state, None)
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
    def _prepare(self, q, k, v, g, scale, initial_state, cu_seqlens, keep_dtype=False):
        """Validate; return (dims, scaled token tensors, compute dtype). Tokens are
        in the compute dtype (fp32, fp64 for fp64 inputs) unless keep_dtype."""
        dims = check_inputs(self.algebra, q, k, v, g, scale, cu_seqlens)
        n_seq = q.shape[0] if cu_seqlens is None else cu_seqlens.numel() - 1
        if initial_state is not None:
            check_state(self.algebra, initial_state, n_seq, q.shape[2], dims, q.device)
        scale = q.shape[-1] ** -0.5 if scale is None else float(scale)
        compute = torch.float64 if q.dtype == torch.float64 else torch.float32
        dtype = q.dtype if keep_dtype else compute
        tokens = {"q": q.to(dtype) * scale, "k": k.to(dtype), "v": v.to(dtype)}
        return dims, tokens, compute

    def _packed_state(self, initial_state, like, dims, dtype):
        """The initial state dict in storage layout (symmetric summaries packed)."""
        n, h = like.shape[0], like.shape[2]
        if initial_state is None:
            return {s.name: like.new_zeros((n, h) + packed_shape(s, dims), dtype=dtype)
                    for s in self.algebra.streaming}
        return {s.name: initial_state[s.name].to(dtype) for s in self.algebra.streaming}

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
        """init and the returned final states are in storage layout; the chunk
        program holds a symmetric summary packed or unpacked (ir.symmetric).
        Kernels that do not fit the GPU's shared memory at this chunk size (large
        states at d = 128) are retried at half the chunk size, down to 16."""
        T = tokens["q"].shape[1]
        C = min(self.chunk_size, max(16, 1 << (T - 1).bit_length()))
        if not self._use_triton(tokens["q"]):
            return self._forward_chunked(C, tokens, gates, init, dims, compute)
        import triton.runtime.errors
        key = (tuple(sorted(dims.items())), tokens["q"].dtype, gates is not None, C)
        C = self._fitting_chunk.get(key, C)
        while True:
            try:
                out = self._forward_chunked(C, tokens, gates, init, dims, compute)
            except triton.runtime.errors.OutOfResources:
                if C <= 16:
                    raise
                C //= 2
                continue
            self._fitting_chunk[key] = C
            return out

    def _forward_chunked(self, C, tokens, gates, init, dims, compute):
        alg = self.algebra
        B, T, H, _ = tokens["q"].shape
        n_chunks = max(1, -(-T // C))
        pad = n_chunks * C - T
        program = chunk_program(alg, C, tuple(sorted(dims.items())), gates is not None)
        init = {name: x if program.is_packed(name) else unpack(alg.summary(name), x, dims)
                for name, x in init.items()}
        names = list(tokens)
        state_names = list(init)

        def run(use_triton, *flat):
            toks = dict(zip(names, flat[:len(names)]))
            if not use_triton:
                toks = {name: x.to(compute) for name, x in toks.items()}
            g = flat[len(names)] if gates is not None else None
            states = dict(zip(state_names, flat[len(flat) - len(state_names):]))
            tiles = {}
            for name, x in toks.items():
                x = torch.nn.functional.pad(x, (0, 0, 0, 0, 0, pad))
                tiles[name] = x.reshape(B, n_chunks, C, H, -1).permute(0, 3, 1, 2, 4)
            lam = None
            if g is not None:
                g = torch.nn.functional.pad(g, (0, 0, 0, pad))
                lam = g.reshape(B, n_chunks, C, H).permute(0, 3, 1, 2).cumsum(-1)
            if use_triton:
                from hladsl.codegen.triton_run import forward_triton
                num, final = forward_triton(program, tiles, lam, states, alg.eps,
                                            schedule=self.schedule)
            else:
                starts, final = chunk_torch.state_pass(program, tiles, lam, states, compute)
                num = chunk_torch.outputs(program, "output", tiles, lam, starts, compute)
                if alg.normalizer is not None:
                    den = chunk_torch.outputs(program, "normalizer", tiles, lam, starts, compute)
                    num = num / (den.unsqueeze(-1) + alg.eps)
            o = num.permute(0, 2, 3, 1, 4).reshape(B, n_chunks * C, H, -1)[:, :T]
            return (o,) + tuple(final[n] for n in state_names)

        flat = list(tokens.values()) + ([gates] if gates is not None else []) + list(init.values())
        if self._use_triton(tokens["q"]):
            outs = _TritonForward.apply(run, *flat)
        else:
            outs = run(False, *flat)
        final = {name: x if program.is_packed(name) else pack(alg.summary(name), x, dims)
                 for name, x in zip(state_names, outs[1:])}
        return outs[0], final

    def _use_triton(self, x) -> bool:
        if self.backend == "torch" or not isinstance(x, torch.Tensor) or x.device.type != "cuda":
            return False
        return True


class _TritonForward(torch.autograd.Function):
    """Forward: the generated Triton kernels. Backward: the VJP of the torch chunk
    program, recomputed (the Triton backward is not generated yet)."""

    @staticmethod
    def forward(ctx, run, *flat):
        ctx.run = run
        ctx.save_for_backward(*flat)
        with torch.no_grad():
            outs = run(True, *flat)
        return outs

    @staticmethod
    def backward(ctx, *grads):
        flat = [x.detach().requires_grad_(need) for x, need in
                zip(ctx.saved_tensors, ctx.needs_input_grad[1:])]
        wanted = [x for x in flat if x.requires_grad]
        if not wanted:
            return (None,) * (len(flat) + 1)
        with torch.enable_grad():
            outs = ctx.run(False, *flat)
        pairs = [(o, g) for o, g in zip(outs, grads) if g is not None and o.requires_grad]
        got = torch.autograd.grad([o for o, _ in pairs], wanted, [g for _, g in pairs],
                                  allow_unused=True)
        it = iter(got)
        return (None,) + tuple(next(it) if x.requires_grad else None for x in flat)


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
