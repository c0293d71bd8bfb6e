"""Running the generated forward chunk kernels: the Triton counterpart of
``chunk_torch.state_pass`` + ``chunk_torch.outputs`` (same calling convention).
Launch choices come from ``runtime.launch``."""
from __future__ import annotations

import torch
import triton
import triton.runtime.errors

from hladsl.codegen.triton_gen import constexprs, kernels
from hladsl.ir.chunk import ChunkProgram
from hladsl.runtime import autotune, binding, launch
from hladsl.runtime.packing import multiplicity_fp32, on_device, row_tiles, slots



def _packed_tables(program: ChunkProgram, device) -> dict:
    """pk_<dim>_idx [p, D] int32 (the slots of every packed multi-index) and
    pk_<dim>_mult [D] fp32 (its multiplicity) for each packed dim."""
    sizes = dict(program.sizes)
    out = {}
    for pd in program.packed:
        n, p = sizes[pd.base], pd.power
        out[f"pk_{pd.name}_idx"] = binding.kept(on_device(slots, device, n, p))
        out[f"pk_{pd.name}_mult"] = binding.kept(on_device(multiplicity_fp32, device, n, p))
    return out


def row_tile_tables(program: ChunkProgram, ctx: dict, common: dict, device) -> tuple[dict, dict]:
    """(kernel arguments, tile counts) for each packed dim the forward context ``ctx`` walks in
    row tiles (``triton_gen._Lowering.row_tiled``): rt_<dim> (``packing.row_tiles`` at the
    dim's tile B_<dim>, int32) and NT_<dim>, which its state, output and cotangent kernels
    take, and {dim: tiles} for the state pass's grid (``launch.split_blocks``)."""
    sizes = dict(program.sizes)
    args, counts = {}, {}
    for pd in ctx["packed"]:
        if pd["rows"]:
            name = pd["name"]
            table = binding.kept(on_device(row_tiles, device, sizes[pd["base"]], pd["power"], common[f"B_{name}"]))
            counts[name] = table.shape[0]
            args[f"rt_{name}"], args[f"NT_{name}"] = table, counts[name]
    return args, counts


def _token_args(inputs, tiles, lam, gated, scales: dict | None = None) -> dict:
    """Token tiles, their strides and their load scales (scl_<x>: what a query input is
    multiplied by as a kernel loads it; 1 where none is given)."""
    args = {}
    for x in inputs:
        name = x["name"]
        args[f"scl_{name}"] = float((scales or {}).get(name, 1.0))
        t = tiles[name]
        if t.stride(-1) != 1:
            t = t.contiguous()
        args[f"in_{name}_ptr"] = t
        for axis, s in zip("nhct", t.stride()[:4]):
            args[f"str_{name}_{axis}"] = s
    if gated:
        args["lam_ptr"] = lam
    return args


GATES = "lam"   # the derived tensor of a bound call (runtime.binding) that kernel_gates makes


def kernel_gates(lam: torch.Tensor, device) -> torch.Tensor:
    """Λ as the kernels read it (fp32, contiguous, on ``device``): a bound call's derived
    ``GATES``, recomputed per call from g."""
    return binding.derived(GATES, lam.to(device=device, dtype=torch.float32).contiguous())


def checked_tiles(program: ChunkProgram, tiles: dict, lam: torch.Tensor | None):
    """(the first token tile, Λ as the kernels read it or None) once ``tiles`` and ``lam`` are
    checked against ``program`` (its chunk; lam exactly where it is gated)."""
    if program.gated != (lam is not None):
        raise ValueError("lam must be given exactly when the chunk program is gated")
    first = next(iter(tiles.values()))
    if first.shape[3] != program.chunk:
        raise ValueError(f"tiles have chunk size {first.shape[3]}, the program {program.chunk}")
    return first, (None if lam is None else kernel_gates(lam, first.device))


def tile_args(name: str, t: torch.Tensor) -> dict:
    """``<name>_ptr`` and its strides over (N, H, nC, C): a tile argument the kernels
    read or write in place (feature stride 1)."""
    if t.stride(-1) != 1:
        raise ValueError(f"{name}: the feature dim must have stride 1, got strides {t.stride()}")
    return {f"{name}_ptr": t, **{f"sio_{name}_{a}": s for a, s in zip("nhct", t.stride()[:4])}}


