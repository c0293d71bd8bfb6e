"""HLA3's carried form (launch.CARRY_PRODUCTS on) under the Triton interpreter, float32, against the
float64 torch path: relative errors of o and the gradients of q, k, v (and g where gated).
    TRITON_INTERPRET=1 python round34_hla3_carried_interpreter.py D T GATED NORMALIZE"""
import sys

import torch

import hladsl
from hladsl.runtime import launch

d, T, gated, normalize = int(sys.argv[1]), int(sys.argv[2]), sys.argv[3] == "1", sys.argv[4] == "1"
launch.switch("CARRY_PRODUCTS", True)
torch.manual_seed(0)
base = [torch.randn(1, T, 2, d, dtype=torch.float64) * 0.5 for _ in range(3)]
base = [x.abs() if normalize else x for x in base] + ([-0.1 * torch.rand(1, T, 2, dtype=torch.float64)] if gated else [])
do = torch.randn(1, T, 2, d, dtype=torch.float64)


def run(op, dtype):
    xs = [x.to(dtype).clone().requires_grad_() for x in base]
    o, _ = op(*xs[:3], g=xs[3] if gated else None)
    o.backward(do.to(dtype))
    return [o.detach()] + [x.grad for x in xs]


op = hladsl.load("hla3", backend="triton", normalize=normalize)
ran = op._carried_op(base[0].float(), None, False)
got = run(op, torch.float32)
ref = run(hladsl.load("hla3", backend="torch", normalize=normalize), torch.float64)
print(f"d={d} T={T} gated={gated} normalize={normalize} ran={ran.algebra.name if ran else 'as written'}: " +
      ", ".join(f"{n} {((a - b.double()).norm() / a.norm()).item():.2e}" for n, a, b in zip("o dq dk dv dg".split(), ref, got)))
