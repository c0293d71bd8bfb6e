"""The attention form (``ir.attention``, ``codegen.attention_gen``,
``runtime.attention_forward``) on CPU under the Triton interpreter: which programs have it
and why the others do not; its kernel (fp32) against brute-force quadratic float64 forms
written here (chunk 16, T not a multiple of it: several key chunks walked, strong gates);
varlen; specs that are not shipped; which calls ``Op`` routes to it; the launch rule
``launch.use_attention_form`` on a CUDA device object; ``--emit attention``."""
import os
import re
from pathlib import Path
from unittest import mock

os.environ["TRITON_INTERPRET"] = "1"   # before any kernel module is generated

import pytest  # noqa: E402
import torch  # noqa: E402

import hladsl  # noqa: E402
from hladsl.codegen import triton_gen  # noqa: E402
from hladsl.codegen.triton_gen import column_pick_macs  # noqa: E402
from hladsl.ir.attention import attention_form, attention_macs, chunk_macs, why_not  # noqa: E402
from hladsl.ir.pipeline import chunk_program  # noqa: E402
from hladsl.runtime import attention_forward, launch  # noqa: E402
from power_specs import SHARED_DIM_POWER  # noqa: E402

C = 16          # the ops' chunk: T = 45 walks three key chunks
BAR = 1e-5      # interpreter fp32 against float64


# -- references ---------------------------------------------------------------------------

def _brute(q, k, v, g=None, *, p=1, scale=None, normalize=False, eps=1e-6):
    """o [B, T, H, dv] float64: o_t = Σ_{j<=t} (s q_t·k_j)^p v_j exp(Λ_t − Λ_j), Λ = cumsum(g)
    (s: ``scale``, d^-0.5 by default); normalised num / (den + eps), den the same sum with
    v_j -> 1. Differentiable (the gradient test uses it too)."""
    q, k, v = (x.double() for x in (q, k, v))
    T = q.shape[1]
    s = q.shape[-1] ** -0.5 if scale is None else scale
    a = torch.einsum("bthd,bjhd->bhtj", s * q, k) ** p
    causal = torch.ones(T, T, dtype=torch.bool).tril()
    if g is not None:
        lam = g.double().cumsum(1).transpose(1, 2)                     # [B, H, T]
        gap = (lam[..., :, None] - lam[..., None, :]).masked_fill(~causal, -float("inf"))
        a = a * gap.exp()
    a = a.masked_fill(~causal, 0.0)
    num = torch.einsum("bhtj,bjhe->bthe", a, v)
    if not normalize:
        return num
    return num / (a.sum(-1).transpose(1, 2)[..., None] + eps)


def _rel(got, want) -> float:
    want = want.double()
    return ((got.double() - want).norm() / want.norm()).item()


def _tokens(gen, B, T, H, d, dv, *, gated, positive, strong=True):
    """q, k, v float32 (q, k positive where normalised: the normaliser stays away from 0) and
    g = -2 rand (strong: a chunk's decay reaches e^-16) or -0.3 rand, or None."""
    q, k = (torch.randn(B, T, H, d, generator=gen) for _ in range(2))
    if positive:
        q, k = q.abs() + 0.1, k.abs() + 0.1
    v = torch.randn(B, T, H, dv, generator=gen)
    g = None
    if gated:
        g = -(2.0 if strong else 0.3) * torch.rand(B, T, H, generator=gen)
    return q, k, v, g


def chunks_of_runs(monkeypatch, module, name: str) -> list:
    """The chunk of every run of ``module.name`` (a function taking the chunk program first;
    op.py imports it from the module inside the call, so patching the module attribute sees
    every one)."""
    calls = []
    real = getattr(module, name)

    def spy(program, *args, **kwargs):
        calls.append(program.chunk)
        return real(program, *args, **kwargs)
    monkeypatch.setattr(module, name, spy)
    return calls


@pytest.fixture
def attention_calls(monkeypatch):
    """The chunk of every ``forward_attention`` run."""
    return chunks_of_runs(monkeypatch, attention_forward, "forward_attention")


# -- 1. the IR rule -----------------------------------------------------------------------

@pytest.mark.parametrize("name,params,n_out,n_den", [
    ("linear", {}, 1, 0), ("linear", {"normalize": True}, 1, 1),
    ("power", {"p": 2}, 1, 0), ("power", {"p": 3}, 1, 0),
    ("power", {"p": 2, "normalize": True}, 1, 1), ("power", {"p": 3, "normalize": True}, 1, 1)])
