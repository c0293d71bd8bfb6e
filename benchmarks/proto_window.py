"""A hand-written prototype (not generated, not used by the op): power p = 2's forward as a windowed
hybrid -- windows of W tokens (a long chunk); the state at each window's start from a state pass that
reads each window once (its rows in sub-tiles of R), the in-window part by hladsl's attention form
(each window a sequence of a varlen call), the part before the window as φ(q) · S_w. The question it
answers: does a chunk of ~1024 whose in-chunk part is attention bring d = 128 at T = 64k near issue 13's
4.5x of d = 64 (RESULTS.md round 47)? Gated, unnormalised, packed symmetric states (i <= j, weights m).

    python benchmarks/proto_window.py            # check against the op at T = 4096, then time T = 65536
"""
from __future__ import annotations

import sys

import torch
import triton
import triton.language as tl

import hladsl
from hladsl.runtime import launch


@triton.jit
def window_state_kernel(k_ptr, v_ptr, lam_ptr, pi_ptr, pj_ptr, s_ptr, T, NW, D,
                        W: tl.constexpr, R: tl.constexpr, BA: tl.constexpr, DK: tl.constexpr,
                        DV: tl.constexpr, DOT: tl.constexpr):
    """S_w [NW, D, DV] (in S's dtype; DOT: the dots' operand dtype, fp32 under the interpreter) at each window's start: S_{w+1} = e^{Λ_w,end} S_w + Σ_n φ(k_n) e^{Λ_end − Λ_n} v_nᵀ,
    Λ the in-window cumulative log gate. A program owns BA packed columns of one (sequence, head)."""
    pid_a = tl.program_id(0)
    pid_bh = tl.program_id(1).to(tl.int64)
    offs_a = pid_a * BA + tl.arange(0, BA)
    amask = offs_a < D
    ia = tl.load(pi_ptr + offs_a, mask=amask, other=0)
    ja = tl.load(pj_ptr + offs_a, mask=amask, other=0)
    offs_r = tl.arange(0, R)
    offs_v = tl.arange(0, DV)
    base_k = k_ptr + pid_bh * T * DK
    base_v = v_ptr + pid_bh * T * DV
    base_l = lam_ptr + pid_bh * T
    S = tl.zeros((BA, DV), dtype=tl.float32)
    for w in range(NW):
        tl.store(s_ptr + ((pid_bh * NW + w) * D + offs_a[:, None]) * DV + offs_v[None, :],
                 S.to(s_ptr.dtype.element_ty), mask=amask[:, None])
        lam_end = tl.load(base_l + w * W + W - 1)
        acc = tl.zeros((BA, DV), dtype=tl.float32)
        for r0 in range(0, W, R):
            rows = w * W + r0 + offs_r
            ki = tl.load(base_k + rows[:, None] * DK + ia[None, :]).to(tl.float32)
            kj = tl.load(base_k + rows[:, None] * DK + ja[None, :]).to(tl.float32)
            phi = (ki * kj).to(DOT)                                          # [R, BA]
            lam = tl.load(base_l + rows)
            vv = tl.load(base_v + rows[:, None] * DV + offs_v[None, :]).to(tl.float32)
            wv = (vv * tl.exp(lam_end - lam)[:, None]).to(DOT)               # [R, DV]
            acc += tl.dot(tl.trans(phi), wv)
        S = S * tl.exp(lam_end) + acc


@triton.jit
def window_output_kernel(q_ptr, lam_ptr, pi_ptr, pj_ptr, pm_ptr, s_ptr, o_ptr, T, NW, D,
                         W: tl.constexpr, C: tl.constexpr, BA: tl.constexpr, DK: tl.constexpr,
                         DV: tl.constexpr, DOT: tl.constexpr):
    """o_t += e^{Λ_t} φ(q_t) · S_w for the C rows of one chunk (w its window), fp32 [BH, T, DV]."""
    pid_c = tl.program_id(0)
    pid_bh = tl.program_id(1).to(tl.int64)
    rows = pid_c * C + tl.arange(0, C)
    w = (pid_c * C) // W
    offs_v = tl.arange(0, DV)
    base_q = q_ptr + pid_bh * T * DK
    acc = tl.zeros((C, DV), dtype=tl.float32)
    for a0 in range(0, D, BA):
        offs_a = a0 + tl.arange(0, BA)
        amask = offs_a < D
        ia = tl.load(pi_ptr + offs_a, mask=amask, other=0)
        ja = tl.load(pj_ptr + offs_a, mask=amask, other=0)
        m = tl.load(pm_ptr + offs_a, mask=amask, other=0.0)
        qi = tl.load(base_q + rows[:, None] * DK + ia[None, :]).to(tl.float32)
        qj = tl.load(base_q + rows[:, None] * DK + ja[None, :]).to(tl.float32)
        phi = (qi * qj * m[None, :]).to(DOT)                                 # [C, BA]
        s = tl.load(s_ptr + ((pid_bh * NW + w) * D + offs_a[:, None]) * DV + offs_v[None, :],
                    mask=amask[:, None], other=0.0).to(DOT)                  # [BA, DV]
        acc += tl.dot(phi, s)
    lam = tl.load(lam_ptr + pid_bh * T + rows)
    o_at = o_ptr + (pid_bh * T + rows[:, None]) * DV + offs_v[None, :]
    tl.store(o_at, tl.load(o_at) + acc * tl.exp(lam)[:, None])


