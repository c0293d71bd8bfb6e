"""Round 39, prepared for run 266 (not run yet): one hla3 fwd + bwd (B = 2, T = 16384, H = 16, d = 64,
bf16, ungated, no state) under Nsight Compute -- where the gradient kernels' time goes (issue 10: ~30 us a
[64, 64] x [64, 64] product where the H200's peak would take ~5 us, round 38). The call runs once to
compile and warm up; only the second is profiled (ncu --profile-from-start off).
    ncu --profile-from-start off --kernel-name regex:grad_kernel --launch-count 4 \\
        --section SpeedOfLight --section WarpStateStats --section ComputeWorkloadAnalysis \\
        --section MemoryWorkloadAnalysis --section LaunchStats --section Occupancy \\
        python3 run266_profile.py"""
import torch

import hladsl

torch.manual_seed(0)
B, T, H, d = 2, 16384, 16, 64
x = [(torch.randn(B, T, H, d, device="cuda") / d ** 0.25).to(torch.bfloat16).requires_grad_() for _ in range(3)]
do = torch.randn(B, T, H, d, device="cuda", dtype=torch.bfloat16)
op = hladsl.load("hla3")


def step():
    o = op(*x)[0]
    o.backward(do)
    torch.cuda.synchronize()


step()
step()
torch.cuda.profiler.start()
step()
torch.cuda.profiler.stop()
print("profiled one fwd + bwd")
