"""Host cost of one fwd+bwd call: wall per call at a tiny shape (GPU idle), and cProfile."""
import cProfile
import io
import pstats
import sys
import time

import torch
import hladsl
from hladsl.bench import FwdBwd

def make(spec, B, T, H, d, gated):
    op = hladsl.load(spec)
    xs = [torch.randn(B, T, H, d, device="cuda").bfloat16().requires_grad_() for _ in op.inputs]
    g = torch.nn.functional.logsigmoid(4 + torch.randn(B, T, H, device="cuda")) if gated else None
    return FwdBwd(lambda: op(*xs, g=g), xs)

def fla(B, T, H, d):
    from fla.ops.simple_gla import chunk_simple_gla
    xs = [torch.randn(B, T, H, d, device="cuda").bfloat16().requires_grad_() for _ in range(3)]
    return FwdBwd(lambda: chunk_simple_gla(*xs, scale=d ** -0.5), xs)

def wall(step, n=200):
    for _ in range(5):
        step.reset_grads()
        step()
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(n):
        step.reset_grads()
        step()
    torch.cuda.synchronize()
    return (time.perf_counter() - t0) / n * 1e6

for spec in sys.argv[1:]:
    for gated in (False, True):
        step = make(spec, 1, 64, 1, 64, gated)
        print(f"{spec}{' gated' if gated else ''} fwd+bwd B=1 T=64 H=1: {wall(step):.1f} us/call", flush=True)
step = fla(1, 64, 1, 64)
print(f"fla fwd+bwd B=1 T=64 H=1: {wall(step):.1f} us/call", flush=True)
step = make("linear", 1, 64, 1, 64, False)
wall(step, 20)
pr = cProfile.Profile()
pr.enable()
for _ in range(200):
    step.reset_grads()
    step()
torch.cuda.synchronize()
pr.disable()
s = io.StringIO()
pstats.Stats(pr, stream=s).sort_stats("cumulative").print_stats(45)
print(s.getvalue()[:12000])
s = io.StringIO()
pstats.Stats(pr, stream=s).sort_stats("tottime").print_stats(30)
print(s.getvalue()[:8000])
