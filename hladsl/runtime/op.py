"""The torch op of a compiled spec: ``hladsl.load(spec)(q, k, v, ...) -> (o, final_state)``.

Token inputs, their dims and the output come from the spec's declarations:
positional arguments follow the ``input`` order, keywords use the declared
names. Every call, eager or under torch.compile, runs ``Op.forward_impl`` and, for
gradients, ``Op.backward_impl``: one autograd path (``runtime.custom_op``: a torch
custom op per loaded spec under torch.compile, its autograd.Function twin in eager
code). Execution (``Op.forward_impl``) splits
into a differentiable preparation in torch (scale, varlen padding, chunk tiles,
cumulative gates, state layouts), a core that is either the torch chunk program
or the generated Triton kernels, and a differentiable finish (unpad, cast).
"""
from __future__ import annotations

import contextlib
import contextvars
import copy
import math
import os
import warnings

import torch

from hladsl.errors import SpecError
from hladsl.ir.attention import attention_form
from hladsl.ir.pipeline import Compilation, program_for
from hladsl.runtime import autotune, binding, chunk_torch, direct, launch
from hladsl.runtime.custom_op import EagerCall, TransformableCall, fresh_outputs, op_name, register
from hladsl.runtime.packing import pack, packed_shape, unpack
from hladsl.runtime.validate import check_inputs, check_state, check_step_state, value_checks

BACKENDS = ("auto", "torch", "triton")
# the form a stateless call runs while the tuner times it ("attention" / "chunk"; ``Op._tuned_form``)
_FORCED_FORM: contextvars.ContextVar = contextvars.ContextVar("hladsl_forced_form", default=None)
_NO_KERNEL_WARNED: set = set()   # (spec, forward/backward, dims, dtype, device) warned about
# the custom op's schema takes a float: NaN stands for "scale not given" (dim^-0.5)
DEFAULT_SCALE = float("nan")


def _default(scale) -> bool:
    return scale is None or math.isnan(scale)
CALL_OPTIONS = {"g": None, "scale": None, "initial_state": None, "output_final_state": False,
                "cu_seqlens": None, "cp_group": None, "cp_strategy": "auto"}
SERIAL_OPTIONS = {"g": None, "scale": None, "initial_state": None}
STEP_OPTIONS = {"g": None, "scale": None, "state": None, "state_indices": None, "backend": None}


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


