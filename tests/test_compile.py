"""The op under torch.compile: one custom-op call in the
graph, no graph breaks, same values and gradients as eager."""
import torch

import hladsl


def test_compiled_forward_and_backward_match_eager():
    op = hladsl.load("hla2", normalize=True)
    gen = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(2, 40, 2, 8, generator=gen, requires_grad=True) for _ in range(3))
    g = (-0.2 * torch.rand(2, 40, 2, generator=gen)).requires_grad_()
    init = {name: (0.1 * torch.randn(2, 2, *shape, generator=gen)).requires_grad_()
            for name, shape in op.state_shapes(8, 8).items()}

    def f(q, k, v, g, init):
        o, state = op(q, k, v, g=g, initial_state=init, output_final_state=True)
        return o, state["G"]

    compiled = torch.compile(f, fullgraph=True, backend="aot_eager")
    ref, got = f(q, k, v, g, init), compiled(q, k, v, g, init)
    for a, b in zip(ref, got):
        torch.testing.assert_close(b, a, rtol=1e-6, atol=1e-6)
    leaves = [q, k, v, g] + list(init.values())
    want = torch.autograd.grad(sum(x.square().sum() for x in ref), leaves)
    have = torch.autograd.grad(sum(x.square().sum() for x in got), leaves)
    for a, b in zip(want, have):
        torch.testing.assert_close(b, a, rtol=1e-5, atol=1e-6)


def test_custom_op_passes_opcheck():
    op = hladsl.load("linear")
    q, k, v = (torch.randn(1, 20, 2, 4, dtype=torch.float64) for _ in range(3))
    torch.library.opcheck(op.custom_op, ([q, k, v], None, 0.5, [], None, "auto"),
                          test_utils=("test_schema", "test_faketensor"))


def test_eager_twin_equals_the_custom_op_values_and_gradients():
    """Eager calls go through EagerCall (no custom-op dispatch), compiled graphs through
    the custom op: both run forward_impl / backward_impl, so values and every gradient
    agree exactly -- also when only a final state, or only o, carries the loss."""
    op = hladsl.load("hla2", normalize=True)
    gen = torch.Generator().manual_seed(1)
    q, k, v = (torch.randn(2, 21, 2, 4, generator=gen, dtype=torch.float64, requires_grad=True)
               for _ in range(3))
    g = (-0.2 * torch.rand(2, 21, 2, generator=gen, dtype=torch.float64)).requires_grad_()
    init = {name: (0.1 * torch.randn(2, 2, *shape, generator=gen, dtype=torch.float64)).requires_grad_()
            for name, shape in op.state_shapes(4, 4).items()}
    leaves = [q, k, v, g] + list(init.values())
    o, state = op(q, k, v, g=g, initial_state=init, output_final_state=True)
    o2, finals = op.custom_op([q, k, v], g, float("nan"), list(init.values()), None, op.schedule)
    torch.testing.assert_close(o, o2, rtol=0, atol=0)
    for name, x in zip(op.state_names, finals):
        torch.testing.assert_close(state[name], x, rtol=0, atol=0)
    for pick in (lambda o, s: o.square().sum() + s["G"].sum(), lambda o, s: s["S"].square().sum(),
                 lambda o, s: o.sum()):
        o, state = op(q, k, v, g=g, initial_state=init, output_final_state=True)
        o2, finals = op.custom_op([q, k, v], g, float("nan"), list(init.values()), None, op.schedule)
        want = torch.autograd.grad(pick(o2, dict(zip(op.state_names, finals))), leaves,
                                   allow_unused=True)
        have = torch.autograd.grad(pick(o, state), leaves, allow_unused=True)
        for a, b in zip(want, have):
            if a is None:
                assert b is None or not b.any()
            else:
                torch.testing.assert_close(b, a, rtol=1e-12, atol=1e-12)
