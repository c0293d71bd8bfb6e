"""``torch.compile`` support: each loaded op is also a ``torch.library`` custom
op (``hladsl::<mechanism>_<hash>``) with a fake implementation for tracing and
an autograd formula that differentiates the eager op. ``Op.__call__`` routes
through it while torch.compile traces, so compiled graphs hold one opaque call."""
from __future__ import annotations

import itertools

import torch

from hladsl.runtime.packing import packed_shape

_COUNTER = itertools.count()


def compiled_call(op, q, k, v, g, scale, initial_state, output_final_state, cu_seqlens):
    fn = op.custom_op
    names = list(op.state_names)
    init = [] if initial_state is None else [initial_state[n] for n in names]
    o, states = fn(q, k, v, g, -1.0 if scale is None else float(scale), init,
                   bool(output_final_state), cu_seqlens)
    return o, (dict(zip(names, states)) if output_final_state else None)


def register(op):
    """A custom op calling ``op.eager`` (registered once per loaded op, eagerly:
    torch.compile must not trace the registration)."""
    name = f"{op.algebra.name}_{next(_COUNTER)}"
    names = list(op.state_names)

    def eager(q, k, v, g, scale, init, want_state, cu_seqlens):
        state = dict(zip(names, init)) if init else None
        o, final = op.eager(q, k, v, g=g, scale=None if scale < 0 else scale, initial_state=state,
                            output_final_state=True, cu_seqlens=cu_seqlens)
        return o, [final[n] for n in names]

    @torch.library.custom_op(f"hladsl::{name}", mutates_args=())
    def run(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor | None,
            scale: float, init: list[torch.Tensor], want_state: bool,
            cu_seqlens: torch.Tensor | None) -> tuple[torch.Tensor, list[torch.Tensor]]:
        o, states = eager(q, k, v, g, scale, init, want_state, cu_seqlens)
        fmt = torch.contiguous_format
        return o.clone(memory_format=fmt), [s.clone(memory_format=fmt) for s in states]

    @run.register_fake
    def _(q, k, v, g, scale, init, want_state, cu_seqlens):
        B, T, H, _ = q.shape
        n = B if cu_seqlens is None else cu_seqlens.shape[0] - 1
        dims = {op.algebra.inputs["q"]: q.shape[-1], op.algebra.inputs["v"]: v.shape[-1]}
        dtype = torch.float64 if q.dtype == torch.float64 else torch.float32
        states = [q.new_empty((n, H) + packed_shape(op.algebra.summary(s), dims), dtype=dtype)
                  for s in names]
        return q.new_empty((B, T, H, v.shape[-1])), states

    @torch.library.custom_op(f"hladsl::{name}_backward", mutates_args=())
    def run_backward(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor | None,
                     scale: float, init: list[torch.Tensor], cu_seqlens: torch.Tensor | None,
                     grad_o: torch.Tensor, grad_states: list[torch.Tensor | None]
                     ) -> list[torch.Tensor]:
        """Gradients of (q, k, v, [g], *init): the eager op recomputed and differentiated."""
        leaves = [q, k, v] + ([g] if g is not None else []) + list(init)
        keep = [n for n, gs in enumerate(grad_states) if gs is not None]

        def forward(*xs):   # torch.func: autograd is excluded inside a custom op's body
            it = iter(xs)
            lq, lk, lv = next(it), next(it), next(it)
            lg = next(it) if g is not None else None
            o, states = eager(lq, lk, lv, lg, scale, list(it), True, cu_seqlens)
            return (o,) + tuple(states[n] for n in keep)

        _, pullback = torch.func.vjp(forward, *leaves)
        got = pullback((grad_o,) + tuple(grad_states[n] for n in keep))
        return [torch.zeros_like(x) if d is None else d.contiguous() for x, d in zip(leaves, got)]

    @run_backward.register_fake
    def _(q, k, v, g, scale, init, cu_seqlens, grad_o, grad_states):
        return [torch.empty_like(x) for x in [q, k, v] + ([g] if g is not None else []) + list(init)]

    def setup_context(ctx, inputs, output):
        q, k, v, g, scale, init, want_state, cu_seqlens = inputs
        ctx.save_for_backward(q, k, v, g, cu_seqlens, *init)
        ctx.scale, ctx.has_init, ctx.has_g = scale, bool(init), g is not None

    def backward(ctx, grad_o, grad_states):
        q, k, v, g, cu_seqlens, *init = ctx.saved_tensors
        grads = run_backward(q, k, v, g, ctx.scale, init, cu_seqlens, grad_o, list(grad_states))
        dq, dk, dv = grads[:3]
        dg = grads[3] if ctx.has_g else None
        dinit = grads[3 + ctx.has_g:]
        return dq, dk, dv, dg, None, list(dinit), None, None

    run.register_autograd(backward, setup_context=setup_context)
    return run
