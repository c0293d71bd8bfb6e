"""Launching the generated backward kernels (hladsl.codegen.triton_bwd): the
Triton counterpart of ``backward_torch.backward_torch`` (same calling
convention, the layouts of ``triton_forward.forward_triton``)."""
from __future__ import annotations

import torch
import triton.runtime.errors

from hladsl.codegen.triton_bwd import backward_kernels
from hladsl.codegen.triton_gen import constexprs
from hladsl.runtime import autotune, binding, launch
from hladsl.runtime.triton_forward import (_packed_tables, _state_buffers, _token_args, row_tile_tables, tile_args,
                                           kernel_gates, token_layout, walk_args, per_chunk_alloc, plan_state_pass,
                                           run_state_pass, group_lam, group_phases, ONE_LEVEL)
from hladsl.ir.chunk import ChunkProgram
from hladsl.runtime.backward_torch import check_backward_args


@autotune.tunes_schedule(lambda a: backward_kernels(a["program"])[0].__name__, ("fused", "two_pass", "scan", "staged"))
def backward_triton(program: ChunkProgram, tiles: dict[str, torch.Tensor], lam: torch.Tensor | None,
                    init_states: dict[str, torch.Tensor], grad_o: torch.Tensor,
                    grad_final: dict[str, torch.Tensor] | None, eps: float,
                    precision: str | None = None, num_warps: int = 4, reverse_block: int | None = None,
                    schedule: str = "auto", targets_per_program: int | None = None,
                    grad_dtype: torch.dtype = torch.float32, seq_chunks: torch.Tensor | None = None,
                    grad_scales: dict[str, float] | None = None,
                    scales: dict[str, float] | None = None, reverse_only: bool = False,
                    kept: "KeptStates | None" = None):
    """tiles: input name -> [N, H, nC, C, dim] (fp32/bf16/fp16, may be strided views);
    lam: [N, H, nC, C] in-chunk cumulative log gates (None iff ungated); init_states
    and grad_final: summary -> [N, H, *program.state_shape] (init_states None: zeros; a
    missing or None grad_final entry is zero; the kernels make zeros themselves); grad_o: [N, H, nC, C, dv] (any float dtype and strides, unit
    feature stride). Returns (d_tiles {input: [N, H, nC, C, dim] in ``grad_dtype``, tile views
    of contiguous [N, nC*C, H, dim] tensors}, d_lam [N, H, nC, C] fp32 or None, d_init
    {summary: [N, H, *shape] fp32}: with init_states None the reverse scan may store its d-states
    in the state-dot dtype (``launch.d_states_dtype``: no d initial state wanted), which d_init
    then sums too coarsely to use -- pass zeros for an accurate one). d_lam is the gradient w.r.t. lam (dg: its reverse
    cumulative sum within each chunk). precision / num_warps as for forward_triton;
    reverse_block: the value-dim block of one reverse-pass program (walking or scan) where
    the program splits it (default: small enough to fill the GPU). schedule: "two_pass" (reverse
    pass writing per-chunk d-states, then a gradient kernel parallel over chunks),
    "fused" (one kernel per (sequence, head) walking the chunks backwards; programs
    without packed states), "scan" (the chunk-start states from the chunk-parallel state
    pass, and the reverse pass chunk-parallel too where the program has one:
    ``launch.use_reverse_scan``), "staged" (the complete chunk scan in two stages and the
    reverse pass in two stages, where the program's scan splits so, else "scan":
    ``launch.backward_module``) or "auto" (fused on a GPU when there are enough (sequence,
    head) pairs to fill it, else its state pass as forward_triton decides, and the two-stage
    module where the one-stage one's reverse pass would walk).
    targets_per_program:
    how many gradient target groups (token inputs, then Λ) one gradient program
    computes (default: launch.grad_target_sets' rule, one). seq_chunks: varlen, as for
    forward_triton (init_states, grad_final and d_init then have one row per sequence).
    grad_scales: input -> the factor it was scaled by (the query scale), by the caller before
    tiling or by the kernels as they load it (``scales``, as for forward_triton): its
    gradient is multiplied by it inside the kernel, before the store in ``grad_dtype`` (an
    fp16 d(scaled q) = dq / scale can overflow where dq does not). reverse_only: stop after
    the reverse pass and return (None, None, d_init) -- the initial state's gradient without
    the gradient kernels (context parallelism's first backward step, runtime.context_parallel).
    kept: what ``keep_state_pass`` kept of the forward's run of step (a) below (the chunk-start
    states and the deltas the reverse scan reads), used where it fits this call's plan."""
    if schedule == "fused" and not backward_kernels(program)[1]["fused"]:
        raise autotune.Unavailable(f"{program.algebra.name} has no fused backward (packed states)")
    first = tiles[next(iter(program.algebra.inputs))]
    module, ctx, stage_complete = _module(program, schedule, first)
    fwd = ctx["forward"]
    n_seq, heads, n_chunks = first.shape[:3]
    device = first.device
    plan = _plan(program, ctx, stage_complete, first, precision, num_warps, reverse_block, schedule,
                 targets_per_program, seq_chunks, reverse_only, init_states is not None)
    walk, common, packed = plan.walk, plan.common, plan.packed
    check_backward_args(program, tiles, lam, init_states, grad_o, grad_final, plan.walkers,
                        zero_init_ok=True)
    if lam is not None:
        lam = kernel_gates(lam, device)
    tokens = _token_args(ctx["inputs"], tiles, lam, program.gated, scales)

    # (a) the chunk-start states, by the forward state-pass kernel (or as the forward kept them)
    state_args, _final = _state_buffers(fwd, program, init_states, (plan.walkers, heads), device)
    if kept is not None and kept.fits(plan, first):
        starts, deltas = kept.starts, kept.deltas
    else:
        starts, deltas = _state_pass(module, fwd, plan, program, tiles, lam, state_args, scales, seq_chunks)

    # the cotangents of num (and den)
    if grad_o.stride(-1) != 1:
        grad_o = grad_o.contiguous()
    cot = tile_args("dnum", grad_o)    # read in place, in its dtype
    if program.normalizer:
        dnum = binding.fresh(torch.empty(grad_o.shape, device=device, dtype=torch.float32))
        dden = binding.fresh(dnum.new_empty(grad_o.shape[:-1]))
        args = {**_token_args(fwd["output_inputs"], tiles, lam, program.gated, scales), **packed,
                **{f"starts_{n}": x for n, x in starts.items()},
                **tile_args("do", grad_o), **tile_args("dnum", dnum), "dden_ptr": dden, "eps": float(eps)}
        launch.launch(module.cotangent_kernel, (n_chunks, n_seq * heads),
                      {**args, **plan.row_tables, **common, **plan.cotangent_dot}, True)
        cot = {**tile_args("dnum", dnum), "dden_ptr": dden}

    if plan.fused:
        del deltas
        return _fused(module, ctx, plan, tokens, state_args, starts, cot, grad_final, first, lam,
                      grad_dtype, grad_scales)

    # (b) reverse state pass: d(end state) of every chunk, d initial state
    reversed_ = None
    if plan.reverse_scan:
        try:
            reversed_ = _reverse_scan(module, ctx, plan, {**tokens, **packed, **cot}, starts, deltas,
                                      state_args, grad_final, seq_chunks, lam, (n_seq, heads, n_chunks))
        except triton.runtime.errors.OutOfResources:
            # rdelta_kernel holds every d-state whole (hla2 at d = 128: 262144 B of shared
            # memory on sm_90, the H100 has 232448), as rstage_kernel does its part's, and
            # neither has a value split to narrow: the walking pass, which narrows, runs
            # instead (the plan keeps it)
            plan.reverse_scan = False
            launch.fit_changed()
    if reversed_ is not None:
        d_init, dends, blocks = reversed_
    else:
        del deltas
        fixed = {**tokens, **packed, **cot, **walk, **common,
                 **{f"starts_{s['name']}": starts[s["name"]] for s in ctx["reverse_reads"]}}
        d_init, dends, blocks = _reverse_pass(module, ctx, plan, fixed, state_args, grad_final, seq_chunks,
                                              (n_seq, heads, n_chunks))
    if reverse_only:
        return None, None, d_init

    # (c) token and Λ gradients, parallel over chunks
    d_tiles, d_lam = _grad_buffers(ctx, first, common, lam, grad_dtype)
    args = {**tokens, **packed, **cot,
            **{f"starts_{s['name']}": starts[s["name"]] for s in ctx["grad_reads"]},
            **{f"dends_{s['name']}": dends[s["name"]] for s in ctx["grad_cts"]},
            **({"n_rblocks": blocks} if ctx["reverse_partial"] else {})}
    loop, dot = plan.grad_loop, plan.grad_dot
    everything = _grad_args(d_tiles, d_lam, grad_scales)
    lam_order = _LamOrder()
    for targets, held, candidates in plan.grad_launches:
        base = {**args, **everything, **common, **loop, **dot, "TARGETS": targets, **plan.grad_warps}
        grid = (n_chunks, n_seq * heads)
        lam_first = lam_order.next(held)   # a later part adds to what part 0 stored
        sums: dict = {}

        def in_parts(parts: int) -> dict:
            """The launch's arguments in ``parts`` parts: one part writes its targets; several
            sum in an fp32 buffer (part p > 0 adds to what the parts before it stored), the last
            writing the target in its dtype (dΛ: fp32, in place) -- one set of buffers for the
            trials and the launch, whatever the part count."""
            if parts == 1:
                return base
            if not sums:
                for g in held:
                    x = d_tiles.get(g["input"])
                    if x is not None and x.dtype != torch.float32:
                        sums.update(tile_args(f"dsum_{g['input']}", token_layout(
                            *x.shape[:4], x.shape[4], torch.float32, device)))
            return {**base, **sums}
        # whole, or in runs, whichever fewest parts' kernels do not spill (launch.grad_parts)
        parts = launch.grad_fitting_parts(module.grad_kernel, grid, in_parts, candidates, lam_first)
        args_in_parts = in_parts(parts)
        for part in range(parts):
            launch.launch(module.grad_kernel, grid, {**args_in_parts, "PART": part, "PARTS": parts,
                                                     "LAM": launch.part_lam(part, lam_first)}, True)
    return d_tiles, d_lam, d_init


