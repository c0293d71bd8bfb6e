"""The one autograd path of an op: ``Op.forward_impl`` and ``Op.backward_impl``, reached
through a ``torch.library`` custom op per loaded spec (``hladsl::<mechanism>_<hash>``)
under torch.compile, with a fake implementation for tracing and an autograd formula
whose backward is a second custom op running ``Op.backward_impl``; and, in eager
code, through ``EagerCall``, an autograd.Function calling the same two functions
without the custom op's dispatch (its host cost was a third of a small fwd + bwd call).

Each op is registered once: ``hladsl.load`` is memoised, and a name already
registered in this process (an op rebuilt after its memo was cleared) is reused.
"""
from __future__ import annotations

import hashlib

import torch

from hladsl.runtime.packing import packed_shape

_REGISTERED: dict[str, object] = {}


def op_name(op) -> str:
    alg = op.algebra
    blob = repr((alg.source, sorted(alg.params.items()), op.backend, op.chunk_size,
                 [s.name for s in alg.streaming]))
    return f"{alg.name}_{hashlib.sha256(blob.encode()).hexdigest()[:12]}"


def _fresh(x, inputs):
    """``x`` contiguous and sharing no storage with the op's inputs (a custom op's
    outputs may not alias them): copied only when it would."""
    x = x.contiguous()
    if any(x.untyped_storage().data_ptr() == y.untyped_storage().data_ptr() for y in inputs):
        x = x.clone()
    return x


def fresh_outputs(o, states, inputs) -> tuple:
    """(o, [states]) of forward_impl as outputs: each ``_fresh``."""
    return _fresh(o, inputs), [_fresh(s, inputs) for s in states]


def _split_grads(grads: list, n_tokens: int, gated: bool) -> tuple[list, object, list]:
    """backward_impl's gradients of (tokens..., [g], init...) -> (d tokens, d g or None, d init)."""
    return (list(grads[:n_tokens]), grads[n_tokens] if gated else None,
            list(grads[n_tokens + gated:]))


def register(op):
    name = op.identity
    if name in _REGISTERED:
        return _REGISTERED[name]
    alg = op.algebra
    names = op.state_names

    @torch.library.custom_op(f"hladsl::{name}", mutates_args=())
    def forward(tokens: list[torch.Tensor], g: torch.Tensor | None, scale: float,
                init: list[torch.Tensor], cu_seqlens: torch.Tensor | None, schedule: str
                ) -> tuple[torch.Tensor, list[torch.Tensor]]:
        o, states = op.forward_impl(tokens, g, scale, init, cu_seqlens, schedule)
        return fresh_outputs(o, states, tokens + init)

    @forward.register_fake
    def _(tokens, g, scale, init, cu_seqlens, schedule):
        first = tokens[0]
        B, T, H, _ = first.shape
        n = B if cu_seqlens is None else cu_seqlens.shape[0] - 1
        dims = {alg.inputs[x]: t.shape[-1] for x, t in zip(op.inputs, tokens)}
        dtype = torch.float64 if first.dtype == torch.float64 else torch.float32
        states = [first.new_empty((n, H) + packed_shape(alg.summary(s), dims), dtype=dtype)
                  for s in names]
        return first.new_empty((B, T, H, dims[op.out_dim])), states

    @torch.library.custom_op(f"hladsl::{name}_backward", mutates_args=())
    def backward_op(tokens: list[torch.Tensor], g: torch.Tensor | None, scale: float,
                    init: list[torch.Tensor], cu_seqlens: torch.Tensor | None, schedule: str,
                    grad_o: torch.Tensor, grad_states: list[torch.Tensor | None]
                    ) -> list[torch.Tensor]:
        """Gradients of (tokens..., [g], init...)."""
        grads = op.backward_impl(tokens, g, scale, init, cu_seqlens, schedule, grad_o, grad_states)
        inputs = list(tokens) + list(init) + [grad_o] + [x for x in grad_states if x is not None]
        return [_fresh(d, inputs) for d in grads]

    @backward_op.register_fake
    def _(tokens, g, scale, init, cu_seqlens, schedule, grad_o, grad_states):
        # contiguous, as backward_impl returns them (not empty_like: it keeps the inputs' strides)
        return [x.new_empty(x.shape) for x in list(tokens) + ([g] if g is not None else []) + list(init)]

    def setup_context(ctx, inputs, output):
        tokens, g, scale, init, cu_seqlens, schedule = inputs
        ctx.save_for_backward(*tokens, g, cu_seqlens, *init)
        ctx.n_tokens, ctx.scale, ctx.schedule = len(tokens), scale, schedule

    def backward(ctx, grad_o, grad_states):
        saved = ctx.saved_tensors
        n = ctx.n_tokens
        tokens, g, cu_seqlens, init = list(saved[:n]), saved[n], saved[n + 1], list(saved[n + 2:])
        grads = backward_op(tokens, g, ctx.scale, init, cu_seqlens, ctx.schedule, grad_o,
                            list(grad_states))
        d_tokens, d_g, d_init = _split_grads(grads, n, g is not None)
        return d_tokens, d_g, None, d_init, None, None

    forward.register_autograd(backward, setup_context=setup_context)
    _REGISTERED[name] = forward
    return forward


