"""Run 277: power p = 2 (gated, bf16, B = 1, T = 4096, H = 4) forward and backward under the
POWER_COLUMNS mode of this process (HLADSL_POWER_COLUMNS); saves o, the final state and the
gradients to $OUT/run277_<mode>_d<d>.pt, then, given two modes, says whether they are equal."""
import os
import sys

import torch

import hladsl
from hladsl.codegen import triton_gen

out = os.environ["OUT"]
if sys.argv[1] == "compare":
    for d in (64, 128):
        a, b = (torch.load(f"{out}/run277_{m}_d{d}.pt") for m in sys.argv[2:4])
        for k in a:
            same = torch.equal(a[k], b[k])
            err = ((a[k].float() - b[k].float()).norm() / b[k].float().norm().clamp_min(1e-30)).item()
            print(f"d={d} {k}: {'bitwise equal' if same else f'differs, rel {err:.2e}'}")
    raise SystemExit(0)
mode = triton_gen.POWER_COLUMNS
for d in (64, 128):
    gen = torch.Generator(device="cuda").manual_seed(0)
    B, T, H = 1, 4096, 4
    q, k, v = (torch.randn(B, T, H, d, device="cuda", generator=gen) / (d ** 0.5 if i else 1.0)
               for i in range(3))
    q, k, v = (x.bfloat16().requires_grad_() for x in (q, k, v))
    g = torch.nn.functional.logsigmoid(4 + torch.randn(B, T, H, device="cuda", generator=gen)).requires_grad_()
    op = hladsl.load("power", p=2)
    o, final = op(q, k, v, g=g, output_final_state=True)
    do = torch.randn(o.shape, device="cuda", generator=gen).to(o.dtype)
    torch.autograd.backward([o], [do])
    saved = {"o": o.detach(), **{f"final_{n}": s.detach() for n, s in final.items()},
             "dq": q.grad, "dk": k.grad, "dv": v.grad, "dg": g.grad}
    torch.save({k: x.cpu() for k, x in saved.items()}, f"{out}/run277_{mode}_d{d}.pt")
    print(f"{mode} d={d}: saved")