class _LamOrder:
    """The LAM constexpr of each gradient launch, in launch order: 0 where its groups add
    nothing to dΛ, 1 for the first that does (it stores dΛ whole: the buffer is uninitialised),
    2 for every later one (it adds to what the earlier launches stored)."""

    def __init__(self):
        self.stored = False

    def next(self, held) -> int:
        if not any(g["dlam"] or g["lam_end"] for g in held):
            return 0
        first, self.stored = not self.stored, True
        return 1 if first else 2


def _module(program, schedule: str, first) -> tuple:
    """(module, context, stage_complete): the backward's kernels in the variant
    ``launch.backward_module`` takes for this schedule and shape."""
    module, ctx = backward_kernels(program)
    if launch.backward_module(schedule, ctx, first):
        return (*backward_kernels(program, stage_complete=True), True)
    return module, ctx, False


def _plan(program, ctx, stage_complete, first, precision, num_warps, reverse_block, schedule,
          targets_per_program, seq_chunks, reverse_only, has_init: bool) -> "_BackwardPlan":
    """``has_init``: the call has an initial state. Its gradient, and context parallelism's
    ``reverse_only`` step's, is summed from the d-states (``launch.d_states_dtype``'s sharp)."""
    key = (id(program), stage_complete, tuple(first.shape[:4]), first.dtype, first.device, precision,
           num_warps, reverse_block, schedule, targets_per_program, reverse_only, has_init)
    return launch.remembered(_PLANS, key, lambda: _BackwardPlan(
        program, ctx, first, precision, num_warps, reverse_block, schedule, targets_per_program,
        seq_chunks, fused_ok=not reverse_only, stage_complete=stage_complete,
        forms_d_init=reverse_only or has_init),
        cacheable=seq_chunks is None)