class Op:
    """One compiled spec as a torch op (made by ``hladsl.load``, one per spec text,
    parameters and options)."""

    def __init__(self, compilation: Compilation, backend: str = "auto", chunk_size: int | None = None,
                 *, derive_carried: bool = True):
        """``derive_carried``: whether calls may run a carried form of this algebra (False for a
        carried form's own op)."""
        alg = compilation.algebra
        if backend not in BACKENDS:
            raise ValueError(f"backend must be one of {', '.join(BACKENDS)}, got {backend!r}")
        if len(alg.output.free) != 1:
            raise SpecError(f"the op needs an output with one free index (its value dim); "
                            f"{alg.output_name} has {len(alg.output.free)}", path=alg.name)
        if chunk_size is not None and (not isinstance(chunk_size, int) or chunk_size < 1):
            raise ValueError(f"chunk_size must be a positive integer or None, got {chunk_size!r} (the Triton "
                             f"kernels need a power of two >= {launch.MIN_CHUNK})")
        self.compilation = compilation
        self.algebra = alg
        self.backend = backend
        self.chunk_size = chunk_size      # None: the launch rules choose (launch.chunk_for)
        # shape class -> launch.takes_long_chunk, and -> launch.use_attention_form (Op._attention)
        self._long_chunks = launch.plan_cache()
        self._bound_steps = launch.plan_cache()   # decode call signature -> runtime.step.BoundStep
        self._bound_calls = launch.plan_cache()   # forward call signature -> _BoundForward or _UNBOUND
        self._record_tries = launch.plan_cache()  # signature -> recordings a raised launch spoiled
        self.schedule = "auto"            # Triton: "two_pass", "fused", "scan", "staged" or "auto" (runtime.launch)
        self.autotune = False             # time launch configs per shape class (runtime.autotune)
        # the carried form's op (_carried_op; False: it has none), derived here where it is on, so
        # that a first call under torch.compile finds it (0.1 s for hla2)
        # (not for the torch backend, which runs no kernels; False: no carried form)
        self._carried = (False if not derive_carried else
                         self._carried_form() if launch.CARRY_DERIVED and backend != "torch" else None)
        self.products = ()   # a carried form's op: the product summaries it adds (carried_compilation)
        self.inputs = tuple(alg.inputs)   # declaration order
        self.queries = alg.queries
        self.out_dim = output_dim(alg)
        self.state_names = tuple(s.name for s in alg.streaming)
        # what launch rules remember per shape class is per spec too: one spec's kernels
        # needing a smaller chunk must not shrink another's (hla3's once ran hla2 at C = 32)
        self.identity = op_name(self)
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
        their number. ``cp_group`` (a torch.distributed group): this rank's contiguous
        shard of the sequences, joined with the other ranks' by the derived combine
        (``runtime.context_parallel``; ``cp_strategy`` "auto", "gather" or "relay");
        ``output_final_state="broadcast"`` returns the final state on every rank."""
        signature = _call_signature(self, args, kwargs)
        if signature is not None:
            bound = self._bound_calls.get(signature)
            if bound is not None and bound is not _UNBOUND:   # like an earlier call but its data
                return bound(args, kwargs)
        tokens, opts = self.bind(args, kwargs, CALL_OPTIONS)
        g, scale, initial_state, output_final_state, cu_seqlens, cp_group, cp_strategy = opts.values()
        if cp_group is not None:   # one sequence sharded over the group's ranks
            from hladsl.runtime.context_parallel import cp_call
            return cp_call(self, tokens, g, scale, initial_state, output_final_state, cu_seqlens,
                           cp_group, cp_strategy)
        dims = check_inputs(self.algebra, tokens, g, scale, cu_seqlens,
                            data_checks=value_checks(tokens[self.inputs[0]]))
        first = tokens[self.inputs[0]]
        carried = self._carried_op(first, initial_state, output_final_state)
        if carried is not None:   # the same call on the carried form (remembered per signature)
            if signature is not None:
                self._bound_calls[signature] = _Delegated(carried)
            return carried(*args, **kwargs)
        n_seq = first.shape[0] if cu_seqlens is None else cu_seqlens.numel() - 1
        init = []
        if initial_state is not None:
            check_state(self.algebra, initial_state, n_seq, first.shape[2], dims, first.device)
            init = [initial_state[n] for n in self.state_names]
        scale = DEFAULT_SCALE if scale is None else float(scale)
        token_list = [tokens[n] for n in self.inputs]
        if torch.compiler.is_compiling():
            o, finals = self.custom_op(token_list, g, scale, init, cu_seqlens, self.schedule)
        elif torch._C._are_functorch_transforms_active():   # torch.func: needs setup_context
            o, *finals = TransformableCall.apply(self, len(token_list), scale, cu_seqlens,
                                                 self.schedule, True, g, *token_list, *init)
        elif not (torch.is_grad_enabled() and any(
                x is not None and x.requires_grad for x in (*token_list, g, *init))):
            # nothing to differentiate: no autograd node (its apply costs ~10 µs a call); the
            # first call of a signature is recorded, to be replayed bound (_BoundForward)
            record = signature is not None and signature not in self._bound_calls
            with binding.recording(_call_tensors(self, args, kwargs)) if record else \
                    contextlib.nullcontext() as rec:
                o, finals = fresh_outputs(*self.forward_impl(token_list, g, scale, init, cu_seqlens,
                                                              self.schedule, bool(output_final_state)),
                                          token_list + init)
            if record:
                self._remember(signature, rec, lambda: _BoundForward.make(self, rec, o, kwargs))
        else:   # the same forward_impl / backward_impl, without the custom op's dispatch
            o, *finals = EagerCall.apply(self, len(token_list), scale, cu_seqlens, self.schedule,
                                         bool(output_final_state), g, *token_list, *init)
        return o, (dict(zip(self.state_names, finals)) if output_final_state else None)

    def _carried_op(self, first, initial_state, output_final_state) -> "Op | None":
        """The op of this algebra's carried form (``ir.carried``) for a call with no state in or
        out that runs generated kernels, where ``launch.CARRY_DERIVED``; None otherwise or
        where the algebra has none. Its state is not this op's, so a call passing or asking
        for one runs as written. It follows this op's schedule and autotuning."""
        if (not launch.CARRY_DERIVED or initial_state is not None or output_final_state
                or not self.use_triton(first)):
            return None
        if self._carried is None:
            if torch.compiler.is_compiling():   # dynamo must not trace the compiler: as written
                return None                     # until an eager call (or the op's creation) derives it
            self._carried = self._carried_form()
        if not self._carried or (self._carried.products and not launch.CARRY_PRODUCTS):
            return None
        self._carried.schedule, self._carried.autotune = self.schedule, self.autotune
        return self._carried

    def _carried_form(self) -> "Op | bool":
        """The carried form's op, or False where the algebra has none (``ir.carried``) or its
        kernels cannot be generated (``carried_kernels_error``). An optimisation: where deriving
        it fails, a warning says why and calls run the spec as written."""
        try:
            found = carried_compilation(self.algebra)
            if found is None or carried_kernels_error(found[0]) is not None:
                return False
        except Exception as exc:   # (a proof or check of the derived algebra failing: a bug to report)
            warnings.warn(f"{self.algebra.name}: its carried form could not be derived ({exc}); "
                          f"calls run the spec as written", stacklevel=3)
            return False
        carried = Op(found[0], self.backend, self.chunk_size, derive_carried=False)
        carried.products = found[1]   # (launch.CARRY_PRODUCTS)
        return carried

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

    def state_shapes(self, *sizes, **named_sizes) -> dict[str, tuple[int, ...]]:
        """Storage shape of each state entry (after [N, H]) for dim sizes given in
        the spec's ``dims`` order or by name."""
        dims = dict(zip(self.algebra.dims, sizes)) | named_sizes
        return {s.name: packed_shape(s, dims) for s in self.algebra.streaming}

    def step(self, *args, **kwargs):
        """``op.step(q, k, v, g=None, scale=None, state=None, state_indices=None,
        backend=None)``: decode, the serial update over the inputs' T tokens
        (runtime.step.run_step). ``state`` ({summary: [N, H, *shape]}, as op(...)'s
        final state) is updated in place, zeros when None. Returns (o in the
        inputs' dtype, state)."""
        from hladsl.runtime.step import run_checked_step
        signature = _step_signature(self, args, kwargs)
        if signature is not None:
            bound = self._bound_steps.get(signature)
            if bound is not None:   # a call like an earlier one in all but its tensors' data
                return bound(args, kwargs.get("g"), kwargs["state"], kwargs.get("state_indices")), \
                    kwargs["state"]
        tokens, opts = self.bind(args, kwargs, STEP_OPTIONS)
        g, scale, state, state_indices, backend = opts.values()
        first = tokens[self.inputs[0]]
        # no checks of g's values on CUDA (each would sync with the host: value_checks)
        dims = check_inputs(self.algebra, tokens, g, scale, None, data_checks=value_checks(first))
        n = first.shape[0] if state is None or state_indices is None else \
            next(iter(state.values())).shape[0]
        if state is None:
            state = {name: first.new_zeros((n, first.shape[2]) + shape, dtype=_compute_dtype(first))
                     for name, shape in self.state_shapes(**dims).items()}
        check_state(self.algebra, state, n, first.shape[2], dims, first.device)
        check_step_state(state, state_indices, first.shape[0], first.shape[1], first.device)
        if backend not in (None, "torch", "triton"):
            raise ValueError(f"step's backend must be None, 'torch' or 'triton', got {backend!r}")
        if backend is None or backend == "triton":   # the interpreter check on CPU included
            backend = "triton" if self.use_triton(first, backend) else "torch"
        remember = None
        if signature is not None and backend == "triton":   # bound where launches are direct (GPU)
            def remember(bound):
                launch.remembered(self._bound_steps, signature, lambda: bound)
        o = run_checked_step(self.algebra, dims, next(iter(state.values())).dtype, tokens, g, state,
                             state_indices, backend,
                             scales={n: self.query_scale(tokens[n], scale) for n in self.queries},
                             out_dtype=first.dtype, on_bound=remember)
        return o, state

    def serial(self, *args, **kwargs):
        """``op.serial(q, k, v, g=None, scale=None, initial_state=None)``: the derived
        serial recurrence over the whole sequence (``step`` on the torch backend,
        from a copy of the initial state). Returns (o, final state)."""
        tokens, opts = self.bind(args, kwargs, SERIAL_OPTIONS)
        g, scale, initial_state = opts.values()
        state = initial_state
        if isinstance(initial_state, dict):   # step updates in place: never the caller's tensors
            state = {n: x.clone() if isinstance(x, torch.Tensor) else x
                     for n, x in initial_state.items()}
        return self.step(**tokens, g=g, scale=scale, state=state, backend="torch")

    # -- execution (called by the custom op and EagerCall) ------------------------------
    def use_triton(self, x: torch.Tensor, backend: str | None = None) -> bool:
        """Generated kernels for ``x``: always for backend "triton"; for "auto" on CUDA
        tensors except float64 ones (the kernels compute in fp32: a float64 call gets
        the torch path, which keeps float64)."""
        backend = backend or self.backend
        if backend == "triton":
            if x.device.type == "cpu" and os.environ.get("TRITON_INTERPRET") != "1":
                raise ValueError("backend='triton' runs generated kernels; on CPU tensors that "
                                 "needs the Triton interpreter (set TRITON_INTERPRET=1 before "
                                 "the first kernel is built), or use backend='torch'")
            return True
        return backend == "auto" and x.device.type == "cuda" and x.dtype != torch.float64

    def forward_impl(self, tokens: list, g, scale: float, init: list, cu_seqlens, schedule: str,
                     final_states: bool = True):
        """(o, [final state per summary]) without autograd; ``final_states`` False: the caller
        will not read them (a call with no initial state then may run the attention form,
        ``_attention``, and return none; under the "auto" schedule only: a named
        schedule is the chunk form's)."""
        if not init and not final_states and schedule == "auto" and self._attention(tokens, g, scale, cu_seqlens):
            return self._attention_forward(tokens, g, scale, cu_seqlens), []
        return self._forward(tokens, g, scale, init, cu_seqlens, schedule, keep=False)[:2]

    def _attention(self, tokens: list, g, scale: float, cu_seqlens, training: bool = False) -> bool:
        """Does a stateless call run the attention form (on the generated kernels only)? By
        ``launch.use_attention_form``'s rule, or, while tuning, by timing both forms (the
        forward, or ``training``: forward and backward) once per shape class."""
        first = tokens[0]
        if launch.ATTENTION_FORM == "never" or not self.use_triton(first):
            return False
        dims = tuple(sorted(self._dims(dict(zip(self.inputs, tokens))).items()))
        gated = g is not None

        def program_at(chunk):
            return program_for(self.compilation, chunk, dims, gated)
        if not launch.remembered(self._long_chunks, ("attention form", dims, gated),
                                 lambda: attention_form(program_at(launch.ATTENTION_CHUNK)) is not None):
            return False
        forced = _FORCED_FORM.get()
        if forced is not None:   # (a candidate the tuner is timing)
            return forced == "attention"
        if launch.ATTENTION_FORM == "auto":
            tuned = self._tuned_form(tokens, g, scale, cu_seqlens, training, dict(dims),
                                     program_at(launch.ATTENTION_CHUNK))
            if tuned is not None:
                return tuned == "attention"
        if cu_seqlens is not None:   # (the layout reads the bounds too: a sync either way)
            bounds = cu_seqlens.tolist()
            return launch.use_attention_form(program_at, [b - a for a, b in zip(bounds, bounds[1:])], first.device)
        key = ("attention", dims, gated, first.shape[1], str(first.device))
        return launch.remembered(self._long_chunks, key,
                                 lambda: launch.use_attention_form(program_at, [first.shape[1]], first.device))

    def _tuned_form(self, tokens: list, g, scale: float, cu_seqlens, training: bool, dims: dict,
                    program) -> str | None:
        """While tuning (``runtime.autotune``): the faster form, "attention" or "chunk", of a
        stateless call of this shape class -- its forward, or (``training``) forward and backward
        from o as the cotangent -- timed once and remembered (None: not tuning). ``program``: the
        call's at the attention form's chunk (its module names the key)."""
        first = tokens[0]
        with contextlib.ExitStack() as stack:
            tuning = autotune.current() or stack.enter_context(
                autotune.session(self.autotune, first, dims, g is not None, cu_seqlens))
            if tuning is None:
                return None
            from hladsl.codegen.attention_gen import attention_kernels
            source = attention_kernels(program)[0].__name__
            key = {"runner": "form", "training": training, "source": source, "chunk_size": self.chunk_size,
                   **tuning.shape}
            winner = tuning.tuner.lookup(key, ("form", training, source, self.chunk_size, tuning.shape_text))
            if winner is None:
                def run(candidate):
                    token = _FORCED_FORM.set(candidate["form"])
                    try:
                        if not training:
                            return self.forward_impl(tokens, g, scale, [], cu_seqlens, "auto", final_states=False)
                        o, _, kept = self.forward_keeping(tokens, g, scale, [], cu_seqlens, "auto", final_states=False)
                        return self.backward_impl(tokens, g, scale, [], cu_seqlens, "auto", o, [], kept)
                    finally:
                        _FORCED_FORM.reset(token)
                what = "training" if training else "forward"
                line = f"hladsl: timing the attention and chunk forms of {self.algebra.name}'s {what}..."
                winner = tuning.tuner.tune(key, [{"form": "attention"}, {"form": "chunk"}], run, line)
            return winner["form"]

    def _attention_forward(self, tokens: list, g, scale: float, cu_seqlens, keep: bool = False):
        """o of a stateless call by the attention form (``runtime.attention_forward``);
        ``keep``: (o, [], what its backward reads: ``AttentionKept``), as ``forward_keeping``."""
        tokens = dict(zip(self.inputs, tokens))

        def run(chunk):
            prep = _Prepared(self, tokens, g, scale, [], cu_seqlens, chunk, keep_dtype=True)
            o_tiles, kept = self._attention_outputs(prep, keep)
            binding.returned(o_tiles, {}, prep)
            o = prep.finish(o_tiles, None)[0]
            return (o, [], kept) if keep else o

        def chunk_form():   # (no attention kernel fitting the GPU at any chunk: the chunk form's kernels)
            if keep:   # (final states asked for: forward_keeping's chunk form, its own keep rule)
                return self.forward_keeping(list(tokens.values()), g, scale, [], cu_seqlens, "auto")
            return self._forward(list(tokens.values()), g, scale, [], cu_seqlens, "auto", keep=False)[0]
        return self._on_kernels("forward", tokens, g, run,
                                lambda: self._run_torch(tokens, g, scale, [], cu_seqlens)[0], chunk_of="attention",
                                no_fit=chunk_form)

    def _attention_outputs(self, prep, keep: bool):
        """(o tiles, what the backward reads or None) of the attention form's forward on
        ``prep``'s tiles; ``keep``: a normalised program's kernel stores den and o in fp32 too,
        and they are kept (``AttentionKept``: the backward reads o only to form d den, so an
        unnormalised program keeps nothing; o before its rounding, or d den loses to it where
        -Σ do o cancels)."""
        from hladsl.runtime.attention_backward import AttentionKept
        from hladsl.runtime.attention_forward import forward_attention, kept_buffers
        o_kept = den = None
        if keep and self.algebra.normalizer is not None:
            o_kept, den = kept_buffers(prep.program, prep.tiles[self.inputs[0]])
        o_tiles = forward_attention(prep.program, prep.tiles, prep.lam, self.algebra.eps, out_dtype=prep.dtype,
                                    seq_chunks=prep.seq_chunks, scales=prep.load_scales, den=den, o_kept=o_kept)
        return o_tiles, (AttentionKept(o_kept, den) if keep else None)

    def _attention_backward(self, tokens: list, g, scale: float, cu_seqlens, grad_o, kept, chunk_form):
        """The gradients of a stateless call by the attention form's backward
        (``runtime.attention_backward``), from what its forward kept (``kept``; None: o and
        den again, by its forward kernel, where the program is normalised: a call through
        the custom op keeps nothing); ``chunk_form()``: the chunk form's, where no attention
        kernel fits."""
        toks = dict(zip(self.inputs, tokens))

        def run(chunk):
            from hladsl.runtime.attention_backward import AttentionKept, backward_attention
            prep = _Prepared(self, toks, g, scale, [], cu_seqlens, chunk, keep_dtype=True)
            got = kept
            first = prep.tiles[self.inputs[0]]
            if got is None or (got.den is not None and got.den.shape != first.shape[:4]):
                # (an unnormalised program's backward reads nothing of its forward)
                got = self._attention_outputs(prep, True)[1] if self.algebra.normalizer is not None else \
                    AttentionKept(None, None)
            d_tiles, d_lam = backward_attention(
                prep.program, prep.tiles, prep.lam, prep.output_vjp(grad_o), got, self.algebra.eps,
                grad_dtype=tokens[0].dtype, seq_chunks=prep.seq_chunks, grad_scales=prep.scales,
                scales=prep.load_scales)
            prep.whole_sequence_lam = True   # (gate_vjp: a bound replay's too, on its copy of prep)
            binding.returned(d_tiles, d_lam, prep)
            grads = [prep.token_vjp(d_tiles[n], x) for n, x in zip(self.inputs, tokens)]
            if g is not None:
                grads.append(prep.gate_vjp(d_lam, g))
            return grads
        # (direction "attention": a chunk it halves to is the one its training forward reads, as the
        # chunk form's training forward runs at its backward's, ``_on_kernels``' fitted chunk)
        return self._on_kernels("attention", toks, g, run, chunk_form, chunk_of="attention", no_fit=chunk_form)

    def forward_keeping(self, tokens: list, g, scale: float, init: list, cu_seqlens, schedule: str,
                        final_states: bool = True):
        """``forward_impl`` before a backward: (o, finals, what ``backward_impl`` may reuse
        (``kept``) or None). On the kernels (``launch.KEEP_STATE_PASS``, no autotuning) the
        forward runs at the backward's chunk and runs the backward's state pass, which keeps
        its chunk starts and the deltas its reverse scan reads. Not while tuning: the tuner
        times the forward's own schedules. ``final_states`` False, no initial state: the
        attention form where ``_attention`` says (no finals; it keeps its o and den)."""
        if not init and not final_states and schedule == "auto" and self._attention(tokens, g, scale, cu_seqlens,
                                                                                      training=True):
            key = _training_key(self, "attention forward", scale, [*tokens, g], init, cu_seqlens, schedule)
            return self._replayed(key, [*tokens, *([] if g is None else [g])],
                                  lambda: self._attention_forward(tokens, g, scale, cu_seqlens, keep=True),
                                  _BoundAttentionForward.make, lambda bound: bound(tokens, g))
        keep = launch.KEEP_STATE_PASS and not autotune.requested(self.autotune) and autotune.current() is None
        if not keep:
            return self._forward(tokens, g, scale, init, cu_seqlens, schedule, keep=False)
        # a training call like an earlier one in all but its data replays that call's launches
        key = _training_key(self, "forward", scale, [*tokens, g], init, cu_seqlens, schedule)
        return self._replayed(key, [*tokens, *([] if g is None else [g])],
                              lambda: self._forward(tokens, g, scale, init, cu_seqlens, schedule, keep=True),
                              _BoundTrainingForward.make, lambda bound: bound(tokens, g))

    def _forward(self, tokens: list, g, scale: float, init: list, cu_seqlens, schedule: str, keep: bool):
        tokens = dict(zip(self.inputs, tokens))
        kept = []

        def run(chunk):
            from hladsl.runtime.triton_forward import forward_triton
            kept.clear()   # a dry run (progress) or a raised one keeps nothing: the last run is the real one
            prep = _Prepared(self, tokens, g, scale, init, cu_seqlens, chunk, keep_dtype=True)
            given = None
            if keep:
                from hladsl.runtime.triton_backward import keep_state_pass
                saved, starts, finals = keep_state_pass(prep.program, prep.tiles, prep.lam, prep.init, schedule,
                                                        prep.seq_chunks, prep.load_scales)
                given = (starts, finals)
            o_tiles, finals = forward_triton(prep.program, prep.tiles, prep.lam, prep.init,
                                             self.algebra.eps, schedule=schedule, out_dtype=prep.dtype,
                                             seq_chunks=prep.seq_chunks, scales=prep.load_scales, given=given)
            binding.returned(o_tiles, finals, prep)
            if keep:
                kept[:] = [saved]
            return prep.finish(o_tiles, finals)
        o, finals = self._on_kernels("forward", tokens, g, run,
                                     lambda: self._run_torch(tokens, g, scale, init, cu_seqlens), schedule, cu_seqlens,
                                     chunk_of="backward" if keep else "forward")
        return o, finals, (kept[0] if kept else None)

    def backward_impl(self, tokens: list, g, scale: float, init: list, cu_seqlens, schedule: str,
                      grad_o, grad_states: list, kept=None):
        """Gradients of (tokens..., g, init...) given those of (o, final states): the
        generated backward kernels between the (linear, cheap) transposes of the torch
        preparation and finish, written out (``_Prepared``'s ``*_vjp``: every product runs
        inside a kernel, no tracing on the host), or torch's VJP of the torch program.
        ``kept``: ``forward_keeping``'s, used where it fits the backward's plan and tiles."""
        from hladsl.runtime.attention_backward import AttentionKept
        keep = [n for n, x in enumerate(grad_states) if x is not None]
        leaves = list(tokens) + ([g] if g is not None else []) + list(init)
        n_tok = len(tokens)

        def forward(*xs):
            toks = dict(zip(self.inputs, xs[:n_tok]))
            gg = xs[n_tok] if g is not None else None
            o, finals = self._run_torch(toks, gg, scale, list(xs[n_tok + (g is not None):]),
                                        cu_seqlens)
            return (o,) + tuple(finals[n] for n in keep)

        def torch_path():
            _, pullback = torch.func.vjp(forward, *leaves)
            got = pullback((grad_o,) + tuple(grad_states[n] for n in keep))
            return [torch.zeros_like(x) if d is None else d.contiguous() for x, d in zip(leaves, got)]

        def run(chunk):
            from hladsl.runtime.triton_backward import backward_triton
            prep = _Prepared(self, dict(zip(self.inputs, tokens)), g, scale, init, cu_seqlens, chunk,
                             keep_dtype=True)
            d_finals = {n: prep.final_vjp(n, d) for n, d in zip(self.state_names, grad_states)
                        if d is not None}
            d_tiles, d_lam, d_init = backward_triton(
                prep.program, prep.tiles, prep.lam, prep.init, prep.output_vjp(grad_o), d_finals,
                self.algebra.eps, schedule=schedule, grad_dtype=tokens[0].dtype, seq_chunks=prep.seq_chunks,
                grad_scales=prep.scales, scales=prep.load_scales, kept=kept)
            binding.returned(d_tiles, d_lam, prep)
            grads = [prep.token_vjp(d_tiles[n], x) for n, x in zip(self.inputs, tokens)]
            if g is not None:
                grads.append(prep.gate_vjp(d_lam, g))
            grads += [prep.init_vjp(s.name, d_init[s.name], x) for s, x in zip(self.algebra.streaming, init)]
            return grads

        def on_kernels():
            return self._on_kernels("backward", dict(zip(self.inputs, tokens)), g, run, torch_path, schedule,
                                    cu_seqlens)
        if isinstance(kept, AttentionKept) or (
                kept is None and not init and not keep and schedule == "auto"
                and self._attention(tokens, g, scale, cu_seqlens, training=True)):
            kept_attention, kept = kept, None   # (the chunk form, where no attention kernel fits, keeps nothing)
            held = [] if kept_attention is None else [x for x in (kept_attention.o_tiles, kept_attention.den)
                                                      if x is not None]
            key = _training_key(self, "attention backward", scale, [*tokens, g, grad_o, *held], init, cu_seqlens,
                                schedule)
            return self._replayed(
                key, [*tokens, *([] if g is None else [g]), grad_o, *held],
                lambda: self._attention_backward(tokens, g, scale, cu_seqlens, grad_o, kept_attention, on_kernels),
                _BoundTrainingBackward.make, lambda bound: bound(tokens, g, grad_o, held))
        if keep:   # final-state gradients: validated every time
            return on_kernels()
        held = [] if kept is None else [*kept.starts.values(), *kept.deltas.values()]
        key = _training_key(self, "backward", scale, [*tokens, g, grad_o, *held], init, cu_seqlens, schedule)
        return self._replayed(key, [*tokens, *([] if g is None else [g]), grad_o, *held], on_kernels,
                              _BoundTrainingBackward.make, lambda bound: bound(tokens, g, grad_o, held))

    def final_state_impl(self, tokens: list, g, scale, init: list) -> list:
        """The final states alone (dense, no autograd): the state pass without the output
        kernel (context parallelism's segment pass, runtime.context_parallel). ``scale`` as
        a call's (None: the default)."""
        scale = DEFAULT_SCALE if scale is None else float(scale)
        toks = dict(zip(self.inputs, tokens))

        def torch_path():
            prep = _Prepared(self, toks, g, scale, init, None, self._chunk(tokens[0]), keep_dtype=False)
            _, finals = chunk_torch.state_pass(prep.program, prep.tiles, prep.lam, prep.init, prep.compute)
            return prep.finish_states(finals)

        def run(chunk):
            from hladsl.runtime.triton_forward import forward_triton
            prep = _Prepared(self, toks, g, scale, init, None, chunk, keep_dtype=True)
            _, finals = forward_triton(prep.program, prep.tiles, prep.lam, prep.init, self.algebra.eps,
                                       schedule=self.schedule, scales=prep.load_scales, states_only=True)
            return prep.finish_states(finals)
        return self._on_kernels("forward", toks, g, run, torch_path)

    def carry_grad_impl(self, tokens: list, g, scale, init: list, grad_o, grad_final: list | None = None) -> list:
        """d(initial state) from the output's cotangent (and ``grad_final``, the final
        states', in storage layout; None: zero), without token gradients: on the generated
        kernels the backward stopped after its reverse pass. Context parallelism's first
        backward step (runtime.context_parallel): every rank's own part of its carry's
        gradient, before the full backward. ``scale`` as a call's (None: the default)."""
        scale = DEFAULT_SCALE if scale is None else float(scale)
        toks = dict(zip(self.inputs, tokens))

        def torch_path():
            _, pull = torch.func.vjp(lambda *xs: self._run_torch(toks, g, scale, list(xs), None), *init)
            finals = grad_final or [torch.zeros_like(x) for x in init]
            return list(pull((grad_o, finals)))

        def run(chunk):
            from hladsl.runtime.triton_backward import backward_triton
            prep = _Prepared(self, toks, g, scale, init, None, chunk, keep_dtype=True)
            d_finals = {s.name: prep.final_vjp(s.name, d) for s, d in zip(self.algebra.streaming, grad_final or ())}
            _, _, d_init = backward_triton(
                prep.program, prep.tiles, prep.lam, prep.init, prep.output_vjp(grad_o), d_finals,
                self.algebra.eps, schedule=self.schedule, grad_dtype=tokens[0].dtype,
                grad_scales=prep.scales, scales=prep.load_scales, reverse_only=True)
            return [prep.init_vjp(s.name, d_init[s.name], x) for s, x in zip(self.algebra.streaming, init)]
        return self._on_kernels("backward", toks, g, run, torch_path)

    def _on_kernels(self, direction: str, tokens: dict, g, run, torch_path, schedule: str | None = None,
                    cu_seqlens=None, chunk_of: str | None = None, no_fit=None):
        """``run(chunk)`` on the generated kernels at the launch layer's chunk for
        ``direction`` (``chunk_of``: another direction's; halved while a kernel does not
        fit), or ``torch_path()`` off them -- the torch backend, or no kernel fitting
        (``_no_kernel_fits``; every rank of a context-parallel call has the same shapes, so
        each falls back alike; ``no_fit()`` runs there instead, where given). ``schedule`` None:
        the op's."""
        first = tokens[self.inputs[0]]
        if not self.use_triton(first):
            return torch_path()
        from triton.runtime.errors import OutOfResources
        schedule = self.schedule if schedule is None else schedule
        dims = self._dims(tokens)
        chunk_of = chunk_of or direction
        shape = (tuple(sorted(dims.items())), first.dtype, g is not None, schedule, str(first.device))
        key = (self.identity, direction, chunk_of, *shape)
        chunk = self._chunk(first, chunk_of, dims, g is not None, schedule, cu_seqlens is not None)
        # from the chunk that direction's own kernels fit (a backward that had to halve its chunk
        # halves the forward that keeps its state pass too)
        chunk = launch.fitted((self.identity, chunk_of, chunk_of, *shape), chunk)
        try:
            with autotune.session(self.autotune, first, dims, g is not None, cu_seqlens):
                return launch.fitting_chunk(key, chunk, run)
        except OutOfResources as exc:
            if no_fit is not None:
                return no_fit()
            self._no_kernel_fits(exc, direction, dims, first)
        return torch_path()

    def _remember(self, signature, rec, make) -> None:
        """Keep the bound form of a recorded call (``make()``), or ``_UNBOUND`` where it has
        none (``make()`` None); a recording that a raised launch spoiled (a chunk halved, a
        narrower walk, the fused schedule abandoned: each remembered by the launch layer) is
        tried again on the next call, RECORD_TRIES times in all."""
        if rec.raised:
            tries = self._record_tries.get(signature, 0) + 1
            self._record_tries[signature] = tries
            if tries < RECORD_TRIES:
                return
        launch.remembered(self._bound_calls, signature, lambda: make() or _UNBOUND)

    def _replayed(self, key, tensors: list, run, make, replay):
        """``run()``, or the bound replay of an earlier run under ``key`` (``replay(bound)``):
        a key's first run is recorded with ``tensors`` as its arguments and
        ``make(op, recording, result)`` binds it (None: it validates from then on); ``key``
        None runs every time."""
        if key is None:
            return run()
        bound = self._bound_calls.get(key)
        if bound is not None:
            return run() if bound is _UNBOUND else replay(bound)
        with binding.recording(tensors) as rec:
            result = run()
        self._remember(key, rec, lambda: make(self, rec, result))
        return result

    # -- internals -----------------------------------------------------------------------
    def _no_kernel_fits(self, exc, what: str, dims: dict, first) -> None:
        """No generated ``what`` kernel fits this GPU (OutOfResources after every chunk size
        and launch fallback; hla2's reverse pass at d = 128 needs 262144 B of shared
        memory). backend "triton" raises, naming the spec and shape; "auto" warns once per
        shape and the caller runs the torch chunk program instead (fp32, slower)."""
        shape = f"dims {dict(sorted(dims.items()))}, {first.dtype}, chunk {self._chunk(first)}"
        if self.backend == "triton":
            raise RuntimeError(f"{self.algebra.name}: no generated {what} kernel fits this GPU at "
                               f"{shape} (every chunk size and launch fallback tried): {exc}") from exc
        key = (self.algebra.name, what, tuple(sorted(dims.items())), first.dtype, str(first.device))
        if key not in _NO_KERNEL_WARNED:
            _NO_KERNEL_WARNED.add(key)
            warnings.warn(f"hladsl: {self.algebra.name}'s generated {what} kernels do not fit this GPU "
                          f"at {shape} ({exc}); running the torch chunk program instead (fp32, slower)",
                          RuntimeWarning, stacklevel=4)

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
            # (no cotangent where den + eps is 0: at eps = 0 a padded row's -- or a zeroed token's, the
            # layer's left padding -- 0 / 0 would make its zero cotangent NaN gradients)
            num = chunk_torch.quotient(num, den, self.algebra.eps)
        return prep.finish(num, finals)

    def _chunk(self, first, direction: str = "forward", dims: dict | None = None, gated: bool = False,
               schedule: str = "", varlen: bool = False) -> int:
        """The chunk size of a kernel call (``launch.chunk_for``; ``dims`` None: the default's)."""
        if direction == "attention":
            return launch.attention_chunk(first.shape[1], self.chunk_size, first.device)
        if dims is None:
            return launch.chunk_for(first.shape[1], self.chunk_size, first.device, direction)
        sizes = tuple(sorted(dims.items()))
        programs = first.shape[0] * first.shape[2]
        key = (direction, sizes, gated, schedule, programs, varlen, str(first.device), first.element_size())

        def long_chunk() -> bool:
            return launch.remembered(self._long_chunks, key, lambda: launch.takes_long_chunk(
                lambda chunk: program_for(self.compilation, chunk, sizes, gated), direction, schedule,
                programs, first.device, varlen, first.element_size()))
        return launch.chunk_for(first.shape[1], self.chunk_size, first.device, direction, long_chunk)

    def _dims(self, tokens) -> dict[str, int]:
        return {self.algebra.inputs[n]: x.shape[-1] for n, x in tokens.items()}

    def query_scale(self, x, scale) -> float:
        return x.shape[-1] ** -0.5 if _default(scale) else float(scale)

    def _scaled(self, tokens, scale, dtype, apply: bool = True):
        """Tokens in ``dtype``, the queries times the call's scale (``apply`` False: left
        unscaled, for kernels that scale them as they load them)."""
        out = {}
        for name, x in tokens.items():
            x = x.to(dtype)
            if name in self.queries and apply:
                x = x * self.query_scale(x, scale)
            out[name] = x
        return out