def token_layout(n_seq: int, heads: int, n_chunks: int, chunk: int, dim: int, dtype, device):
    """An empty [N, H, nC, C, dim] tile view of a contiguous [N, nC*C, H, dim] tensor: the
    layout of the op's tokens, so kernels write outputs and gradients where they go."""
    x = binding.fresh(torch.empty((n_seq, n_chunks * chunk, heads, dim), dtype=dtype, device=device))
    return x.view(n_seq, n_chunks, chunk, heads, dim).permute(0, 3, 1, 2, 4)


@autotune.tunes_schedule(lambda a: kernels(a["program"])[0].__name__, ("fused", "two_pass", "scan", "staged"))
def forward_triton(program: ChunkProgram, tiles: dict[str, torch.Tensor], lam: torch.Tensor | None,
                   init_states: dict[str, torch.Tensor], eps: float, precision: str | None = None,
                   state_block: int | None = None, num_warps: int = 4,
                   num_stages: int | None = None, packed_block: int | None = None,
                   state_options: dict | None = None, output_options: dict | None = None,
                   schedule: str = "auto", out_dtype: torch.dtype = torch.float32,
                   seq_chunks: torch.Tensor | None = None, scales: dict[str, float] | None = None,
                   states_only: bool = False, given: tuple[dict, dict] | None = None):
    """tiles: input name -> [N, H, nC, C, dim] (fp32/bf16/fp16; may be a strided view);
    lam: [N, H, nC, C] in-chunk cumulative log gates (None iff the program is ungated);
    init_states: summary -> [N, H, *shape] as the program holds it (program.state_shape), or None
    (zeros, made by the kernels). precision: how fp32 tiles are
    multiplied (tl.dot input_precision: "ieee" exact but slow to compile and run,
    "tf32x3" / "bf16x3" about fp32-accurate on tensor cores, "tf32" fastest; None:
    ``launch.exact_precision``). state_block: the
    width of the blocks of every non-packed dim a state-pass program splits (the value dim;
    a second one where the program allows, linear's key dim; default: ``launch.state_blocks``). packed_block: the tile
    of a packed symmetric dim (default triton_gen.PACKED_TILE). state_options /
    output_options: launch arguments overriding the defaults of one kernel
    (e.g. {"DOT": tl.float32, "num_stages": 1}). schedule: "scan" (the chunk-parallel
    state pass, ``launch.use_chunk_scan``, then the outputs), "staged" (the same in two
    stages, ``launch.forward_module``), "two_pass" (state pass,
    then outputs parallel over chunks), "fused" (one kernel, no chunk-start states
    in HBM; needs a program without packed states) or "auto" (on a GPU, fused when
    there are enough (sequence, head) pairs to fill it without chunk parallelism, else
    the scan where ``launch.use_chunk_scan`` takes it, else two-pass). Returns (o [N, H, nC, C, dv]
    in ``out_dtype``, a tile view of a contiguous [N, nC*C, H, dv] tensor, {summary: final state
    [N, H, *shape] fp32}). seq_chunks (varlen, int32 [S + 1]): the tiles hold S sequences
    in one row (N = 1), sequence n in chunks seq_chunks[n] .. seq_chunks[n+1] - 1; its
    initial and final states are row n of [S, H, *shape]; never the fused schedule. scales:
    query input -> the call's scale, applied by the kernels as they load its tiles (bf16 /
    fp16: the bits of torch's x * scale, without that extra pass over the tokens).
    states_only: the final states alone, no output kernel (o is None; context parallelism's
    segment pass). given: (chunk-start states {state: [N, H, nC, *shape]}, final states) the
    caller's state pass computed (the backward's, ``triton_backward.keep_state_pass``): only
    the output kernel runs. Without ``given``, the plan may take the module whose complete chunk
    scan runs in two stages (schedule "staged", or "auto" by ``launch.forward_module``)."""
    module, ctx = kernels(program)
    first, lam = checked_tiles(program, tiles, lam)
    n_seq, heads, n_chunks, chunk = first.shape[:4]
    device = first.device
    if schedule == "fused" and not ctx["fused"]:
        raise autotune.Unavailable(f"{program.algebra.name} has no fused schedule (packed states)")
    key = (id(program), tuple(first.shape[:4]), first.dtype, device, precision, state_block, num_warps,
           num_stages, packed_block, schedule, states_only, given is None)
    plan = launch.remembered(_PLANS, key, lambda: _ForwardPlan(
        program, ctx, first, precision, state_block, num_warps, num_stages, packed_block, schedule,
        seq_chunks, fused_ok=not states_only, may_stage=given is None),
        cacheable=seq_chunks is None and not (state_options or output_options))
    if plan.stage_complete:   # (the plan's choice: a plan is made for one module variant)
        module, ctx = kernels(program, stage_complete=True)
    common = plan.common
    if given is not None:
        return _given_starts_output(module, ctx, plan, program, tiles, lam, given, eps, out_dtype, scales,
                                    output_options, num_stages is None)
    if plan.fused:
        try:
            return _fused(module, ctx, plan, tiles, lam, init_states, eps, num_stages is None,
                          state_options, out_dtype, scales)
        except triton.runtime.errors.OutOfResources:
            if schedule == "fused":
                raise   # auto: all states in one kernel may not fit (hla2 at d = 128): two-pass
            plan.fused = False

    state_args, final = _state_buffers(ctx, program, init_states, (plan.walkers, heads), device)
    out_args = {}
    sdot = {**common, **plan.output_launch, **(output_options or {})}["SDOT"]
    # the final states alone: a one-level scan writes no chunk starts (the walk always does; a
    # two-stage scan's first stage does, for its second stage's increments)
    store_chunks = not (states_only and plan.chunk_scan and plan.scan_groups == 1)
    staged = plan.chunk_scan and ctx["chunk_scan"]["stage"]
    first_stage = set(_names(ctx["chunk_scan"]["states"])) if staged else set()
    # the one-level scan may store the output's derived carries instead of the states read only
    # through them (triton_gen._derived_starts: HLA2's W0 = S C - G instead of C and G)
    derived = plan.derived_starts and store_chunks and not states_only
    # (a second stage that walks the derived carries never stores the states they drop; the
    # derived kernel reads the starts of every state the derived carries read, as stored: none
    # of them in SDOT, as the stage kernel's reads and their products are fp32-accurate)
    by_kernel = bool(plan.chunk_scan and ctx["chunk_scan"]["derived_kernel"])
    derived_only = set(ctx["chunk_scan"]["derived_only"]) \
        if (derived and not by_kernel) or (staged and staged["derived"]) else set()
    sdot_beside = set(ctx["chunk_scan"]["sdot_beside_derived"]) if derived and not by_kernel else set()
    for s in ctx["states"]:
        if s["read"]:
            init = state_args[f"init_{s['name']}"]
            as_sdot = s["starts_sdot"] or s["name"] in sdot_beside
            starts = per_chunk_alloc(init, seq_chunks)((n_seq, heads, n_chunks) + tuple(init.shape[2:]),
                                                      dtype=launch.starts_dtype(as_sdot, sdot)) \
                if (store_chunks or s["name"] in first_stage) and s["name"] not in derived_only \
                else final[s["name"]]   # (never written)
            state_args[f"starts_{s['name']}"] = out_args[f"starts_{s['name']}"] = starts
    like = next(iter(final.values()))
    derived_args = derived_start_args(ctx, like, per_chunk_alloc(like, seq_chunks) if derived else None,
                                      (n_seq, heads, n_chunks), sdot)
    if derived_args:   # the scan's and the output kernel's parameters
        out_args.update(derived_args, DERIVED_STARTS=derived)
        derived_args["STORE_DERIVED"] = derived
    tokens = {**_token_args(ctx["state_inputs"], tiles, lam, program.gated, scales), **plan.packed}
    run_state_pass(module, ctx, plan, state_args, tokens, lam, num_stages is None, state_options,
                   store_chunks=store_chunks, derived_args=derived_args)
    if states_only:
        return None, final
    if derived and by_kernel:
        _run_derived_kernel(module, ctx, plan, state_args, {k: v for k, v in derived_args.items() if k.startswith("dstart_")},
                            num_stages is None, state_options)

    return _output(module, ctx, plan, program, tiles, lam, out_args, eps, out_dtype, scales, output_options,
                   num_stages is None), final


