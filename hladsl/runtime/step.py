"""The decode step: ``run_step`` applies the derived serial update
X_t = X_{t-1} ⊕ token_t to T >= 1 tokens, updating the caller's state tensors
in place, and returns the outputs.

Both backends run the same plan (``codegen.step_gen.step_plan``): row states
(power attention's U) stay on their packed rows, other symmetric states are
held whole. "torch" evaluates each term with batched einsums over (batch, head),
looping over the T tokens; "triton" launches the one generated kernel
(``codegen.step_gen``), which allocates nothing but o and never syncs with the
host, so a decode step can be captured in a CUDA graph. Where some states lack
the value dim (HLA2's S) and the launch rule splits the value dim, it is two
launches on one stream: step_kernel over value blocks (reading, never writing,
those states), then state_kernel updating them in place (``launch.step_value_block``).
"""
from __future__ import annotations

import torch

from hladsl.codegen.step_gen import StepPlan, step_plan
from hladsl.ir.algebra import Algebra
from hladsl.ir.contract import Plan
from hladsl.ir.evaluate import letters_for
from hladsl.ir.operands import Kind, exhaustive
from hladsl.runtime import launch
from hladsl.runtime.packing import combos, multiplicity, pack, packed_shape, unpack

BACKENDS = ("torch", "triton")


def run_step(algebra: Algebra, tokens: dict, g, state: dict, state_indices=None,
             backend: str = "torch", block_v: int | None = None, num_warps: int | None = None,
             packed_rows: int | None = None) -> torch.Tensor:
    """tokens: {input: [B, T, H, dim]} (scaled, any float dtype); g: [B, T, H] log
    gates or None; state: {summary: [N, H, *storage shape]} fp32/fp64, updated in
    place; state_indices: optional [B] ints, the state row of each batch row.
    Returns o [B, T, H, dv] in the state dtype. block_v / num_warps / packed_rows
    override the Triton launch (value-dim block, warps, rows per packed block)."""
    if backend not in BACKENDS:
        raise ValueError(f"backend must be one of {BACKENDS}, got {backend!r}")
    sizes, dtype = _check(algebra, tokens, g, state, state_indices)
    plan = step_plan(algebra, sizes)
    if backend == "triton":
        return _run_triton(plan, tokens, g, state, state_indices, dtype, block_v, num_warps,
                           packed_rows)
    return _run_torch(plan, tokens, g, state, state_indices, dtype)


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
    if T < 1:
        raise ValueError("tokens must hold at least one token (T >= 1)")
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
    if state_indices is None:
        if n != B:
            raise ValueError(f"state has {n} rows but the batch {B}: pass state_indices")
    elif (not isinstance(state_indices, torch.Tensor) or tuple(state_indices.shape) != (B,)
          or state_indices.dtype not in (torch.int32, torch.int64)
          or state_indices.device != first.device):
        raise ValueError(f"state_indices must be an int32/int64 tensor [B] = [{B}] on {first.device}")
    return sizes, dtypes.pop()


# -- torch --------------------------------------------------------------------------------------

def _run_torch(plan: StepPlan, tokens, g, state, state_indices, dtype):
    alg = plan.algebra
    sizes = dict(plan.sizes)
    held = {}
    for s in alg.streaming:
        x = state[s.name] if state_indices is None else state[s.name].index_select(0, state_indices.long())
        held[s.name] = x.to(dtype) if plan.row_dim(s.name) else unpack(s, x.to(dtype), sizes)
    T = next(iter(tokens.values())).shape[1]
    outs = []
    for t in range(T):
        tok = {name: x[:, t].to(dtype) for name, x in tokens.items()}       # [B, H, dim]
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