def carried_compilation(alg) -> tuple[Compilation, tuple[str, ...]] | None:
    """The target-independent passes of ``alg``'s carried form (``ir.carried``) and the product
    summaries it adds (HLA3's Z0..Z2, ``launch.CARRY_PRODUCTS``), or None."""
    from hladsl.ir.carried import carried_form
    from hladsl.ir.pipeline import algebra_compilation
    found = carried_form(alg)
    if found is None:
        return None
    return algebra_compilation(found[0]), tuple(p for c in found[1] for p in c.products)


def carried_kernels_error(compilation: Compilation) -> str | None:
    """Why the carried form's kernels cannot be generated (at the default chunk, dims of 64,
    gated: what its terms allow does not depend on the sizes), None where they can."""
    from hladsl.codegen.triton_bwd import generation_error
    sizes = tuple((d, 64) for d in compilation.algebra.dims)
    return generation_error(program_for(compilation, launch.DEFAULT_CHUNK, sizes, True))


def _tensor_signature(x) -> tuple:
    """What a launch setup and Triton's specialisation read off a tensor (not its data)."""
    return x.shape, x.stride(), x.dtype, x.device, x.data_ptr() & 15


def _bound_key(op: Op, scale, tensors) -> tuple:
    """What every bound launch (a decode step's, a forward call's) depends on beyond its
    form: the op's backend, the direct switch (bound launches are direct), the scale by
    type and value (True and numpy floats equal 1.0 but fail validation), each tensor's
    ``_tensor_signature`` (None for an absent one)."""
    return (op.backend, direct.ENABLED, type(scale), scale,
            *(None if x is None else _tensor_signature(x) for x in tensors))


