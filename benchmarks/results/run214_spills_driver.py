"""Which whole gradient groups spill past the limit (launch.grad_whole_spills), per spec:
the local bytes a thread of each whole group's grad_kernel keeps, after two fwd + bwd calls
(runs 214, 216, 217; run 217 ran linear, hla2 and ahla only)."""
import torch

import hladsl
from hladsl.runtime import launch

torch.manual_seed(0)
B, T, H, d = 2, 4096, 16, 64
CASES = [("hla3_masked", False), ("hla3_masked", True), ("hla2", True), ("hla2", False), ("ahla", True),
         ("linear", True), ("hla3", False)]
for name, gated in CASES:
    op = hladsl.load(name)
    q, k, v = (torch.randn(B, T, H, d, device="cuda", dtype=torch.bfloat16, requires_grad=True) for _ in range(3))
    g = (-0.05 * torch.rand(B, T, H, device="cuda")).requires_grad_() if gated else None
    before = dict(launch._WHOLE_SPILLS)
    for _ in range(2):
        o, _ = op(q, k, v, g=g)
        o.float().square().mean().backward()
    torch.cuda.synchronize()
    new = {key: value for key, value in launch._WHOLE_SPILLS.items() if key not in before}
    print(name, "gated" if gated else "ungated", "whole groups' local bytes:",
          sorted(value for value in new.values()), flush=True)