def _run_triton(plan, tokens, g, state, state_indices, dtype, block_v, num_warps, packed_rows):
    import triton

    from hladsl.codegen.step_gen import step_kernel
    from hladsl.codegen.triton_gen import block_size
    module, ctx = step_kernel(plan.algebra, plan.sizes, g is not None)
    first = next(iter(tokens.values()))
    B, T, H, _ = first.shape
    dv = dict(plan.sizes)[plan.value_dim]
    o = torch.empty((B, T, H, dv), device=first.device, dtype=dtype)
    args, rows = _kernel_args(plan, ctx, tokens, g, state, state_indices, o, packed_rows)
    full = block_size(dv)
    if block_v is None:
        width = launch.step_value_block(dv, ctx["split"], ctx["phased"])
    elif not (ctx["split"] or ctx["phased"]) and block_v < full:
        raise ValueError(f"{plan.algebra.name}'s step cannot split {plan.value_dim} (block_v)")
    else:
        width = min(block_size(block_v), full)
    args[f"B_{plan.value_dim}"] = width
    # phase split: more than one value block while some states lack the value dim
    # (step_kernel leaves those to state_kernel, launched after it on the same stream)
    phased = ctx["phased"] and width < full
    if ctx["phased"]:
        args["STORE_FREE"] = not phased
    grid = (B * H * triton.cdiv(dv, width),)
    everything = [name for name, _ in plan.states]
    warps = num_warps or _warps(plan, width, rows, everything)
    free_warps = num_warps or _warps(plan, full, rows, ctx["free"])
    # kernels with packed dims sum outputs in a [T, value block] register tile:
    # longer inputs run as consecutive launches of launch.STEP_MAX_TOKENS (the state carries over)
    span = T if ctx["direct"] else launch.STEP_MAX_TOKENS
    for a in range(0, T, span):
        n = min(span, T - a)
        piece = dict(args, T=n, T_BLOCK=max(2, triton.next_power_of_2(n)), o_ptr=o[:, a:a + n])
        for name, x in tokens.items():
            piece[f"in_{name}_ptr"] = x[:, a:a + n]
        if g is not None:
            piece["g_ptr"] = g[:, a:a + n]
        module.step_kernel[grid](**piece, num_warps=warps)
        if phased:
            kernel = module.state_kernel
            kernel[(B * H,)](**{k: v for k, v in piece.items() if k in kernel.arg_names},
                             num_warps=free_warps)
    return o


def _kernel_args(plan, ctx, tokens, g, state, state_indices, o, packed_rows):
    """The kernel's arguments but T, T_BLOCK and the value block; the rows of a
    packed block. Tensors go in as they are (strides passed): nothing is copied."""
    import triton.language as tl

    from hladsl.codegen.step_gen import PACKED_ROWS
    from hladsl.codegen.triton_gen import block_size
    sizes = dict(plan.sizes)
    args = {}
    for name, x in tokens.items():
        args[f"in_{name}_ptr"] = x
        args.update({f"str_{name}_{axis}": s for axis, s in zip("bthf", x.stride())})
    if g is not None:
        args["g_ptr"] = g
        args.update({f"str_g_{axis}": s for axis, s in zip("bth", g.stride())})
    for s in ctx["states"]:
        x = state[s["name"]]
        args[f"st_{s['name']}_ptr"] = x
        axes = ["n", "h"] + list(range(s["axes"]))
        args.update({f"str_{s['name']}_{axis}": st for axis, st in zip(axes, x.stride())})
    rows = 0
    for pd in plan.packed:
        idx, mult = _tables(sizes[pd.base], pd.power, o.device)
        rows = packed_rows or min(PACKED_ROWS, block_size(pd.size))
        args.update({f"pk_{pd.name}_idx": idx, f"pk_{pd.name}_mult": mult,
                     f"D_{pd.name}": pd.size, f"B_{pd.name}": rows})
    for d, n in sizes.items():
        args[f"D_{d}"], args[f"B_{d}"] = n, block_size(n)
    args.update({f"str_o_{axis}": s for axis, s in zip("bth", o.stride())})
    args.update(rows_ptr=state_indices if state_indices is not None else o,
                H=o.shape[2], INDEXED=state_indices is not None,
                ACC=tl.float64 if o.dtype == torch.float64 else tl.float32)
    if ctx["normalize"]:
        args["eps"] = float(plan.algebra.eps)
    return args, rows


def _warps(plan: StepPlan, width: int, rows: int, names) -> int:
    """Warps for the fp32 elements of the states ``names`` one program holds at a
    time (its whole states at this value block, or one block of ``rows`` packed
    rows; the rule is ``launch.step_warps``)."""
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
    return launch.step_warps(max([whole, *blocks.values()]))


_TABLES: dict = {}


def _tables(n: int, p: int, device):
    """Slots [p, D] int32 and multiplicities [D] fp32 of a packed dim, made once per device."""
    key = (n, p, str(device))
    if key not in _TABLES:
        _TABLES[key] = (combos(n, p).t().contiguous().to(device=device, dtype=torch.int32),
                        multiplicity(n, p).to(device=device, dtype=torch.float32))
    return _TABLES[key]