def _step_signature(op: Op, args: tuple, kwargs: dict):
    """The key of a decode call in the usual form -- the token inputs positionally, the
    state (and g, scale, state_indices) by keyword -- under which a bound launch serves
    it; None for any other form (and while torch.compile traces): those validate."""
    if (len(args) != len(op.inputs) or "state" not in kwargs or "backend" in kwargs
            or not kwargs.keys() <= _BOUND_KEYWORDS or torch.compiler.is_compiling()):
        return None
    try:
        state, g, rows = kwargs["state"], kwargs.get("g"), kwargs.get("state_indices")
        if len(state) != len(op.state_names):
            return None
        return (os.environ.get("HLADSL_CHECK_VALUES"),
                *_bound_key(op, kwargs.get("scale"), (*args, g, rows, *(state[n] for n in op.state_names))))
    except (AttributeError, KeyError, TypeError):   # not tensors / not the op's state: validate
        return None


_BOUND_KEYWORDS = frozenset({"g", "scale", "state", "state_indices"})
RECORD_TRIES = 3   # recordings of a signature before it validates for good (``Op._remember``)


def _call_signature(op: Op, args: tuple, kwargs: dict):
    """The key of a forward call in the usual form -- the token inputs positionally, g,
    scale, initial_state and output_final_state by keyword -- with nothing to
    differentiate, under which a bound call (``_BoundForward``) serves it; None for any
    other form, while torch.compile or torch.func traces, while autotuning, and with
    HLADSL_CHECK_VALUES=1 (a bound call checks no values): those validate. The key holds
    everything else the validated path reads per call: the op's schedule and chunk size,
    which options are given, the device, ``_bound_key``; an initial state must have exactly
    the op's entries. Launch rule constants are changed through ``launch.switch``, which forgets
    bound calls."""
    if len(args) != len(op.inputs) or not kwargs.keys() <= _CALL_KEYWORDS:
        return None
    try:
        init = kwargs.get("initial_state")
        if init is not None and (type(init) is not dict or init.keys() != set(op.state_names)):
            return None
        tensors = _call_tensors(op, args, kwargs)
        if not _may_bind(op, tensors) or (torch.is_grad_enabled() and any(x.requires_grad for x in tensors)):
            return None
        final = kwargs.get("output_final_state", False)
        if not isinstance(final, bool):
            return None
        return (op.schedule, op.chunk_size, final, init is None, kwargs.get("g") is None,
                torch.cuda.current_device() if tensors[0].is_cuda else None,
                *_bound_key(op, kwargs.get("scale"), tensors))
    except (AttributeError, KeyError, TypeError):   # not tensors / not the op's state: validate
        return None


