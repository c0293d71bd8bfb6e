"""Run every shipped mechanism on the CPU and compare the chunked op with the
derived serial recurrence."""
import time

import torch

import hladsl
from hladsl.frontend.specs import shipped_names

torch.manual_seed(0)
B, T, H, d, dv = 1, 256, 2, 16, 16
q, k, v = torch.randn(B, T, H, d), torch.randn(B, T, H, d), torch.randn(B, T, H, dv)
g = -0.1 * torch.rand(B, T, H)
for name in shipped_names():
    op = hladsl.load(name, normalize=True)
    start = time.perf_counter()
    o, state = op(q, k, v, g=g, output_final_state=True)
    elapsed = time.perf_counter() - start
    ref, _ = op.serial(q[:, :32], k[:, :32], v[:, :32], g=g[:, :32])
    err = ((o[:, :32] - ref).norm() / ref.norm()).item()
    shapes = {n: tuple(s.shape[2:]) for n, s in state.items()}
    print(f"{name:12s} o {tuple(o.shape)}  {elapsed * 1e3:7.1f} ms  chunked vs serial {err:.1e}  "
          f"state {shapes}")
