"""The normaliser's quotient o = num / (den + eps) at its edges, on every path that
differentiates it (the torch backend in float64; the chunk form's and the attention form's
kernels under the Triton interpreter): eps = 0 where T pads the last chunk (a padded row's
den is 0, and its zero cotangent must stay 0, not 0 / 0), a den past fp32's square root
(d den = -Σ do num / z², z² overflows), and d den from o before its rounding to bf16 (a spec
whose one input is on both sides, where -Σ do o cancels)."""
import os

os.environ["TRITON_INTERPRET"] = "1"   # before any kernel module is generated

import pytest  # noqa: E402
import torch  # noqa: E402

import hladsl  # noqa: E402
from hladsl.runtime import launch  # noqa: E402

from test_attention_form import _brute, _rel  # noqa: E402

C = 16
FORMS = {"chunk": "never", "attention": "always"}

# x is the query, the key and the value: d den's -Σ do o cancels to well under o's size
TIED_SOURCE = """
mechanism tied {
  dims d
  input x[d]
  param normalize = true, eps = 1e-6
  state S[i, e] = x[i] x[e]
  state z[i] = x[i]
  output o[e] = x[i] S[i, e]
  normalizer = x[i] z[i]
}
"""


def _grads(out, leaves, w):
    return torch.autograd.grad((out.double() * w.double()).sum(), leaves)


def _inputs(T: int, seed: int, k_scale: float = 1.0):
    gen = torch.Generator().manual_seed(seed)
    q, k = (torch.rand(1, T, 2, 8, generator=gen) + 0.1 for _ in range(2))
    v = torch.randn(1, T, 2, 8, generator=gen)
    g = -0.5 * torch.rand(1, T, 2, generator=gen)
    return [q, k * k_scale, v, g], torch.randn(1, T, 2, 8, generator=gen)


@pytest.mark.parametrize("path", ["torch", "chunk", "attention"])
@pytest.mark.parametrize("name,params", [("linear", {}), ("power", {"p": 2})])
def test_eps_zero_with_a_padded_chunk_gives_finite_exact_gradients(name, params, path):
    """T = 40 pads the last chunk of 16 (the torch path's chunk 64 too): every gradient
    finite and equal to float64 autograd of the brute force at eps = 0."""
    x, w = _inputs(40, 41)
    kwargs = dict(normalize=True, eps=0.0, **params)
    if path == "torch":
        leaves = [t.double().requires_grad_() for t in x]
        o, _ = hladsl.load(name, backend="torch", **kwargs)(*leaves[:3], g=leaves[3])
        got, bar = _grads(o, leaves, w), 1e-9
    else:
        leaves = [t.clone().requires_grad_() for t in x]
        with launch.switched(ATTENTION_FORM=FORMS[path]):
            o, _ = hladsl.load(name, backend="triton", chunk_size=C, **kwargs)(*leaves[:3], g=leaves[3])
            got, bar = _grads(o, leaves, w), 1e-4
    ref = [t.detach().double().requires_grad_() for t in x]
    want = _grads(_brute(*ref[:3], ref[3], p=params.get("p", 1), normalize=True, eps=0.0), ref, w)
    for n, a, b in zip("qkvg", got, want):
        assert torch.isfinite(a).all(), f"d{n} not finite"
        assert _rel(a, b) <= bar, f"d{n}: relative error {_rel(a, b):.2e}"


@pytest.mark.parametrize("path", ["chunk", "attention"])
def test_a_normaliser_past_fp32s_square_root_gives_exact_gradients(path):
    """k scaled by 1e19: den ~ 1e19, whose square overflows fp32 (the chunk form's d den
    was formed as / (z * z): 13x wrong). o does not depend on the scale."""
    x, w = _inputs(40, 42, k_scale=1e19)
    leaves = [t.clone().requires_grad_() for t in x]
    with launch.switched(ATTENTION_FORM=FORMS[path]):
        o, _ = hladsl.load("linear", backend="triton", chunk_size=C, normalize=True)(*leaves[:3], g=leaves[3])
        got = _grads(o, leaves, w)
    ref = [t.detach().double().requires_grad_() for t in x]
    want = _grads(_brute(*ref[:3], ref[3], normalize=True), ref, w)
    for n, a, b in zip("qkvg", got, want):
        assert _rel(a, b) <= 1e-4, f"d{n}: relative error {_rel(a, b):.2e}"


def test_the_attention_forms_d_den_reads_o_before_its_rounding(tmp_path):
    """bf16 inputs: the attention form's gradients as close to float64 as the chunk form's,
    which forms num again in fp32 (with the bf16 o kept, dg was 3.8e-2 against 3.9e-3)."""
    path = tmp_path / "tied.hla"
    path.write_text(TIED_SOURCE)
    gen = torch.Generator().manual_seed(5)
    x = torch.rand(1, 64, 2, 16, generator=gen) + 0.05
    g = -0.1 * torch.rand(1, 64, 2, generator=gen)
    w = torch.randn(1, 64, 2, 16, generator=gen)
    ref = [x.double().requires_grad_(), g.double().requires_grad_()]
    want = _grads(hladsl.load(str(path), backend="torch", normalize=True)(ref[0], g=ref[1], scale=1.0)[0], ref, w)
    errors = {}
    for form, switch in FORMS.items():
        leaves = [x.to(torch.bfloat16).requires_grad_(), g.clone().requires_grad_()]
        with launch.switched(ATTENTION_FORM=switch):
            o, _ = hladsl.load(str(path), backend="triton", chunk_size=C, normalize=True)(leaves[0], g=leaves[1],
                                                                                         scale=1.0)
            errors[form] = [_rel(a, b) for a, b in zip(_grads(o, leaves, w), want)]
    for n, (a, c) in enumerate(zip(errors["attention"], errors["chunk"])):
        assert a <= 1.25 * c and a <= 5e-3, f"input {n}: attention form {a:.2e}, chunk form {c:.2e}"


def test_the_torch_paths_quotient_has_exact_second_derivatives():
    """backend "torch", float64: the quotient's backward is linear in do, so forward-mode through
    double backward (torch.autograd.functional.jvp, whose cotangent is zeros) and Hessian-vector
    products agree with central differences (a mask on do zeroed the JVP; the review's finding)."""
    op = hladsl.load("linear", backend="torch", normalize=True, chunk_size=4)
    gen = torch.Generator().manual_seed(1)
    q, k = (torch.rand(1, 5, 1, 3, generator=gen, dtype=torch.float64) + 0.1 for _ in range(2))
    v = torch.randn(1, 5, 1, 3, generator=gen, dtype=torch.float64)
    g = -torch.rand(1, 5, 1, generator=gen, dtype=torch.float64)
    xs = (q, k, v, g)

    def f(*x):
        return op(*x[:3], g=x[3])[0]
    tangent = tuple(torch.randn(x.shape, generator=gen, dtype=torch.float64) for x in xs)
    step = 1e-6
    with torch.no_grad():
        want = (f(*(x + step * t for x, t in zip(xs, tangent))) - f(*(x - step * t for x, t in zip(xs, tangent)))) / (
            2 * step)
    _, got = torch.autograd.functional.jvp(f, xs, tangent)
    assert _rel(got, want) < 1e-7

    def loss(q):
        return f(q, k, v, g).square().sum()

    def grad(q):
        q = q.clone().requires_grad_()
        return torch.autograd.grad(loss(q), q)[0]
    _, hvp = torch.autograd.functional.hvp(loss, q, tangent[0])
    want = (grad(q + step * tangent[0]) - grad(q - step * tangent[0])) / (2 * step)
    assert _rel(hvp, want) < 1e-6
