"""Round 35: how HLA3's carried form (ir.carried) conditions a long ungated sequence, on the CPU's
torch path (no GPU): fp32 against float64 of the spec as written, T = 65536, d = 16, one head.
    python benchmarks/results/round35_hla3_long_fp32_cpu.py"""
import time

import torch

import hladsl
from hladsl.runtime.op import Op, carried_compilation

torch.manual_seed(0)
T, d = 65536, 16
alg = hladsl.load("hla3").algebra
as_written = hladsl.load("hla3", backend="torch")
carried = Op(carried_compilation(alg)[0], "torch", derive_carried=False)
q = torch.randn(1, T, 1, d, dtype=torch.float64)
k = torch.randn(1, T, 1, d, dtype=torch.float64) / d ** 0.5
v = torch.randn(1, T, 1, d, dtype=torch.float64)
for gated in (False, True):
    g = -0.01 * torch.rand(1, T, 1, dtype=torch.float64) if gated else None
    t = time.time()
    ref, _ = as_written(q, k, v, g=g)

    def rms(a):
        return ((a.double() - ref).pow(2).mean().sqrt() / ref.pow(2).mean().sqrt()).item()

    def f(x):
        return None if x is None else x.float()
    o1, _ = as_written(f(q), f(k), f(v), g=f(g))
    o2, _ = carried(f(q), f(k), f(v), g=f(g))
    o3, _ = carried(q, k, v, g=g)
    print(f"gated={gated}: RMS ratio against float64 as written -- fp32 as written {rms(o1):.2e}, "
          f"fp32 carried {rms(o2):.2e}, float64 carried {rms(o3):.2e} ({time.time() - t:.0f} s)")