def _output(module, ctx, plan, program, tiles, lam, starts_args: dict, eps, out_dtype, scales, options,
            may_fall_back: bool) -> torch.Tensor:
    """The output kernel's o, from the chunk starts (and derived starts) in ``starts_args``."""
    first = next(iter(tiles.values()))
    n_seq, heads, n_chunks = first.shape[:3]
    o, out = _output_buffer(program, ctx, first, eps, out_dtype)
    args = {**starts_args, **_token_args(ctx["output_inputs"], tiles, lam, program.gated, scales),
            **plan.packed, **plan.row_tables, **out}
    launch.launch(module.output_kernel, (n_chunks, n_seq * heads),
                  {**args, **plan.common, **plan.output_launch, **(options or {})}, may_fall_back)
    return o


def derived_start_args(ctx: dict, like: torch.Tensor, alloc=None, rows: tuple = (), sdot=None) -> dict:
    """The derived-start buffers of the scan and output kernels (``triton_gen._derived_starts``;
    none where the program has none): ``alloc(rows + shape)`` each, in the output kernel's
    ``sdot`` where it reads that carry only as an SDOT operand (``launch.starts_dtype``), or
    ``like`` where they are parameters only (not stored, not read)."""
    cs = ctx["chunk_scan"]
    return {f"dstart_{d['name']}": alloc(rows + tuple(d["shape"]), dtype=launch.starts_dtype(d["starts_sdot"], sdot))
            if alloc else like for d in (cs["derived_starts"] if cs else ())}


