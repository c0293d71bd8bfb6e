"""One stateless hla2 fwd + bwd call (the carried form where HLADSL_LAUNCH has CARRY_DERIVED=true):
prints OK or FAILED with the launch settings. python run239_probe.py GATED D T (one process per variant:
a misaligned address leaves the CUDA context unusable)."""
import os
import sys

import torch

import hladsl

gated, d, T = sys.argv[1] == "1", int(sys.argv[2]), int(sys.argv[3])
tag = f"gated={int(gated)} d={d} T={T} [{os.environ.get('HLADSL_LAUNCH')}]"
q, k, v = (torch.randn(2, T, 4, d, device="cuda", dtype=torch.bfloat16, requires_grad=True) for _ in range(3))
g = (-0.05 * torch.rand(2, T, 4, device="cuda")).requires_grad_() if gated else None
try:
    o, _ = hladsl.load("hla2")(q, k, v, g=g)
    o.backward(torch.randn_like(o))
    torch.cuda.synchronize()
    print("OK", tag, flush=True)
except Exception as e:
    print("FAILED", tag, repr(e)[:160], flush=True)