def _state_pass(module, fwd, plan, program, tiles, lam, state_args: dict, scales, seq_chunks) -> tuple[dict, dict]:
    """Step (a): (chunk-start states {state: [N, H, nC, *shape] fp32, or in SDOT for the states
    of ``plan.starts_sdot``}, the state pass's
    per-chunk deltas (``run_state_pass``)); ``state_args`` gains the starts."""
    first = tiles[next(iter(program.algebra.inputs))]
    starts = {}
    for s in fwd["states"]:
        if s["read"]:
            init = state_args[f"init_{s['name']}"]
            as_sdot = s["name"] in plan.starts_sdot   # (in SDOT where every reader rounds them so)
            starts[s["name"]] = per_chunk_alloc(init, seq_chunks)(tuple(first.shape[:3]) + tuple(init.shape[2:]),
                                                                dtype=launch.starts_dtype(as_sdot, plan.stored_sdot))
            state_args[f"starts_{s['name']}"] = starts[s["name"]]
    deltas = run_state_pass(module, fwd, plan, state_args,
                            {**_token_args(fwd["state_inputs"], tiles, lam, program.gated, scales), **plan.packed},
                            lam, True)
    return starts, deltas


class KeptStates:
    """What a forward under autograd kept of the backward's step (a), run once instead of
    twice (``keep_state_pass``): the chunk-start states and the deltas the backward's
    reverse scan reads (the others are dropped), for one plan's state pass on tiles of
    ``lead`` (their [N, H, nC, C], dtype, device)."""

    def __init__(self, plan, lead: tuple, starts: dict, deltas: dict):
        self.plan, self.lead, self.starts, self.deltas = plan, lead, starts, deltas

    def fits(self, plan, first) -> bool:
        """Made by ``plan``'s state pass (the same chunk-scan choice, scan groups, precision
        and warps: the deltas' layout and values) for tiles like ``first``."""
        return (self.lead == (tuple(first.shape[:4]), first.dtype, first.device)
                and (self.plan is plan or _state_pass_form(self.plan) == _state_pass_form(plan)))

    def split(self) -> tuple[list, "KeptStates"]:
        """(its tensors, itself without them): autograd saves the tensors (freed after the
        backward, as ``save_for_backward``'s are) and ``joined`` puts them back."""
        tensors = list(self.starts.values()) + list(self.deltas.values())
        return tensors, KeptStates(self.plan, self.lead, dict.fromkeys(self.starts), dict.fromkeys(self.deltas))

    def joined(self, tensors) -> "KeptStates":
        n = len(self.starts)
        return KeptStates(self.plan, self.lead, dict(zip(self.starts, tensors[:n])),
                          dict(zip(self.deltas, tensors[n:])))