@pytest.mark.parametrize("gated", [True, False], ids=["gated", "ungated"])
def test_pairwise_specs_have_an_attention_form(name, params, n_out, n_den, gated):
    program = chunk_program(hladsl.compile_spec(name, **params), C, (("d", 8), ("dv", 8)), gated)
    assert why_not(program) == ""
    form = attention_form(program)
    assert form is not None
    # the carried-state terms vanish; one pairwise term each is left, (q_t·k_n)^p v_n
    assert (len(form.output), len(form.normalizer)) == (n_out, n_den)
    p = params.get("p", 1)
    for t in form.output + form.normalizer:
        assert t.source.count("q_t[") == p and t.source.count("k_n0[") == p, t.source
        assert "n0 <= t" in t.source
    assert all(t in program.output for t in form.output)
    assert all(t in program.normalizer for t in form.normalizer)


@pytest.mark.parametrize("name,earlier", [("hla2", 2), ("ahla", 2), ("hla3", 2), ("hla3_masked", 3)])
@pytest.mark.parametrize("normalize", [False, True], ids=["plain", "norm"])
def test_specs_summing_over_several_earlier_tokens_have_none(name, earlier, normalize):
    program = chunk_program(hladsl.compile_spec(name, normalize=normalize), C, (("d", 8), ("dv", 8)), True)
    assert attention_form(program) is None
    reason = why_not(program)
    term, _, why = reason.partition(": ")
    assert "q_t[" in term and "[n0 " in term, reason            # names the term
    assert why.startswith(f"it sums over {earlier} earlier tokens"), reason
    assert why.endswith("not one"), reason


def test_attention_macs_count_block_pairs_at_or_below_the_diagonal():
    """Work grows with the block pairs (1, 3, 6, ... for 1, 2, 3 blocks) in the attention
    form and with the blocks in the chunk form."""
    program = chunk_program(hladsl.compile_spec("power", p=2), C, (("d", 16), ("dv", 16)), True)
    form = attention_form(program)
    one = attention_macs(form, program, C)
    assert one > 0
    assert [attention_macs(form, program, n * C) for n in (2, 3, 4)] == [3 * one, 6 * one, 10 * one]
    assert attention_macs(form, program, 2 * C + 1) == 6 * one   # a partial block counts whole
    assert chunk_macs(program, 3 * C) == 3 * chunk_macs(program, C) == 3 * chunk_macs(program, C - 5)


# -- 2. the kernel against the brute force -------------------------------------------------

KERNEL_CASES = [   # name, params, gated, positive features, d, dv, scale
    ("linear", {}, True, False, 8, 8, None),
    ("linear", {"normalize": True}, False, True, 6, 5, None),       # dims padded to 16-wide blocks
    ("power", {"p": 2, "normalize": True}, True, True, 6, 8, None),
    ("power", {"p": 3}, False, False, 4, 8, None),
    ("power", {"p": 2}, True, False, 8, 8, 0.7),                    # a scale of the call's
    ("linear", {"normalize": True}, True, True, 8, 8, 0.25),
]


@pytest.mark.parametrize("name,params,gated,positive,d,dv,scale", KERNEL_CASES,
                         ids=[f"{c[0]}{c[1].get('p', '')}-{'gated' if c[2] else 'ungated'}"
                              f"{'-norm' if c[1].get('normalize') else ''}{'-scale' if c[6] else ''}"
                              for c in KERNEL_CASES])
def test_kernel_matches_brute_force(name, params, gated, positive, d, dv, scale, attention_calls):
    gen = torch.Generator().manual_seed(11)
    B, T, H = 2, 45, 2                       # 45 = 2 * 16 + 13: three key chunks, the last one padded
    q, k, v, g = _tokens(gen, B, T, H, d, dv, gated=gated, positive=positive)
    op = hladsl.load(name, backend="triton", chunk_size=C, **params)
    with torch.no_grad(), launch.switched(ATTENTION_FORM="always"):
        o, state = op(q, k, v, g=g, scale=scale)
    assert attention_calls == [C]
    assert state is None
    assert o.shape == (B, T, H, dv) and o.dtype == torch.float32
    want = _brute(q, k, v, g, p=params.get("p", 1), scale=scale, normalize=params.get("normalize", False))
    err = _rel(o, want)
    assert err <= BAR, f"relative error {err:.2e}"


