"""The torch op of a compiled spec: ``hladsl.load(spec)(q, k, v, ...) -> (o, final_state)``.

Token inputs, their dims and the output come from the spec's declarations:
positional arguments follow the ``input`` order, keywords use the declared
names. Every call, eager or under torch.compile, goes through one torch custom
op per loaded spec (``runtime.custom_op``) whose autograd formula calls
``Op.backward_impl``: one autograd path. Execution (``Op.forward_impl``) splits
into a differentiable preparation in torch (scale, varlen padding, chunk tiles,
cumulative gates, state layouts), a core that is either the torch chunk program
or the generated Triton kernels, and a differentiable finish (unpad, cast).
"""
from __future__ import annotations

import torch

from hladsl.errors import SpecError
from hladsl.ir.pipeline import Compilation, program_for
from hladsl.runtime import chunk_torch, launch
from hladsl.runtime.packing import pack, packed_shape, unpack
from hladsl.runtime.serial_torch import serial_polys, step
from hladsl.runtime.validate import check_inputs, check_state

BACKENDS = ("auto", "torch", "triton")
CALL_OPTIONS = {"g": None, "scale": None, "initial_state": None, "output_final_state": False,
                "cu_seqlens": None}
SERIAL_OPTIONS = {"g": None, "scale": None, "initial_state": None}


def output_dim(alg) -> str:
    """The dim of the output's one free index (the value dim)."""
    (index,) = alg.output.free
    for m in alg.output.terms:
        for f in m.factors:
            if index in f.indices:
                if f.kind == "input":
                    return alg.inputs[f.name]
                if f.kind == "state":
                    return alg.summary(f.name).dims[f.indices.index(index)]
    raise SpecError(f"cannot tell the dim of output index '{index}'", path=alg.name)


def query_inputs(alg) -> tuple[str, ...]:
    """Inputs read at the output's own token (the query side): ``scale`` multiplies them."""
    return tuple(dict.fromkeys(f.name for m in alg.output.terms for f in m.factors
                               if f.kind == "input"))