def _state_pass_form(plan) -> tuple:
    """What decides what a backward plan reads of its state pass, and their values."""
    return (plan.stage_complete, plan.chunk_scan, plan.scan_groups, plan.fused,
            getattr(plan, "reverse_scan", False), plan.state_common["PREC"], plan.common["num_warps"])


def keep_state_pass(program: ChunkProgram, tiles: dict[str, torch.Tensor], lam: torch.Tensor | None,
                    init_states: dict[str, torch.Tensor] | None, schedule: str = "auto",
                    seq_chunks: torch.Tensor | None = None, scales: dict[str, float] | None = None,
                    precision: str | None = None, num_warps: int = 4) -> tuple[KeptStates, dict, dict]:
    """The backward's step (a), run by a forward under autograd (``launch.KEEP_STATE_PASS``;
    arguments as ``backward_triton``'s, for the backward's default reverse block and target
    sets): (what the backward
    reads of it, the chunk-start states of the states the output reads, the final states
    {summary: [N, H, *shape] fp32}). The forward's output kernel reads those starts, so the
    call's state pass runs once: at T = 64k it is a sixth of hla2's fwd + bwd."""
    first = tiles[next(iter(program.algebra.inputs))]
    module, ctx, stage_complete = _module(program, schedule, first)
    fwd = ctx["forward"]
    plan = _plan(program, ctx, stage_complete, first, precision, num_warps, None, schedule, None, seq_chunks,
                 False, init_states is not None)
    if lam is not None:
        lam = kernel_gates(lam, first.device)
    state_args, final = _state_buffers(fwd, program, init_states, (plan.walkers, first.shape[1]), first.device)
    starts, deltas = _state_pass(module, fwd, plan, program, tiles, lam, state_args, scales, seq_chunks)
    read = set()
    if not plan.fused and plan.reverse_scan:   # the deltas its reverse scan reads, by itself or by group
        read = {f"deltas_{s['name']}" for s in ctx["reverse_scan"]["deltas"]}
        read |= {f"group_{k}" for k in read}
    lead = (tuple(first.shape[:4]), first.dtype, first.device)
    return KeptStates(plan, lead, starts, {k: x for k, x in deltas.items() if k in read}), starts, final


def _reverse_pass(module, ctx, plan, fixed: dict, state_args: dict, grad_final, seq_chunks,
                  rows: tuple) -> tuple[dict, dict, int]:
    """The reverse state pass: (d initial state, d end state of every chunk, blocks of the
    value dim). A d-state the blocks hold partial sums of (``reverse_partial``) gets one
    slot per block: per chunk for the gradient kernel to sum, and its d initial state
    summed here. Where the kernel fits no launch fallback, the launch layer narrows the
    value blocks (``launch.launch_narrowing``) and the plan keeps that."""
    partial = set(ctx["reverse_partial"])
    d_init, dends = {}, {}
    has_dfinal = _has_dfinal(grad_final)

    def buffers(grid) -> dict:   # per attempt: the slots follow the grid's blocks
        blocks = _value_blocks(ctx, grid)
        rev = {"HAS_DFINAL": has_dfinal}
        for s in ctx["reverse_states"]:
            name = s["name"]
            init = state_args[f"init_{name}"]
            shape = tuple(init.shape[2:])
            slots = (blocks,) if name in partial else ()
            rev[f"dfinal_{name}"] = _dfinal(grad_final, name, init, has_dfinal)
            rev[f"dinit_{name}"] = d_init[name] = binding.fresh(init.new_empty(tuple(init.shape[:2]) + slots + shape))
            rev[f"dends_{name}"] = dends[name] = per_chunk_alloc(init, seq_chunks)(rows + slots + shape)
        return {**fixed, **rev}

    grid = launch.launch_narrowing(module.reverse_kernel, plan, "reverse_launch", buffers, True)
    for name in partial:
        d_init[name] = d_init[name].sum(2)
    return d_init, dends, _value_blocks(ctx, grid)