@triton.jit
def rows_state_kernel(k_ptr, v_ptr, lam_ptr, ti_ptr, tj_ptr, s_ptr, T, NW, NT,
                      W: tl.constexpr, R: tl.constexpr, BA: tl.constexpr, DK: tl.constexpr,
                      DV: tl.constexpr, DOT: tl.constexpr, DECAYED: tl.constexpr = False):
    """``window_state_kernel`` over row tiles of the pairs: tile (i, j0) holds φ_(i, j) = k_i k_j for
    j in [j0, j0 + BA) -- one column times an aligned slice of the token tile, no gathers (pairs
    j < i come along, weighted 0 on the query side). S_w [NW, NT, BA, DV]."""
    pid_a = tl.program_id(0)
    pid_bh = tl.program_id(1).to(tl.int64)
    i = tl.load(ti_ptr + pid_a)
    offs_j = tl.load(tj_ptr + pid_a) + tl.arange(0, BA)
    offs_r = tl.arange(0, R)
    offs_v = tl.arange(0, DV)
    base_k = k_ptr + pid_bh * T * DK
    base_v = v_ptr + pid_bh * T * DV
    base_l = lam_ptr + pid_bh * T
    S = tl.zeros((BA, DV), dtype=tl.float32)
    for w in range(NW):
        tl.store(s_ptr + (((pid_bh * NW + w) * NT + pid_a) * BA + tl.arange(0, BA)[:, None]) * DV + offs_v[None, :],
                 S.to(s_ptr.dtype.element_ty))
        lam_end = tl.load(base_l + w * W + W - 1)
        acc = tl.zeros((BA, DV), dtype=tl.float32)
        for r0 in range(0, W, R):
            rows = w * W + r0 + offs_r
            kcol = tl.load(base_k + rows * DK + i).to(tl.float32)
            kblk = tl.load(base_k + rows[:, None] * DK + offs_j[None, :]).to(tl.float32)
            phi = (kcol[:, None] * kblk).to(DOT)                             # [R, BA]
            if DECAYED:   # (v e^{Λ_end − Λ_n} formed once for every tile, ``decayed_values``)
                wv = tl.load(base_v + rows[:, None] * DV + offs_v[None, :]).to(DOT)
            else:
                lam = tl.load(base_l + rows)
                vv = tl.load(base_v + rows[:, None] * DV + offs_v[None, :]).to(tl.float32)
                wv = (vv * tl.exp(lam_end - lam)[:, None]).to(DOT)
            acc += tl.dot(tl.trans(phi), wv)
        S = S * tl.exp(lam_end) + acc


@triton.jit
def rows_output_kernel(q_ptr, lam_ptr, ti_ptr, tj_ptr, s_ptr, o_ptr, T, NW, NT,
                       W: tl.constexpr, C: tl.constexpr, BA: tl.constexpr, DK: tl.constexpr,
                       DV: tl.constexpr, DOT: tl.constexpr):
    """``window_output_kernel`` over the row tiles: m(i, j) = 2 for j > i, 1 for j = i, 0 below."""
    pid_c = tl.program_id(0)
    pid_bh = tl.program_id(1).to(tl.int64)
    rows = pid_c * C + tl.arange(0, C)
    w = (pid_c * C) // W
    offs_v = tl.arange(0, DV)
    base_q = q_ptr + pid_bh * T * DK
    acc = tl.zeros((C, DV), dtype=tl.float32)
    for a in range(NT):
        i = tl.load(ti_ptr + a)
        offs_j = tl.load(tj_ptr + a) + tl.arange(0, BA)
        m = tl.where(offs_j > i, 2.0, tl.where(offs_j == i, 1.0, 0.0))
        qcol = tl.load(base_q + rows * DK + i).to(tl.float32)
        qblk = tl.load(base_q + rows[:, None] * DK + offs_j[None, :]).to(tl.float32)
        phi = (qcol[:, None] * qblk * m[None, :]).to(DOT)                    # [C, BA]
        s = tl.load(s_ptr + (((pid_bh * NW + w) * NT + a) * BA + tl.arange(0, BA)[:, None]) * DV
                    + offs_v[None, :]).to(DOT)
        acc += tl.dot(phi, s)
    lam = tl.load(lam_ptr + pid_bh * T + rows)
    o_at = o_ptr + (pid_bh * T + rows[:, None]) * DV + offs_v[None, :]
    tl.store(o_at, tl.load(o_at) + acc * tl.exp(lam)[:, None])