_CALL_KEYWORDS = frozenset({"g", "scale", "initial_state", "output_final_state"})


def _training_key(op: Op, direction: str, scale, tensors: list, init, cu_seqlens, schedule: str):
    """The key of an autograd call's forward (``direction`` "forward"; ``tensors``: the
    tokens and g) or backward ("backward": also dO and what the forward kept) under which
    its bound replay serves it (``_BoundTrainingForward``, ``_BoundTrainingBackward``);
    None where the call validates every time: varlen, an initial state, the torch backend,
    bound calls off, while torch.compile or torch.func traces, while autotuning, with
    HLADSL_CHECK_VALUES=1, or a tensor that is not a plain one. Like ``_call_signature``,
    it holds the schedule, the chunk size, the device and ``_bound_key``; and the count of
    launches that settled on less than planned (``launch.fit_changes``): the forward runs at
    the backward's fitted chunk and keeps what its reverse scan reads, so a later halving
    would leave a bound forward keeping states the backward no longer reads."""
    if cu_seqlens is not None or init or autotune.current() is not None or not _may_bind(op, tensors):
        return None
    first = tensors[0]
    return ("training", direction, schedule, op.chunk_size, len(tensors), launch.fit_changes(),
            torch.cuda.current_device() if first.is_cuda else None, *_bound_key(op, scale, tensors))


