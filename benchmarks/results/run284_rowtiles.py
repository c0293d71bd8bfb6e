"""Round 44, run 284: a hand-written prototype of power p = 2's forward with *row tiles* of the packed
dim (a tile = one first index a and an aligned block of 64 second indices b >= a: its factor columns are
one column of the token tile times an aligned [C, 64] slice -- no one-hot dots, no gather), timed beside
hladsl's generated forward in the same process, gated, bf16, B = 2, H = 16, T = 16384.
The packed layout is the generated kernels' (combinations_with_replacement order), so the prototype's
output is compared with the op's.  Not a runtime path: a probe of whether the rule is worth generating."""
import sys

import torch
import triton
import triton.language as tl
from triton.testing import do_bench

import hladsl


@triton.jit
def rt_state(k_ptr, v_ptr, lam_ptr, tiles_ptr, starts_ptr, T, H, nC,
             D: tl.constexpr, DP: tl.constexpr, DV: tl.constexpr, C: tl.constexpr, BT: tl.constexpr, BV: tl.constexpr,
             DT: tl.constexpr = tl.bfloat16):
    pid_nh = tl.program_id(0).to(tl.int64)
    tile = tl.program_id(1)
    pid_v = tl.program_id(2)
    b = pid_nh // H
    h = pid_nh % H
    a = tl.load(tiles_ptr + 2 * tile)
    b0 = tl.load(tiles_ptr + 2 * tile + 1)
    cols = b0 + tl.arange(0, BT)
    valid = (cols >= a) & (cols < D)
    offs_p = a * D - (a * (a - 1)) // 2 - a + cols        # packed position of (a, col)
    offs_v = pid_v * BV + tl.arange(0, BV)
    offs_t = tl.arange(0, C)
    st = tl.zeros((BT, BV), dtype=tl.float32)
    for c in range(nC):
        tl.store(starts_ptr + ((pid_nh * nC + c) * DP + offs_p[:, None]) * DV + offs_v[None, :],
                 st.to(starts_ptr.dtype.element_ty), mask=valid[:, None])
        rows = (b * T + c * C + offs_t) * H + h
        kcol = tl.load(k_ptr + rows * D + a).to(tl.float32)
        kblk = tl.load(k_ptr + rows[:, None] * D + cols[None, :], mask=(cols < D)[None, :], other=0.0).to(tl.float32)
        v = tl.load(v_ptr + rows[:, None] * DV + offs_v[None, :]).to(tl.float32)
        lam = tl.load(lam_ptr + (pid_nh * nC + c) * C + offs_t)
        lam_end = tl.load(lam_ptr + (pid_nh * nC + c) * C + C - 1)
        phi = tl.where(valid[None, :], kcol[:, None] * kblk, 0.0)
        vd = v * tl.exp(lam_end - lam)[:, None]
        st = st * tl.exp(lam_end) + tl.dot(tl.trans(phi.to(DT)), vd.to(DT))