@triton.jit
def pair_state_kernel(k_ptr, v_ptr, ti_ptr, tj_ptr, s_ptr, lam_ptr, T, NW, NT,
                      W: tl.constexpr, R: tl.constexpr, BA: tl.constexpr, DK: tl.constexpr,
                      DV: tl.constexpr, DOT: tl.constexpr):
    """``rows_state_kernel`` (values decayed) with two row tiles of one slice a program (tiles 2a, 2a + 1,
    ``row_tiles(..., paired=True)``): the slice and the values are loaded once for both dots."""
    pid_a = tl.program_id(0)
    pid_bh = tl.program_id(1).to(tl.int64)
    i0 = tl.load(ti_ptr + 2 * pid_a)
    i1 = tl.load(ti_ptr + 2 * pid_a + 1)
    offs_j = tl.load(tj_ptr + 2 * pid_a) + tl.arange(0, BA)
    offs_r = tl.arange(0, R)
    offs_v = tl.arange(0, DV)
    offs_b = tl.arange(0, BA)
    base_k = k_ptr + pid_bh * T * DK
    base_v = v_ptr + pid_bh * T * DV
    base_l = lam_ptr + pid_bh * T
    S0 = tl.zeros((BA, DV), dtype=tl.float32)
    S1 = tl.zeros((BA, DV), dtype=tl.float32)
    for w in range(NW):
        at = s_ptr + (((pid_bh * NW + w) * NT + 2 * pid_a) * BA + offs_b[:, None]) * DV + offs_v[None, :]
        tl.store(at, S0.to(s_ptr.dtype.element_ty))
        tl.store(at + BA * DV, S1.to(s_ptr.dtype.element_ty))
        decay = tl.exp(tl.load(base_l + w * W + W - 1))
        acc0 = tl.zeros((BA, DV), dtype=tl.float32)
        acc1 = tl.zeros((BA, DV), dtype=tl.float32)
        for r0 in range(0, W, R):
            rows = w * W + r0 + offs_r
            kblk = tl.load(base_k + rows[:, None] * DK + offs_j[None, :]).to(tl.float32)
            k0 = tl.load(base_k + rows * DK + i0).to(tl.float32)
            k1 = tl.load(base_k + rows * DK + i1).to(tl.float32)
            wv = tl.load(base_v + rows[:, None] * DV + offs_v[None, :]).to(DOT)
            acc0 += tl.dot(tl.trans((k0[:, None] * kblk).to(DOT)), wv)
            acc1 += tl.dot(tl.trans((k1[:, None] * kblk).to(DOT)), wv)
        S0 = S0 * decay + acc0
        S1 = S1 * decay + acc1