def _reverse_scan(module, ctx, plan, fixed: dict, starts: dict, deltas: dict, state_args: dict,
                  grad_final, seq_chunks, lam, rows: tuple) -> tuple[dict, dict, int]:
    """The chunk-parallel reverse pass (``triton_bwd._reverse_scan``): every chunk's own part
    of its d-states at once, then the scan over them, reading the forward's per-chunk deltas
    ``deltas`` (those it does not read lend their memory to the d-state parts); in two stages
    (``stage``: no forward delta read), then every chunk's increment of the upper d-states
    from the lower ones' chunk ends, and their scan. Returns what ``_reverse_pass`` returns,
    each d-state whole (one slot: the reverse pass's partial sums are its walking kernel's)."""
    rs = ctx["reverse_scan"]
    read = {f"deltas_{s['name']}" for s in rs["deltas"]}
    spare = [x for k, x in deltas.items() if k not in read and k.startswith("deltas_")]
    parts = _part_buffers(rs["written"], state_args, rows, spare, plan.d_states_dtype)
    launch.launch_narrowing(module.rdelta_kernel, plan, "rdelta_launch",
                            {**fixed, **{f"starts_{s['name']}": starts[s["name"]] for s in rs["reads"]},
                             **parts, **plan.common}, True)
    args, d_init, dends = _rscan_buffers(ctx, rs, parts, state_args, grad_final, seq_chunks, rows,
                                         plan.d_states_dtype)
    gate = {"lam_ptr": lam} if lam is not None else {}
    walking = {**plan.walk, **plan.common, **{f"starts_{s['name']}": starts[s["name"]] for s in rs["starts"]}}
    n_groups = plan.scan_groups if rs["groupable"] else 1
    if n_groups == 1:
        launch.launch_narrowing(module.rscan_kernel, plan, "rscan_launch",
                                {**args, **parts, **{k: deltas[k] for k in read}, **gate, **walking, **ONE_LEVEL,
                                 **_prefetch(rs), "group_len": rows[2]}, True)
        stage = rs["stage"]
        if stage:   # the upper d-states: each one's increment at every chunk, then their walk
            # (the first stage's parts no chunk-end cotangent was written over are free now)
            free = [x for x in parts.values() if all(x.data_ptr() != y.data_ptr() for y in dends.values())]
            parts = _part_buffers(stage["written"], state_args, rows, free, plan.d_states_dtype)
            inputs = {**fixed, **{f"starts_{s['name']}": starts[s["name"]] for s in stage["reads"]},
                      **{f"dends_{s['name']}": dends[s["name"]] for s in stage["cts"]}, **parts, **plan.common}
            for part in range(len(stage["delta_code"])):
                launch.launch_narrowing(module.rstage_kernel, plan, "rstage_launch", {**inputs, "PART": part}, True)
            args, upper_init, upper_ends = _rscan_buffers(ctx, stage, parts, state_args, grad_final, seq_chunks, rows,
                                                          plan.d_states_dtype)
            launch.launch_narrowing(module.rstage_scan_kernel, plan, "rstage_scan_launch",
                                    {**args, **parts, **gate, **plan.walk, **plan.common, **ONE_LEVEL,
                                     **_prefetch(stage), "group_len": rows[2]}, True)
            d_init.update(upper_init)
            dends.update(upper_ends)
        return d_init, dends, 1
    # two levels (launch.scan_groups): each group's own part of its d(start) from zero, the walk
    # over the groups (each one step at its forward delta) to each group's d(end), the groups again
    alone, over_groups, again = group_phases(n_groups, rows[2])
    own, ends = {}, {}
    for s in rs["states"]:
        init = state_args[f"init_{s['name']}"]
        own[s["name"]] = binding.fresh(init.new_empty(rows[:2] + (n_groups,) + tuple(init.shape[2:])))
        ends[s["name"]] = binding.fresh(torch.empty_like(own[s["name"]]))
    read_now = {k: deltas[k] for k in read}
    launch.launch_narrowing(module.rscan_kernel, plan, "group_rscan_launch",
                            {**args, "HAS_DFINAL": False, **{f"dinit_{n}": x for n, x in own.items()}, **parts,
                             **read_now, **gate, **walking, **alone}, True)
    launch.launch_narrowing(module.rscan_kernel, plan, "rscan_launch",
                            {**args, "IN_PLACE": False, **{f"dends_{n}": x for n, x in ends.items()},
                             **{f"rdeltas_{n}": own[n] for n in (s["name"] for s in rs["written"])},
                             **{k: deltas["group_" + k] for k in read},
                             **({"lam_ptr": group_lam(lam, n_groups)} if lam is not None else {}),
                             **walking, **over_groups}, True)
    launch.launch_narrowing(module.rscan_kernel, plan, "group_rscan_launch",
                            {**args, "HAS_DFINAL": True, **{f"dfinal_{n}": x for n, x in ends.items()}, **parts,
                             **read_now, **gate, **walking, **again}, True)
    return d_init, dends, 1