def _run_derived_kernel(module, ctx, plan, starts: dict, dstarts: dict, may_fall_back: bool,
                        options: dict | None = None) -> None:
    """``derived_kernel`` (``triton_gen._derived_kernel``): the derived carries at every chunk
    start into the ``dstarts`` buffers, from the ``starts_<state>`` buffers in ``starts``."""
    reads = {f"starts_{s['name']}": starts[f"starts_{s['name']}"] for s in ctx["chunk_scan"]["derived_kernel"]["reads"]}
    launch.launch_narrowing(module.derived_kernel, plan, "derived_launch", {**reads, **dstarts, **plan.common},
                            may_fall_back, options)


def _given_starts_output(module, ctx, plan, program, tiles, lam, given, eps, out_dtype, scales, options,
                         may_fall_back: bool):
    """forward_triton's output kernel alone, reading the chunk starts in ``given`` (and the
    derived carries ``derived_kernel`` forms from them, where the plan has one: the backward's
    state pass stores every state's starts)."""
    starts, final = given
    args = {f"starts_{s['name']}": starts[s["name"]] for s in ctx["states"] if s["read"]}
    like = next(iter(final.values()))
    cs = ctx["chunk_scan"]
    if plan.derived_starts and cs and cs["derived_kernel"]:
        sdot = {**plan.common, **plan.output_launch, **(options or {})}["SDOT"]
        rows = tuple(next(iter(tiles.values())).shape[:3])
        dstarts = derived_start_args(ctx, like, per_chunk_alloc(like, None), rows, sdot)
        _run_derived_kernel(module, ctx, plan, args, dstarts, may_fall_back)
        args.update(dstarts, DERIVED_STARTS=True)
    else:
        unread = derived_start_args(ctx, like)
        if unread:
            args.update(unread, DERIVED_STARTS=False)
    return _output(module, ctx, plan, program, tiles, lam, args, eps, out_dtype, scales, options,
                   may_fall_back), final


_PLANS = launch.plan_cache()    # launch plans of recent shape classes (launch.remembered)


