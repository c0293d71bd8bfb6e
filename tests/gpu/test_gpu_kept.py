"""The state pass kept from the forward for the backward (``launch.KEEP_STATE_PASS``) on
CUDA: under autograd the forward runs at the backward's chunk (hla2's forward alone runs
at 128, its backward at 64) and runs the backward's state pass (there the two-level scan,
whose groups' deltas the reverse scan reads); the backward then runs no state pass. Each
case runs one fwd + bwd with the rule off and on: one state pass instead of two,
gradients bit for bit equal, outputs and final states within bf16 rounding (the forward's
chunk differs) and the outputs against the fp32 reference as close as before."""
from __future__ import annotations

import pytest
import torch

import hladsl
from gpu_support import DEVICE, group, rms_ratio
from hladsl.runtime import launch

pytestmark = pytest.mark.gpu


@pytest.mark.parametrize("spec,gated", [pytest.param("hla2", False, marks=group("kept", "hla2")),
                                        pytest.param("linear", True, marks=group("kept", "linear"))])
def test_backward_reads_the_state_pass_the_forward_kept(state_passes, spec, gated):
    B, T, H, D = 1, 8192, 4, 64   # 4 (sequence, head) pairs: the scan, in groups in the backward
    gen = torch.Generator(device=DEVICE).manual_seed(3)
    q, k, v = (torch.randn(B, T, H, D, device=DEVICE, generator=gen).to(torch.bfloat16) for _ in range(3))
    g = torch.nn.functional.logsigmoid(4 + torch.randn(B, T, H, device=DEVICE, generator=gen)) if gated else None
    w_o = torch.randn(B, T, H, D, device=DEVICE, generator=gen)
    op = hladsl.load(spec)
    passes = state_passes

    def fwd_bwd():
        passes.clear()
        leaves = [x.clone().requires_grad_() for x in (q, k, v)] + ([g.clone().requires_grad_()] if gated else [])
        o, final = op(*leaves[:3], g=leaves[3] if gated else None, output_final_state=True)
        ((o.float() * w_o).sum() + sum(x.sum() for x in final.values())).backward()
        return o.detach(), final, [x.grad for x in leaves], len(passes)

    # validated calls: a bound one replays its launches and calls no state pass function
    # (tests/gpu/test_gpu_direct.py checks it equals the validated call bit for bit)
    with launch.switched(KEEP_STATE_PASS=False, BOUND_CALLS=False):
        fwd_bwd()   # (a shape class's first call also dry-runs, counting what it compiles)
        o_re, final_re, grads_re, passes_re = fwd_bwd()
    with launch.switched(BOUND_CALLS=False):
        fwd_bwd()
        o, final, grads, passes_kept = fwd_bwd()
    assert (passes_re, passes_kept) == (2, 1)
    for got, want in zip(grads, grads_re):
        assert torch.equal(got, want)
    ref, _ = hladsl.load(spec, backend="torch")(q.float(), k.float(), v.float(), g=g)
    assert rms_ratio(ref, o) <= max(1.2 * rms_ratio(ref, o_re), 5e-3)
    assert rms_ratio(o_re, o) < 1e-2
    for n in final:
        assert rms_ratio(final_re[n], final[n]) < 1e-4, n