def _may_bind(op: Op, tensors: list) -> bool:
    """Whether a call of ``op`` on ``tensors`` (None: an absent one) may be recorded or
    replayed at all: not on the torch backend, with bound calls on, not while torch.compile
    or torch.func traces, not while autotuning is asked for or runs, not with HLADSL_CHECK_VALUES=1
    (a bound call checks no values), plain tensors only (a subclass -- a FakeTensor while
    tracing -- may not have an address)."""
    return not (op.backend == "torch" or not launch.BOUND_CALLS or torch.compiler.is_compiling()
                or torch._C._are_functorch_transforms_active() or autotune.requested(op.autotune)
                or autotune.current() is not None or os.environ.get("HLADSL_CHECK_VALUES") == "1"
                or any(x is not None and type(x) is not torch.Tensor for x in tensors))


def _call_tensors(op: Op, args: tuple, kwargs: dict) -> list:
    """The tensors of a call in the usual form: tokens, g, the initial state's in state order."""
    init = kwargs.get("initial_state")
    g = kwargs.get("g")
    return [*args, *([] if g is None else [g]),
            *([] if init is None else [init[n] for n in op.state_names])]


_UNBOUND = object()   # a signature whose recorded call could not be bound: it validates every time


class _Delegated:
    """A call signature the carried form's op runs (``Op._carried_op``): passed on whole.
    Changing ``CARRY_DERIVED`` or ``CARRY_PRODUCTS`` through ``launch.switch`` forgets these
    with every other plan (set directly, an op keeps routing as before)."""

    def __init__(self, op: Op):
        self.op = op

    def __call__(self, args: tuple, kwargs: dict):
        return self.op(*args, **kwargs)


class _BoundForward:
    """A forward call replayed as its recorded launches (``runtime.binding``): fresh output
    buffers, the in-chunk cumulative gates, the kernels; o is the output kernel's buffer
    and the final states are put in storage layout as the validated call does."""

    def __init__(self, op: Op, call, o_buffer: int, finals: dict, prep, final_state: bool):
        self.op, self.call, self.o_buffer, self.finals = op, call, o_buffer, finals
        self.program, self.dims, self.compute = prep.program, prep.dims, prep.compute
        self.tiling = (prep.shape[0], prep.n_chunks, prep.chunk, prep.shape[2])
        self.final_state = final_state

    @classmethod
    def make(cls, op: Op, rec, o, kwargs: dict):
        """From a recorded call that returned ``o``, or None (``_bound_forward``)."""
        bound = _bound_forward(rec, o)
        if bound is None:
            return None
        call, o_buffer, finals, prep = bound
        return cls(op, call, o_buffer, finals, prep, kwargs.get("output_final_state", False))

    def __call__(self, args: tuple, kwargs: dict):
        buffers = self.call.run(_call_tensors(self.op, args, kwargs),
                                _gates_deriver(kwargs.get("g"), self.compute, self.tiling, self.call.derived),
                                {self.o_buffer, *self.finals.values()})
        if not self.final_state:
            return buffers[self.o_buffer], None
        finals = storage_states(self.op.algebra, self.program, self.dims, self.compute,
                                {n: buffers[p] for n, p in self.finals.items()})
        return buffers[self.o_buffer], dict(zip(self.op.state_names, finals))


def _bound_forward(rec, o):
    """(bound call, o's buffer, {state: final buffer}, the preparation) of a recorded forward
    that returned ``o``, or None where it cannot be replayed: no kernels ran, its tokens were
    padded or laid out per sequence, o is not the output kernel's buffer as it is, or a
    tensor has no role (``binding.bind``)."""
    if rec.returned is None:
        return None
    o_tiles, finals, prep = rec.returned
    if prep.pad or prep.index is not None:
        return None
    o_buffer = o_tiles.data_ptr()
    base = rec.fresh.get(o_buffer)   # contiguous [B, T, H, dv]; o may differ in size-1 dims' strides
    if base is None or base.shape != o.shape or not o.is_contiguous() or o.data_ptr() != o_buffer:
        return None
    call = binding.bind(rec)
    places = None if call is None else _place(finals, call)
    if places is None or o_buffer not in call.fresh:
        return None
    return call, o_buffer, places, prep


def _gates_deriver(g, compute, tiling, names) -> dict:
    """A bound call's derived tensors ``names`` (``BoundCall.derived``): ``GATES`` (Λ as
    the kernels read it), as _Prepared and ``kernel_gates`` make it from g (no padding in a
    bound call), and a grouped scan's group decays (``GROUP_GATES`` + count) from that Λ."""
    if g is None:
        return {}
    from hladsl.runtime.triton_forward import GATES, GROUP_GATES, group_lam, kernel_gates
    made = []

    def gates():
        if not made:
            made.append(kernel_gates(chunk_gates(g.to(compute), *tiling), g.device))
        return made[0]
    derive = {GATES: gates}
    for name in names:
        if name.startswith(GROUP_GATES):
            derive[name] = lambda n=int(name[len(GROUP_GATES):]): group_lam(gates(), n)
    return derive