def _eager_forward(op, n_tokens: int, scale: float, cu_seqlens, schedule: str, g, tensors) -> tuple:
    tokens, init = list(tensors[:n_tokens]), list(tensors[n_tokens:])
    o, states = op.forward_impl(tokens, g, scale, init, cu_seqlens, schedule)
    o, states = fresh_outputs(o, states, tokens + init)
    return (o, *states)


def _eager_save(ctx, op, n_tokens: int, scale: float, cu_seqlens, schedule: str, g, tensors, o,
                kept=None) -> None:
    """The backward's inputs on ``ctx``; ``kept`` (``Op.forward_keeping``'s) saved like the
    inputs, so that the backward frees it."""
    held, ctx.kept = kept.split() if kept is not None else ([], None)
    ctx.save_for_backward(g, cu_seqlens, *tensors, *held)
    ctx.n_inputs = len(tensors)
    ctx.op, ctx.n_tokens, ctx.scale, ctx.schedule = op, n_tokens, scale, schedule
    ctx.o_meta = (o.shape, o.dtype, o.device)
    ctx.set_materialize_grads(False)   # unused final states: no zero tensors to pass back


class EagerCall(torch.autograd.Function):
    """The eager twin of the custom op: the same ``forward_impl`` and ``backward_impl``,
    with the same outputs (contiguous, sharing no storage with the inputs) and
    gradients. Its forward keeps the state pass for its backward (``Op.forward_keeping``;
    the custom op returns only its outputs, so under torch.compile and torch.func the
    backward runs it again). Measured on CPU with the kernel launches stubbed (linear,
    B = 1, T = 64, d = 64): fwd + bwd 1005 µs through the custom op, 636 µs through this. ``forward``
    takes ``ctx`` itself (no ``setup_context``): with one, every ``apply`` binds its
    arguments to ``inspect.signature(forward)`` (~20 µs a call). Under the torch.func
    transforms, which need ``setup_context``, ``Op.__call__`` uses ``TransformableCall``."""

    @staticmethod
    def forward(ctx, op, n_tokens: int, scale: float, cu_seqlens, schedule: str, final_states: bool, g,
                *tensors):
        tokens, init = list(tensors[:n_tokens]), list(tensors[n_tokens:])
        o, states, kept = op.forward_keeping(tokens, g, scale, init, cu_seqlens, schedule, final_states)
        o, states = fresh_outputs(o, states, tokens + init)
        _eager_save(ctx, op, n_tokens, scale, cu_seqlens, schedule, g, tensors, o, kept)
        return (o, *states)

    @staticmethod
    def backward(ctx, grad_o, *grad_states):
        g, cu_seqlens, *saved = ctx.saved_tensors
        tensors, held = saved[:ctx.n_inputs], saved[ctx.n_inputs:]
        n = ctx.n_tokens
        tokens, init = tensors[:n], tensors[n:]
        if grad_o is None:   # only final states were used
            shape, dtype, device = ctx.o_meta
            grad_o = torch.zeros(shape, dtype=dtype, device=device)
        grads = ctx.op.backward_impl(tokens, g, ctx.scale, init, cu_seqlens, ctx.schedule, grad_o,
                                     list(grad_states), kept=None if ctx.kept is None else ctx.kept.joined(held))
        d_tokens, d_g, d_init = _split_grads(grads, n, g is not None)
        return (None, None, None, None, None, None, d_g, *d_tokens, *d_init)


class TransformableCall(torch.autograd.Function):
    """``EagerCall`` with ``setup_context``, as torch.func's transforms (grad, vjp, ...)
    require of an autograd.Function (the custom op's own autograd lacks it too)."""

    @staticmethod
    def forward(op, n_tokens: int, scale: float, cu_seqlens, schedule: str, final_states: bool, g, *tensors):
        # (the final states always: with nothing kept, its backward runs the chunk form's or
        # recomputes the attention form's forward)
        return _eager_forward(op, n_tokens, scale, cu_seqlens, schedule, g, tensors)

    @staticmethod
    def setup_context(ctx, inputs, output):
        op, n_tokens, scale, cu_seqlens, schedule, _, g, *tensors = inputs
        _eager_save(ctx, op, n_tokens, scale, cu_seqlens, schedule, g, tensors, output[0])

    backward = EagerCall.backward
