"""Round 42, run 273: the backward's chunk starts and d-states in the state-dot dtype (bf16 for bf16 inputs)
where its products read them in bf16 anyway (the carried form, no exact state reads). Per case: RMS ratio of
each gradient against the torch path's in fp32 (B = 1, T = 4096, H = 4, d = 64), the variants' gradients
against the fp32-stored ones (0 = the same bits), then fwd + bwd at B = 2, T = 16384, H = 16, alternating,
same process. Run 273 ran it on d5315d7 with an experimental switch for the starts (every read state in
SDOT, which for ungated carried hla3 is what the landed rule, triton_bwd._starts_sdot, chooses) and
D_STATES_IN_SDOT for the d-states; on the landed tree the variants are the rules switched off by hand:
    python3 run273_states.py hla3 [gated] [short]"""
import sys
import time

import torch
import triton.testing

import hladsl
from hladsl.runtime import launch

spec = sys.argv[1]
gated = "gated" in sys.argv[2:]
_rule = launch.d_states_dtype


class _Stored:
    """The rules as landed (starts: ``STARTS_IN_SDOT``; d-states: ``d_states_dtype``) or fp32."""

    def __init__(self, starts: bool, d_states: bool):
        self.starts, self.d_states = starts, d_states

    def __enter__(self):
        launch.switch("STARTS_IN_SDOT", self.starts)
        launch.d_states_dtype = _rule if self.d_states else (lambda sdot, sharp=True: torch.float32)

    def __exit__(self, *exc):
        launch.switch("STARTS_IN_SDOT", True)
        launch.d_states_dtype = _rule
        launch.forget_plans()


variants = {"fp32": _Stored(False, False), "starts": _Stored(True, False), "both": _Stored(True, True)}
if "short" in sys.argv[2:]:
    variants.pop("starts")
op = hladsl.load(spec)


def inputs(B, T, H, d, dtype, seed=0):
    gen = torch.Generator(device="cuda").manual_seed(seed)
    x = [(torch.randn(B, T, H, d, device="cuda", generator=gen) / d ** 0.25) for _ in range(3)]
    do = torch.randn(B, T, H, d, device="cuda", generator=gen)
    g = torch.nn.functional.logsigmoid(torch.randn(B, T, H, device="cuda", generator=gen)) / 16 if gated else None
    x = [t.to(dtype).requires_grad_() for t in x]
    g = None if g is None else g.requires_grad_()
    return x, g, do.to(dtype)


def grads(x, g, do):
    ts = x + ([g] if gated else [])
    for t in ts:
        t.grad = None
    o = op(*x, g=g)[0]
    o.backward(do)
    return [o.float().detach()] + [t.grad.float().clone() for t in ts]


def rms(a, b):
    return ((a - b).pow(2).mean() / b.pow(2).mean()).sqrt().item()


names = ["o", "dq", "dk", "dv"] + (["dg"] if gated else [])
t0 = time.time()
op_ref = hladsl.load(spec, backend="torch")
x32, g32, do32 = inputs(1, 4096, 4, 64, torch.float32)
o32 = op_ref(*x32, g=g32)[0]
o32.backward(do32)
ref = [o32.float().detach()] + [t.grad.float().clone() for t in x32 + ([g32] if gated else [])]
print(f"fp32 torch reference in {time.time() - t0:.0f} s", flush=True)
got = {}
for name, knobs in variants.items():
    with knobs:
        got[name] = grads(*inputs(1, 4096, 4, 64, torch.bfloat16))
    print(f"{name} at {time.time() - t0:.0f} s", flush=True)
    print(f"{spec}{' gated' * gated} {name}: RMS vs fp32 " + " ".join(f"{n} {rms(a, b):.2e}" for n, a, b in zip(names, got[name], ref)), flush=True)
    if name != "fp32":
        print(f"{spec}{' gated' * gated} {name} vs fp32: " + " ".join(f"{n} {rms(a, b):.2e}" for n, a, b in zip(names, got[name], got["fp32"])), flush=True)
x, g, do = inputs(2, 16384, 16, 64, torch.bfloat16)


def step():
    for t in x + ([g] if gated else []):
        t.grad = None
    op(*x, g=g)[0].backward(do)


times = {n: [] for n in variants}
for _ in range(2):
    for name, knobs in variants.items():
        with knobs:
            step()
            times[name].append(triton.testing.do_bench(step, return_mode="median"))
for name, v in times.items():
    print(f"{spec}{' gated' * gated} fwd + bwd, {name}: " + " ".join(f"{t:.3f}" for t in v) + " ms", flush=True)
fwd = triton.testing.do_bench(lambda: op(*x, g=g), return_mode="median")
print(f"{spec}{' gated' * gated} fwd (under autograd): {fwd:.3f} ms", flush=True)
