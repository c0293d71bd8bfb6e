"""Round 40, run 269: hla3's gradient parts side by side (launch.GRAD_SIDE_PARTS: one launch of nC x PARTS
programs, a chunk's parts neighbours sharing L2 lines, slots added by slot_sum_kernel) against a launch a part -- the
gradients of the two (RMS ratio against each other) and fwd + bwd time, same process, alternating.
B = 2, T = 16384, H = 16, d = 64, bf16, no state (the carried form), gated with a second argument "gated".
    python3 run269_side.py hla3 [gated]   (run in round 41 on 3333ca8; the switch was declined and is not in the tree)"""
import sys

import torch
import triton.testing

import hladsl
from hladsl.runtime import launch

spec = sys.argv[1] if len(sys.argv) > 1 else "hla3"
gated = sys.argv[2:] == ["gated"]
torch.manual_seed(0)
B, T, H, d = 2, 16384, 16, 64
x = [(torch.randn(B, T, H, d, device="cuda") / d ** 0.25).to(torch.bfloat16).requires_grad_() for _ in range(3)]
do = torch.randn(B, T, H, d, device="cuda", dtype=torch.bfloat16)
g = (torch.nn.functional.logsigmoid(torch.randn(B, T, H, device="cuda")) / 16).requires_grad_() if gated else None
op = hladsl.load(spec)


def step():
    for t in x + ([g] if gated else []):
        t.grad = None
    op(*x, g=g)[0].backward(do)


def grads():
    step()
    return [t.grad.float().clone() for t in x + ([g] if gated else [])]


def rms(a, b):
    return ((a - b).pow(2).mean() / b.pow(2).mean()).sqrt().item()


ref = grads()
with launch.switched(GRAD_SIDE_PARTS=True):
    side = grads()
print(spec, "gated" * gated, "side vs a launch a part, RMS ratio dq dk dv (dg):", " ".join(f"{rms(a, b):.2e}" for a, b in zip(side, ref)), flush=True)
times = {"a launch a part": [], "side by side": []}
for _ in range(2):
    times["a launch a part"].append(triton.testing.do_bench(step, return_mode="median"))
    with launch.switched(GRAD_SIDE_PARTS=True):
        step()
        times["side by side"].append(triton.testing.do_bench(step, return_mode="median"))
for k, v in times.items():
    print(f"{spec}{' gated' * gated} fwd + bwd, {k}: " + " ".join(f"{t:.3f}" for t in v) + " ms", flush=True)
