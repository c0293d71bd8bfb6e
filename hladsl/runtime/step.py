"""The decode step: ``run_step`` applies the derived serial update
X_t = X_{t-1} ⊕ token_t to T >= 1 tokens, updating the caller's state tensors
in place, and returns the outputs.

Both backends run the same plan (``codegen.step_plan.step_plan``): row states
(power attention's U) stay on their packed rows, other symmetric states are
held whole. "torch" evaluates each term with batched einsums over (batch, head),
looping over the T tokens; "triton" launches the generated kernels
(``codegen.step_gen``), which never sync with the host, so a decode step can be
captured in a CUDA graph. Where some states lack the value dim (HLA2's S), the
bridged split runs free_kernel (those states, and the bridges: the value-free
contractions the other terms read) then value_kernel (the other states over value
blocks); its scratch of bridges is allocated with o, one allocation a step. Where
it does not apply, the shared split's last value block of each (row, head) writes
them, counted in a small int32 buffer of zeros kept per state storage (``_counters``:
made at the first step on that state, left at zero by every step).
"""
from __future__ import annotations

import torch

from hladsl.codegen.step_plan import StepPlan, step_plan
from hladsl.ir.algebra import Algebra
from hladsl.ir.contract import Plan
from hladsl.ir.evaluate import letters_for
from hladsl.ir.operands import Kind, exhaustive
from hladsl.runtime import direct, launch
from hladsl.runtime.packing import combos, multiplicity, multiplicity_fp32, on_device, pack, packed_shape, slots, unpack
from hladsl.runtime.validate import check_step_state

BACKENDS = ("torch", "triton")


def run_step(algebra: Algebra, tokens: dict, g, state: dict, state_indices=None,
             backend: str = "torch", block_v: int | None = None, num_warps: int | None = None,
             packed_rows: int | None = None, scales: dict | None = None,
             out_dtype: torch.dtype | None = None) -> torch.Tensor:
    """tokens: {input: [B, T, H, dim]} (any float dtype); g: [B, T, H] log gates or
    None; state: {summary: [N, H, *storage shape]} fp32/fp64, updated in place;
    state_indices: optional [B] ints, the state row of each batch row; scales: input ->
    the factor its tokens are multiplied by (the query scale), applied as they are read.
    Returns o [B, T, H, dv] in ``out_dtype`` (default the state dtype; the kernel
    writes it so: no cast after). block_v / num_warps / packed_rows override the
    Triton launch (value-dim block, warps, rows per packed block; under the bridged
    split they are value_kernel's, free_kernel's warps follow launch.step_free_warps)."""
    if backend not in BACKENDS:
        raise ValueError(f"backend must be one of {BACKENDS}, got {backend!r}")
    sizes, dtype = _check(algebra, tokens, g, state, state_indices)
    return run_checked_step(algebra, sizes, dtype, tokens, g, state, state_indices, backend, block_v,
                            num_warps, packed_rows, scales, out_dtype)


def run_checked_step(algebra: Algebra, sizes: dict, dtype: torch.dtype, tokens: dict, g, state: dict,
                     state_indices, backend: str, block_v=None, num_warps=None, packed_rows=None,
                     scales: dict | None = None, out_dtype: torch.dtype | None = None, on_bound=None):
    """``run_step`` on arguments validated by the caller (``Op.step`` checks them as the
    op's inputs): ``sizes`` {dim: n}, ``dtype`` the state tensors' dtype. ``on_bound``
    receives this launch as a ``BoundStep`` where it can be one (the caller reuses it for
    calls whose tensors match these in everything but their data)."""
    plan = step_plan(algebra, sizes)
    scales = {name: float((scales or {}).get(name, 1.0)) for name in tokens}
    if backend == "triton" and dtype == torch.float64 and set(scales.values()) != {1.0}:
        # a float kernel argument is fp32: an fp64 step scales its tokens here, exactly
        tokens = {n: x * scales[n] if scales[n] != 1.0 else x for n, x in tokens.items()}
        scales = dict.fromkeys(scales, 1.0)
    if backend == "triton":
        return _run_triton(plan, tokens, g, state, state_indices, dtype, block_v, num_warps,
                           packed_rows, scales, out_dtype or dtype, on_bound)
    o = _run_torch(plan, tokens, g, state, state_indices, dtype, scales)
    return o if out_dtype is None else o.to(out_dtype)