class _ForwardPlan:
    """The launch choices of one forward shape class, made once: the constexprs and
    launch options every kernel shares, the schedule, the state pass's grid / blocks /
    tiling, the output kernel's dot dtypes and warps, the packed tables and walk arguments."""

    def __init__(self, program, ctx, first, precision, state_block, num_warps, num_stages,
                 packed_block, schedule, seq_chunks, fused_ok: bool = True, may_stage: bool = False):
        self.program = program      # keeps id(program) in the plan's key from being reused
        n_seq, heads, n_chunks = first.shape[:3]
        device = first.device
        common = dict(H=heads, n_chunks=n_chunks, DOT=launch.dot_dtype(first.dtype, device),
                      SDOT=launch.state_dot_dtype(first.dtype, device),
                      PREC=precision or launch.exact_precision(device),
                      num_warps=num_warps, **constexprs(program))
        if num_stages is not None:
            common["num_stages"] = num_stages
        packed_block = packed_block or launch.PACKED_BLOCK
        if packed_block is not None:
            common.update({f"B_{pd.name}": packed_block for pd in program.packed})
        self.common = common
        self.walk = walk_args(seq_chunks, n_seq, device)   # (a varlen plan is never reused)
        self.walkers = self.walk.pop("walkers")   # sequences the state pass walks
        # (not for the final states alone: the fused kernel computes every output too)
        self.fused = fused_ok and seq_chunks is None and launch.use_fused(schedule, bool(ctx["fused"]), device,
                                                             n_seq * heads, n_chunks)
        if self.fused:
            f = ctx["fused"]
            self.fused_launch = launch.split_blocks(n_seq * heads, [f["split"]] if f["split"] else [],
                                                    program, common, first, f["chained_dots"], state_block)
        self.packed = _packed_tables(program, device)
        # a forward that runs its own state pass may take the module whose complete scan runs
        # in two stages (launch.forward_module); ``forward_triton`` launches that module's kernels
        self.stage_complete = False
        if may_stage and not self.fused:
            staged_schedule, stage = launch.forward_module(schedule, ctx)
            staged = kernels(program, stage_complete=True)[1] if stage else None
            if staged and launch.use_chunk_scan(staged_schedule, staged["chunk_scan"], first,
                                                staged["state_chained_dots"]):   # (else it would walk)
                ctx, schedule, self.stage_complete = staged, staged_schedule, True
        self.row_tables, self.row_tile_counts = row_tile_tables(program, ctx, common, device)
        plan_state_pass(self, program, ctx, common, first, schedule, "forward", state_block, precision)
        features = launch.feature_blocks(program, common)
        self.output_launch = {**launch.dot_override(first, ctx["output_chained_dots"], launch.packed_blocks(program, common), features),
                              **launch.output_warps(features)}   # the output kernel's dot dtypes, warps


def plan_state_pass(plan, program: ChunkProgram, ctx: dict, common: dict, first, schedule: str,
                    direction: str, state_block: int | None = None, precision: str | None = None) -> None:
    """A plan's state-pass launches (``direction`` "forward", or "backward": its
    recomputation): the constexprs they share (``state_common``: ``common`` with the state
    passes' exact-product precision, ``precision`` or ``launch.exact_precision``'s), the
    walking kernel's (``state_launch``), and where
    ``launch.use_chunk_scan`` takes the chunk-parallel pass, the delta and scan kernels'
    (``delta_launch``, ``scan_launch``), in two stages the second's (``stage_launch``,
    ``stage_scan_launch``) and, where ``launch.scan_groups`` walks the scan in
    ``scan_groups`` groups, the groups' walks (``group_scan_launch``)."""
    n_seq, heads, n_chunks = first.shape[:3]
    plan.state_common = {**common, "PREC": precision or launch.exact_precision(first.device, state_pass=True)}
    plan.state_launch = launch.split_blocks(plan.walkers * heads, ctx["splits"], program, common, first,
                                            ctx["state_chained_dots"], state_block,
                                            packed_tiles=plan.row_tile_counts)
    cs = ctx["chunk_scan"]
    plan.chunk_scan = launch.use_chunk_scan(schedule, cs, first, ctx["state_chained_dots"])
    plan.scan_groups = 1
    plan.derived_starts = False
    if plan.chunk_scan:
        plan.delta_launch = launch.split_blocks((n_chunks, n_seq * heads), ctx["splits"], program, common,
                                                first, cs["delta_chained_dots"])
        stage = cs["stage"]
        plan.scan_launch = (launch.flat_scan_blocks(plan.walkers * heads, program, _names(cs["states"]))
                            if cs["flat"] else
                            launch.split_blocks(plan.walkers * heads, ctx["splits"], program, common, first,
                                                cs["scan_chained_dots"], state_block, scan=True,
                                                states=_names(cs["states"]) if stage else None))
        plan.scan_groups = launch.scan_groups(n_chunks, plan.walkers * heads, first.device,
                                              plan.walk["VARLEN"], cs["groupable"], direction)
        # (a second stage walking the derived carries has no other way to give them to the output)
        plan.derived_starts = (direction == "forward" and plan.scan_groups == 1 and bool(cs["derived_starts"])
                               and (launch.DERIVED_STARTS or bool(stage and stage["derived"])))
        if cs["derived_kernel"]:   # formed after both stages (triton_gen._derived_kernel)
            plan.derived_starts = direction == "forward" and launch.DERIVED_KERNEL
        if plan.derived_starts and cs["derived_kernel"]:
            plan.derived_launch = launch.split_blocks(
                (n_chunks, n_seq * heads), ctx["splits"], program, common, first, cs["derived_kernel"]["chained_dots"],
                state_block or launch.DERIVED_BLOCK, warps=launch.stage_warps(launch.feature_blocks(program, common)),
                states=_names(cs["derived_kernel"]["reads"]))
        if stage:   # the two-stage scan's second stage (triton_gen._second_stage)
            plan.stage_launch = launch.split_blocks(
                (n_chunks, n_seq * heads), ctx["splits"], program, common, first, stage["delta_chained_dots"],
                state_block or launch.STAGE_BLOCK, warps=launch.stage_warps(launch.feature_blocks(program, common)))
            plan.stage_scan_launch = (launch.flat_scan_blocks(plan.walkers * heads, program, _names(stage["states"]))
                                      if stage["flat"] else
                                      launch.split_blocks(plan.walkers * heads, ctx["splits"], program, common,
                                                          first, stage["scan_chained_dots"], state_block, scan=True,
                                                          states=_names(stage["states"])))
        if plan.scan_groups > 1:   # the groups' walks (phases 1 and 3); the walk over groups is scan_launch's
            plan.group_scan_launch = launch.split_blocks(plan.walkers * heads * plan.scan_groups, ctx["splits"],
                                                         program, common, first, cs["scan_chained_dots"],
                                                         state_block, scan=True)