@triton.jit
def pair_output_kernel(q_ptr, lam_ptr, ti_ptr, tj_ptr, s_ptr, o_ptr, T, NW, NT,
                       W: tl.constexpr, C: tl.constexpr, BA: tl.constexpr, DK: tl.constexpr,
                       DV: tl.constexpr, DOT: tl.constexpr):
    """``rows_output_kernel`` over paired row tiles: the query slice loaded once for both tiles."""
    pid_c = tl.program_id(0)
    pid_bh = tl.program_id(1).to(tl.int64)
    rows = pid_c * C + tl.arange(0, C)
    w = (pid_c * C) // W
    offs_v = tl.arange(0, DV)
    offs_b = tl.arange(0, BA)
    base_q = q_ptr + pid_bh * T * DK
    acc = tl.zeros((C, DV), dtype=tl.float32)
    for a in range(NT // 2):
        i0 = tl.load(ti_ptr + 2 * a)
        i1 = tl.load(ti_ptr + 2 * a + 1)
        offs_j = tl.load(tj_ptr + 2 * a) + offs_b
        m0 = tl.where(offs_j > i0, 2.0, tl.where(offs_j == i0, 1.0, 0.0))
        m1 = tl.where(offs_j > i1, 2.0, tl.where(offs_j == i1, 1.0, 0.0))
        qblk = tl.load(base_q + rows[:, None] * DK + offs_j[None, :]).to(tl.float32)
        q0 = tl.load(base_q + rows * DK + i0).to(tl.float32)
        q1 = tl.load(base_q + rows * DK + i1).to(tl.float32)
        at = s_ptr + (((pid_bh * NW + w) * NT + 2 * a) * BA + offs_b[:, None]) * DV + offs_v[None, :]
        acc += tl.dot((q0[:, None] * qblk * m0[None, :]).to(DOT), tl.load(at).to(DOT))
        acc += tl.dot((q1[:, None] * qblk * m1[None, :]).to(DOT), tl.load(at + BA * DV).to(DOT))
    lam = tl.load(lam_ptr + pid_bh * T + rows)
    o_at = o_ptr + (pid_bh * T + rows[:, None]) * DV + offs_v[None, :]
    tl.store(o_at, tl.load(o_at) + acc * tl.exp(lam)[:, None])


@triton.jit
def slice_output_kernel(q_ptr, lam_ptr, s_ptr, o_ptr, T, NW, NT,
                        W: tl.constexpr, C: tl.constexpr, BA: tl.constexpr, DK: tl.constexpr,
                        DV: tl.constexpr, DOT: tl.constexpr):
    """``pair_output_kernel`` with the tiles' (i, j0) from the loop counters, not loaded (the paired
    order: slice j0 = s·BA holds tiles i = 0 .. j0 + BA - 1, from BA·s(s + 1)/2 on), so the
    inner loop's loads depend on nothing loaded in it; the query slice loaded once a slice."""
    pid_c = tl.program_id(0)
    pid_bh = tl.program_id(1).to(tl.int64)
    rows = pid_c * C + tl.arange(0, C)
    w = (pid_c * C) // W
    offs_v = tl.arange(0, DV)
    offs_b = tl.arange(0, BA)
    base_q = q_ptr + pid_bh * T * DK
    base_s = s_ptr + (pid_bh * NW + w) * NT * BA * DV
    acc = tl.zeros((C, DV), dtype=tl.float32)
    for s in range(DK // BA):
        offs_j = s * BA + offs_b
        qblk = tl.load(base_q + rows[:, None] * DK + offs_j[None, :]).to(tl.float32)
        first = BA * s * (s + 1) // 2
        for i in range(0, (s + 1) * BA, 2):
            m0 = tl.where(offs_j > i, 2.0, tl.where(offs_j == i, 1.0, 0.0))
            m1 = tl.where(offs_j > i + 1, 2.0, tl.where(offs_j == i + 1, 1.0, 0.0))
            q0 = tl.load(base_q + rows * DK + i).to(tl.float32)
            q1 = tl.load(base_q + rows * DK + i + 1).to(tl.float32)
            at = base_s + ((first + i) * BA + offs_b[:, None]) * DV + offs_v[None, :]
            acc += tl.dot((q0[:, None] * qblk * m0[None, :]).to(DOT), tl.load(at).to(DOT))
            acc += tl.dot((q1[:, None] * qblk * m1[None, :]).to(DOT), tl.load(at + BA * DV).to(DOT))
    lam = tl.load(lam_ptr + pid_bh * T + rows)
    o_at = o_ptr + (pid_bh * T + rows[:, None]) * DV + offs_v[None, :]
    tl.store(o_at, tl.load(o_at) + acc * tl.exp(lam)[:, None])


def decayed_values(vh, lam, W: int):
    """v_n e^{Λ_end − Λ_n} [BH, T, dv] in v's dtype, Λ in-window (each row's weight into its window's end)."""
    BH, T, dv = vh.shape
    lam_w = lam.reshape(BH, T // W, W)
    return (vh.reshape(BH, T // W, W, dv).float() * (lam_w[..., -1:] - lam_w).exp()[..., None]).to(vh.dtype).reshape(
        BH, T, dv)


def row_tiles(d: int, BA: int, device, paired: bool = False):
    """(i, j0) of every row tile: j0 the aligned blocks of width BA that reach j >= i. Paired: ordered
    by slice, so tiles 2a and 2a + 1 share theirs (a slice j0 has j0 + BA tiles: even for an even BA)."""
    tiles = [(i, j0) for i in range(d) for j0 in range(0, d, BA) if j0 + BA > i]
    if paired:
        tiles.sort(key=lambda t: (t[1], t[0]))
    ti, tj = zip(*tiles)
    return (torch.tensor(ti, dtype=torch.int32, device=device), torch.tensor(tj, dtype=torch.int32, device=device))


def pairs(d: int, device):
    i, j = torch.triu_indices(d, d, device=device)
    return i.int().contiguous(), j.int().contiguous(), torch.where(i == j, 1.0, 2.0).to(device)


def windowed(op, q, k, v, g, W: int, warps=(4, 4), R: int = 64, BA: int = 64, rows: bool = False,
             paired: bool = False, C: int = 64, sliced: bool = False):
    """o [B, T, H, dv] fp32: the window part by the op's attention form (windows as varlen
    sequences), the earlier part by the two kernels above. q already scaled."""
    B, T, H, d = q.shape
    dv = v.shape[-1]
    NW = T // W
    cu = torch.arange(0, B * T + 1, W, device=q.device, dtype=torch.int32)
    with torch.no_grad(), launch.switched(ATTENTION_FORM="always"):
        o_in, _ = op(*(x.reshape(1, B * T, H, -1) for x in (q, k, v)), g=g.reshape(1, B * T, H), scale=1.0,
                     cu_seqlens=cu)
    o = o_in.reshape(B, T, H, dv).float().permute(0, 2, 1, 3).contiguous().reshape(B * H, T, dv)
    qh, kh, vh = (x.permute(0, 2, 1, 3).contiguous() for x in (q, k, v))
    lam = g.float().permute(0, 2, 1).reshape(B * H, NW, W).cumsum(-1).reshape(B * H, T).contiguous()
    pi, pj, pm = pairs(d, q.device)
    D = pi.numel()
    interpret = q.device.type == "cpu"
    dot = tl.float32 if interpret else tl.bfloat16
    C = min(C, W)
    if paired:   # (two row tiles of one slice a program, the values decayed once)
        ti, tj = row_tiles(d, BA, q.device, paired=True)
        NT = ti.numel()
        S = torch.empty(B * H, NW, NT, BA, dv, device=q.device, dtype=torch.float32 if interpret else torch.bfloat16)
        pair_state_kernel[(NT // 2, B * H)](kh, decayed_values(vh.reshape(B * H, T, dv), lam, W), ti, tj, S, lam, T, NW, NT, W=W, R=R,
                                            BA=BA, DK=d, DV=dv, DOT=dot, num_warps=warps[0])
        if sliced:
            slice_output_kernel[(T // C, B * H)](qh, lam, S, o, T, NW, NT, W=W, C=C, BA=BA, DK=d, DV=dv, DOT=dot,
                                                 num_warps=warps[1])
        else:
            pair_output_kernel[(T // C, B * H)](qh, lam, ti, tj, S, o, T, NW, NT, W=W, C=C, BA=BA, DK=d, DV=dv,
                                                DOT=dot, num_warps=warps[1])
        return o.reshape(B, H, T, dv).permute(0, 2, 1, 3)
    if rows:   # (the row-tiled kernels: BA-wide row tiles of the pairs)
        ti, tj = row_tiles(d, BA, q.device)
        NT = ti.numel()
        S = torch.empty(B * H, NW, NT, BA, dv, device=q.device, dtype=torch.float32 if interpret else torch.bfloat16)
        rows_state_kernel[(NT, B * H)](kh, vh, lam, ti, tj, S, T, NW, NT, W=W, R=R, BA=BA, DK=d, DV=dv, DOT=dot,
                                       num_warps=warps[0])
        rows_output_kernel[(T // C, B * H)](qh, lam, ti, tj, S, o, T, NW, NT, W=W, C=C, BA=BA, DK=d, DV=dv,
                                            DOT=dot, num_warps=warps[1])
        return o.reshape(B, H, T, dv).permute(0, 2, 1, 3)
    S = torch.empty(B * H, NW, D, dv, device=q.device, dtype=torch.float32 if interpret else torch.bfloat16)
    window_state_kernel[(triton.cdiv(D, BA), B * H)](kh, vh, lam, pi, pj, S, T, NW, D, W=W, R=R, BA=BA, DK=d, DV=dv,
                                                     DOT=dot, num_warps=warps[0])
    window_output_kernel[(T // C, B * H)](qh, lam, pi, pj, pm, S, o, T, NW, D, W=W, C=C, BA=BA, DK=d, DV=dv,
                                          DOT=dot, num_warps=warps[1])
    return o.reshape(B, H, T, dv).permute(0, 2, 1, 3)


def parts(d: int = 128, T: int = 65536, W: int = 1024):
    """The time of each part at one shape: the windows' attention, the state pass, the output kernel."""
    from triton.testing import do_bench
    dev, B, H = "cuda", 2, 16
    op = hladsl.load("power", p=2)
    gen = torch.Generator(device=dev).manual_seed(7)
    q, k = ((torch.randn(B, T, H, d, device=dev, generator=gen) * d ** -0.5).to(torch.bfloat16) for _ in range(2))
    v = torch.randn(B, T, H, d, device=dev, generator=gen).to(torch.bfloat16)
    g = -0.05 * torch.rand(B, T, H, device=dev, generator=gen)
    NW = T // W
    cu = torch.arange(0, B * T + 1, W, device=dev, dtype=torch.int32)
    flat = [x.reshape(1, B * T, H, -1) for x in (q, k, v)]
    qh, kh, vh = (x.permute(0, 2, 1, 3).contiguous() for x in (q, k, v))
    lam = g.float().permute(0, 2, 1).reshape(B * H, NW, W).cumsum(-1).reshape(B * H, T).contiguous()
    pi, pj, pm = pairs(d, dev)
    D = pi.numel()
    S = torch.empty(B * H, NW, D, d, device=dev, dtype=torch.bfloat16)
    o = torch.zeros(B * H, T, d, device=dev)
    with torch.no_grad(), launch.switched(ATTENTION_FORM="always"):
        t_att = do_bench(lambda: op(*flat, g=g.reshape(1, B * T, H), scale=1.0, cu_seqlens=cu), warmup=3, rep=30)
    t_state = do_bench(lambda: window_state_kernel[(triton.cdiv(D, 64), B * H)](
        kh, vh, lam, pi, pj, S, T, NW, D, W=W, R=64, BA=64, DK=d, DV=d, DOT=tl.bfloat16, num_warps=4), warmup=3, rep=30)
    t_out = do_bench(lambda: window_output_kernel[(T // 64, B * H)](
        qh, lam, pi, pj, pm, S, o, T, NW, D, W=W, C=64, BA=64, DK=d, DV=d, DOT=tl.bfloat16, num_warps=4),
        warmup=3, rep=30)
    flops = 2 * B * H * T * D * d   # each of the state pass and the output: one multiply-add per (token, α, e)
    line = (f"d={d} T={T} W={W}: windows' attention {t_att:.2f} ms, gathered state pass {t_state:.2f} "
            f"({flops / t_state / 1e9:.0f} TFLOP/s), output {t_out:.2f} ({flops / t_out / 1e9:.0f} TFLOP/s)")
    for BA in (32, 64):   # row tiles (TFLOP/s by the packed pairs' FLOPs: the useful work)
        ti, tj = row_tiles(d, BA, dev)
        NT = ti.numel()
        S_rows = torch.empty(B * H, NW, NT, BA, d, device=dev, dtype=torch.bfloat16)
        for warps in (4, 8):
            t_state = do_bench(lambda: rows_state_kernel[(NT, B * H)](
                kh, vh, lam, ti, tj, S_rows, T, NW, NT, W=W, R=64, BA=BA, DK=d, DV=d, DOT=tl.bfloat16,
                num_warps=warps),
                warmup=3, rep=30)
            t_out = do_bench(lambda: rows_output_kernel[(T // 64, B * H)](
                qh, lam, ti, tj, S_rows, o, T, NW, NT, W=W, C=64, BA=BA, DK=d, DV=d, DOT=tl.bfloat16,
                num_warps=warps),
                warmup=3, rep=30)
            line += (f"; rows BA={BA} ({NT * BA} columns) {warps} warps: state {t_state:.2f} "
                     f"({flops / t_state / 1e9:.0f}), output {t_out:.2f} ({flops / t_out / 1e9:.0f})")
        if BA == 64:   # the values' decay formed once, rows by 64 or 128 a step
            kh3, vh3 = kh.reshape(B * H, T, d), vh.reshape(B * H, T, d)
            for R in (64, 128):
                t_state = do_bench(lambda: rows_state_kernel[(NT, B * H)](
                    kh3, decayed_values(vh3, lam, W), lam, ti, tj, S_rows, T, NW, NT, W=W, R=R, BA=BA, DK=d, DV=d,
                    DOT=tl.bfloat16, DECAYED=True, num_warps=4), warmup=3, rep=30)
                line += f"; rows BA=64 decayed v, R={R}: state {t_state:.2f} ({flops / t_state / 1e9:.0f})"
    print(line, flush=True)


def best(d: int = 128, T: int = 65536, W: int = 1024):
    """The row-tiled parts at larger steps: the state pass at 256 rows a step, the output at 128
    query rows a program (each S tile read once for more rows)."""
    from triton.testing import do_bench
    dev, B, H = "cuda", 2, 16
    gen = torch.Generator(device=dev).manual_seed(7)
    kh, qh = ((torch.randn(B * H, T, d, device=dev, generator=gen) * d ** -0.5).to(torch.bfloat16) for _ in range(2))
    vh = torch.randn(B * H, T, d, device=dev, generator=gen).to(torch.bfloat16)
    lam = (-0.05 * torch.rand(B * H, T // W, W, device=dev, generator=gen)).cumsum(-1).reshape(B * H, T).contiguous()
    NW, flops = T // W, None
    o = torch.zeros(B * H, T, d, device=dev)
    line = f"d={d} T={T} W={W}"
    for BA in (32, 64):
        ti, tj = row_tiles(d, BA, dev)
        NT = ti.numel()
        flops = 2 * B * H * T * (d * (d + 1) // 2) * d
        S = torch.empty(B * H, NW, NT, BA, d, device=dev, dtype=torch.bfloat16)
        for R, warps in ((128, 4), (256, 4), (256, 8)):
            t = do_bench(lambda: rows_state_kernel[(NT, B * H)](
                kh, decayed_values(vh, lam, W), lam, ti, tj, S, T, NW, NT, W=W, R=R, BA=BA, DK=d, DV=d,
                DOT=tl.bfloat16, DECAYED=True, num_warps=warps), warmup=3, rep=30)
            line += f"; BA={BA} state R={R} {warps}w {t:.2f} ({flops / t / 1e9:.0f})"
        for Cq, warps in ((64, 4), (128, 4), (128, 8)):
            t = do_bench(lambda: rows_output_kernel[(T // Cq, B * H)](
                qh, lam, ti, tj, S, o, T, NW, NT, W=W, C=Cq, BA=BA, DK=d, DV=d, DOT=tl.bfloat16, num_warps=warps),
                warmup=3, rep=30)
            line += f"; BA={BA} output C={Cq} {warps}w {t:.2f} ({flops / t / 1e9:.0f})"
    print(line, flush=True)


def paired(d: int = 128, T: int = 65536, W: int = 1024):
    """Two row tiles of one slice a program (the slice, the values and the query slice loaded once for
    two dots), beside the op by the rule and on the attention form, and the whole windowed forward."""
    from triton.testing import do_bench
    dev, B, H = "cuda", 2, 16
    op = hladsl.load("power", p=2)
    gen = torch.Generator(device=dev).manual_seed(7)
    q, k = ((torch.randn(B, T, H, d, device=dev, generator=gen) * d ** -0.5).to(torch.bfloat16) for _ in range(2))
    v = torch.randn(B, T, H, d, device=dev, generator=gen).to(torch.bfloat16)
    g = -0.05 * torch.rand(B, T, H, device=dev, generator=gen)
    qh, kh, vh = (x.permute(0, 2, 1, 3).contiguous().reshape(B * H, T, d) for x in (q, k, v))
    NW = T // W
    lam = g.float().permute(0, 2, 1).reshape(B * H, NW, W).cumsum(-1).reshape(B * H, T).contiguous()
    flops = 2 * B * H * T * (d * (d + 1) // 2) * d
    o = torch.zeros(B * H, T, d, device=dev)
    line = f"d={d} T={T} W={W} paired"
    for BA in (32, 64):
        ti, tj = row_tiles(d, BA, dev, paired=True)
        NT = ti.numel()
        S = torch.empty(B * H, NW, NT, BA, d, device=dev, dtype=torch.bfloat16)
        vd = decayed_values(vh, lam, W)
        for R, warps in ((64, 4), (128, 4), (128, 8)):
            t = do_bench(lambda: pair_state_kernel[(NT // 2, B * H)](
                kh, vd, ti, tj, S, lam, T, NW, NT, W=W, R=R, BA=BA, DK=d, DV=d, DOT=tl.bfloat16,
                num_warps=warps), warmup=3, rep=30)
            line += f"; BA={BA} state R={R} {warps}w {t:.2f} ({flops / t / 1e9:.0f})"
        for Cq, warps in ((64, 4), (128, 4), (128, 8)):
            t = do_bench(lambda: pair_output_kernel[(T // Cq, B * H)](
                qh, lam, ti, tj, S, o, T, NW, NT, W=W, C=Cq, BA=BA, DK=d, DV=d, DOT=tl.bfloat16,
                num_warps=warps), warmup=3, rep=30)
            line += f"; BA={BA} output C={Cq} {warps}w {t:.2f} ({flops / t / 1e9:.0f})"
        print(line, flush=True)
        line = f"d={d} T={T} W={W} paired"
    with torch.no_grad():
        rule = do_bench(lambda: op(q, k, v, g=g, scale=1.0), warmup=3, rep=30)
        with launch.switched(ATTENTION_FORM="always"):
            attention = do_bench(lambda: op(q, k, v, g=g, scale=1.0), warmup=3, rep=30)
    line = f"d={d} T={T}: op by the rule {rule:.2f} ms, attention form {attention:.2f}"
    for BA, R, C, warps in ((64, 128, 64, (4, 4)), (64, 128, 128, (4, 8)), (32, 128, 128, (4, 8))):
        t = do_bench(lambda: windowed(op, q, k, v, g, W, warps, R=R, BA=BA, paired=True, C=C), warmup=3, rep=30)
        line += f"; windowed paired BA={BA} R={R} C={C} warps {warps} {t:.2f}"
    print(line, flush=True)


def sliced(d: int = 128, T: int = 65536, W: int = 1024):
    """``slice_output_kernel`` against ``pair_output_kernel`` at warps and stages, and the whole windowed
    forward with the paired state pass and either output."""
    from triton.testing import do_bench
    dev, B, H = "cuda", 2, 16
    op = hladsl.load("power", p=2)
    gen = torch.Generator(device=dev).manual_seed(7)
    q, k = ((torch.randn(B, T, H, d, device=dev, generator=gen) * d ** -0.5).to(torch.bfloat16) for _ in range(2))
    v = torch.randn(B, T, H, d, device=dev, generator=gen).to(torch.bfloat16)
    g = -0.05 * torch.rand(B, T, H, device=dev, generator=gen)
    qh = q.permute(0, 2, 1, 3).contiguous().reshape(B * H, T, d)
    NW = T // W
    lam = g.float().permute(0, 2, 1).reshape(B * H, NW, W).cumsum(-1).reshape(B * H, T).contiguous()
    flops = 2 * B * H * T * (d * (d + 1) // 2) * d
    o = torch.zeros(B * H, T, d, device=dev)
    BA = 64
    ti, tj = row_tiles(d, BA, dev, paired=True)
    NT = ti.numel()
    S = torch.randn(B * H, NW, NT, BA, d, device=dev).to(torch.bfloat16)
    line = f"d={d} T={T} W={W} output"
    for Cq, warps, stages in ((64, 4, 2), (64, 4, 3), (128, 4, 2), (128, 8, 2), (128, 8, 3)):
        t_pair = do_bench(lambda: pair_output_kernel[(T // Cq, B * H)](
            qh, lam, ti, tj, S, o, T, NW, NT, W=W, C=Cq, BA=BA, DK=d, DV=d, DOT=tl.bfloat16,
            num_warps=warps, num_stages=stages), warmup=3, rep=30)
        t_slice = do_bench(lambda: slice_output_kernel[(T // Cq, B * H)](
            qh, lam, S, o, T, NW, NT, W=W, C=Cq, BA=BA, DK=d, DV=d, DOT=tl.bfloat16,
            num_warps=warps, num_stages=stages), warmup=3, rep=30)
        line += (f"; C={Cq} {warps}w {stages}s pair {t_pair:.2f} ({flops / t_pair / 1e9:.0f}) "
                 f"slice {t_slice:.2f} ({flops / t_slice / 1e9:.0f})")
    print(line, flush=True)
    line = f"d={d} T={T} W={W} windowed"
    for Cq, warps in ((64, (4, 4)), (128, (4, 8))):
        for sl in (False, True):
            t = do_bench(lambda: windowed(op, q, k, v, g, W, warps, R=128, BA=BA, paired=True, C=Cq, sliced=sl),
                         warmup=3, rep=30)
            line += f"; C={Cq} {'sliced' if sl else 'paired'} {t:.2f}"
    print(line, flush=True)


def against_the_op(T: int = 65536, W: int = 1024):
    """Issue 13's ratio in one process: the op's d = 64 forward (its rule: the chunk form) and d = 128
    (its rule: the attention form) beside the windowed prototype at d = 128 (paired state pass, sliced
    output), gated, B = 2, H = 16, bf16."""
    from triton.testing import do_bench
    dev, B, H = "cuda", 2, 16
    op = hladsl.load("power", p=2)
    times = {}
    for d in (64, 128):
        gen = torch.Generator(device=dev).manual_seed(7)
        q, k = ((torch.randn(B, T, H, d, device=dev, generator=gen) * d ** -0.5).to(torch.bfloat16) for _ in range(2))
        v = torch.randn(B, T, H, d, device=dev, generator=gen).to(torch.bfloat16)
        g = -0.05 * torch.rand(B, T, H, device=dev, generator=gen)
        with torch.no_grad():
            times[f"op d={d}"] = do_bench(lambda: op(q, k, v, g=g, scale=1.0), warmup=3, rep=100)
            if d == 128:
                for W_ in (W, 2 * W):
                    times[f"windowed d={d} W={W_}"] = do_bench(lambda: windowed(
                        op, q, k, v, g, W_, (4, 4), R=128, BA=64, paired=True, C=64, sliced=True), warmup=3, rep=100)
        print(f"T={T} " + ", ".join(f"{name} {t:.2f} ms" for name, t in times.items()) + " | ratios to op d=64: "
              + ", ".join(f"{name} {t / times['op d=64']:.2f}x" for name, t in times.items() if "128" in name),
              flush=True)


def main():
    if sys.argv[1:] == ["against"]:
        against_the_op()
        return
    if sys.argv[1:] == ["sliced"]:
        sliced(128)
        return
    if sys.argv[1:] == ["paired"]:
        paired(128)
        return
    if sys.argv[1:] == ["best"]:
        best(128)
        return
    if sys.argv[1:] == ["parts"]:
        parts(128)
        parts(64)
        return
    from triton.testing import do_bench
    dev = "cuda"
    op = hladsl.load("power", p=2)
    for d in (128, 64):
        gen = torch.Generator(device=dev).manual_seed(7)
        for T, check in ((4096, True), (65536, False)):
            B, H = (1, 4) if check else (2, 16)
            q = (torch.randn(B, T, H, d, device=dev, generator=gen) * d ** -0.5).to(torch.bfloat16)
            k = (torch.randn(B, T, H, d, device=dev, generator=gen) * d ** -0.5).to(torch.bfloat16)
            v = torch.randn(B, T, H, d, device=dev, generator=gen).to(torch.bfloat16)
            g = -0.05 * torch.rand(B, T, H, device=dev, generator=gen)
            if check:
                with torch.no_grad():
                    want = op(q, k, v, g=g, scale=1.0)[0].float()
                for W in (1024, 2048):
                    got = windowed(op, q, k, v, g, W)
                    err = ((got - want).norm() / want.norm()).item()
                    print(f"d={d} T={T} W={W}: rel. error against the op {err:.2e}", flush=True)
                continue
            with torch.no_grad():
                rule = do_bench(lambda: op(q, k, v, g=g, scale=1.0), warmup=5, rep=50)
                with launch.switched(ATTENTION_FORM="always"):
                    attention = do_bench(lambda: op(q, k, v, g=g, scale=1.0), warmup=5, rep=50)
                line = f"d={d} T={T} B={B} H={H}: op by the rule {rule:.2f} ms, attention form {attention:.2f}"
                for W in (1024, 2048):
                    for warps in ((4, 4), (8, 4)):
                        try:
                            t = do_bench(lambda: windowed(op, q, k, v, g, W, warps), warmup=3, rep=30)
                            line += f"; window {W} warps {warps} {t:.2f}"
                        except Exception as exc:   # (a prototype: report and go on)
                            line += f"; window {W} warps {warps} failed: {type(exc).__name__}"
                print(line, flush=True)


if __name__ == "__main__":
    sys.exit(main())