def test_strong_gates_decay_across_chunks(attention_calls):
    """Gates strong enough that a chunk's total Λ reaches -8, so the decays between
    chunks matter: a kernel that drops ``lam_gap`` (or adds it once instead of summing the
    chunks walked) is wrong by O(1); also against a float64 Λ the same o, whatever the gap's
    size (no Λ over the whole sequence is formed in fp32)."""
    gen = torch.Generator().manual_seed(12)
    B, T, H, d = 1, 64, 2, 8
    q, k, v, _ = _tokens(gen, B, T, H, d, d, gated=False, positive=False)
    # weak gates inside chunk 0 and 2, strong ones elsewhere: o at chunk 3 sees chunk 1 through
    # the totals of chunks 2 and 3 -- Λ sums over two chunks
    g = torch.full((B, T, H), -0.05)
    g[:, C:2 * C] = -0.5
    g[:, 3 * C:] = -0.02
    op = hladsl.load("linear", backend="triton", chunk_size=C)
    with torch.no_grad(), launch.switched(ATTENTION_FORM="always"):
        o, _ = op(q, k, v, g=g)
    want = _brute(q, k, v, g)
    assert attention_calls == [C]
    assert _rel(o, want) <= BAR
    ungated = _brute(q, k, v, None)
    assert _rel(ungated[:, 3 * C:], want[:, 3 * C:]) > 0.1   # the decays matter here


# -- 3. varlen ----------------------------------------------------------------------------

@pytest.mark.parametrize("bounds", [[0, 21, 21, 22, 57], [0, 0, 1, 33, 33]],
                         ids=["empty-and-one-token-inside", "empty-first-and-last"])
def test_varlen_matches_each_sequence_alone(bounds, attention_calls):
    """cu_seqlens with an empty sequence and one of 1 token: a key walk stops at its own
    sequence's first chunk; each sequence's o as the same op gives it alone (bitwise) and
    as the brute force gives it."""
    gen = torch.Generator().manual_seed(13)
    T, H, d = bounds[-1], 2, 8
    q, k, v, g = _tokens(gen, 1, T, H, d, d, gated=True, positive=True)
    op = hladsl.load("power", backend="triton", chunk_size=C, p=2, normalize=True)
    cu = torch.tensor(bounds, dtype=torch.int32)
    with torch.no_grad(), launch.switched(ATTENTION_FORM="always"):
        o, state = op(q, k, v, g=g, cu_seqlens=cu)
        assert state is None and o.shape == (1, T, H, d)
        alone = {}
        for a, b in zip(bounds, bounds[1:]):
            if b > a:
                alone[a, b], _ = op(q[:, a:b], k[:, a:b], v[:, a:b], g=g[:, a:b])
    assert len(attention_calls) == 1 + len(alone)
    for (a, b), o_alone in alone.items():
        assert torch.equal(o[:, a:b], o_alone), (a, b)
        want = _brute(q[:, a:b], k[:, a:b], v[:, a:b], g[:, a:b], p=2, normalize=True)
        assert _rel(o[:, a:b], want) <= BAR, (a, b)


# -- 4. specs that are not shipped ---------------------------------------------------------

TWO_KV_SOURCE = (Path(__file__).resolve().parent / "specs" / "two_kv.hla").read_text()   # (the GPU suite's too)

# two summaries decaying at different rates (exp(2 (Λ_t − Λ_j)) and none): strict masks
# n < t beside the diagonal term of token t alone, which the compiler splits out
TWO_RATES_SOURCE = """
mechanism two_rates {
  dims d, dv
  input q[d], k[d], v[dv]
  param normalize = false, eps = 1e-6
  state S[i, e] = k[i] v[e]  decay 2
  state U[i, e] = k[i] v[e]  decay 0
  state z[i] = k[i]  decay 2
  state y[i] = k[i]  decay 0
  output o[e] = q[i] (S[i, e] + 0.5 U[i, e])
  normalizer = q[i] (z[i] + 0.5 y[i])
}
"""

# the output reads a token directly besides its state: a term of token t alone
SKIP_SOURCE = """
mechanism skip {
  dims d, dv
  input q[d], k[d], v[dv]
  state S[i, e] = k[i] v[e]
  output o[e] = q[i] S[i, e] + v[e]
}
"""