ONE_LEVEL = {"STORE_CHUNKS": True, "STORE_LAST": True, "n_groups": 1}   # a scan kernel's whole walk


def group_phases(n_groups: int, n_chunks: int) -> tuple[dict, dict, dict]:
    """The scan kernels' arguments for the three launches of a two-level walk (forward or
    reverse; ``launch.scan_groups``): the groups from zero to their own deltas (nothing per
    chunk written), the walk over the groups (its "chunks"), the groups again from their
    starts (no last state). ``n_chunks``: the chunks grouped (``launch.scan_group_len``)."""
    length = launch.scan_group_len(n_chunks)
    return ({"STORE_CHUNKS": False, "STORE_LAST": True, "n_groups": n_groups, "group_len": length},
            {**ONE_LEVEL, "n_chunks": n_groups, "group_len": n_groups},
            {"STORE_CHUNKS": True, "STORE_LAST": False, "n_groups": n_groups, "group_len": length})


def run_state_pass(module, ctx: dict, plan, state_args: dict, tokens: dict, lam, may_fall_back: bool,
                   overrides: dict | None = None, store_chunks: bool = True,
                   derived_args: dict | None = None) -> dict:
    """The chunk-start states (``starts_``) and final states of ``state_args`` (init_ /
    final_ / starts_ buffers, HAS_INIT): the walking state pass, or the chunk-parallel one
    (``plan.chunk_scan``): every chunk's deltas into a per-chunk buffer, then the scan (in
    two levels where ``plan.scan_groups`` > 1; in two stages where the program's scan has a
    second, ``triton_gen._second_stage``: the first stage's scan, every chunk's increments of
    the second stage's states, their scan). Returns those per-chunk deltas
    ({"deltas_<state>": buffer}; none for the walk or two stages), and in two levels each group's own
    delta ({"group_deltas_<state>": [N, H, groups, *shape]}): the backward's chunk-parallel
    reverse pass reads some and reuses the others' memory. ``store_chunks`` False: a
    one-level scan writes no chunk starts (the final states alone). ``derived_args``: the scan
    kernel's derived-starts arguments (``triton_gen._derived_starts``; none: not stored)."""
    walk, common = plan.walk, plan.state_common
    like = state_args[next(k for k in state_args if k.startswith("init_"))]
    no_derived = derived_start_args(ctx, like)   # the scan kernel's parameters: stored only where asked
    if no_derived:
        no_derived["STORE_DERIVED"] = False
    derived_args = derived_args or no_derived
    if not plan.chunk_scan:
        launch.launch_narrowing(module.state_pass_kernel, plan, "state_launch",
                                {**state_args, **tokens, **plan.row_tables, **walk, **common}, may_fall_back, overrides)
        return {}
    first = next(iter(v for k, v in tokens.items() if k.startswith("in_")))
    rows = tuple(first.shape[:3])        # (N, H, nC): a delta per chunk, laid out as the starts
    cs = ctx["chunk_scan"]

    def per_chunk(buffers: list[dict]) -> dict:
        return {f"deltas_{b['name']}": binding.fresh(like.new_empty(rows + tuple(b["shape"]))) for b in buffers}
    deltas = per_chunk(cs["buffers"])
    launch.launch_narrowing(module.delta_kernel, plan, "delta_launch", {**tokens, **deltas, **common},
                            may_fall_back, overrides)
    gate = {"lam_ptr": lam} if lam is not None else {}
    fixed = {**walk, **common, "PREFETCH": launch.SCAN_PREFETCH}
    stage = cs["stage"]
    if stage:   # two stages: the first stage's states, their starts stored for the second's increments
        lower = _states_args(state_args, cs["states"])
        launch.launch_narrowing(module.scan_kernel, plan, "scan_launch",
                                {**lower, **deltas, **gate, **fixed, **ONE_LEVEL, "group_len": rows[2]},
                                may_fall_back, overrides)
        increments = per_chunk(stage["buffers"])
        reads = {f"starts_{s['name']}": state_args[f"starts_{s['name']}"] for s in stage["reads"]}
        reads.update((f"deltas_{b['name']}", deltas[f"deltas_{b['name']}"]) for b in stage["delta_reads"])
        for part in stage["part_sets"][launch.STAGE_PARTS]:   # one launch a part: a state, or a term (triton_gen._second_stage)
            launch.launch_narrowing(module.stage_kernel, plan, "stage_launch",
                                    {**tokens, **reads, **increments, **common, "PART": part},
                                    may_fall_back, overrides)
        if stage["derived"]:   # the derived carries' walk (triton_gen._staged_recursion)
            walk = {k: v for k, v in _states_args(state_args, stage["walked"]).items() if not k.startswith("starts_")}
            walk.update((k, v) for k, v in derived_args.items() if k.startswith("dstart_"))
        else:
            walk = _states_args(state_args, stage["states"])
        launch.launch_narrowing(module.stage_scan_kernel, plan, "stage_scan_launch",
                                {**walk, **increments, **gate, **fixed, **ONE_LEVEL, "group_len": rows[2],
                                 "STORE_CHUNKS": store_chunks}, may_fall_back, overrides)
        return {}   # (no reverse scan reads a two-stage pass's deltas)
    if plan.scan_groups == 1:
        launch.launch_narrowing(module.scan_kernel, plan, "scan_launch",
                                {**state_args, **deltas, **gate, **fixed, **ONE_LEVEL, "group_len": rows[2],
                                 "STORE_CHUNKS": store_chunks, **derived_args}, may_fall_back, overrides)
        return deltas
    n_groups = plan.scan_groups
    alone, over_groups, again_args = group_phases(n_groups, rows[2])
    totals, starts = {}, {}   # each group's own delta; each group's start
    for s in ctx["states"]:
        name, init = s["name"], state_args[f"init_{s['name']}"]
        totals[name] = binding.fresh(init.new_empty(rows[:2] + (n_groups,) + tuple(init.shape[2:])))
        starts[name] = binding.fresh(torch.empty_like(totals[name]))
    state_args = {**state_args, **no_derived}   # a group's chunk starts are not the call's: never derived
    groups = {k: v for k, v in state_args.items() if not k.startswith("final_")}
    groups.update({f"final_{n}": x for n, x in totals.items()}, HAS_INIT=False)
    launch.launch_narrowing(module.scan_kernel, plan, "group_scan_launch",
                            {**groups, **deltas, **gate, **fixed, **alone}, may_fall_back, overrides)
    over = {**state_args, **{f"starts_{n}": x for n, x in starts.items() if f"starts_{n}" in state_args}}
    over_deltas = {k: totals[k[len("deltas_"):]] for k in deltas}
    over_gate = {"lam_ptr": group_lam(lam, n_groups)} if lam is not None else {}
    launch.launch_narrowing(module.scan_kernel, plan, "scan_launch",
                            {**over, **over_deltas, **over_gate, **fixed, **over_groups}, may_fall_back, overrides)
    again = {k: v for k, v in state_args.items() if not k.startswith("init_")}
    again.update({f"init_{n}": x for n, x in starts.items()}, HAS_INIT=True)
    launch.launch_narrowing(module.scan_kernel, plan, "group_scan_launch",
                            {**again, **deltas, **gate, **fixed, **again_args}, may_fall_back, overrides)
    return {**deltas, **{f"group_deltas_{n}": x for n, x in totals.items()}}


