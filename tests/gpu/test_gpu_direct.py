"""Direct launches of compiled kernels (``runtime.direct``) on CUDA: a launch that skips
``JITFunction.run`` must run the binary Triton would have chosen, with the same
arguments. Each case runs the same calls with direct launches off (every launch through
``kernel[grid]``) and on, and asks for bitwise-equal outputs, final states and
gradients; then inputs whose pointers are not 16-byte aligned (Triton compiles another
variant for them) must match as well, and the direct cache must have been used.
"""
from __future__ import annotations

import pytest
import torch

import hladsl
from gpu_support import DEVICE, group
from hladsl.runtime import direct

pytestmark = pytest.mark.gpu
B, T, H, D = 2, 300, 3, 64


def bound_kinds(op) -> set[str]:
    """The kinds of op's bound calls and its carried form's (``op.Op._carried_op``: hla2's calls
    with no state in or out run it; a forward call's signature is then ``op._Delegated``)."""
    kinds = {type(b).__name__ for b in op._bound_calls.values()} - {"_Delegated"}
    return kinds | (bound_kinds(op._carried) if op._carried else set())


def _inputs(gen, offset: int, T: int = T):
    """q, k, v [B, T, H, D] bf16 and log gates; with ``offset`` > 0 views starting
    ``offset`` elements into their storage (pointers not 16-byte aligned)."""
    def draw(*shape):
        flat = torch.randn(offset + torch.Size(shape).numel(), generator=gen, device=DEVICE)
        return flat[offset:].view(*shape)
    q, k, v = (draw(B, T, H, D).to(torch.bfloat16) for _ in range(3))
    if offset:   # cast first (contiguous copy), then view with an offset again
        q, k, v = (torch.cat([x.new_zeros(offset), x.flatten()])[offset:].view(B, T, H, D)
                   for x in (q, k, v))
    g = torch.nn.functional.logsigmoid(3 + draw(B, T, H))
    return q, k, v, g


def _run(op, q, k, v, g):
    leaves = [x.detach().clone().requires_grad_(True) for x in (q, k, v, g)]
    o, final = op(*leaves[:3], g=leaves[3], output_final_state=True)
    (o.float().square().mean() + sum(x.sum() for x in final.values())).backward()
    state = {n: x.detach().clone() for n, x in final.items()}
    step_o, _ = op.step(q[:, :5], k[:, :5], v[:, :5], g=g[:, :5], state=state)
    return [o.detach(), *final.values(), *(x.grad for x in leaves), step_o, *state.values()]


@pytest.mark.parametrize("spec", [pytest.param(s, marks=group("direct", s)) for s in ("linear", "hla2")])
def test_direct_launches_equal_jit_launches_bitwise(spec, monkeypatch):
    op = hladsl.load(spec)
    gen = torch.Generator(device=DEVICE).manual_seed(0)
    for offset in (0, 1):
        inputs = _inputs(gen, offset)
        if offset:
            assert inputs[0].data_ptr() % 16 != 0
        monkeypatch.setattr(direct, "ENABLED", False)
        want = _run(op, *inputs)
        monkeypatch.setattr(direct, "ENABLED", True)
        _run(op, *inputs)          # first launches of each variant compile / remember
        before = len(direct._COMPILED)
        got = _run(op, *inputs)    # every launch direct
        assert before > 0 and len(direct._COMPILED) == before
        for a, b in zip(want, got):
            assert torch.equal(a, b)


@pytest.mark.parametrize("spec", [pytest.param(s, marks=group("direct", s)) for s in ("linear", "hla2", "power")])
def test_bound_forward_calls_equal_validated_calls_bitwise(spec):
    """A forward call with nothing to differentiate, like an earlier one in all but its
    data, replays that call's launches (op._BoundForward): gated and not, with an
    initial state the kernels read as given (linear's S) and without, aligned and
    misaligned inputs; bitwise equal to the validated call on new data each time, with
    new output buffers."""
    from hladsl.runtime import launch, progress
    op = hladsl.load(spec, **({"p": 2} if spec == "power" else {}))
    gen = torch.Generator(device=DEVICE).manual_seed(1)
    # a shape class's first call (progress's dry run counts what it compiles) is bound too
    q, k, v, g = _inputs(gen, 0, T=192)
    with torch.no_grad():
        first = op(q, k, v, g=g)[0]
        assert progress.quiet() or "_BoundForward" in bound_kinds(op)
        assert torch.equal(op(q, k, v, g=g)[0], first)
    for offset in (0, 1):
        for gated in (False, True):
            calls = []
            for _ in range(3):
                q, k, v, g = _inputs(gen, offset, T=256)   # whole chunks: no padding
                kw = {"output_final_state": True, **({"g": g} if gated else {})}
                if spec == "linear":
                    kw["initial_state"] = {"S": torch.randn(B, H, D, D, generator=gen, device=DEVICE)}
                calls.append(((q, k, v), kw))
            with launch.switched(BOUND_CALLS=False):
                want = [op(*xs, **kw) for xs, kw in calls]
            with torch.no_grad():
                got = [op(*xs, **kw) for xs, kw in calls]
            assert "_BoundForward" in bound_kinds(op)
            assert got[1][0].data_ptr() != got[2][0].data_ptr()
            for (o, finals), (o_want, finals_want) in zip(got, want):
                assert torch.equal(o, o_want)
                for name in finals_want:
                    assert torch.equal(finals[name], finals_want[name]), name


@pytest.mark.parametrize("spec,form", [pytest.param(s, f, marks=group("direct", s), id=f"{s}-{f}") for s, f in (
    ("linear", "never"), ("hla2", "never"), ("ahla", "never"), ("linear", "always"))])
def test_bound_training_calls_equal_validated_calls_bitwise(spec, form):
    """An autograd call like an earlier one in all but its data replays that call's launches:
    its forward with the kept state pass (op._BoundTrainingForward; on the attention form,
    ``form`` "always", op._BoundAttentionForward keeping o) and its backward from a cotangent
    (op._BoundTrainingBackward), gated and not, aligned and misaligned inputs; o and every
    gradient bitwise equal to the validated calls', in new buffers."""
    from hladsl.runtime import launch
    with launch.switched(ATTENTION_FORM=form):
        _bound_training_calls(spec, form)


def _bound_training_calls(spec, form):
    from hladsl.runtime import launch
    op = hladsl.load(spec)
    gen = torch.Generator(device=DEVICE).manual_seed(2)

    def train(q, k, v, g, do):
        leaves = [x.detach().clone().requires_grad_(True) for x in (q, k, v, g) if x is not None]
        o, _ = op(*leaves[:3], g=leaves[3] if g is not None else None)
        o.backward(do)
        return [o.detach(), *(x.grad for x in leaves)]

    for offset in (0, 1):
        for gated in (False, True):
            steps = []
            for _ in range(3):
                q, k, v, g = _inputs(gen, offset, T=256)   # whole chunks: no padding
                do = torch.randn(B, 256, H, D, generator=gen, device=DEVICE).to(torch.bfloat16)
                steps.append((q, k, v, g if gated else None, do))
            with launch.switched(BOUND_CALLS=False):
                want = [train(*step) for step in steps]
            got = [train(*step) for step in steps]
            kinds = bound_kinds(op)
            forward = "_BoundAttentionForward" if form == "always" else "_BoundTrainingForward"
            assert {forward, "_BoundTrainingBackward"} <= kinds, kinds
            assert got[1][1].data_ptr() != got[2][1].data_ptr()
            for a, b in zip(got, want):
                assert len(a) == len(b) == 4 + gated
                for x, y in zip(a, b):
                    assert torch.equal(x, y)
