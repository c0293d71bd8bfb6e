"""Stateless hla2 calls (no state in or out: what launch.CARRY_DERIVED routes to the carried form),
bf16 kernels with and without the carried form against the fp32 torch program: RMS ratios of o and
dq, dk, dv (dg where gated). python run238_numerics.py GATED D T"""
import sys
import time

import torch

import hladsl
from hladsl.runtime import launch
from gpu_support import rms_ratio

gated, d, T = sys.argv[1] == "1", int(sys.argv[2]), int(sys.argv[3])
gen = torch.Generator(device="cuda").manual_seed(1000 + d)
q, k, v = (torch.randn(1, T, 4, d, device="cuda", generator=gen) for _ in range(3))
g = -0.05 * torch.rand(1, T, 4, device="cuda", generator=gen) if gated else None
do = torch.randn(1, T, 4, d, device="cuda", generator=gen)


def run(op, dtype):
    xs = [x.detach().to(dtype).clone().requires_grad_() for x in (q, k, v)] + ([g.clone().requires_grad_()] if gated else [])
    o, _ = op(*xs[:3], g=xs[3] if gated else None)
    o.backward(do.to(o.dtype))
    return [o] + [x.grad for x in xs]


ref = run(hladsl.load("hla2", backend="torch"), torch.float32)
for on in (False, True):
    launch.switch("CARRY_DERIVED", on)
    t0 = time.time()
    try:
        got = run(hladsl.load("hla2"), torch.bfloat16)
        torch.cuda.synchronize()
        names = ["o", "dq", "dk", "dv", "dg"]
        print(f"hla2 gated={gated} d={d} T={T} carried={on} ({time.time() - t0:.0f} s): " +
              ", ".join(f"{n} {rms_ratio(r, x):.3e}" for n, r, x in zip(names, ref, got)), flush=True)
    except Exception as e:
        print(f"hla2 gated={gated} d={d} T={T} carried={on}: FAILED {repr(e)[:200]}", flush=True)
        break