def _names(states: list[dict]) -> tuple[str, ...]:
    return tuple(s["name"] for s in states)


def _states_args(state_args: dict, states: list[dict]) -> dict:
    """The entries of ``state_args`` (init_ / final_ / starts_ buffers, HAS_INIT) for the
    ``states`` one stage of a two-stage scan walks."""
    names = set(_names(states))
    return {k: v for k, v in state_args.items()
            if not k.startswith(("init_", "final_", "starts_")) or k.split("_", 1)[1] in names}


GROUP_GATES = "lam/groups:"   # + the group count: a bound call's derived ``group_lam``


def group_lam(lam: torch.Tensor, n_groups: int) -> torch.Tensor:
    """The walk over groups' log decays, laid out as ``lam`` ([rows, groups, C]: the kernels
    read each chunk's last entry): each group's entry is the sum of its chunks' last ones.
    A bound call derives it from its Λ (``GROUP_GATES``)."""
    length = launch.scan_group_len(lam.shape[2])
    ends = lam[..., -1].reshape(-1, lam.shape[2])
    walkers = ends.shape[0]
    padded = ends.new_zeros(walkers, n_groups * length)
    padded[:, :ends.shape[1]] = ends
    out = lam.new_zeros(walkers, n_groups, lam.shape[-1])
    out[..., -1] = padded.view(walkers, n_groups, length).sum(-1)
    return binding.derived(f"{GROUP_GATES}{n_groups}", out)