# the review's case: a pairwise output term whose query side (q_t . k_t) the normaliser, a term of
# token t alone, computes too -- the kernel must not read it from inside the key loop
QK_SOURCE = """
mechanism qk {
  dims d, dv
  input q[d], k[d], v[dv]
  param normalize = false, eps = 1e-6
  state S[e] = v[e]
  output o[e] = q[i] k[i] S[e]
  normalizer = q[i] k[i]
}
"""


def _unshipped_reference(which, x, g, normalize):
    """Brute force of the specs above at scale 1 (the tests pass scale=1.0: the skip spec
    reads v at the query's time, so a scale would multiply v too)."""
    if which == "two_kv":
        q, k, u, v = x
        a = _brute(q, k, v, g, scale=1.0) + _brute(q, u, v, g, scale=1.0)
        if not normalize:
            return a
        ones = torch.ones_like(v[..., :1])
        return a / (_brute(q, k, ones, g, scale=1.0) + _brute(q, u, ones, g, scale=1.0) + 1e-6)
    if which == "two_rates":
        q, k, v = x
        twice = None if g is None else 2 * g
        ones = torch.ones_like(v[..., :1])
        num = _brute(q, k, v, twice, scale=1.0) + 0.5 * _brute(q, k, v, None, scale=1.0)
        if not normalize:
            return num
        return num / (_brute(q, k, ones, twice, scale=1.0) + 0.5 * _brute(q, k, ones, None, scale=1.0) + 1e-6)
    q, k, v = x
    if which == "qk":   # o_t = (q_t . k_t) Σ_{j<=t} v_j exp(Λ_t − Λ_j), over (q_t . k_t + eps) normalised
        qk = (q.double() * k.double()).sum(-1, keepdim=True)
        sums = _brute(torch.ones_like(q[..., :1]), torch.ones_like(k[..., :1]), v, g, scale=1.0)
        return qk * sums / (qk + 1e-6) if normalize else qk * sums
    return _brute(q, k, v, g, scale=1.0) + v.double()


UNSHIPPED = {"two_kv": TWO_KV_SOURCE, "two_rates": TWO_RATES_SOURCE, "skip": SKIP_SOURCE, "qk": QK_SOURCE}


@pytest.mark.parametrize("which,normalize,gated", [
    ("two_kv", False, True), ("two_kv", True, False), ("two_rates", True, True), ("two_rates", False, True),
    ("skip", False, True), ("qk", True, True), ("qk", False, False)])
def test_unshipped_spec_runs_its_attention_form(which, normalize, gated, tmp_path, attention_calls):
    """A spec written here gets the attention form with no new Python and matches its brute
    force (and the torch backend, float64), over several key chunks."""
    path = tmp_path / f"{which}.hla"
    path.write_text(UNSHIPPED[which])
    params = {"normalize": True} if normalize else {}
    n_in = 4 if which == "two_kv" else 3
    program = chunk_program(hladsl.compile_spec(str(path), **params), C, (("d", 8), ("dv", 8)), gated)
    assert attention_form(program) is not None, why_not(program)
    gen = torch.Generator().manual_seed(14)
    B, T, H, d = 1, 45, 2, 8
    x = [torch.rand(B, T, H, d, generator=gen) + 0.1 for _ in range(n_in - 1)] + \
        [torch.randn(B, T, H, d, generator=gen)]
    g = -torch.rand(B, T, H, generator=gen) if gated else None
    op = hladsl.load(str(path), backend="triton", chunk_size=C, **params)
    with torch.no_grad(), launch.switched(ATTENTION_FORM="always"):
        o, state = op(*x, g=g, scale=1.0)
    assert attention_calls == [C] and state is None
    want = _unshipped_reference(which, x, g, normalize)
    ref, _ = hladsl.load(str(path), backend="torch", **params)(*(t.double() for t in x), scale=1.0,
                                                              g=None if g is None else g.double())
    assert _rel(ref, want) <= 1e-12          # the brute force is the spec's meaning
    with torch.no_grad(), launch.switched(ATTENTION_FORM="never"):
        o_chunk, _ = op(*x, g=g, scale=1.0)
    assert _rel(o_chunk, want) <= BAR        # the chunk form's kernels agree
    err = _rel(o, want)
    by_chunk = [f"{_rel(o[:, c:c + C], want[:, c:c + C]):.1e}" for c in range(0, T, C)]
    assert err <= BAR, f"relative error {err:.2e}; by query chunk {by_chunk}"


