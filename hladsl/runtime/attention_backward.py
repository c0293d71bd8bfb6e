"""Training on a program's attention form (``ir.attention.attention_backward``,
``codegen.attention_gen``): the gradients of a call with no state in or out, in two kernels
and no chunk-start state -- the query side (dq, dΛ_t, and d num, d den of a normalised
program from the forward's o and den) and then the key side (dk, dv, dΛ_n). Same tiles,
gates and gradient layouts as ``triton_backward.backward_triton``."""
from __future__ import annotations

import torch

from hladsl.codegen.attention_gen import attention_bwd_kernels
from hladsl.ir.chunk import ChunkProgram
from hladsl.runtime import binding, launch
from hladsl.runtime.attention_forward import chunk_firsts
from hladsl.runtime.triton_backward import _grad_args
from hladsl.runtime.triton_forward import _token_args, checked_tiles, tile_args, token_layout

_PLANS = launch.plan_cache()


class AttentionKept:
    """What a training forward on the attention form keeps for its backward (normalised programs
    only): its output o in fp32 before its rounding, as tiles, and its normaliser den
    [N, H, nC, C] fp32 -- the backward's d num and d den come from them, as FlashAttention's
    from its output and log-sum-exp."""

    def __init__(self, o_tiles: torch.Tensor | None, den: torch.Tensor | None):
        self.o_tiles, self.den = o_tiles, den

    def split(self) -> tuple[list, "AttentionKept"]:
        """(its tensors, itself without them): autograd saves the tensors (``KeptStates.split``)."""
        return [self.o_tiles, self.den], AttentionKept(None, None)

    def joined(self, tensors) -> "AttentionKept":
        return AttentionKept(*tensors)


def backward_attention(program: ChunkProgram, tiles: dict[str, torch.Tensor], lam: torch.Tensor | None,
                       grad_o: torch.Tensor, kept: AttentionKept, eps: float,
                       grad_dtype: torch.dtype = torch.float32, seq_chunks: torch.Tensor | None = None,
                       grad_scales: dict[str, float] | None = None,
                       scales: dict[str, float] | None = None) -> tuple[dict, torch.Tensor | None]:
    """(d_tiles {input: [N, H, nC, C, dim] in ``grad_dtype``}, d_lam [N, H, nC, C] fp32 or
    None) as ``backward_triton`` returns them for a call with no initial state and no final
    state's gradient: tiles, lam, grad_o, seq_chunks, grad_scales and scales as it takes them;
    ``kept``: the forward's fp32 o tiles and den (``forward_attention(den=..., o_kept=...)``)."""
    module, ctx = attention_bwd_kernels(program)
    ab = ctx["attention_bwd"]
    first, lam = checked_tiles(program, tiles, lam)
    n_seq, heads, n_chunks, chunk = first.shape[:4]
    key = (id(program), tuple(first.shape[:4]), first.dtype, first.device)
    common = launch.remembered(_PLANS, key, lambda: launch.attention_launch(
        program, first, ab["chained_dots"], backward=True), cacheable=seq_chunks is None)
    d_tiles = {x["name"]: token_layout(n_seq, heads, n_chunks, chunk, common[f"D_{x['dim']}"], grad_dtype,
                                       first.device) for x in ab["grads"]}
    d_lam = None if lam is None else binding.fresh(torch.empty_like(lam))
    if grad_o.stride(-1) != 1:
        grad_o = grad_o.contiguous()
    both = {x["name"]: d_tiles[x["name"]] for x in ab["grads"] if x["query"] and x["key"]}
    sums = {f"dsum_{n}": d if d.dtype == torch.float32 else token_layout(n_seq, heads, n_chunks, chunk, d.shape[-1],
                                                                          torch.float32, first.device)
            for n, d in both.items()}   # (an input both kernels reach: the query kernel's part in fp32)
    args = {**_token_args(ab["inputs"], tiles, lam, program.gated, scales),
            **_grad_args(d_tiles, d_lam, grad_scales, parted=False),
            **{k: v for n, d in sums.items() for k, v in tile_args(n, d).items()},
            "H": heads, "n_chunks": n_chunks, "VARLEN": seq_chunks is not None, **common}
    query_args = {}
    if ctx["normalize"]:   # the query kernel writes d num, d den for the key kernel
        dnum = binding.fresh(torch.empty(grad_o.shape, device=first.device, dtype=torch.float32))
        args.update(tile_args("dnum", dnum), dden_ptr=binding.fresh(dnum.new_empty(grad_o.shape[:-1])))
        query_args = {**tile_args("do", grad_o), **tile_args("out", kept.o_tiles), "den_ptr": kept.den,
                      "eps": float(eps)}
    else:
        args.update(tile_args("dnum", grad_o))
    grid = (n_chunks, n_seq * heads)
    firsts = lasts = grad_o   # (not read without varlen)
    if seq_chunks is not None:
        firsts, lasts = chunk_firsts(seq_chunks, n_chunks), chunk_firsts(seq_chunks, n_chunks, last=True)
    launch.launch(module.attention_query_grad_kernel, grid, {**args, **query_args, "chunk_bound": firsts}, True)
    launch.launch(module.attention_key_grad_kernel, grid, {**args, "chunk_bound": lasts}, True)
    return d_tiles, d_lam


def gap_share(d_lam: torch.Tensor, seq_chunks: torch.Tensor | None) -> None:
    """``backward_attention``'s dΛ, at each token's Λ over its sequence -> at its in-chunk Λ
    (in place; the op's ``_Prepared.gate_vjp`` calls it, after a bound replay too). The
    kernels' masks read Λ_t − Λ_n as in-chunk Λs plus the totals of the chunks between
    (``lam_gap``): the total of chunk j (its last in-chunk Λ) enters every pair whose query
    lies past j and whose key at or before it. Every pair adds +W·x at its query and −W·x at
    its key, so that is the sum of dΛ over the chunks after j in its sequence: added at j's
    last position. ``seq_chunks``: varlen, as the kernels take it (None: one sequence a row)."""
    lasts = None if seq_chunks is None else chunk_firsts(seq_chunks, d_lam.shape[-2], last=True)
    totals = d_lam.sum(-1)
    after = totals.flip(-1).cumsum(-1).flip(-1)             # Σ over chunks c' >= c
    after = torch.nn.functional.pad(after, (0, 1))          # (Σ over chunks past the last: 0)
    share = after[..., 1:]                                  # Σ over c' > c
    if lasts is not None:   # less what lies past c's sequence
        share = share - after[..., lasts.long() + 1]
    d_lam[..., -1] += share