def _rscan_launch(rs: dict, walkers: int, program, common: dict, first, reverse_block, staged: bool) -> tuple:
    """A reverse scan kernel's (grid, block arguments, Tiling): blocks of its d-states' flat
    layouts where its walk is elementwise (``rs["flat"]``), else blocks of its split dims;
    in two stages each scan's blocks sized by its own d-states."""
    names = tuple(s["name"] for s in rs["states"])
    if rs["flat"]:
        return launch.flat_scan_blocks(walkers, program, names)
    return launch.split_blocks(walkers, rs["splits"], program, common, first, rs["scan_chained_dots"],
                               reverse_block, states=names if staged else None)


def _prefetch(rs: dict) -> dict:
    """A flat reverse scan's PREFETCH argument (``launch.SCAN_PREFETCH``, as the forward's scans)."""
    return {"PREFETCH": launch.SCAN_PREFETCH} if rs["flat"] else {}


def _part_buffers(written: list, state_args: dict, rows: tuple, spare: list, dtype: torch.dtype) -> dict:
    """A delta kernel's per-chunk d-state parts (``rdeltas_``) in ``dtype``, in a ``spare`` buffer
    of the same shape where one is left (an fp32 one holds bf16 parts in its first half)."""
    parts = {}
    for s in written:
        init = state_args[f"init_{s['name']}"]
        shape = rows + tuple(init.shape[2:])
        reuse = next((x for x in spare if tuple(x.shape) == shape and x.is_contiguous()
                      and x.element_size() % dtype.itemsize == 0), None)
        spare = [x for x in spare if x is not reuse]
        parts[f"rdeltas_{s['name']}"] = (binding.fresh(init.new_empty(shape, dtype=dtype)) if reuse is None else
                                         reuse.view(-1).view(dtype)[:reuse.numel()].view(shape))
    return parts


def _rscan_buffers(ctx, rs: dict, parts: dict, state_args: dict, grad_final, seq_chunks,
                   rows: tuple, dtype: torch.dtype) -> tuple[dict, dict, dict]:
    """(a reverse scan kernel's d-state arguments, its d initial states, its chunk-end
    d-states): the latter in the gradient kernel's layout (one slot for a partial-sum
    d-state) and in ``dtype``, written over their parts where ``launch.reverse_in_place`` allows."""
    partial = set(ctx["reverse_partial"])
    has_dfinal = _has_dfinal(grad_final)
    in_place = launch.reverse_in_place(rs["in_place"], seq_chunks)
    args, d_init, dends = {"HAS_DFINAL": has_dfinal, "IN_PLACE": bool(in_place)}, {}, {}
    for s in rs["states"]:
        name = s["name"]
        init = state_args[f"init_{name}"]
        slots = (1,) if name in partial else ()   # the gradient kernel's layout, one block
        args[f"dfinal_{name}"] = _dfinal(grad_final, name, init, has_dfinal)
        args[f"dinit_{name}"] = d_init[name] = binding.fresh(torch.empty_like(init))
        shape = rows + slots + tuple(init.shape[2:])
        if name in in_place:   # written over its part, chunk by chunk, after the part is read
            dends[name] = parts[f"rdeltas_{name}"].view(shape)
        else:
            dends[name] = per_chunk_alloc(init, seq_chunks)(shape, dtype=dtype)
        args[f"dends_{name}"] = dends[name]
    return args, d_init, dends


def _value_blocks(ctx, grid) -> int:
    """The reverse pass's blocks of the value dim holding partial sums (1: none)."""
    return grid[1 + ctx["reverse_splits"].index(ctx["o_dim"])] if ctx["reverse_partial"] else 1