# -- 5. which calls run it -----------------------------------------------------------------

def _routing_inputs(seed=15, T=40):
    gen = torch.Generator().manual_seed(seed)
    return _tokens(gen, 2, T, 2, 8, 8, gated=True, positive=False, strong=False)


def _op():
    return hladsl.load("power", backend="triton", chunk_size=C, p=2)


def test_a_plain_stateless_no_grad_call_runs_it(attention_calls):
    q, k, v, g = _routing_inputs()
    with launch.switched(ATTENTION_FORM="always"):
        o, state = _op()(q, k, v, g=g)              # nothing requires grad: no autograd node
    assert attention_calls == [C] and state is None
    assert _rel(o, _brute(q, k, v, g, p=2)) <= BAR


def test_a_call_asking_for_its_final_state_runs_the_chunk_form(attention_calls):
    q, k, v, g = _routing_inputs()
    op = _op()
    with torch.no_grad(), launch.switched(ATTENTION_FORM="always"):
        o, state = op(q, k, v, g=g, output_final_state=True)
    assert attention_calls == []
    assert set(state) == set(op.state_names)
    assert _rel(o, _brute(q, k, v, g, p=2)) <= BAR
    want, want_state = hladsl.load("power", backend="torch", p=2)(q.double(), k.double(), v.double(),
                                                                  g=g.double(), output_final_state=True)
    for name in state:
        assert _rel(state[name], want_state[name]) <= BAR, name


def test_a_call_with_an_initial_state_runs_the_chunk_form(attention_calls):
    q, k, v, g = _routing_inputs()
    op = _op()
    gen = torch.Generator().manual_seed(16)
    init = {n: 0.1 * torch.randn(2, 2, *s, generator=gen) for n, s in op.state_shapes(8, 8).items()}
    with torch.no_grad(), launch.switched(ATTENTION_FORM="always"):
        o, state = op(q, k, v, g=g, initial_state=init)
    assert attention_calls == [] and state is None
    want, _ = hladsl.load("power", backend="torch", p=2)(
        q.double(), k.double(), v.double(), g=g.double(), initial_state={n: x.double() for n, x in init.items()})
    assert _rel(o, want) <= BAR
    assert _rel(want, _brute(q, k, v, g, p=2)) > 1e-3       # the initial state was read


def test_a_call_to_differentiate_runs_it_and_gradients_flow(attention_calls):
    """(Its backward: tests/test_attention_backward.py.)"""
    q, k, v, g = _routing_inputs()
    leaves = [x.clone().requires_grad_() for x in (q, k, v, g)]
    with launch.switched(ATTENTION_FORM="always"):
        o, _ = _op()(*leaves[:3], g=leaves[3])
        assert attention_calls == [C]
        w = torch.randn(o.shape, generator=torch.Generator().manual_seed(17))
        grads = torch.autograd.grad((o * w).sum(), leaves)
    ref = [x.double().requires_grad_() for x in (q, k, v, g)]
    want = torch.autograd.grad((_brute(*ref[:3], ref[3], p=2) * w.double()).sum(), ref)
    assert _rel(o.detach(), _brute(q, k, v, g, p=2)) <= BAR
    for name, got, exp in zip("qkvg", grads, want):
        assert _rel(got, exp) <= 1e-4, name


def test_inputs_requiring_grad_under_no_grad_run_it(attention_calls):
    q, k, v, g = _routing_inputs()
    leaves = [x.clone().requires_grad_() for x in (q, k, v)]
    with torch.no_grad(), launch.switched(ATTENTION_FORM="always"):
        o, _ = _op()(*leaves, g=g)
    assert attention_calls == [C]
    assert _rel(o, _brute(q, k, v, g, p=2)) <= BAR


@pytest.mark.parametrize("mode", ["never", "auto"])
def test_never_and_auto_on_cpu_run_the_chunk_form(mode, attention_calls):
    q, k, v, g = _routing_inputs()
    with torch.no_grad(), launch.switched(ATTENTION_FORM=mode):
        o, state = _op()(q, k, v, g=g)
    assert attention_calls == [] and state is None
    assert _rel(o, _brute(q, k, v, g, p=2)) <= BAR