def _place(tensors: dict, call) -> dict | None:
    """{name: address} of buffers a recorded call's kernels wrote, each a fresh buffer its
    bound form allocates (``binding.BoundCall.fresh``); None where one is not."""
    places = {n: x.data_ptr() for n, x in tensors.items()}
    return places if set(places.values()) <= call.fresh.keys() else None


class _BoundTrainingForward:
    """The forward of an autograd call replayed (``Op.forward_keeping``): the recorded
    launches of the kept state pass and the output kernel on fresh buffers, returning o,
    the final states and what the backward reads (``KeptStates``) as the validated call does."""

    def __init__(self, op: Op, call, o_buffer: int, finals: dict, starts: dict, deltas: dict, kept, prep):
        self.op, self.call, self.o_buffer = op, call, o_buffer
        self.finals, self.starts, self.deltas = finals, starts, deltas
        self.kept_plan, self.kept_lead = kept.plan, kept.lead
        self.outputs = {o_buffer, *finals.values(), *starts.values(), *deltas.values()}
        self.program, self.dims, self.compute = prep.program, prep.dims, prep.compute
        self.tiling = (prep.shape[0], prep.n_chunks, prep.chunk, prep.shape[2])

    @classmethod
    def make(cls, op: Op, rec, result):
        """From a recorded training forward that returned ``result`` (o, finals, kept), or None
        (as ``_BoundForward.make``; also where it kept nothing)."""
        o, _, kept = result
        bound = None if kept is None else _bound_forward(rec, o)
        if bound is None:
            return None
        call, o_buffer, finals, prep = bound
        starts, deltas = _place(kept.starts, call), _place(kept.deltas, call)
        if starts is None or deltas is None:
            return None
        return cls(op, call, o_buffer, finals, starts, deltas, kept, prep)

    def __call__(self, tokens: list, g):
        from hladsl.runtime.triton_backward import KeptStates
        buffers = self.call.run([*tokens, *([] if g is None else [g])],
                                _gates_deriver(g, self.compute, self.tiling, self.call.derived), self.outputs)
        finals = storage_states(self.op.algebra, self.program, self.dims, self.compute,
                                {n: buffers[p] for n, p in self.finals.items()})
        kept = KeptStates(self.kept_plan, self.kept_lead, {n: buffers[p] for n, p in self.starts.items()},
                          {n: buffers[p] for n, p in self.deltas.items()})
        return buffers[self.o_buffer], finals, kept


class _BoundAttentionForward:
    """The forward of an autograd call on the attention form replayed (``Op.forward_keeping``):
    its recorded launch on fresh buffers, returning o, no finals and what its backward reads
    (``AttentionKept``: o in fp32 and den where normalised) as the validated call does."""

    def __init__(self, call, o_buffer: int, kept: dict, prep):
        self.call, self.o_buffer, self.kept = call, o_buffer, kept
        self.outputs = {o_buffer, *kept.values()}
        self.compute = prep.compute
        self.tiling = (prep.shape[0], prep.n_chunks, prep.chunk, prep.shape[2])

    @classmethod
    def make(cls, op: Op, rec, result):
        from hladsl.runtime.attention_backward import AttentionKept
        o, _, kept = result
        bound = _bound_forward(rec, o) if isinstance(kept, AttentionKept) else None   # (not the chunk form's)
        if bound is None:
            return None
        call, o_buffer, _, prep = bound
        places = _place({} if kept.den is None else {"o": kept.o_tiles, "den": kept.den}, call)
        return None if places is None else cls(call, o_buffer, places, prep)

    def __call__(self, tokens: list, g):
        from hladsl.runtime.attention_backward import AttentionKept
        buffers = self.call.run([*tokens, *([] if g is None else [g])],
                                _gates_deriver(g, self.compute, self.tiling, self.call.derived), self.outputs)
        o = buffers[self.o_buffer]
        if not self.kept:   # (as the validated call: an unnormalised program keeps nothing)
            return o, [], AttentionKept(None, None)
        return o, [], AttentionKept(tile(buffers[self.kept["o"]], *self.tiling), buffers[self.kept["den"]])


class _BoundTrainingBackward:
    """The backward of an autograd call replayed (``Op.backward_impl`` without final-state
    gradients): the recorded launches on fresh buffers, then the same torch transposes of
    the preparation (``_Prepared.token_vjp``, ``gate_vjp``) on their gradient tiles."""

    def __init__(self, call, d_tiles: dict, d_lam, layout):
        self.call, self.d_tiles, self.d_lam, self.layout = call, d_tiles, d_lam, layout
        self.outputs = {*d_tiles.values(), *([] if d_lam is None else [d_lam])}
        self.tiling = (layout.shape[0], layout.n_chunks, layout.chunk, layout.shape[2])

    @classmethod
    def make(cls, op: Op, rec, result):
        if rec.returned is None:
            return None
        d_tiles, d_lam, prep = rec.returned
        if prep.pad or prep.index is not None:
            return None
        call = binding.bind(rec)
        if call is None:
            return None
        tiles, lam = _place(d_tiles, call), _place({} if d_lam is None else {"dlam": d_lam}, call)
        if tiles is None or lam is None:
            return None
        layout = copy.copy(prep)   # its layout only: none of the recorded call's tensors
        layout.tiles = layout.lam = layout.init = None
        return cls(call, tiles, lam.get("dlam"), layout)

    def __call__(self, tokens: list, g, grad_o, held: list) -> list:
        buffers = self.call.run([*tokens, *([] if g is None else [g]), grad_o, *held],
                                _gates_deriver(g, self.layout.compute, self.tiling, self.call.derived),
                                self.outputs)
        grads = [self.layout.token_vjp(tile(buffers[self.d_tiles[n]], *self.tiling), x)
                 for n, x in zip(self.layout.op.inputs, tokens)]
        if g is not None:
            grads.append(self.layout.gate_vjp(buffers[self.d_lam], g))
        return grads


def chunk_gates(gates, B: int, n_chunks: int, chunk: int, H: int):
    """[B, nC*C, H] log gates -> [B, H, nC, C] in-chunk cumulative sums (Λ)."""
    return tile(gates.unsqueeze(-1), B, n_chunks, chunk, H)[..., 0].cumsum(-1)


def tile(x, B: int, n_chunks: int, chunk: int, H: int):
    """[B, nC*C, H, dim] -> [B, H, nC, C, dim], a view."""
    return x.reshape(B, n_chunks, chunk, H, -1).permute(0, 3, 1, 2, 4)


def storage_states(alg, program, dims: dict, compute, finals: dict) -> list:
    """The kernels' final states (the program's layout) in storage layout and ``compute`` dtype."""
    states = [finals[s.name] if program.is_packed(s.name) else pack(s, finals[s.name], dims)
              for s in alg.streaming]
    return [x.to(compute) for x in states]


def _compute_dtype(x) -> torch.dtype:
    return torch.float64 if x.dtype == torch.float64 else torch.float32