# -- validation ------------------------------------------------------------------------------

def _check(alg: Algebra, tokens, g, state, state_indices):
    if not isinstance(tokens, dict) or set(tokens) != set(alg.inputs):
        got = sorted(tokens) if isinstance(tokens, dict) else type(tokens).__name__
        raise ValueError(f"tokens must be a dict with the inputs {sorted(alg.inputs)}, got {got}")
    first = None
    sizes: dict[str, int] = {}
    for name, x in tokens.items():
        if not isinstance(x, torch.Tensor) or x.dim() != 4 or not x.is_floating_point():
            raise ValueError(f"tokens['{name}'] must be a float tensor [B, T, H, dim]")
        first = first if first is not None else x
        if x.shape[:3] != first.shape[:3] or x.device != first.device:
            raise ValueError(f"tokens['{name}'] must share [B, T, H] = {tuple(first.shape[:3])} and "
                             f"the device of the other tokens")
        dim = alg.inputs[name]
        if sizes.setdefault(dim, x.shape[-1]) != x.shape[-1]:
            raise ValueError(f"tokens['{name}'] has last dimension {x.shape[-1]}, but dim '{dim}' "
                             f"is {sizes[dim]}")
    B, T, H, _ = first.shape
    if g is not None and (not isinstance(g, torch.Tensor) or tuple(g.shape) != (B, T, H)
                          or not g.is_floating_point() or g.device != first.device):
        raise ValueError(f"g must be a float tensor [B, T, H] = {(B, T, H)} on {first.device}")
    want = {s.name: s for s in alg.streaming}
    if not isinstance(state, dict) or set(state) != set(want):
        raise ValueError(f"state must be a dict with the entries {sorted(want)}")
    dtypes = {x.dtype for x in state.values() if isinstance(x, torch.Tensor)}
    if len(dtypes) != 1 or not dtypes <= {torch.float32, torch.float64}:
        raise ValueError("state tensors must all be float32 or all float64")
    n = next(iter(state.values())).shape[0]
    for name, s in want.items():
        shape = (n, H) + packed_shape(s, sizes)
        x = state[name]
        if not isinstance(x, torch.Tensor) or tuple(x.shape) != shape or x.device != first.device:
            raise ValueError(f"state['{name}'] must be a tensor of shape {shape} on {first.device}, "
                             f"got {tuple(x.shape) if isinstance(x, torch.Tensor) else x}")
    if state_indices is None and n != B:
        raise ValueError(f"state has {n} rows but the batch {B}: pass state_indices")
    check_step_state(state, state_indices, B, T, first.device)   # T >= 1, state_indices
    return sizes, dtypes.pop()


# -- torch --------------------------------------------------------------------------------------

def _run_torch(plan: StepPlan, tokens, g, state, state_indices, dtype, scales):
    alg = plan.algebra
    sizes = dict(plan.sizes)
    held = {}
    for s in alg.streaming:
        x = state[s.name] if state_indices is None else state[s.name].index_select(0, state_indices.long())
        held[s.name] = x.to(dtype) if plan.row_dim(s.name) else unpack(s, x.to(dtype), sizes)
    T = next(iter(tokens.values())).shape[1]
    outs = []
    for t in range(T):
        tok = {name: x[:, t].to(dtype) * scales[name] for name, x in tokens.items()}   # [B, H, dim]
        rho = None if g is None else torch.exp(g[:, t].to(dtype))           # [B, H]
        prev = held
        held = {name: _sum(plan, terms, tok, prev, rho) for name, terms in plan.states}
        num = _sum(plan, plan.output, tok, held, rho)
        if plan.normalizer:
            num = num / (_sum(plan, plan.normalizer, tok, held, rho).unsqueeze(-1) + alg.eps)
        outs.append(num)
    for s in alg.streaming:
        x = held[s.name] if plan.row_dim(s.name) else pack(s, held[s.name], sizes)
        if state_indices is None:
            state[s.name].copy_(x)
        else:
            state[s.name].index_copy_(0, state_indices.long(), x.to(state[s.name].dtype))
    return torch.stack(outs, dim=1)


