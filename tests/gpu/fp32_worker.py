"""One fp32 training call of a spec on CUDA (backend "auto": the generated kernels) against
the torch path in float64 on the CPU; prints one JSON line of RMS ratios. Run in a process
of its own by test_gpu_fp32.py: an illegal memory access poisons the process's CUDA
context, so it must not take the suite's worker down with it.

    python fp32_worker.py SPEC_ID GATED(0/1) [cpu]   (cpu: the harness itself, on CPU tensors
    under TRITON_INTERPRET=1 at a small shape)"""
import json
import sys

import torch

import gpu_support as gs

spec, gated = gs.BY_ID[sys.argv[1]], sys.argv[2] == "1"
on_cpu = sys.argv[3:] == ["cpu"]
if on_cpu:
    gs.DEVICE = torch.device("cpu")
# B = 1, T = 1024, H = 2: a shape where hla3's fp32 reverse pass narrows its value blocks to 16
# (run 258); on the CPU two chunks of the interpreter's
B, T, H = (1, 80, 1) if on_cpu else (1, 1024, 2)
d = dv = 8 if on_cpu else spec.d
gen = gs.generator(0)
tokens = gs.tokens(spec, B, T, H, d, dv, torch.float64, False, gen)
g = gs.gates(B, T, H, gen).double() if gated else None
cot = torch.randn(B, T, H, dv, device=gs.DEVICE, generator=gen, dtype=torch.float64)


def run(backend: str, device, dtype) -> dict:
    leaves = {n: x.to(device, dtype).requires_grad_() for n, x in tokens.items()}
    if gated:
        leaves["g"] = g.to(device, dtype).requires_grad_()
    o = gs.load(spec, backend)(*(leaves[n] for n in tokens), g=leaves.get("g"))[0]
    o.backward(cot.to(device, dtype))
    return {"o": o, **{f"d{n}": x.grad for n, x in leaves.items()}}


got = run("triton" if on_cpu else "auto", gs.DEVICE, torch.float32)
want = run("torch", "cpu", torch.float64)
print(json.dumps({n: gs.rms_ratio(want[n], got[n].cpu()) for n in want}))