class _Prepared:
    """The differentiable torch side of one call: scaled tokens as chunk tiles
    [N, H, nC, C, dim], in-chunk cumulative gates [N, H, nC, C], the initial
    state in the program's layout (None for the kernels when the call has none:
    they start from zeros); ``finish`` maps the core's outputs back."""

    def __init__(self, op: Op, tokens, g, scale, init, cu_seqlens, chunk: int, keep_dtype: bool):
        alg = op.algebra
        first = tokens[op.inputs[0]]
        self.op, self.dtype = op, first.dtype
        self.whole_sequence_lam = False   # the attention form's backward sets it (gate_vjp)
        self.compute = compute = _compute_dtype(first)
        self.dims = dims = op._dims(tokens)
        self.scales = {n: op.query_scale(tokens[n], scale) for n in op.queries}
        # the kernels scale the queries as they load them (launch.SCALE_QUERIES_IN_KERNEL); a
        # float kernel argument is fp32, so float64 tokens are scaled here, exactly
        in_kernel = keep_dtype and first.dtype != torch.float64 and launch.SCALE_QUERIES_IN_KERNEL
        self.load_scales = self.scales if in_kernel else {}
        tokens = op._scaled(tokens, scale, first.dtype if keep_dtype else compute,
                            apply=not self.load_scales)
        gates = None if g is None else g.to(compute)
        self.index = self.seq_chunks = None
        if cu_seqlens is not None:   # the kernels: one row of chunks; the torch path: padded rows
            tokens, gates, self.index, self.seq_chunks = _varlen_layout(tokens, gates, cu_seqlens, chunk,
                                                                        one_row=keep_dtype)
        first = tokens[op.inputs[0]]
        B, T, H = first.shape[:3]
        self.shape = (B, T, H)
        self.program = program_for(op.compilation, chunk, tuple(sorted(dims.items())),
                                   gates is not None)
        self.chunk = chunk
        self.n_chunks = n_chunks = max(1, -(-T // chunk))
        self.pad = n_chunks * chunk - T
        self.tiles = {name: self._tiled(x) for name, x in tokens.items()}   # views unless padded
        self.lam = None
        if gates is not None:
            if self.pad:
                gates = torch.nn.functional.pad(gates, (0, 0, 0, self.pad))
            self.lam = chunk_gates(gates, B, n_chunks, chunk, H)
        rows = B if self.seq_chunks is None else self.seq_chunks.numel() - 1   # one per sequence
        self.rows = (rows, H)
        self.init = None   # no initial state: the kernels start from zeros (HAS_INIT)
        if init or not keep_dtype:   # the torch program needs its zeros
            self.init = {}
            for n, s in enumerate(alg.streaming):
                x = (init[n].to(compute) if init else
                     first.new_zeros((rows, H) + packed_shape(s, dims), dtype=compute))
                self.init[s.name] = x if self.program.is_packed(s.name) else unpack(s, x, dims)

    def _tiled(self, x):
        """[N, T, H, dim] -> [N, H, nC, C, dim] (a view unless T needs padding)."""
        if self.pad:
            x = torch.nn.functional.pad(x, (0, 0, 0, 0, 0, self.pad))
        B, _, H = self.shape
        return tile(x, B, self.n_chunks, self.chunk, H)

    def _untiled(self, d):
        """The transpose of _tiled and _varlen_layout: tile gradients [N, H, nC, C, dim] ->
        the caller's [B, T, H, dim] (or varlen [1, T, H, dim]) layout."""
        B, T, H = self.shape
        d = d.permute(0, 2, 3, 1, 4).reshape(B, self.n_chunks * self.chunk, H, -1)[:, :T]
        if self.index is None:
            return d
        return d.reshape(-1, *d.shape[2:])[self.index].unsqueeze(0)

    # -- the transposes of the preparation and finish (all linear) ----------------------------
    def output_vjp(self, grad_o):
        """d o [B, T, H, dv] -> d o-tiles [N, H, nC, C, dv] (views where no padding)."""
        if self.index is not None:
            B, T, H = self.shape
            flat = grad_o.new_zeros((B * T,) + grad_o.shape[2:])
            flat[self.index] = grad_o[0]
            grad_o = flat.reshape(B, T, *grad_o.shape[2:])
        return self._tiled(grad_o)

    def final_vjp(self, name, d):
        """d final state (storage layout) -> the program's layout."""
        s = self.op.algebra.summary(name)
        if self.program.is_packed(name) or not s.symmetric:   # the same layout
            return d.float()
        full = self.init[name] if self.init is not None else \
            d.new_zeros(self.rows + tuple(self.program.state_shape(name)), dtype=self.compute)
        _, pull = torch.func.vjp(lambda x: pack(s, x, self.dims), full)
        return pull(d.to(full.dtype))[0]

    def token_vjp(self, d_tiles, x):
        """The kernels applied the query scale (``grad_scales``): only the layout is left."""
        return self._untiled(d_tiles).to(x.dtype, memory_format=torch.contiguous_format)

    def gate_vjp(self, d_lam, g):
        """dΛ (in-chunk cumulative sums) -> dg: a reverse cumulative sum within each chunk. The
        attention form's dΛ is at whole-sequence Λ (``whole_sequence_lam``): each chunk's share
        of the gaps between chunk starts is moved to its last in-chunk Λ first (in place)."""
        if self.whole_sequence_lam:
            from hladsl.runtime.attention_backward import gap_share
            gap_share(d_lam, self.seq_chunks)
        d = d_lam.flip(-1).cumsum(-1).flip(-1)
        return self._untiled(d.unsqueeze(-1))[..., 0].to(g.dtype).contiguous()

    def init_vjp(self, name, d, x):
        s = self.op.algebra.summary(name)
        if self.program.is_packed(name) or not s.symmetric:   # the same layout
            return d.to(x.dtype).contiguous()
        _, pull = torch.func.vjp(lambda y: unpack(s, y, self.dims), x.to(d.dtype))
        return pull(d)[0].to(x.dtype).contiguous()

    def finish_states(self, finals) -> list:
        """The final states in storage layout, in the compute dtype."""
        return storage_states(self.op.algebra, self.program, self.dims, self.compute, finals)

    def finish(self, o_tiles, finals):
        """o [B, T, H, dv] in the inputs' dtype and the final states in storage layout (none
        where ``finals`` is None: the attention form has no state)."""
        B, T, H = self.shape
        o = o_tiles.permute(0, 2, 3, 1, 4).reshape(B, -1, H, o_tiles.shape[-1])[:, :T]
        if self.index is not None:
            o = o.reshape(-1, *o.shape[2:])[self.index].unsqueeze(0)
        if o.dtype != self.dtype or not o.is_contiguous():   # one copy: cast and lay out together
            o = o.to(self.dtype, memory_format=torch.contiguous_format)
        return o, ([] if finals is None else self.finish_states(finals))


def _checked_bounds(cu_seqlens, T: int) -> list[int]:
    """cu_seqlens as a list, checked here whatever the device: reading it syncs anyway
    (the layout depends on it), and bad bounds would silently give a wrong-shaped o."""
    bounds = cu_seqlens.tolist()
    if bounds[0] != 0 or bounds[-1] != T or any(b < a for a, b in zip(bounds, bounds[1:])):
        raise ValueError(f"cu_seqlens must rise from 0 to T = {T}, got {bounds}")
    return bounds


def _varlen_layout(tokens, gates, cu_seqlens, chunk: int, one_row: bool):
    """Varlen [1, T, ...] (sequences back to back) -> the layout the chunk programs run:
    ``one_row`` (the kernels): every sequence in one row [1, T', ...], each padded to whole
    chunks (T' = Σ ceil(len / C) C: their total length, not count × longest), with
    seq_chunks (int32 [S + 1]: sequence n owns chunks seq_chunks[n] .. seq_chunks[n+1] - 1);
    else (the torch path, whose state pass has no sequence boundaries) one padded row per
    sequence [S, Tmax, ...], seq_chunks None. Also the gather index of the tokens' rows."""
    first_token = next(iter(tokens.values()))
    bounds = _checked_bounds(cu_seqlens, first_token.shape[1])
    lengths = [b - a for a, b in zip(bounds, bounds[1:])]
    device = first_token.device
    if one_row:
        chunks = [0]
        for n in lengths:
            chunks.append(chunks[-1] + -(-n // chunk))
        starts = [c * chunk for c in chunks[:-1]]
        lead = (1, max(chunks[-1], 1) * chunk)    # at least one chunk: kernels need a grid
        seq_chunks = torch.tensor(chunks, dtype=torch.int32, device=device)
    else:
        t_max = max(max(lengths), 1)
        starts = [n * t_max for n in range(len(lengths))]
        lead, seq_chunks = (len(lengths), t_max), None
    index = torch.cat([torch.arange(n, device=device) + a for a, n in zip(starts, lengths)]
                      + [torch.zeros(0, dtype=torch.long, device=device)])

    def lay(x):   # bounds rise from 0 to T: x[0] is every token, in order
        flat = x.new_zeros((lead[0] * lead[1],) + x.shape[2:])
        return flat.index_copy(0, index, x[0]).reshape(*lead, *x.shape[2:])
    out = {name: lay(x) for name, x in tokens.items()}
    return out, None if gates is None else lay(gates), index, seq_chunks