def test_the_op_asks_the_rule_with_each_sequences_length(monkeypatch, attention_calls):
    """``Op._attention`` under "auto": the rule gets the call's sequence lengths (each varlen
    sequence's, from cu_seqlens), is asked once per dense shape class, and is not asked for a
    program without the form (ahla)."""
    asked = []

    def rule(program_at, lengths, device):
        asked.append(list(lengths))
        return True
    monkeypatch.setattr(launch, "use_attention_form", rule)
    q, k, v, g = _routing_inputs(T=40)
    op = _op()
    with torch.no_grad(), launch.switched(ATTENTION_FORM="auto"):
        op(q, k, v, g=g)
        op(q, k, v, g=g)
        cu = torch.tensor([0, 7, 7, 40])
        o, _ = op(q[:1], k[:1], v[:1], g=g[:1], cu_seqlens=cu)
        hladsl.load("ahla", backend="triton", chunk_size=C)(q, k, v, g=g)
    assert asked == [[40], [7, 0, 33]], asked
    assert attention_calls == [C] * 3   # (two dense calls, not bound on CPU here, and the varlen one)
    for a, b in ((0, 7), (7, 40)):
        assert _rel(o[:, a:b], _brute(q[:1, a:b], k[:1, a:b], v[:1, a:b], g[:1, a:b], p=2)) <= BAR


def test_a_named_schedule_runs_the_chunk_form(attention_calls):
    """A schedule other than "auto" names one of the chunk form's ("fused" on packed states still
    raises, as it says)."""
    q, k, v, g = _routing_inputs()
    op = _op()
    try:
        with torch.no_grad(), launch.switched(ATTENTION_FORM="always"):
            op.schedule = "two_pass"
            o, _ = op(q, k, v, g=g)
            assert attention_calls == []
            op.schedule = "fused"
            with pytest.raises(ValueError, match="fused"):
                op(q, k, v, g=g)
            op.schedule = "auto"
            op(q, k, v, g=g)
    finally:
        op.schedule = "auto"
    assert attention_calls == [C]
    assert _rel(o, _brute(q, k, v, g, p=2)) <= BAR


def test_a_program_without_the_form_runs_the_chunk_form_when_always(attention_calls):
    gen = torch.Generator().manual_seed(18)
    q, k, v, g = _tokens(gen, 1, 40, 2, 8, 8, gated=True, positive=False, strong=False)
    with torch.no_grad(), launch.switched(ATTENTION_FORM="always"):
        o, _ = hladsl.load("ahla", backend="triton", chunk_size=C)(q, k, v, g=g)
    want, _ = hladsl.load("ahla", backend="torch")(q.double(), k.double(), v.double(), g=g.double())
    assert attention_calls == []
    assert _rel(o, want) <= BAR


def test_a_second_call_is_replayed_bound(attention_calls, interpreter_binds):
    """The second call of a signature replays the first's recorded launch (the attention
    kernel, ``_BoundForward``) on its own data: o as the validated path gives it, bitwise,
    and as the brute force gives it."""
    op = _op()
    calls = [_routing_inputs(seed, T=32) for seed in (19, 20, 21)]   # T a multiple of C: bindable
    with torch.no_grad(), launch.switched(ATTENTION_FORM="always"):
        got = [op(q, k, v, g=g)[0] for q, k, v, g in calls]
    assert attention_calls == [C]                       # the first call only: the others replayed
    assert [k.__name__ for k in interpreter_binds] == ["attention_kernel"] * 2
    with torch.no_grad(), launch.switched(ATTENTION_FORM="always", BOUND_CALLS=False):
        validated = [op(q, k, v, g=g)[0] for q, k, v, g in calls]
    assert len(attention_calls) == 4
    for o, o_validated, (q, k, v, g) in zip(got, validated, calls):
        assert torch.equal(o, o_validated)
        assert _rel(o, _brute(q, k, v, g, p=2)) <= BAR
    assert got[1].data_ptr() != got[2].data_ptr()


# -- 6. the launch rule ----------------------------------------------------------------------

CUDA = torch.device("cuda")   # (the rule reads only its .type: no GPU needed)


def _program_at(name, d, gated=True, **params):
    alg = hladsl.compile_spec(name, **params)
    asked = []

    def at(chunk):
        asked.append(chunk)
        return chunk_program(alg, chunk, (("d", d), ("dv", d)), gated)
    return at, asked