def per_chunk_alloc(like: torch.Tensor, seq_chunks):
    """The allocator of per-chunk state buffers: zeros for varlen (an all-empty batch keeps
    one chunk no sequence owns, whose outputs are discarded but must not read garbage)."""
    if seq_chunks is None:
        return lambda *shape, **kw: binding.fresh(like.new_empty(*shape, **kw))
    return like.new_zeros


_NO_TABLE: dict = {}


def walk_args(seq_chunks, n_seq: int, device) -> dict:
    """The walking kernels' (state pass, reverse pass) varlen arguments, and how many
    sequences they walk."""
    if seq_chunks is None:
        if device not in _NO_TABLE:
            _NO_TABLE[device] = binding.kept(torch.zeros(1, dtype=torch.int32, device=device))
        return {"seq_chunks": _NO_TABLE[device], "VARLEN": False, "walkers": n_seq}
    if n_seq != 1:
        raise ValueError(f"varlen tiles hold every sequence in one row (N = 1), got N = {n_seq}")
    return {"seq_chunks": seq_chunks, "VARLEN": True, "walkers": seq_chunks.numel() - 1}


def _fused(module, ctx, plan, tiles, lam, init_states, eps, may_fall_back, options, out_dtype,
           scales=None):
    first = next(iter(tiles.values()))
    f = ctx["fused"]
    args, final = _state_buffers(ctx, plan.program, init_states, (plan.walkers, first.shape[1]),
                                 first.device)
    args.update(_token_args(f["inputs"], tiles, lam, plan.program.gated, scales))
    o, out = _output_buffer(plan.program, ctx, first, eps, out_dtype)
    args.update(out)
    grid, block, tiling = plan.fused_launch
    launch.launch(module.fused_kernel, grid, {**args, **plan.common, **block, **(options or {})},
                  may_fall_back, tiling)
    return o, final


def _state_buffers(ctx, program, init_states, rows: tuple, device) -> tuple[dict, dict]:
    """init_/final_ kernel arguments of every state (fp32, contiguous), HAS_INIT, and the
    finals. ``init_states`` None: every initial state is zero, which the kernels make
    themselves (HAS_INIT False; init_ then points at the final buffer, never read), so a
    call without one allocates and fills no zero states. ``rows``: (sequences, heads)."""
    args, final = {"HAS_INIT": init_states is not None}, {}
    for s in ctx["states"]:
        name = s["name"]
        if init_states is None:
            init = final[name] = binding.fresh(torch.empty(rows + tuple(program.state_shape(name)),
                                                           device=device, dtype=torch.float32))
        else:
            init = init_states[name].to(device=device, dtype=torch.float32).contiguous()
            final[name] = binding.fresh(torch.empty_like(init))
        args[f"init_{name}"], args[f"final_{name}"] = init, final[name]
    return args, final


def _output_buffer(program, ctx, first, eps, dtype) -> tuple[torch.Tensor, dict]:
    n_seq, heads, n_chunks, chunk = first.shape[:4]
    o = token_layout(n_seq, heads, n_chunks, chunk, dict(program.sizes)[ctx["o_dim"]], dtype, first.device)
    return o, {**tile_args("out", o), **({"eps": float(eps)} if ctx["normalize"] else {})}