def _has_dfinal(grad_final) -> bool:
    """Does any final state have a gradient? Without one the walking kernels start from
    zero d-states themselves (HAS_DFINAL False: no zero buffers to allocate and fill)."""
    return any(x is not None for x in (grad_final or {}).values())


def _dfinal(grad_final, name: str, init: torch.Tensor, has_dfinal: bool) -> torch.Tensor:
    """The dfinal_ argument of ``name``: its gradient (fp32, contiguous); zeros where another
    state has one; else ``init``, a placeholder the kernel does not read (HAS_DFINAL False)."""
    given = (grad_final or {}).get(name)
    if given is not None:
        return given.to(device=init.device, dtype=torch.float32).contiguous()
    return torch.zeros_like(init) if has_dfinal else init


def _grad_buffers(ctx, first, common, lam, dtype) -> tuple[dict, torch.Tensor | None]:
    n_seq, heads, n_chunks, chunk = first.shape[:4]
    d_tiles = {x["name"]: token_layout(n_seq, heads, n_chunks, chunk, common[f"D_{x['dim']}"], dtype,
                                       first.device) for x in ctx["inputs"]}
    return d_tiles, None if lam is None else binding.fresh(torch.empty_like(lam))


def _grad_args(d_tiles, d_lam, grad_scales=None, parted: bool = True) -> dict:
    """Every gradient buffer as a kernel argument (a launch writes only its targets'),
    with its input's scale, and as its own parts' sum (``dsum_``: read and written only by
    a gradient kernel in parts, whose launch passes an fp32 buffer there unless it is fp32;
    ``parted`` False: the fused kernel, which has none)."""
    args = {}
    for n, x in d_tiles.items():
        args.update(tile_args(f"dx_{n}", x), **(tile_args(f"dsum_{n}", x) if parted else {}))
        args[f"gscale_{n}"] = float((grad_scales or {}).get(n, 1.0))
    if d_lam is not None:
        args["dlam_ptr"] = d_lam
    return args


def _fused(module, ctx, plan, tokens, state_args, starts, cot, grad_final, first, lam, grad_dtype,
           grad_scales):
    n_seq, heads = first.shape[:2]
    args, d_init = {}, {}
    args["HAS_DFINAL"] = has_dfinal = _has_dfinal(grad_final)
    for s in ctx["reverse_states"]:
        name = s["name"]
        init = state_args[f"init_{name}"]
        args[f"dfinal_{name}"] = _dfinal(grad_final, name, init, has_dfinal)
        args[f"dinit_{name}"] = d_init[name] = binding.fresh(torch.empty_like(init))
    args.update({f"starts_{s['name']}": starts[s["name"]] for s in ctx["fused"]["reads"]})
    d_tiles, d_lam = _grad_buffers(ctx, first, plan.common, lam, grad_dtype)
    groups, lam_order = ctx["fused"]["groups"], _LamOrder()
    for targets in plan.fused_targets:
        held = [g for n, g in enumerate(groups) if targets >> n & 1]
        launch.launch(module.fused_bwd_kernel, (n_seq * heads,),
                      {**tokens, **plan.packed, **args, **cot, **_grad_args(d_tiles, d_lam, grad_scales, parted=False),
                       **plan.common, **plan.fused_dot, "TARGETS": targets, "LAM": lam_order.next(held)}, True)
    return d_tiles, d_lam, d_init


_PLANS = launch.plan_cache()    # launch plans of recent shape classes (launch.remembered)


