"""What the kernels read and write (``runtime.launch``), bitwise on CUDA: two rules that
move work into the generated kernels claim the same bits as the torch-side path they
replace, which the CPU interpreter cannot show (its fp32 -> bf16 cast truncates, its
bf16 dots are off, so SDOT is fp32 there).

* SCALE_QUERIES_IN_KERNEL: a bf16 / fp16 query tile times the scale, rounded to the input
  dtype as it is loaded, equals torch's ``q * scale`` -- forward, final states and every
  gradient. (fp32 inputs are not claimed bitwise: the compiler may fuse the product
  into the next FMA, one rounding fewer.)
* STARTS_IN_SDOT: chunk-start states (and a scan's derived starts) stored in bf16 where the
  output kernel only feeds them to bf16 dots give the same output as fp32 starts rounded at
  the dot. So do the backward's chunk starts where every kernel reading them reads them so
  (``triton_bwd._starts_sdot``: carried hla2 / hla3 with no state) -- output and gradients.
"""
from __future__ import annotations

import pytest
import torch

import hladsl
from gpu_support import DEVICE, group
from hladsl.runtime import launch

pytestmark = pytest.mark.gpu
B, T, H, D = 2, 300, 3, 64


def _inputs(dtype, seed=0):
    gen = torch.Generator(device=DEVICE).manual_seed(seed)
    q, k, v = (torch.randn(B, T, H, D, generator=gen, device=DEVICE).to(dtype) for _ in range(3))
    g = torch.nn.functional.logsigmoid(3 + torch.randn(B, T, H, generator=gen, device=DEVICE))
    return q, k, v, g


def _fwd_bwd(op, q, k, v, g):
    leaves = [x.detach().clone().requires_grad_(True) for x in (q, k, v, g)]
    o, final = op(*leaves[:3], g=leaves[3], scale=0.3, output_final_state=True)
    (o.float().square().mean() + sum(x.sum() for x in final.values())).backward()
    return [o.detach(), *final.values(), *(x.grad for x in leaves)]


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
@pytest.mark.parametrize("spec", [pytest.param(s, marks=group("kernel_io", s)) for s in ("linear", "hla2")])
def test_query_scale_in_the_kernels_is_torchs_bits(spec, dtype, monkeypatch):
    op = hladsl.load(spec)
    inputs = _inputs(dtype)
    monkeypatch.setattr(launch, "SCALE_QUERIES_IN_KERNEL", False)
    want = _fwd_bwd(op, *inputs)
    monkeypatch.setattr(launch, "SCALE_QUERIES_IN_KERNEL", True)
    got = _fwd_bwd(op, *inputs)
    for a, b in zip(want, got):
        assert torch.equal(a, b)


@pytest.mark.parametrize("spec, schedule", [
    pytest.param(s, schedule, marks=group("kernel_io", s))
    # hla2 under the one-level scan: its derived start W0 and then S (triton_gen._derived_starts)
    for s, schedule in (("linear", "two_pass"), ("ahla", "two_pass"), ("hla2", "scan"))])
def test_bf16_chunk_starts_give_the_same_output(spec, schedule, monkeypatch):
    op = hladsl.load(spec)
    # the state pass stores chunk starts (the fused schedule has none); restored after: ops are
    # memoised (left "two_pass", a later test's "auto"-only attention form never ran, run 298)
    monkeypatch.setattr(op, "schedule", schedule)
    q, k, v, g = _inputs(torch.bfloat16, seed=1)
    monkeypatch.setattr(launch, "STARTS_IN_SDOT", False)
    want = op(q, k, v, g=g)[0]
    chosen = []
    rule = launch.starts_dtype
    monkeypatch.setattr(launch, "STARTS_IN_SDOT", True)
    monkeypatch.setattr(launch, "starts_dtype", lambda *a: chosen.append(rule(*a)) or chosen[-1])
    got = op(q, k, v, g=g)[0]
    assert chosen and set(chosen) == {torch.bfloat16}
    assert torch.equal(want, got)


@pytest.mark.parametrize("spec", [pytest.param(s, marks=group("kernel_io", s)) for s in ("hla2", "hla3")])
def test_bf16_backward_chunk_starts_give_the_same_gradients(spec, monkeypatch):
    op = hladsl.load(spec)
    q, k, v, _ = _inputs(torch.bfloat16, seed=2)

    def fwd_bwd():   # no state in or out: the carried form, whose starts are read only by SDOT dots
        leaves = [x.detach().clone().requires_grad_(True) for x in (q, k, v)]
        o = op(*leaves, scale=0.3)[0]
        o.float().square().mean().backward()
        return [o.detach(), *(x.grad for x in leaves)]
    monkeypatch.setattr(launch, "STARTS_IN_SDOT", False)
    launch.forget_plans()
    want = fwd_bwd()
    chosen = []
    rule = launch.starts_dtype
    monkeypatch.setattr(launch, "STARTS_IN_SDOT", True)
    monkeypatch.setattr(launch, "starts_dtype", lambda *a: chosen.append(rule(*a)) or chosen[-1])
    launch.forget_plans()
    got = fwd_bwd()
    assert torch.bfloat16 in chosen
    for a, b in zip(want, got):
        assert torch.equal(a, b)
