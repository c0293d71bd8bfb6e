"""Running a program's attention form (``ir.attention``, ``codegen.attention_gen``): the
forward of a call with no state in or out, one kernel, no chunk-start states. Same tiles
and gates as ``triton_forward.forward_triton``; launch choices from ``runtime.launch``."""
from __future__ import annotations

import torch

from hladsl.codegen.attention_gen import attention_bwd_kernels, attention_kernels
from hladsl.ir.chunk import ChunkProgram
from hladsl.runtime import binding, launch
from hladsl.runtime.triton_forward import _output_buffer, _token_args, checked_tiles, tile_args

_PLANS = launch.plan_cache()


def chunk_firsts(seq_chunks: torch.Tensor, n_chunks: int, last: bool = False) -> torch.Tensor:
    """int32 [n_chunks]: for each chunk of a varlen row, the first chunk of its sequence (the
    sequence whose bounds hold it, empty ones skipped; no host sync); ``last``: its last."""
    chunks = torch.arange(n_chunks, dtype=seq_chunks.dtype, device=seq_chunks.device)
    owner = torch.searchsorted(seq_chunks[1:].contiguous(), chunks, right=True)
    if last:   # (a chunk past every sequence, padding, is its own last)
        return torch.maximum(seq_chunks[(owner + 1).clamp_max(seq_chunks.numel() - 1)] - 1, chunks).to(torch.int32)
    return seq_chunks[owner.clamp_max(seq_chunks.numel() - 1)].to(torch.int32)


def kept_buffers(program: ChunkProgram, first: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(o_kept, den): the fp32 buffers a normalised program's training forward stores o and
    its normaliser in for the backward (``forward_attention``), on ``first``'s tiles."""
    _, ctx = attention_bwd_kernels(program)
    o_kept = _output_buffer(program, ctx, first, 0.0, torch.float32)[0]
    return o_kept, binding.fresh(torch.empty(first.shape[:4], dtype=torch.float32, device=first.device))


def forward_attention(program: ChunkProgram, tiles: dict[str, torch.Tensor], lam: torch.Tensor | None,
                      eps: float, out_dtype: torch.dtype = torch.float32,
                      seq_chunks: torch.Tensor | None = None, scales: dict[str, float] | None = None,
                      options: dict | None = None, den: torch.Tensor | None = None,
                      o_kept: torch.Tensor | None = None) -> torch.Tensor:
    """o [N, H, nC, C, dv] (a tile view of a contiguous [N, nC*C, H, dv] tensor in
    ``out_dtype``) of a call with no initial state: tiles, lam, seq_chunks and scales as
    ``forward_triton`` takes them; ``options``: launch arguments overriding the rule's.
    ``den``: an fp32 [N, H, nC, C] buffer (normalised programs) the kernel stores the
    normaliser in, for the backward (``runtime.attention_backward``; the kernel of its module),
    and ``o_kept`` an fp32 tile buffer like o's that it stores o in before o's rounding."""
    module, ctx = (attention_kernels if den is None else attention_bwd_kernels)(program)
    first, lam = checked_tiles(program, tiles, lam)
    n_seq, heads, n_chunks = first.shape[:3]
    key = (id(program), tuple(first.shape[:4]), first.dtype, first.device)
    common = launch.remembered(_PLANS, key, lambda: launch.attention_launch(
        program, first, ctx["attention"]["chained_dots"]), cacheable=seq_chunks is None)
    o, out = _output_buffer(program, ctx, first, eps, out_dtype)
    varlen = seq_chunks is not None
    # (a varlen call is never bound; without one the kernel never reads chunk_first: any pointer)
    firsts = chunk_firsts(seq_chunks, n_chunks) if varlen else o
    if ctx["normalize"]:
        out.update(den_ptr=o if den is None else den, STORE_DEN=den is not None,
                   **tile_args("okeep", o if o_kept is None else o_kept))
    args = {**_token_args(ctx["attention"]["inputs"], tiles, lam, program.gated, scales), **out,
            "chunk_first": firsts, "VARLEN": varlen, "H": heads, "n_chunks": n_chunks, **common,
            **(options or {})}
    launch.launch(module.attention_kernel, (n_chunks, n_seq * heads), args, options is None)
    return o