def _by_macs(at, lengths) -> bool:
    program = at(launch.ATTENTION_CHUNK)
    form = attention_form(program)
    chunk = sum(chunk_macs(program, n) + column_pick_macs(program) * -(-n // program.chunk) for n in lengths)
    return form is not None and sum(attention_macs(form, program, n) for n in lengths) <= launch.ATTENTION_MAC_RATIO * chunk


def _one_hot_dots(source: str) -> dict[str, int]:
    """Per kernel of a generated forward module: its one-hot column dots, _dot(raw_x, t) of a
    temp t defined as a one-hot tl.where over a dim's offsets."""
    counts = {}
    for chunk in source.split("\ndef ")[1:]:
        name = chunk.split("(", 1)[0]
        onehots = set(re.findall(r"^\s*(t\d+) = tl\.where\(\(offs_\w+\[:, None\] ==", chunk, re.M))
        counts[name] = sum(t in onehots for t in re.findall(r"_dot\(raw_\w+, (t\d+),", chunk))
    return counts


@pytest.mark.parametrize("spec,params,d,dots", [
    ("power", {"p": 2}, 128, 2), ("power", {"p": 2, "normalize": True}, 128, 2), ("power", {"p": 3}, 128, 3),
    ("power", {"p": 2}, 64, 0), ("linear", {}, 128, 0), ("same_dim", {}, 128, 0)])
def test_column_pick_macs_are_the_generated_kernels_one_hot_dots(tmp_path, spec, params, d, dots):
    """The count against the generated source: each forward kernel forming a packed power runs p
    one-hot [C, d] x [d, B] dots a packed tile (0 where the columns are gathered in registers, at
    d <= 64, or loaded, where d is a dim the kernels split: ``same_dim``'s value dim is d)."""
    if spec == "same_dim":
        (tmp_path / "same_dim.hla").write_text(SHARED_DIM_POWER)
        spec = str(tmp_path / "same_dim.hla")
    alg = hladsl.compile_spec(spec, **params)
    sizes = (("d", d),) if spec.endswith(".hla") else (("d", d), ("dv", d))
    program = chunk_program(alg, 64, sizes, True)
    per_kernel = _one_hot_dots(triton_gen.render(triton_gen.kernel_context(program), "test"))
    assert per_kernel["state_pass_kernel"] == per_kernel["output_kernel"] == dots
    packed = {pd.name: pd.size for pd in program.packed}
    (size,) = packed.values() if packed else (0,)
    assert column_pick_macs(program) == 2 * dots * program.chunk * d * size


@pytest.mark.parametrize("name,params,d,picks", [
    ("power", {"p": 2}, 128, 2 * (2 * 64 * 128 * 8256)),          # spow2(q) in the output kernel, spow2(k) in the state pass
    ("power", {"p": 2, "normalize": True}, 128, 2 * (2 * 64 * 128 * 8256)),   # z shares U's columns in each kernel
    ("power", {"p": 3}, 128, 2 * (3 * 64 * 128 * 357760)),
    ("power", {"p": 2}, 64, 0), ("linear", {}, 128, 0)])           # gathered in registers; no packed power
def test_the_chunk_form_counts_its_one_hot_column_dots(name, params, d, picks):
    """The chunk form's MACs for the rule: the algebra's products plus the one-hot dots that pick a
    wide tile's packed power columns, p [C, d] x [d, D] dots a chunk in each kernel forming spow."""
    at, _ = _program_at(name, d, **params)
    program = at(launch.ATTENTION_CHUNK)
    assert column_pick_macs(program) == picks
    C = program.chunk
    assert launch.chunk_form_macs(program, [3 * C, 2 * C - 5]) == 5 * (chunk_macs(program, C) + picks)
    if name == "power" and d == 64:   # "dot" picks every tile's columns by dots, "rows" none
        with mock.patch.object(triton_gen, "POWER_COLUMNS", "dot"):
            assert column_pick_macs(program) == 2 * (params["p"] * C * 64 * 2080)
    if picks:
        with mock.patch.object(triton_gen, "POWER_COLUMNS", "rows"):
            assert column_pick_macs(program) == 0


def test_power_at_d128_and_64k_takes_the_attention_form():
    """Run 312 (H200, gated forward, B = 2, H = 16): 82.6 ms on the attention form against the chunk
    form's 131.3 at T = 64k, and at 96k 190.6 vs 196.5; the chunk form's training at 64k runs out of
    memory. Counting the column dots moves the rule's MAC ratio there from 5.92 to 1.99."""
    power, _ = _program_at("power", 128, p=2)
    linear, _ = _program_at("linear", 128)
    with launch.switched(ATTENTION_FORM="auto"):
        assert launch.use_attention_form(power, [65536], CUDA) is True
        assert launch.use_attention_form(power, [98304], CUDA) is True
        assert launch.use_attention_form(power, [1 << 17], CUDA) is False
        assert launch.use_attention_form(linear, [65536], CUDA) is False
        with mock.patch.object(triton_gen, "POWER_COLUMNS", "rows"):   # (no dots: the algebra's count alone)
            assert launch.use_attention_form(power, [65536], CUDA) is False


@pytest.mark.parametrize("name,params,d,lengths", [
    ("power", {"p": 2}, 128, [16384]), ("power", {"p": 2}, 64, [16384]), ("power", {"p": 2}, 128, [1 << 20]),
    ("power", {"p": 3}, 64, [16384]), ("linear", {}, 64, [16384]), ("linear", {}, 128, [256] * 64),
    ("power", {"p": 2}, 64, [1024] * 16), ("hla2", {}, 64, [16384])])
def test_auto_follows_the_mac_ratio(name, params, d, lengths):
    at, asked = _program_at(name, d, **params)
    with launch.switched(ATTENTION_FORM="auto"):
        assert launch.use_attention_form(at, lengths, CUDA) == _by_macs(at, lengths)
        assert set(asked) == {launch.ATTENTION_CHUNK}
        assert launch.use_attention_form(at, lengths, torch.device("cpu")) is False   # "auto": CUDA only


def test_the_clear_cases_of_the_launch_rule(monkeypatch):
    power, _ = _program_at("power", 128, p=2)
    linear, _ = _program_at("linear", 64)
    hla2, _ = _program_at("hla2", 64)
    monkeypatch.setattr(launch, "ATTENTION_FORM", "auto")
    assert launch.use_attention_form(power, [16384], CUDA) is True     # a 8256 x 128 state a head
    assert launch.use_attention_form(power, [16384], CUDA) == _by_macs(power, [16384])
    assert launch.use_attention_form(linear, [16384], CUDA) is False   # a 64 x 64 state a head
    assert launch.use_attention_form(hla2, [256], CUDA) is False       # no form
    with launch.switched(ATTENTION_FORM="never"):
        assert launch.use_attention_form(power, [16384], CUDA) is False
    with launch.switched(ATTENTION_FORM="always"):
        assert launch.use_attention_form(linear, [16384], CUDA) is True
        assert launch.use_attention_form(linear, [16384], torch.device("cpu")) is True
        assert launch.use_attention_form(hla2, [16384], CUDA) is False
    monkeypatch.setattr(launch, "ATTENTION_MAC_RATIO", 1e6)   # the rule reads the ratio
    assert launch.use_attention_form(linear, [16384], CUDA) is True
    monkeypatch.setattr(launch, "ATTENTION_MAC_RATIO", 0.0)
    assert launch.use_attention_form(power, [16384], CUDA) is False
    with pytest.raises(ValueError, match="ATTENTION_FORM"):
        with launch.switched(ATTENTION_FORM="sometimes"):
            pass


# -- 7. --emit attention ---------------------------------------------------------------------

def test_emit_attention(capsys):
    from hladsl.cli import main
    from hladsl.emit import emit
    text = emit("power", "attention", {}, None)
    assert "def attention_kernel(" in text and "no attention form" not in text
    assert "q_t[_0] q_t[_1] k_n0[_0] k_n0[_1] v_n0[e]" in text   # its pairwise term
    assert "def attention_query_grad_kernel(" in text and "def attention_key_grad_kernel(" in text
    assert "#   key: dv[Tn0,e] +=" in text and "#   query: dq[Tt,_0] +=" in text   # its backward's networks
    none = emit("hla2", "attention", {}, None)
    assert "no attention form" in none and "sums over 2 earlier tokens" in none
    assert "attention_kernel" not in none
    assert main(["compile", "power", "--emit", "attention"]) == 0
    assert "def attention_kernel(" in capsys.readouterr().out