@triton.jit
def rt_output(q_ptr, k_ptr, v_ptr, lam_ptr, tiles_ptr, starts_ptr, o_ptr, T, H, nC, NT,
              D: tl.constexpr, DP: tl.constexpr, DV: tl.constexpr, C: tl.constexpr, BT: tl.constexpr,
              DT: tl.constexpr = tl.bfloat16):
    c = tl.program_id(0)
    pid_nh = tl.program_id(1).to(tl.int64)
    b = pid_nh // H
    h = pid_nh % H
    offs_t = tl.arange(0, C)
    offs_d = tl.arange(0, D)
    offs_v = tl.arange(0, DV)
    rows = (b * T + c * C + offs_t) * H + h
    q = tl.load(q_ptr + rows[:, None] * D + offs_d[None, :])
    k = tl.load(k_ptr + rows[:, None] * D + offs_d[None, :])
    v = tl.load(v_ptr + rows[:, None] * DV + offs_v[None, :])
    lam = tl.load(lam_ptr + (pid_nh * nC + c) * C + offs_t)
    s = tl.dot(q.to(DT), tl.trans(k.to(DT)))
    mask = tl.exp(tl.where(offs_t[:, None] >= offs_t[None, :], lam[:, None] - lam[None, :], float("-inf")))
    o = tl.dot((s * s * mask).to(DT), v.to(DT))
    acc = tl.zeros((C, DV), dtype=tl.float32)
    for t in range(NT):
        a = tl.load(tiles_ptr + 2 * t)
        b0 = tl.load(tiles_ptr + 2 * t + 1)
        cols = b0 + tl.arange(0, BT)
        valid = (cols >= a) & (cols < D)
        offs_p = a * D - (a * (a - 1)) // 2 - a + cols
        qcol = tl.load(q_ptr + rows * D + a).to(tl.float32)
        qblk = tl.load(q_ptr + rows[:, None] * D + cols[None, :], mask=(cols < D)[None, :], other=0.0).to(tl.float32)
        phi = tl.where(valid[None, :], qcol[:, None] * qblk * tl.where(cols == a, 1.0, 2.0)[None, :], 0.0)
        st = tl.load(starts_ptr + ((pid_nh * nC + c) * DP + offs_p[:, None]) * DV + offs_v[None, :],
                     mask=valid[:, None], other=0.0)
        acc += tl.dot(phi.to(DT), st.to(DT))
    o += acc * tl.exp(lam)[:, None]
    tl.store(o_ptr + rows[:, None] * DV + offs_v[None, :], o.to(o_ptr.dtype.element_ty))


