"""Round 38, run 254: round 37's review mends on a GPU. A bf16 hla3 call (carried form, ungated,
no state) tries its gradient groups' candidates before their first launch; each trial must compile
the variant the launch then runs (the fp32 part-sum pointers included), so Triton's compiled
grad_kernel variants are exactly the ones the trials compiled, and a second call compiles nothing.
Gradients are checked against an fp32 call of the same op (RMS ratio)."""
import torch

import hladsl
from hladsl.runtime import direct, launch


def compiled_variants(kernel) -> int:
    return sum(len(entry[0]) for entry in kernel.device_caches.values())


def grad_kernels():
    ids = {key[0] for key in launch._SPILLS}
    return [direct._PARAMS[i][0] for i in ids if i in direct._PARAMS]


torch.manual_seed(0)
B, T, H, d = 2, 2048, 4, 64
x = [torch.randn(B, T, H, d, device="cuda") / d ** 0.25 for _ in range(3)]
do = torch.randn(B, T, H, d, device="cuda")
op = hladsl.load("hla3")


def grads(dtype):
    leaves = [t.to(dtype).requires_grad_() for t in x]
    o = op(*leaves)[0]   # (o, final states)
    o.backward(do.to(dtype))
    return [o.float()] + [t.grad.float() for t in leaves]


bf = grads(torch.bfloat16)
kernels = grad_kernels()
tried = len(launch._SPILLS)
built = sum(compiled_variants(k) for k in kernels)
chosen = sorted(set(launch._GRAD_PARTS.values()) if hasattr(launch._GRAD_PARTS, "values") else [])
print(f"grad kernels {len(kernels)}: variants the trials compiled {tried}, Triton compiled {built}; "
      f"part counts chosen {chosen}")
before = len(direct._COMPILED)
grads(torch.bfloat16)
print(f"second bf16 call: {len(direct._COMPILED) - before} new launch variants, "
      f"Triton compiled {sum(compiled_variants(k) for k in kernels) - built} more grad_kernel variants")
ref = grads(torch.float32)
for name, a, r in zip(("o", "dq", "dk", "dv"), bf, ref):
    print(f"{name}: RMS ratio bf16 vs fp32 {((a - r).pow(2).mean().sqrt() / r.pow(2).mean().sqrt()).item():.3e}")
assert built == tried, "a launch compiled a variant its trial had not"
