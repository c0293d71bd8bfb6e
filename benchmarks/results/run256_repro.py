"""Round 38, run 256: run 255's illegal memory access (run254_trials.py's bf16 hla3 call, B = 2,
T = 2048, H = 4, ungated, no state) located: the call with CUDA_LAUNCH_BLOCKING=1, every kernel
launch recorded, the last one named where the call fails.
    python3 run256_repro.py B T H [gated] [fp32] [warps4] [ieee]
(run 258: fp32 inputs; run 259: the launch fallbacks without 8 warps, fp32-accurate dots as "ieee")"""
import sys
import traceback

import torch

import hladsl
from hladsl.runtime import direct, launch

B, T, H = (int(a) for a in sys.argv[1:4])
gated = "gated" in sys.argv[4:]
dtype = torch.float32 if "fp32" in sys.argv[4:] else torch.bfloat16
last = []
call, cached = direct.call, direct.cached


def note(kernel, grid, args):
    name = getattr(getattr(kernel, "fn", kernel), "__name__", str(kernel))
    shown = {k: v for k, v in args.items() if k.isupper() or k.startswith(("B_", "num_"))}
    last[:] = [f"{name} grid={tuple(grid)} {shown}"]


def recorded(kernel, grid, args, key_args=None):
    note(kernel, grid, args)
    return call(kernel, grid, args, key_args)


def recorded_cached(kernel, grid, args):
    note(kernel, grid, args)
    return cached(kernel, grid, args)


direct.call, direct.cached = recorded, recorded_cached
if "warps4" in sys.argv[4:]:
    launch.FALLBACKS = tuple(f for f in launch.FALLBACKS if f.get("num_warps", 4) == 4)
if "ieee" in sys.argv[4:]:
    launch.EXACT_DOTS = launch.EXACT_STATE_DOTS = "ieee"
print("variant:", sys.argv[4:], launch.FALLBACKS, launch.EXACT_DOTS, launch.EXACT_STATE_DOTS)
torch.manual_seed(0)
d = 64
x = [(torch.randn(B, T, H, d, device="cuda") / d ** 0.25).to(dtype).requires_grad_() for _ in range(3)]
g = (-0.05 * torch.rand(B, T, H, device="cuda")).requires_grad_() if gated else None
try:
    o = hladsl.load("hla3")(*x, g=g)[0]
    o.backward(torch.randn_like(o))
    torch.cuda.synchronize()
    print(f"B={B} T={T} H={H} gated={gated} {dtype}: OK, |dq| {x[0].grad.float().norm():.4g}")
except Exception as exc:
    print(f"B={B} T={T} H={H} gated={gated} {dtype}: FAILED {type(exc).__name__}: {str(exc)[:200]}")
    print("  last launch:", last[0][:900] if last else None)
    print("  " + "".join(traceback.format_exc().splitlines(True)[-12:-1]))
