"""Standalone: the dv group's chain at d = 128 -- t = A^T B (128 x 128 x 128, fp32 tiles cast to bf16),
then r = Q t^T ([64, 128] x [128, 128]). Variant by argv[1]."""
import sys
import torch
import triton
import triton.language as tl

@triton.jit
def k(a_ptr, b_ptr, q_ptr, r_ptr, V: tl.constexpr, D: tl.constexpr, C: tl.constexpr):
    offs_d = tl.arange(0, D)
    offs_t = tl.arange(0, C)
    a = tl.load(a_ptr + offs_d[:, None] * D + offs_d[None, :], mask=offs_d[:, None] < D, other=0.0)
    b = tl.load(b_ptr + offs_d[:, None] * D + offs_d[None, :], mask=offs_d[:, None] < D, other=0.0)
    q = tl.load(q_ptr + offs_t[:, None] * D + offs_d[None, :])
    if V == 0:
        t = tl.dot(tl.trans(a).to(tl.bfloat16), b.to(tl.bfloat16))
        r = tl.dot(q, tl.trans(t).to(tl.bfloat16))
    elif V == 1:
        t = tl.dot(tl.trans(a.to(tl.bfloat16)), b.to(tl.bfloat16))
        r = tl.dot(q, tl.trans(t.to(tl.bfloat16)))
    elif V == 2:   # the other order: (Q B^T) A
        u = tl.dot(q, tl.trans(b).to(tl.bfloat16))
        r = tl.dot(u.to(tl.bfloat16), a.to(tl.bfloat16))
    else:          # t transposed via a dot of transposed operands: t^T = B^T A
        tt = tl.dot(tl.trans(b).to(tl.bfloat16), a.to(tl.bfloat16))
        r = tl.dot(q, tt.to(tl.bfloat16))
    tl.store(r_ptr + offs_t[:, None] * D + offs_d[None, :], r)

V, D, C, W = (int(x) for x in sys.argv[1:5])
a, b = torch.randn(D, D, device="cuda"), torch.randn(D, D, device="cuda")
q = torch.randn(C, D, device="cuda", dtype=torch.bfloat16)
r = torch.empty(C, D, device="cuda")
try:
    k[(1,)](a, b, q, r, V=V, D=D, C=C, num_warps=W)
    torch.cuda.synchronize()
    ref = q.float() @ (a.T @ b).T
    print(f"variant {V} D={D} C={C} warps={W}: ok, rel err {((r - ref).norm() / ref.norm()).item():.2e}")
except Exception as e:
    print(f"variant {V} D={D} C={C} warps={W}: FAILED {repr(e)[:120]}")