class Op:
    """One compiled spec as a torch op (made by ``hladsl.load``, one per spec text,
    parameters and options)."""

    def __init__(self, compilation: Compilation, backend: str = "auto", chunk_size: int = 64):
        alg = compilation.algebra
        if backend not in BACKENDS:
            raise ValueError(f"backend must be one of {', '.join(BACKENDS)}, got {backend!r}")
        if len(alg.output.free) != 1:
            raise SpecError(f"the op needs an output with one free index (its value dim); "
                            f"{alg.output_name} has {len(alg.output.free)}", path=alg.name)
        if not isinstance(chunk_size, int) or chunk_size < 1:
            raise ValueError(f"chunk_size must be a positive integer, got {chunk_size!r} (the Triton "
                             f"kernels need a power of two >= {launch.MIN_CHUNK})")
        self.compilation = compilation
        self.algebra = alg
        self.backend = backend
        self.chunk_size = chunk_size
        self.schedule = "auto"            # Triton: "two_pass", "fused" or "auto" (runtime.launch)
        self.inputs = tuple(alg.inputs)   # declaration order
        self.queries = query_inputs(alg)
        self.out_dim = output_dim(alg)
        self.state_names = tuple(s.name for s in alg.streaming)
        from hladsl.runtime.custom_op import register
        self.custom_op = register(self)

    def __repr__(self) -> str:
        return (f"hladsl.load({self.algebra.name!r}) -> inputs {list(self.inputs)}, "
                f"state {list(self.state_names)}, backend {self.backend!r}")

    # -- public ---------------------------------------------------------------------------
    def __call__(self, *args, **kwargs):
        """``op(q, k, v, g=None, scale=None, initial_state=None, output_final_state=False,
        cu_seqlens=None)`` for a spec declaring inputs q, k, v: token inputs [B, T, H, dim]
        in declaration order (or by name), then the options (positionally too);
        g: [B, T, H] log gates (<= 0) or None; scale multiplies the query inputs (default
        dim^-0.5). Returns (o [B, T, H, dv] in the inputs' dtype, final state
        {summary: [N, H, *shape]} fp32 (fp64 for fp64 inputs) or None); symmetric
        summaries are packed. With cu_seqlens (B = 1) each sequence runs alone and N is
        their number."""
        tokens, opts = self.bind(args, kwargs, CALL_OPTIONS)
        g, scale, initial_state, output_final_state, cu_seqlens = opts.values()
        compiling = torch.compiler.is_compiling()
        dims = check_inputs(self.algebra, tokens, g, scale, cu_seqlens, data_checks=not compiling)
        first = tokens[self.inputs[0]]
        n_seq = first.shape[0] if cu_seqlens is None else cu_seqlens.numel() - 1
        init = []
        if initial_state is not None:
            check_state(self.algebra, initial_state, n_seq, first.shape[2], dims, first.device)
            init = [initial_state[n] for n in self.state_names]
        o, finals = self.custom_op([tokens[n] for n in self.inputs], g,
                                   -1.0 if scale is None else float(scale), init, cu_seqlens,
                                   self.schedule)
        return o, (dict(zip(self.state_names, finals)) if output_final_state else None)

    def bind(self, args, kwargs, options: dict):
        """(token inputs by declared name, options) from positional and keyword
        arguments: tokens first in declaration order, then ``options`` in order."""
        names = self.inputs + tuple(options)
        if len(args) > len(names):
            raise ValueError(f"{self.algebra.name} takes at most {len(names)} positional arguments "
                             f"({', '.join(names)}), got {len(args)}")
        given = dict(zip(names, args))
        for name, x in kwargs.items():
            if name not in names:
                raise ValueError(f"unexpected argument '{name}': {self.algebra.name} takes token "
                                 f"inputs {', '.join(self.inputs)} and {', '.join(options)}")
            if name in given:
                raise ValueError(f"argument '{name}' given twice")
            given[name] = x
        tokens = {n: given[n] for n in self.inputs if n in given}
        missing = [n for n in self.inputs if n not in tokens]
        if missing:
            raise ValueError(f"missing token input(s) {', '.join(missing)} "
                             f"({self.algebra.name} takes {', '.join(self.inputs)})")
        return tokens, {n: given.get(n, default) for n, default in options.items()}

    def step(self, *args, g=None, scale=None, state=None, **tokens):
        """Decode: apply T (small) tokens to ``state`` in place -> (o, state).

        TEMPORARY, replaced on main by the generated step kernel: this version runs
        the chunk path (initial_state=state, output_final_state=True) and copies the
        final state into the given tensors. Same layout as op(...)'s final state;
        with state=None a zero state is created and returned."""
        o, final = self(*args, g=g, scale=scale, initial_state=state, output_final_state=True,
                        **tokens)
        if state is None:
            return o, final
        for name, x in final.items():
            state[name].copy_(x)
        return o, state

    def state_shapes(self, *sizes, **named_sizes) -> dict[str, tuple[int, ...]]:
        """Storage shape of each state entry (after [N, H]) for dim sizes given in
        the spec's ``dims`` order or by name."""
        dims = dict(zip(self.algebra.dims, sizes)) | named_sizes
        return {s.name: packed_shape(s, dims) for s in self.algebra.streaming}

    def serial(self, *args, **kwargs):
        """``op.serial(q, k, v, g=None, scale=None, initial_state=None)``: the derived
        serial recurrence, token by token (a reference)."""
        alg = self.algebra
        tokens, opts = self.bind(args, kwargs, SERIAL_OPTIONS)
        g, scale, initial_state = opts.values()
        dims = check_inputs(alg, tokens, g, scale, None)
        first = tokens[self.inputs[0]]
        if initial_state is not None:
            check_state(alg, initial_state, first.shape[0], first.shape[2], dims, first.device)
        compute = _compute_dtype(first)
        tokens = self._scaled(tokens, scale, compute)
        state = {}
        for s in alg.streaming:
            if initial_state is None:
                state[s.name] = first.new_zeros(first.shape[:1] + first.shape[2:3] +
                                                tuple(dims[d] for d in s.dims), dtype=compute)
            else:
                state[s.name] = unpack(s, initial_state[s.name].to(compute), dims)
        polys = serial_polys(alg)
        outs = []
        for t in range(first.shape[1]):
            tok = {name: x[:, t] for name, x in tokens.items()}
            state, num, den = step(alg, polys, state, tok, None if g is None else g[:, t].to(compute))
            outs.append(num if den is None else num / (den.unsqueeze(-1) + alg.eps))
        o = torch.stack(outs, dim=1)
        return o.to(first.dtype), {n: pack(alg.summary(n), state[n], dims) for n in self.state_names}

    # -- execution (called by the custom op) -------------------------------------------------
    def use_triton(self, x: torch.Tensor) -> bool:
        if self.backend == "triton":
            return True
        return self.backend == "auto" and x.device.type == "cuda"

    def forward_impl(self, tokens: list, g, scale: float, init: list, cu_seqlens, schedule: str):
        """(o, [final state per summary]) without autograd."""
        tokens = dict(zip(self.inputs, tokens))
        first = tokens[self.inputs[0]]
        if not self.use_triton(first):
            return self._run_torch(tokens, g, scale, init, cu_seqlens)
        dims = self._dims(tokens)
        key = (tuple(sorted(dims.items())), first.dtype, g is not None)

        def run(chunk):
            prep = _Prepared(self, tokens, g, scale, init, cu_seqlens, chunk, keep_dtype=True)
            from hladsl.runtime.triton_forward import forward_triton
            o_tiles, finals = forward_triton(prep.program, prep.tiles, prep.lam, prep.init,
                                             self.algebra.eps, schedule=schedule)
            return prep.finish(o_tiles, finals)
        return launch.fitting_chunk(key, self._chunk(first), run)

    def backward_impl(self, tokens: list, g, scale: float, init: list, cu_seqlens, schedule: str,
                      grad_o, grad_states: list):
        """Gradients of (tokens..., g, init...) given those of (o, final states)."""
        keep = [n for n, x in enumerate(grad_states) if x is not None]
        leaves = list(tokens) + ([g] if g is not None else []) + list(init)
        n_tok = len(tokens)

        def forward(*xs):
            toks = dict(zip(self.inputs, xs[:n_tok]))
            gg = xs[n_tok] if g is not None else None
            o, finals = self._run_torch(toks, gg, scale, list(xs[n_tok + (g is not None):]),
                                        cu_seqlens)
            return (o,) + tuple(finals[n] for n in keep)

        # the generated Triton backward lands with the backward program (ir.backward);
        # until then both backends differentiate the torch chunk program
        _, pullback = torch.func.vjp(forward, *leaves)
        got = pullback((grad_o,) + tuple(grad_states[n] for n in keep))
        return [torch.zeros_like(x) if d is None else d.contiguous() for x, d in zip(leaves, got)]

    # -- internals -----------------------------------------------------------------------
    def _run_torch(self, tokens, g, scale, init, cu_seqlens):
        first = tokens[self.inputs[0]]
        prep = _Prepared(self, tokens, g, scale, init, cu_seqlens, self._chunk(first),
                         keep_dtype=False)
        starts, finals = chunk_torch.state_pass(prep.program, prep.tiles, prep.lam, prep.init,
                                                prep.compute)
        num = chunk_torch.outputs(prep.program, "output", prep.tiles, prep.lam, starts, prep.compute)
        if self.algebra.normalizer is not None:
            den = chunk_torch.outputs(prep.program, "normalizer", prep.tiles, prep.lam, starts,
                                      prep.compute)
            num = num / (den.unsqueeze(-1) + self.algebra.eps)
        return prep.finish(num, finals)

    def _chunk(self, first) -> int:
        T = first.shape[1]
        return launch.chunk_for(T, self.chunk_size)

    def _dims(self, tokens) -> dict[str, int]:
        return {self.algebra.inputs[n]: x.shape[-1] for n, x in tokens.items()}

    def _scaled(self, tokens, scale, dtype):
        out = {}
        for name, x in tokens.items():
            x = x.to(dtype)
            if name in self.queries:
                x = x * (x.shape[-1] ** -0.5 if scale is None or scale < 0 else float(scale))
            out[name] = x
        return out