def row_tiles(d, bt, device):
    tiles = [(a, j * bt) for j in range(-(-d // bt)) for a in range(min(d, (j + 1) * bt))]
    return torch.tensor(tiles, dtype=torch.int32, device=device).flatten(), len(tiles)


def prototype(q, k, v, g, C, bt=64, bv=None, warps_state=4, warps_out=4, dt=tl.bfloat16, stages=None, parts=False):
    B, T, H, d = q.shape
    dv = v.shape[-1]
    nC = T // C
    dp = d * (d + 1) // 2
    lam = g.float().permute(0, 2, 1).reshape(B * H, nC, C).cumsum(-1).contiguous()
    tiles, nt = row_tiles(d, bt, q.device)
    bv = bv or dv
    starts = torch.empty(B * H, nC, dp, dv, device=q.device, dtype=torch.bfloat16 if dt == tl.bfloat16 else torch.float32)
    o = torch.empty_like(v)

    extra = {} if stages is None else {"num_stages": stages}

    def state():
        rt_state[(B * H, nt, dv // bv)](k, v, lam, tiles, starts, T, H, nC, D=d, DP=dp, DV=dv, C=C, BT=bt, BV=bv, DT=dt,
                                        num_warps=warps_state, **extra)

    def output():
        rt_output[(nC, B * H)](q, k, v, lam, tiles, starts, o, T, H, nC, nt, D=d, DP=dp, DV=dv, C=C, BT=bt, DT=dt,
                               num_warps=warps_out, **extra)
        return o

    def run():
        state()
        return output()
    return (run, state, output) if parts else run


def main():
    dev = "cuda"
    B, H, T = 2, 16, 16384
    op = hladsl.load("power", p=2)
    for d in [int(x) for x in (sys.argv[1:] or ["128", "64"])]:
        gen = torch.Generator(device=dev).manual_seed(0)
        q = (torch.randn(B, T, H, d, device=dev, generator=gen) / d ** 0.5).to(torch.bfloat16)
        k = (torch.randn(B, T, H, d, device=dev, generator=gen) / d ** 0.5).to(torch.bfloat16)
        v = torch.randn(B, T, H, d, device=dev, generator=gen).to(torch.bfloat16)
        g = torch.nn.functional.logsigmoid(4 + torch.randn(B, T, H, device=dev, generator=gen))
        ref = op(q, k, v, g=g, scale=1.0)
        ref = ref[0] if isinstance(ref, tuple) else ref
        ms = do_bench(lambda: op(q, k, v, g=g, scale=1.0))
        print(f"d={d} hladsl generated forward: {ms:.3f} ms", flush=True)
        for C, ws, wo, bv in [(64, 4, 4, None), (128, 4, 8, None), (64, 8, 8, None), (128, 8, 8, None),
                              (64, 4, 4, d // 2), (128, 4, 8, d // 2)]:
            if d < 128 and (C, ws, wo) != (64, 4, 4):
                continue
            try:
                run = prototype(q, k, v, g, C, bv=bv, warps_state=ws, warps_out=wo)
                out = run()
                err = ((out.float() - ref.float()).pow(2).mean() / ref.float().pow(2).mean()).sqrt().item()
                ms = do_bench(run)
                print(f"d={d} row tiles C={C} warps state/out={ws}/{wo} BV={bv or d}: {ms:.3f} ms "
                      f"(rel RMS vs the op {err:.2e})", flush=True)
            except Exception as exc:   # a config that does not fit is reported, not fatal
                print(f"d={d} row tiles C={C} warps {ws}/{wo}: {type(exc).__name__}: {str(exc)[:200]}", flush=True)


def stages_probe():
    """Run 285: each kernel's time apart, at 1-3 software-pipeline stages (d = 128, C = 128)."""
    dev, B, H, T, d = "cuda", 2, 16, 16384, 128
    gen = torch.Generator(device=dev).manual_seed(0)
    q = (torch.randn(B, T, H, d, device=dev, generator=gen) / d ** 0.5).to(torch.bfloat16)
    k = (torch.randn(B, T, H, d, device=dev, generator=gen) / d ** 0.5).to(torch.bfloat16)
    v = torch.randn(B, T, H, d, device=dev, generator=gen).to(torch.bfloat16)
    g = torch.nn.functional.logsigmoid(4 + torch.randn(B, T, H, device=dev, generator=gen))
    for C, ws, wo, bv in [(128, 4, 8, 64), (64, 4, 4, 64), (128, 4, 8, 128)]:
        for stages in (None, 1, 2, 3):
            try:
                run, state, output = prototype(q, k, v, g, C, bv=bv, warps_state=ws, warps_out=wo, stages=stages,
                                               parts=True)
                run()
                print(f"C={C} BV={bv} warps {ws}/{wo} stages={stages}: state {do_bench(state):.3f} ms, "
                      f"output {do_bench(output):.3f} ms", flush=True)
            except Exception as exc:
                print(f"C={C} stages={stages}: {type(exc).__name__}: {str(exc)[:150]}", flush=True)


def interpreter_check():
    """The prototype against the op in float64, fp32 tiles under TRITON_INTERPRET=1 (d = 32, tiles of
    16 and 32, B = 1, H = 2, T = 64, C = 16): ``TRITON_INTERPRET=1 python run284_rowtiles.py check``."""
    torch.manual_seed(0)
    B, H, T, d = 1, 2, 64, 32
    q = torch.randn(B, T, H, d) / d ** 0.5
    k = torch.randn(B, T, H, d) / d ** 0.5
    v = torch.randn(B, T, H, d)
    g = torch.nn.functional.logsigmoid(4 + torch.randn(B, T, H))
    ref = hladsl.load("power", p=2)(q.double(), k.double(), v.double(), g=g.double(), scale=1.0)
    ref = ref[0] if isinstance(ref, tuple) else ref
    for bt in (16, 32):
        out = prototype(q, k, v, g, 16, bt=bt, dt=tl.float32)()
        err = ((out.double() - ref).pow(2).mean() / ref.pow(2).mean()).sqrt().item()
        print(f"tiles of {bt}: rel RMS against the op in float64 {err:.2e}")


if __name__ == "__main__" and sys.argv[1:] == ["check"]:
    interpreter_check()
elif __name__ == "__main__" and sys.argv[1:] == ["stages"]:
    stages_probe()
elif __name__ == "__main__":
    main()