def _sum(plan, terms, tok, held, rho):
    total = None
    for t in terms:
        operands = [_TENSOR[o.kind](plan, o, tok, held) for o in t.operands]
        value = _contract(operands, [o.indices for o in t.operands], t.output, t.plan) * t.coef
        if t.rho and rho is not None:
            r = rho ** t.rho
            value = value * r.reshape(r.shape + (1,) * len(t.output))
        total = value if total is None else total + value
    return total


def _contract(operands, indices, output, order: Plan):
    names = letters_for(list(output) + [i for idx in indices for i in idx])
    values = list(zip(operands, indices))

    def spec(*idx):
        return ",".join("..." + "".join(names[i] for i in x) for x in idx[:-1]) + \
            "->..." + "".join(names[i] for i in idx[-1])
    for s in order.steps:
        (a, ia), (b, ib) = values[s.left], values[s.right]
        values.append((torch.einsum(spec(ia, ib, s.indices), a, b), s.indices))
    value, idx = values[order.result]
    return torch.einsum(spec(idx, output), value)


def _power(plan, o, tok, held):
    """spow(x)[..., α] = Π_r x[..., α_r] over the packed rows (times m(α) when consumed)."""
    pd = next(p for p in plan.packed if p.name == o.packed)
    x = tok[o.name]
    slots = combos(dict(plan.sizes)[pd.base], pd.power).to(x.device)
    value = x[..., slots[:, 0]]
    for r in range(1, pd.power):
        value = value * x[..., slots[:, r]]
    if o.weighted:
        value = value * multiplicity(dict(plan.sizes)[pd.base], pd.power).to(x.device, x.dtype)
    return value


_TENSOR = exhaustive({Kind.TOKEN: lambda plan, o, tok, held: tok[o.name], Kind.POWER: _power,
                      Kind.CARRY: lambda plan, o, tok, held: held[o.name]},
                     "the torch step", (Kind.TOKEN, Kind.POWER, Kind.CARRY))


# -- triton -------------------------------------------------------------------------------------

_SETUPS = launch.plan_cache()     # launch setups of recent shapes (launch.remembered)


def _run_triton(plan, tokens, g, state, state_indices, dtype, block_v, num_warps, packed_rows,
                scales, out_dtype, on_bound=None):
    first = next(iter(tokens.values()))
    B, T, H, _ = first.shape
    key = (id(plan), B, T, H, dtype, g is not None, state_indices is not None, block_v, num_warps,
           packed_rows, first.device)
    setup = launch.remembered(_SETUPS, key, lambda: _Setup(plan, *key[1:]))
    o, scratch = setup.outputs(first.device, out_dtype, dtype)
    tensors = _tensor_args(setup.states, tokens, g, state, state_indices, o)
    if setup.shared:
        tensors["cnt_ptr"] = _counters(state[setup.states[0][0]])
    if scratch is not None:
        tensors["br_ptr"] = scratch
    for name, scale in scales.items():
        tensors[f"scl_{name}"] = scale
    for a, n, t_block in setup.pieces:
        piece = tensors if n == T else _piece(tensors, tokens, g, o, a, n)
        for kernel in setup.kernels:
            direct.call(kernel.kernel, kernel.grid, kernel.args(piece, n, t_block))
    if on_bound is not None and len(setup.pieces) == 1:
        bound = [direct.bind(k.kernel, k.grid, k.args(tensors, T, setup.pieces[0][2]), k.tensors)
                 for k in setup.kernels]
        if None not in bound:
            on_bound(BoundStep(setup, bound, out_dtype))
    return o


