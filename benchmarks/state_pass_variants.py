"""The experiment behind the transposed token loads (benchmarks/RESULTS.md, round 5, run 40):
linear's state pass written by hand in the forms the code generator could emit -- a register
transpose of an fp32 token tile (what it emitted) vs a transposed load in the input dtype, the
gate applied to k or to v, chunk-start states stored in fp32 or bf16 -- beside fla's chunk_fwd_h.

    python benchmarks/state_pass_variants.py        # H100: B = 2, T = 4096, H = 16, d = 64
"""
import torch
import triton
import triton.language as tl

VARIANTS = ((0, 0, 0), (1, 0, 0), (1, 1, 0), (1, 1, 1), (1, 0, 1))   # trans_load, scale_v, bf16 starts


@triton.jit
def state_pass(k_ptr, v_ptr, lam_ptr, starts, T, H, n_chunks, C: tl.constexpr, D: tl.constexpr,
               BV: tl.constexpr, GATED: tl.constexpr, TRANS_LOAD: tl.constexpr,
               BF16_STARTS: tl.constexpr, SCALE_V: tl.constexpr):
    pid = tl.program_id(0).to(tl.int64)
    b, h = pid // H, pid % H
    offs_t = tl.arange(0, C)
    offs_d = tl.arange(0, D)
    offs_v = tl.program_id(1) * BV + tl.arange(0, BV)
    state = tl.zeros((D, BV), tl.float32)
    row = H * D
    base = b * T * row + h * D
    for i_c in range(0, n_chunks):
        at = ((pid * n_chunks + i_c) * D + offs_d[:, None]) * D + offs_v[None, :]
        tl.store(starts + at, state.to(tl.bfloat16) if BF16_STARTS else state)
        rows = i_c * C + offs_t
        v = tl.load(v_ptr + base + rows[:, None] * row + offs_v[None, :])
        if GATED:
            lam = tl.load(lam_ptr + pid * T + rows)
            lam_end = tl.load(lam_ptr + pid * T + i_c * C + C - 1)
            w = tl.exp(lam_end - lam)
            state = state * tl.exp(lam_end)
        if TRANS_LOAD:
            kt = tl.load(k_ptr + base + rows[None, :] * row + offs_d[:, None])   # [D, C] bf16
            if GATED:
                if SCALE_V:
                    v = (v.to(tl.float32) * w[:, None]).to(tl.bfloat16)
                else:
                    kt = (kt.to(tl.float32) * w[None, :]).to(tl.bfloat16)
            state += tl.dot(kt, v)
        else:   # the generator's former form: fp32 tile, register transpose
            kt = tl.trans(tl.load(k_ptr + base + rows[:, None] * row + offs_d[None, :]).to(tl.float32))
            if GATED:
                kt = kt * w[None, :]
            state += tl.dot(kt.to(tl.bfloat16), v.to(tl.float32).to(tl.bfloat16))


def main():
    B, T, H, D, C = 2, 4096, 16, 64, 64
    n_chunks = T // C
    k = torch.randn(B, T, H, D, device="cuda").bfloat16()
    v = torch.randn_like(k)
    g = torch.nn.functional.logsigmoid(4 + torch.randn(B, T, H, device="cuda"))
    lam = g.view(B, n_chunks, C, H).cumsum(2).permute(0, 3, 1, 2).contiguous()
    results = []
    for gated in (False, True):
        for trans, scale_v, bf16 in VARIANTS:
            if scale_v and not gated:
                continue
            for BV in (16, 32, 64):
                for stages in (2, 3, 4):
                    starts = torch.empty(B * H * n_chunks * D * D, device="cuda",
                                         dtype=torch.bfloat16 if bf16 else torch.float32)
                    grid = (B * H, D // BV)

                    def run():
                        state_pass[grid](k, v, lam, starts, T, H, n_chunks, C=C, D=D, BV=BV, GATED=gated,
                                         TRANS_LOAD=trans, BF16_STARTS=bf16, SCALE_V=scale_v,
                                         num_warps=4, num_stages=stages)
                    us = 1e3 * triton.testing.do_bench(run, warmup=5, rep=50, return_mode="median")
                    results.append(((trans, scale_v, bf16), gated, BV, stages, us))
    for gated in (False, True):
        print("gated" if gated else "ungated")
        for variant in VARIANTS:
            rows = sorted((r for r in results if r[1] == gated and r[0] == variant), key=lambda r: r[-1])
            if rows:
                print(f"  trans_load, scale_v, bf16 starts = {variant}: {rows[0][-1]:.1f} us "
                      f"(BV = {rows[0][2]}, {rows[0][3]} stages)")
    try:
        from fla.ops.common.chunk_h import chunk_fwd_h
        from fla.ops.utils import chunk_local_cumsum
    except ImportError:
        return
    for gated in (False, True):
        gl = chunk_local_cumsum(g, chunk_size=64) if gated else None
        us = 1e3 * triton.testing.do_bench(lambda: chunk_fwd_h(k, v, g=gl), warmup=5, rep=50,
                                           return_mode="median")
        print(f"fla chunk_fwd_h {'gated' if gated else 'ungated'}: {us:.1f} us")


if __name__ == "__main__":
    main()
