"""hla2w backward at d = 128 (misaligned address): print every grad_kernel launch, then run."""
import os
import sys
import torch
from hladsl.runtime import launch, triton_backward
orig = launch.launch
def traced(kernel, grid, args, may_fall_back, tiling=None):
    name = getattr(getattr(kernel, "fn", kernel), "__name__", "?")
    if "grad" in name:
        small = {k: v for k, v in args.items() if not isinstance(v, torch.Tensor)}
        ts = {k: (tuple(v.shape), str(v.dtype).replace("torch.", ""), v.data_ptr() % 16, v.stride()[-1]) for k, v in args.items() if isinstance(v, torch.Tensor)}
        print("LAUNCH", name, grid, small, flush=True)
        print("   tensors", {k: t for k, t in ts.items() if t[2] != 0 or t[3] != 1}, flush=True)
    orig(kernel, grid, args, may_fall_back, tiling)
    torch.cuda.synchronize()
launch.launch = traced
triton_backward.launch.launch = traced
import hladsl  # noqa: E402  (after the launch layer is wrapped)
d, T = int(sys.argv[1]), int(sys.argv[2])
op = hladsl.load(os.path.abspath("benchmarks/exp/hla2w.hla"))
q, k, v = (torch.randn(1, T, 4, d, device="cuda", dtype=torch.bfloat16, requires_grad=True) for _ in range(3))
o = op(q, k, v)
o = o[0] if isinstance(o, tuple) else o
try:
    o.backward(torch.randn_like(o))
    torch.cuda.synchronize()
    print("OK", d, T, os.environ.get("HLADSL_LAUNCH"))
except Exception as e:
    print("FAILED", d, T, os.environ.get("HLADSL_LAUNCH"), repr(e)[:200])