def _compute_dtype(x) -> torch.dtype:
    return torch.float64 if x.dtype == torch.float64 else torch.float32


class _Prepared:
    """The differentiable torch side of one call: scaled tokens as chunk tiles
    [N, H, nC, C, dim], in-chunk cumulative gates [N, H, nC, C], the initial
    state in the program's layout; ``finish`` maps the core's outputs back."""

    def __init__(self, op: Op, tokens, g, scale, init, cu_seqlens, chunk: int, keep_dtype: bool):
        alg = op.algebra
        first = tokens[op.inputs[0]]
        self.op, self.dtype = op, first.dtype
        self.compute = compute = _compute_dtype(first)
        self.dims = dims = op._dims(tokens)
        tokens = op._scaled(tokens, None if scale < 0 else scale,
                            first.dtype if keep_dtype else compute)
        gates = None if g is None else g.to(compute)
        self.index = None
        if cu_seqlens is not None:
            tokens, gates, self.index = _to_padded(tokens, gates, cu_seqlens)
        first = tokens[op.inputs[0]]
        B, T, H = first.shape[:3]
        self.shape = (B, T, H)
        self.program = program_for(op.compilation, chunk, tuple(sorted(dims.items())),
                                   gates is not None)
        n_chunks = max(1, -(-T // chunk))
        pad = n_chunks * chunk - T
        self.tiles = {}
        for name, x in tokens.items():
            x = torch.nn.functional.pad(x, (0, 0, 0, 0, 0, pad))
            self.tiles[name] = x.reshape(B, n_chunks, chunk, H, -1).permute(0, 3, 1, 2, 4)
        self.lam = None
        if gates is not None:
            gates = torch.nn.functional.pad(gates, (0, 0, 0, pad))
            self.lam = gates.reshape(B, n_chunks, chunk, H).permute(0, 3, 1, 2).cumsum(-1)
        self.init = {}
        for n, s in enumerate(alg.streaming):
            x = (init[n].to(compute) if init else
                 first.new_zeros((B, H) + packed_shape(s, dims), dtype=compute))
            self.init[s.name] = x if self.program.is_packed(s.name) else unpack(s, x, dims)

    def finish(self, o_tiles, finals):
        """o [B, T, H, dv] in the inputs' dtype and the final states in storage layout."""
        alg, (B, T, H) = self.op.algebra, self.shape
        o = o_tiles.permute(0, 2, 3, 1, 4).reshape(B, -1, H, o_tiles.shape[-1])[:, :T]
        if self.index is not None:
            o = o.reshape(-1, *o.shape[2:])[self.index].unsqueeze(0)
        states = [finals[s.name] if self.program.is_packed(s.name)
                  else pack(s, finals[s.name], self.dims) for s in alg.streaming]
        return o.to(self.dtype), [x.to(self.compute) for x in states]


def _to_padded(tokens, gates, cu_seqlens):
    """Varlen [1, T, ...] -> padded [N, Tmax, ...] plus the gather index back."""
    bounds = cu_seqlens.tolist()
    lengths = [b - a for a, b in zip(bounds, bounds[1:])]
    t_max = max(max(lengths), 1)
    device = next(iter(tokens.values())).device
    rows = [torch.arange(length, device=device) + n * t_max for n, length in enumerate(lengths)]
    index = torch.cat(rows) if rows else torch.zeros(0, dtype=torch.long, device=device)
    src = torch.cat([torch.arange(a, a + n, device=device) for a, n in zip(bounds, lengths)])
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