class _BackwardPlan:
    """The launch choices of one backward shape class, made once: shared constexprs and
    options, packed tables, walk arguments, the schedule, the state and reverse passes'
    grids / blocks / tilings, the dot dtypes of each kernel, and the gradient kernel's
    launches (target sets, the groups each holds, the part counts each may run in:
    ``launch.grad_parts``; the launcher picks one, ``launch.grad_fitting_parts``)."""

    def __init__(self, program, ctx, first, precision, num_warps, reverse_block, schedule,
                 targets_per_program, seq_chunks, fused_ok: bool = True, stage_complete: bool = False,
                 forms_d_init: bool = True):
        self.program = program      # keeps id(program) in the plan's key from being reused
        self.stage_complete = stage_complete   # the module variant (launch.backward_module)
        fwd = ctx["forward"]
        n_seq, heads, n_chunks = first.shape[:3]
        device = first.device
        self.walk = walk_args(seq_chunks, n_seq, device)   # (a varlen plan is never reused)
        self.walkers = walkers = self.walk.pop("walkers")  # (sequence, head) pairs walked
        self.common = common = dict(
            H=heads, n_chunks=n_chunks, DOT=launch.dot_dtype(first.dtype, device),
            SDOT=launch.state_dot_dtype(first.dtype, device, ctx["exact_state_reads"]),
            PREC=precision or launch.exact_precision(device), num_warps=num_warps,
            **constexprs(program))
        features = launch.feature_blocks(program, common)
        # a d initial state is formed, or the quotient's cotangents cancel: keep what they sum sharp
        # (the starts' sets: triton_bwd._starts_sdot; stored in stored_sdot)
        sharp = forms_d_init or ctx["cancelling_d_states"]
        self.starts_sdot = ctx["starts_sdot_rounded" if launch.rounded_starts(sharp) else "starts_sdot"]
        self.stored_sdot = launch.stored_sdot(first, common, features)
        self.d_states_dtype = launch.d_states_dtype(self.stored_sdot, sharp)
        self.packed = _packed_tables(program, device)
        self.row_tables, self.row_tile_counts = row_tile_tables(program, fwd, common, device)
        plan_state_pass(self, program, fwd, common, first, schedule, "backward", precision=precision)
        self.cotangent_dot = launch.dot_override(first, fwd["output_chained_dots"], launch.packed_blocks(program, common), features)
        # (not for the reverse pass alone: the fused kernel computes every gradient too)
        self.fused = fused_ok and seq_chunks is None and launch.use_fused(schedule, bool(ctx["fused"]), device,
                                                                          n_seq * heads, n_chunks)
        if self.fused:
            self.scan_groups = 1   # no reverse scan reads the groups' deltas
            self.fused_dot = launch.dot_override(first, ctx["fused"]["chained_dots"], {}, features)
            self.fused_targets = launch.grad_target_sets(len(ctx["fused"]["groups"]), targets_per_program)
            return
        rs = ctx["reverse_scan"]
        self.reverse_scan = launch.use_reverse_scan(schedule, self.chunk_scan, rs)
        if not (self.reverse_scan and rs["groupable"]):
            self.scan_groups = 1   # the recomputed scan groups only for a reverse scan that reads the groups' deltas
        if self.reverse_scan:
            self.rdelta_launch = launch.split_blocks((n_chunks, n_seq * heads), [], program, common, first,
                                                     rs["delta_chained_dots"])
            stage = rs["stage"]
            self.rscan_launch = _rscan_launch(rs, walkers * heads, program, common, first, reverse_block,
                                              bool(stage))
            if stage:   # the second stage (triton_bwd._reverse_scan): increments as the forward's
                self.rstage_launch = launch.split_blocks((n_chunks, n_seq * heads), [], program, common, first,
                                                         stage["delta_chained_dots"],
                                                         warps=launch.stage_warps(launch.feature_blocks(program, common)))
                self.rstage_scan_launch = _rscan_launch(stage, walkers * heads, program, common, first,
                                                        reverse_block, True)
            if self.scan_groups > 1 and rs["groupable"]:   # the groups' walks of the two-level scan
                self.group_rscan_launch = launch.split_blocks(walkers * heads * self.scan_groups, rs["splits"],
                                                              program, common, first, rs["scan_chained_dots"],
                                                              reverse_block)
        self.reverse_launch = launch.split_blocks(walkers * heads, ctx["reverse_splits"], program, common,
                                                  first, ctx["reverse_chained_dots"], reverse_block,
                                                  fixed_blocks=bool(ctx["reverse_partial"]))
        self.grad_loop = {}
        if ctx["grad_loop_dim"]:
            pd = f"B_{ctx['grad_loop_dim']}"
            self.grad_loop[pd] = launch.grad_loop_tile(first.shape[3], common[pd])
        # the narrow loop tile matters to the bf16 guard only where a DOT-dtype dot runs on it
        self.grad_dot = launch.dot_override(first, ctx["grad_chained_dots"],
                                            self.grad_loop if ctx["grad_loop_dot"] else {}, features)
        self.grad_warps = launch.grad_warps(features, launch.tf32_tiles(common))
        groups = ctx["grad_groups"]
        self.grad_launches = []   # (TARGETS, the groups it holds, the part counts it may run in)
        for targets in launch.grad_target_sets(len(groups), targets_per_program):
            held = [g for n, g in enumerate(groups) if targets >> n & 1]
            self.grad_launches.append((targets, held, launch.grad_parts(
                max(g["networks"] for g in held), sum(g["matmuls"] for g in held))))