class BoundStep:
    """A decode step's launches for one signature of its tensors (shapes, strides, dtypes,
    devices, alignment: what the launch setup and Triton's specialisation depend on),
    kept by ``Op.step``: a call allocates o (and the bridges' scratch with it), looks up
    its state's counters where the step is split so, and launches the bound kernels -- no
    validation, plan or key."""

    def __init__(self, setup, bound: list, out_dtype):
        self.setup, self.bound, self.out_dtype = setup, bound, out_dtype

    def __call__(self, tokens, g, state: dict, state_indices):
        setup = self.setup
        first = tokens[0]
        o, scratch = setup.outputs(first.device, self.out_dtype, state[setup.states[0][0]].dtype)
        values = {f"in_{name}_ptr": x for name, x in zip(setup.inputs, tokens)}
        values["g_ptr"] = g
        values.update({f"st_{name}_ptr": state[name] for name, _ in setup.states})
        values["rows_ptr"] = state_indices if state_indices is not None else o
        values["o_ptr"], values["br_ptr"] = o, scratch
        if setup.shared:
            values["cnt_ptr"] = _counters(state[setup.states[0][0]])
        for kernel, bound in zip(setup.kernels, self.bound):
            bound.launch([values[n] for n in kernel.tensors])
        return o


_COUNTERS: dict = {}   # (device, state storage address, rows x heads) -> int32 counters


def _counters(first_state: torch.Tensor) -> torch.Tensor:
    """The shared split's per-(state row, head) counters of value blocks done, int32
    zeros kept per state storage (its first tensor's address: steps on different states,
    even on different streams, never share one; a state's storage may go and come back,
    its counters stay -- N * H ints per address the caching allocator ever gave a state).
    Every step leaves them at zero (the last block of each (row, head) subtracts the
    blocks' count). Under CUDA-graph capture each captured step gets its own buffer,
    zeroed by the graph (its memset is captured; the graph's pool keeps it)."""
    n, h = first_state.shape[:2]
    if first_state.is_cuda and torch.cuda.is_current_stream_capturing():
        return torch.zeros(n * h, dtype=torch.int32, device=first_state.device)
    key = (first_state.device, first_state.data_ptr(), n * h)
    hit = _COUNTERS.get(key)
    if hit is None:
        hit = _COUNTERS[key] = torch.zeros(n * h, dtype=torch.int32, device=first_state.device)
    return hit


def counters_of(first_state: torch.Tensor):
    """The counters a step on this state uses outside graph capture (None before its first split step)."""
    return _COUNTERS.get((first_state.device, first_state.data_ptr(), first_state.shape[0] * first_state.shape[1]))


def _piece(args: dict, tokens, g, o, a: int, n: int) -> dict:
    """The arguments of the launches over tokens a .. a + n - 1 (the bridges' scratch,
    sized for one piece, is reused by each)."""
    piece = dict(args, o_ptr=o[:, a:a + n])
    for name, x in tokens.items():
        piece[f"in_{name}_ptr"] = x[:, a:a + n]
    if g is not None:
        piece["g_ptr"] = g[:, a:a + n]
    return piece


class _Kernel:
    """One launch of a step: the kernel, its grid, its fixed arguments (those of the
    setup's that are its parameters, and launch options) and ``tensors``, the pointer
    parameters each call fills (the template's ``*_ptr`` not fixed here), in order."""

    OPTIONS = ("num_warps", "num_stages")

    def __init__(self, kernel, grid, static: dict):
        self.kernel, self.grid = kernel, grid
        self.params = set(kernel.arg_names)
        self.static = {k: v for k, v in static.items() if k in self.params or k in self.OPTIONS}
        self.tensors = [n for n in kernel.arg_names if n.endswith("_ptr") and n not in self.static]
        self.blocked = "T_BLOCK" in self.params   # kernels with a [T, value block] accumulator

    def args(self, values: dict, T: int, t_block: int) -> dict:
        """Its arguments for the launch over T tokens (``t_block``: T padded to a power of two)."""
        out = dict(self.static)
        out.update({k: v for k, v in values.items() if k in self.params})
        out["T"] = T
        if self.blocked:
            out["T_BLOCK"] = t_block
        return out


