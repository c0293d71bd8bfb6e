"""Launching the generated chunk kernels: the Triton counterpart of
``chunk_torch.state_pass`` + ``chunk_torch.outputs`` (same calling convention)."""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from hladsl.codegen.triton_gen import block_size, constexprs, kernels
from hladsl.ir.chunk import ChunkProgram

_DOT = {torch.bfloat16: tl.bfloat16, torch.float16: tl.float16}


def _state_block(size: int, programs: int, device, narrow_ok: bool) -> int:
    """Value-dim block of a state-pass program: halve the padded dim (not below
    16, tl.dot's minimum) while that leaves fewer programs than two per SM.
    Without ``narrow_ok`` the full width is kept: Triton 3.6's Hopper wgmma
    lowering miscompiles some chains of dots (a matmul reading a matmul result)
    on narrow bf16/fp16 tiles -- hla3's state pass at widths 16 and 32 gives NaN
    or an illegal address (cf. triton-lang/triton issues 6124, 10486, 11366) --
    while fp32 (tf32x3) and dot chains without such reads split correctly."""
    width = block_size(size)
    if not narrow_ok:
        return width
    sms = (torch.cuda.get_device_properties(device).multi_processor_count
           if device.type == "cuda" else 1)
    while width > 16 and programs * triton.cdiv(size, width) < 2 * sms:
        width //= 2
    return width


def _token_args(inputs, tiles, lam, gated) -> dict:
    args = {}
    for x in inputs:
        name = x["name"]
        t = tiles[name]
        if t.stride(-1) != 1:
            t = t.contiguous()
        args[f"in_{name}_ptr"] = t
        for axis, s in zip("nhct", t.stride()[:4]):
            args[f"str_{name}_{axis}"] = s
    if gated:
        args["lam_ptr"] = lam
    return args


def forward_triton(program: ChunkProgram, tiles: dict[str, torch.Tensor], lam: torch.Tensor | None,
                   init_states: dict[str, torch.Tensor], eps: float, precision: str = "tf32x3",
                   state_block: int | None = None, num_warps: int = 4,
                   num_stages: int | None = None):
    """tiles: input name -> [N, H, nC, C, dim] (fp32/bf16/fp16; may be a strided view);
    lam: [N, H, nC, C] in-chunk cumulative log gates (None iff the program is ungated);
    init_states: summary -> [N, H, *shape] unpacked. precision: how fp32 tiles are
    multiplied (tl.dot input_precision: "ieee" exact but slow to compile and run,
    "tf32x3" about fp32-accurate on tensor cores, "tf32" fastest). state_block: the
    width of the value-dim block one state-pass program owns, where the program
    allows splitting (default: small enough to fill the GPU). Returns (o [N, H, nC, C, dv] fp32,
    {summary: final state [N, H, *shape] fp32})."""
    module, ctx = kernels(program)
    if program.gated != (lam is not None):
        raise ValueError("lam must be given exactly when the chunk program is gated")
    first = next(iter(tiles.values()))
    n_seq, heads, n_chunks, chunk = first.shape[:4]
    if chunk != program.chunk:
        raise ValueError(f"tiles have chunk size {chunk}, the program {program.chunk}")
    device = first.device
    if lam is not None:
        lam = lam.to(device=device, dtype=torch.float32).contiguous()
    common = dict(H=heads, n_chunks=n_chunks, DOT=_DOT.get(first.dtype, tl.float32), PREC=precision,
                  num_warps=num_warps, **constexprs(program))
    if num_stages is not None:
        common["num_stages"] = num_stages

    state_args, out_args, final = {}, {}, {}
    for s in ctx["states"]:
        name = s["name"]
        init = init_states[name].to(device=device, dtype=torch.float32).contiguous()
        final[name] = torch.empty_like(init)
        state_args[f"init_{name}"], state_args[f"final_{name}"] = init, final[name]
        if s["read"]:
            starts = init.new_empty((n_seq, heads, n_chunks) + tuple(init.shape[2:]))
            state_args[f"starts_{name}"] = out_args[f"starts_{name}"] = starts
    state_args.update(_token_args(ctx["state_inputs"], tiles, lam, program.gated))
    grid, block = (n_seq * heads,), {}
    if ctx["split"]:
        size = dict(program.sizes)[ctx["split"]]
        narrow_ok = first.dtype not in _DOT or not ctx["state_chained_dots"]
        width = state_block or _state_block(size, n_seq * heads, device, narrow_ok)
        grid = (n_seq * heads, triton.cdiv(size, width))
        block = {f"B_{ctx['split']}": width, "SPLIT": grid[1] > 1}
    module.state_pass_kernel[grid](**state_args, **{**common, **block})

    dv = dict(program.sizes)[ctx["o_dim"]]
    o = torch.empty((n_seq, heads, n_chunks, chunk, dv), device=device, dtype=torch.float32)
    out_args.update(_token_args(ctx["output_inputs"], tiles, lam, program.gated))
    out_args["out_ptr"] = o
    if ctx["normalize"]:
        out_args["eps"] = float(eps)
    module.output_kernel[(n_chunks, n_seq * heads)](**out_args, **common)
    return o, final
