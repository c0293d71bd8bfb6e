"""One fp32 training call of a spec on CUDA (backend "auto": the generated kernels) against
the torch path in float64 on the CPU; prints one JSON line of relative errors. Run in a
process of its own by test_gpu_fp32.py: an illegal memory access poisons the process's
CUDA context, so it must not take the suite's worker down with it.

    python fp32_worker.py SPEC_ID GATED(0/1) [DEVICE]   (DEVICE "cpu": the harness itself,
    under TRITON_INTERPRET=1 at a small shape)"""
import json
import sys

import torch

import hladsl
from gpu_support import BY_ID

spec, gated = BY_ID[sys.argv[1]], sys.argv[2] == "1"
device = sys.argv[3] if len(sys.argv) > 3 else "cuda"
# B = 1, T = 1024, H = 2: the shape where hla3's fp32 reverse pass narrows its value blocks to 16
# (run 258); two chunks' worth on the CPU
B, T, H = (1, 1024, 2) if device == "cuda" else (1, 80, 1)
d = dv = spec.d if device == "cuda" else 8
gen = torch.Generator().manual_seed(0)
dims = {"d": d, "dv": dv}
base = [torch.randn(B, T, H, dims[dim], generator=gen, dtype=torch.float64) / dims[dim] ** 0.25
        for _, dim in spec.inputs]
g = -0.05 * torch.rand(B, T, H, generator=gen, dtype=torch.float64) if gated else None
cot = torch.randn(B, T, H, dv, generator=gen, dtype=torch.float64)


def run(backend, dev, dtype):
    op = hladsl.load(spec.source(), backend=backend, **spec.params)
    xs = [x.to(dev, dtype).requires_grad_() for x in base]
    gl = g.to(dev, dtype).requires_grad_() if gated else None
    o = op(*xs, g=gl)[0]
    o.backward(cot.to(dev, dtype))
    return [o] + [x.grad for x in xs] + ([gl.grad] if gated else [])


got = run("auto" if device == "cuda" else "triton", device, torch.float32)
want = run("torch", "cpu", torch.float64)
names = ["o"] + [f"d{n}" for n, _ in spec.inputs] + (["dg"] if gated else [])
print(json.dumps({n: ((a.double().cpu() - b).norm() / b.norm()).item() for n, a, b in zip(names, got, want)}))