class _Setup:
    """What a step launch needs besides the tensors, made once per (plan, shape, dtype,
    flags, overrides): the kernels (step_kernel, or the bridged split's free_kernel then
    value_kernel) with their constexpr/size arguments, value-dim blocks, grids and
    warps, and the token pieces of one launch each."""

    def __init__(self, plan, B, T, H, dtype, gated, indexed, block_v, num_warps, packed_rows,
                 device):
        import triton.language as tl

        from hladsl.codegen.step_gen import PACKED_ROWS, step_kernel
        from hladsl.codegen.triton_gen import block_size
        module, ctx = step_kernel(plan.algebra, plan.sizes, gated)
        self.plan = plan   # keeps id(plan) in the setup's key from being reused
        sizes = dict(plan.sizes)
        self.B, self.H = B, H
        self.dv = dv = sizes[plan.value_dim]
        self.states = [(s["name"], s["axes"]) for s in ctx["states"]]
        self.inputs = [x["name"] for x in ctx["inputs"]]
        static, rows = {}, 0
        for pd in ctx["packed"]:   # the plan's, and those the value-free states update on
            idx, mult = (on_device(t, device, sizes[pd["base"]], pd["power"]) for t in (slots, multiplicity_fp32))
            if pd["name"] in plan.packed_names():
                block = rows = packed_rows or min(PACKED_ROWS, block_size(pd["size"]))
            else:
                # only the last block's update of value-free states walks it (vectors of
                # packed rows): in few blocks, not a chain of dependent round trips (HLA2's S
                # in 33 blocks of 64 rows: a step of 64.5 µs, run 105; at once 41.9, run 106)
                block = min(launch.STEP_FREE_ROWS, block_size(pd["size"]))
            static.update({f"pk_{pd['name']}_idx": idx, f"pk_{pd['name']}_mult": mult,
                           f"D_{pd['name']}": pd["size"], f"B_{pd['name']}": block})
        for d, n in sizes.items():
            static[f"D_{d}"], static[f"B_{d}"] = n, block_size(n)
        static.update(H=H, INDEXED=indexed, ACC=tl.float64 if dtype == torch.float64 else tl.float32)
        full = block_size(dv)
        bridged = bool(ctx["bridges"]) and launch.STEP_BRIDGED
        if block_v is None:
            width = launch.step_value_block(dv, ctx["split"], ctx["shared"], bridged)
        elif not (ctx["split"] or ctx["shared"]) and block_v < full:
            raise ValueError(f"{plan.algebra.name}'s step cannot split {plan.value_dim} (block_v)")
        else:
            width = min(block_size(block_v), full)
        blocks = -(-dv // width)
        # kernels with packed dims sum outputs in a [T, value block] register tile, and
        # the bridged split's scratch holds one piece: longer inputs run as consecutive
        # launches of launch.STEP_MAX_TOKENS (the state carries over)
        span = T if ctx["direct"] and not bridged else launch.STEP_MAX_TOKENS
        self.pieces = [(a, min(span, T - a), max(2, 1 << (min(span, T - a) - 1).bit_length()))
                       for a in range(0, T, span)]
        names = [name for name, _ in plan.states]
        eps = {"eps": float(plan.algebra.eps)} if ctx["normalize"] else {}
        self.shared = False
        self.scratch = 0
        if bridged:
            # free_kernel (one program per (row, head)) then value_kernel (value blocks)
            self.scratch = B * min(span, T) * H * ctx["bridge_width"]
            static["BR_W"] = ctx["bridge_width"]
            free, value = ctx["free_names"], ctx["value_names"]
            warps_free = launch.step_free_warps(_elements(plan, full, rows, free)[0])
            warps_value = num_warps or _warps(plan, width, rows, value)
            self.kernels = [
                _Kernel(module.free_kernel, (B * H,), {**static, "num_warps": warps_free}),
                _Kernel(module.value_kernel, (B * H * blocks,),
                        {**static, **eps, f"B_{plan.value_dim}": width, "num_warps": warps_value})]
            return
        static[f"B_{plan.value_dim}"] = width
        # shared split: more than one value block while some states lack the value dim
        # (every block forms them, the last one of a (row, head) writes them)
        self.shared = ctx["shared"] and width < full
        if ctx["shared"]:
            static["SHARED"] = self.shared
            if not self.shared:
                static["cnt_ptr"] = None   # a pointer only when SHARED (the call's _counters)
        warps = num_warps or _warps(plan, width, rows, names, self.shared)
        self.kernels = [_Kernel(module.step_kernel, (B * H * blocks,), {**static, **eps, "num_warps": warps})]

    def outputs(self, device, out_dtype, state_dtype):
        """o [B, T, H, dv] and the bridges' scratch (None when not bridged): one
        allocation, o at its start (a step allocates nothing else)."""
        B, H = self.B, self.H
        T = self.pieces[-1][0] + self.pieces[-1][1]
        if not self.scratch:
            return torch.empty((B, T, H, self.dv), device=device, dtype=out_dtype), None
        size = B * T * H * self.dv * out_dtype.itemsize
        start = -(-size // 16) * 16
        buf = torch.empty(start + self.scratch * state_dtype.itemsize, device=device, dtype=torch.uint8)
        o = buf[:size].view(out_dtype).view(B, T, H, self.dv)
        return o, buf[start:].view(state_dtype)


def _tensor_args(states, tokens, g, state, state_indices, o) -> dict:
    """The tensors and their strides: passed as they are, nothing is copied."""
    args = {}
    for name, x in tokens.items():
        args[f"in_{name}_ptr"] = x
        st = x.stride()
        args[f"str_{name}_b"], args[f"str_{name}_t"], args[f"str_{name}_h"], args[f"str_{name}_f"] = st
    if g is not None:
        args["g_ptr"] = g
        args["str_g_b"], args["str_g_t"], args["str_g_h"] = g.stride()
    for name, axes in states:
        x = state[name]
        args[f"st_{name}_ptr"] = x
        st = x.stride()
        args[f"str_{name}_n"], args[f"str_{name}_h"] = st[0], st[1]
        for a in range(axes):
            args[f"str_{name}_{a}"] = st[2 + a]
    args["o_ptr"] = o
    args["str_o_b"], args["str_o_t"], args["str_o_h"] = o.stride()[:3]
    args["rows_ptr"] = state_indices if state_indices is not None else o
    return args


def _warps(plan: StepPlan, width: int, rows: int, names, shared: bool = False) -> int:
    """Warps for the fp32 elements of the states ``names`` one program holds at a
    time (its whole states at this value block, or one block of ``rows`` packed
    rows; the rule is ``launch.step_warps``)."""
    whole, blocks = _elements(plan, width, rows, names)
    return launch.step_warps(max([whole, *blocks.values()]), shared)


def _elements(plan: StepPlan, width: int, rows: int, names):
    """(fp32 elements of the whole states ``names``, {packed dim: elements of one block
    of its row states}) at value block ``width``."""
    from hladsl.codegen.triton_gen import block_size
    sizes = dict(plan.sizes)
    whole, blocks = 0, {}
    for name in names:
        n = 1
        for d in plan.dims_of(name):
            n *= (width if d == plan.value_dim else rows if d in plan.packed_names()
                  else block_size(sizes[d]))
        if plan.row_dim(name):
            blocks[plan.row_dim(name)] = blocks.get(plan.row_dim(name), 0) + n
        else:
            whole += n
    return whole, blocks


