"""Which whole gradient groups spill past the limit (launch.grad_whole_spills), per spec."""
import torch, hladsl
from hladsl.runtime import launch
torch.manual_seed(0)
B, T, H, d = 2, 4096, 16, 64
for name, gated in [("linear", True), ("hla2", True), ("ahla", True)]:
    op = hladsl.load(name)
    q, k, v = (torch.randn(B, T, H, d, device="cuda", dtype=torch.bfloat16, requires_grad=True) for _ in range(3))
    g = (-0.05 * torch.rand(B, T, H, device="cuda")).requires_grad_() if gated else None
    before = dict(launch._WHOLE_SPILLS)
    for _ in range(2):
        o, _ = op(q, k, v, g=g)
        o.float().square().mean().backward()
    torch.cuda.synchronize()
    new = {k: v for k, v in launch._WHOLE_SPILLS.items() if k not in before}
    print(name, "gated" if gated else "ungated", "whole groups' local bytes:",
          sorted(v for v in new.values()), flush=True)
