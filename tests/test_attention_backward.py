"""Training on the attention form (``ir.attention.attention_backward``,
``codegen.attention_gen``, ``runtime.attention_backward``) on CPU under the Triton
interpreter: which networks each of its two kernels sums; every gradient (q, k, v, g) of
its kernels (fp32) against float64 autograd of the brute-force quadratic forms of
``test_attention_form`` (issue 10's interpreter bar, 1e-4), over several key chunks with
strong gates; varlen; unshipped specs (against the brute force and the torch backend in
float64); the share of the gaps between chunk starts in dΛ; which calls train on it."""
import json
import os

os.environ["TRITON_INTERPRET"] = "1"   # before any kernel module is generated

import pytest  # noqa: E402
import torch  # noqa: E402

import hladsl  # noqa: E402
from hladsl.ir.attention import attention_backward, pairwise_network  # noqa: E402
from hladsl.ir.backward import Target  # noqa: E402
from hladsl.ir.pipeline import chunk_program  # noqa: E402
from hladsl.runtime import attention_backward as attention_bwd_runtime, autotune, launch  # noqa: E402
from hladsl.runtime.attention_backward import gap_share  # noqa: E402

from test_attention_form import (C, KERNEL_CASES, UNSHIPPED, _brute, _routing_inputs, _tokens, _unshipped_reference,  # noqa: E402
                                 _rel, attention_calls, chunks_of_runs)  # noqa: F401 (a fixture)

GRAD_BAR = 1e-4   # issue 10: the kernels under the interpreter (fp32) against float64


@pytest.fixture
def backward_calls(monkeypatch):
    """The chunk of every ``backward_attention`` run."""
    return chunks_of_runs(monkeypatch, attention_bwd_runtime, "backward_attention")


def _grads(out, leaves, w):
    return torch.autograd.grad((out.double() * w.double()).sum(), leaves)


# -- 1. the IR: which networks each kernel sums ---------------------------------------------

@pytest.mark.parametrize("name,params", [("linear", {}), ("linear", {"normalize": True}), ("power", {"p": 2}),
                                         ("power", {"p": 3, "normalize": True})])
def test_networks_split_into_query_and_key_sides(name, params):
    """dq and dΛ_t sum over key chunks, dk, dv and dΛ_n over query chunks; no network targets a
    state; every one is pairwise (no term of token t alone in these specs); a dΛ network is
    planned to its pair products [t, n], the same on both sides."""
    program = chunk_program(hladsl.compile_spec(name, **params), C, (("d", 8), ("dv", 8)), True)
    ab = attention_backward(program)
    assert {(g.target, g.name) for g in ab.query} == {(Target.TOKEN, "q"), (Target.LAM, "")}
    assert {(g.target, g.name) for g in ab.key} == {(Target.TOKEN, "k"), (Target.TOKEN, "v"), (Target.LAM, "")}
    assert all(pairwise_network(g) for g in ab.query + ab.key)
    lams = {side: [g for g in getattr(ab, side) if g.target is Target.LAM] for side in ("query", "key")}
    assert len(lams["query"]) == len(lams["key"]) == (2 if params.get("normalize") else 1)
    for a, b in zip(lams["query"], lams["key"]):
        assert a.term.operands == b.term.operands and a.term.coef == -b.term.coef
        t, n = a.indices[0], b.indices[0]
        assert a.term.plan.steps[-1].indices == (t, n) and b.term.plan.steps[-1].indices == (n, t)   # then summed
    p = params.get("p", 1)
    parts = 2 if params.get("normalize") else 1                # num's networks, and den's
    assert len([g for g in ab.query if g.target is Target.TOKEN]) == p * parts


def test_networks_of_a_target_sharing_their_last_product_sum_before_it(monkeypatch):
    """Normalised power's dq: num's network ends in (... M) · k, and den's in (d den ∘ q kᵀ ∘ M) · k
    once d den, a vector on a kept index, leaves its product ((d den ∘ q) kᵀ = d den ∘ (q kᵀ), q kᵀ
    computed already); their other factors are summed first, so the query kernel runs as many dots
    a key chunk as the unnormalised one's (3; 5 with each network's own). dk: d den moves onto the
    other side of its last product (Σ_t (d den_t q_t) A_t,n = Σ_t q_t (d den_t A_t,n)), which then
    shares q with num's. The gradients: ``test_gradients_match_brute_force``."""
    import re

    from hladsl.codegen import attention_gen

    def dots(merge: bool, **params) -> dict:
        monkeypatch.setattr(attention_gen._AttentionBwdLowering, "merges_last_products", merge)
        program = chunk_program(hladsl.compile_spec("power", p=2, **params), C, (("d", 8), ("dv", 8)), True)
        parts = re.split(r"\ndef (attention_\w+)", attention_gen.attention_bwd_source(program))
        return {parts[i]: parts[i + 1].count("_dot(") for i in range(1, len(parts), 2)}
    merged, apart, plain = dots(True, normalize=True), dots(False, normalize=True), dots(True)
    assert (merged["attention_query_grad_kernel"], apart["attention_query_grad_kernel"]) == (3, 5)
    assert merged["attention_query_grad_kernel"] == plain["attention_query_grad_kernel"]
    assert merged["attention_key_grad_kernel"] < apart["attention_key_grad_kernel"]


@pytest.mark.parametrize("name", ["hla2", "hla3"])
def test_programs_without_an_attention_form_have_no_attention_backward(name):
    program = chunk_program(hladsl.compile_spec(name), C, (("d", 8), ("dv", 8)), True)
    assert attention_backward(program) is None


# -- 2. the kernels against float64 autograd of the brute force ----------------------------

GRAD_CASES = KERNEL_CASES + [("power", {"p": 3, "normalize": True}, True, True, 4, 8, None)]   # (the forward's)


@pytest.mark.parametrize("name,params,gated,positive,d,dv,scale", GRAD_CASES,
                         ids=[f"{c[0]}{c[1].get('p', '')}-{'gated' if c[2] else 'ungated'}"
                              f"{'-norm' if c[1].get('normalize') else ''}{'-scale' if c[6] else ''}"
                              for c in GRAD_CASES])
def test_gradients_match_brute_force(name, params, gated, positive, d, dv, scale, backward_calls):
    """T = 45 (three chunks of 16, the last padded), strong gates (a chunk decays by up to
    e^-16): dΛ's share of the gaps between chunks matters."""
    gen = torch.Generator().manual_seed(21)
    q, k, v, g = _tokens(gen, 2, 45, 2, d, dv, gated=gated, positive=positive)
    leaves = [x.clone().requires_grad_() for x in (q, k, v) + ((g,) if gated else ())]
    op = hladsl.load(name, backend="triton", chunk_size=C, **params)
    with launch.switched(ATTENTION_FORM="always"):
        o, state = op(*leaves[:3], g=leaves[3] if gated else None, scale=scale)
        w = torch.randn(o.shape, generator=gen)
        got = _grads(o, leaves, w)
    assert backward_calls == [C] and state is None
    ref = [x.detach().double().requires_grad_() for x in leaves]
    want_o = _brute(*ref[:3], ref[3] if gated else None, p=params.get("p", 1), scale=scale,
                    normalize=params.get("normalize", False))
    want = _grads(want_o, ref, w)
    assert _rel(o.detach(), want_o.detach()) <= GRAD_BAR
    for x, a, b in zip("qkvg", got, want):
        assert a.dtype == torch.float32 and a.shape == b.shape, x
        assert _rel(a, b) <= GRAD_BAR, f"d{x}: relative error {_rel(a, b):.2e}"


def test_gate_gradient_reaches_across_chunks(backward_calls):
    """Gates only in chunk 1, strong: dg there comes from the pairs that straddle it (queries in
    chunks 2, 3, keys in 0, 1) -- what the kernels' dΛ at whole-sequence Λ misses before
    ``gap_share`` moves it to the chunk's last in-chunk Λ."""
    gen = torch.Generator().manual_seed(22)
    q, k, v, _ = _tokens(gen, 1, 64, 2, 8, 8, gated=False, positive=False)
    g = torch.full((1, 64, 2), -0.01)
    g[:, C:2 * C] = -0.5
    leaves = [x.clone().requires_grad_() for x in (q, k, v, g)]
    with launch.switched(ATTENTION_FORM="always"):
        o, _ = hladsl.load("linear", backend="triton", chunk_size=C)(*leaves[:3], g=leaves[3])
        w = torch.randn(o.shape, generator=gen)
        got = _grads(o, leaves, w)[3]
    ref = [x.detach().double().requires_grad_() for x in leaves]
    want = _grads(_brute(*ref[:3], ref[3]), ref, w)[3]
    assert backward_calls == [C]
    assert _rel(got, want) <= GRAD_BAR
    assert want[:, :2 * C].abs().max() > 1e-2   # (the straddling pairs' gradient is not small)


@pytest.mark.parametrize("bounds", [[0, 21, 21, 22, 57], [0, 0, 1, 33, 33]],
                         ids=["empty-and-one-token-inside", "empty-first-and-last"])
def test_varlen_gradients_match_each_sequence_alone(bounds, backward_calls):
    """cu_seqlens with an empty sequence and one of 1 token: a query walk stops at its
    sequence's last chunk, a key walk at its first, dΛ's gap shares stay in their sequence."""
    gen = torch.Generator().manual_seed(23)
    T = bounds[-1]
    q, k, v, g = _tokens(gen, 1, T, 2, 8, 8, gated=True, positive=True)
    leaves = [x.clone().requires_grad_() for x in (q, k, v, g)]
    op = hladsl.load("power", backend="triton", chunk_size=C, p=2, normalize=True)
    cu = torch.tensor(bounds, dtype=torch.int32)
    with launch.switched(ATTENTION_FORM="always"):
        o, _ = op(*leaves[:3], g=leaves[3], cu_seqlens=cu)
        w = torch.randn(o.shape, generator=gen)
        got = _grads(o, leaves, w)
    assert backward_calls == [C]
    ref = [x.detach().double().requires_grad_() for x in leaves]
    pieces = [_brute(*(y[:, a:b] for y in ref[:3]), ref[3][:, a:b], p=2, normalize=True)
              for a, b in zip(bounds, bounds[1:]) if b > a]
    want = _grads(torch.cat(pieces, 1), ref, w)
    for x, a, b in zip("qkvg", got, want):
        assert _rel(a, b) <= GRAD_BAR, f"d{x}: relative error {_rel(a, b):.2e}"


def test_gap_share_moves_later_chunks_sums_to_each_chunks_last_position():
    """By hand: chunks' dΛ sums s_c; chunk c's last position gains Σ_{c' > c} s_c' within its
    sequence (varlen: the sequences' chunk bounds)."""
    d = torch.arange(1.0, 1.0 + 2 * 4 * 3).reshape(1, 2, 4, 3)
    s = d.sum(-1)
    whole = d.clone()
    gap_share(whole, None)
    want = d.clone()
    for c in range(4):
        want[..., c, -1] += s[..., c + 1:].sum(-1)
    assert torch.equal(whole, want)
    parts = d.clone()
    gap_share(parts, torch.tensor([0, 2, 2, 4]))   # sequences of chunks {0, 1}, {} and {2, 3}
    want = d.clone()
    want[..., 0, -1] += s[..., 1]
    want[..., 2, -1] += s[..., 3]
    assert torch.equal(parts, want)


# -- 3. specs that are not shipped -----------------------------------------------------------

# (not qk normalised: its o = (q_t·k_t) s_t / (q_t·k_t + eps) is s_t but for eps, so dq and dk are
# eps-sized differences that fp32 cannot resolve, the chunk form's kernels no better)
@pytest.mark.parametrize("which,normalize,gated", [
    ("two_kv", True, True), ("two_rates", True, True), ("skip", False, True), ("qk", False, True),
    ("qk", False, False)])
def test_unshipped_spec_trains_on_its_attention_form(which, normalize, gated, tmp_path, backward_calls):
    """A spec written here gets its attention form's backward with no new Python: two key
    summaries (two key-side inputs), strict masks beside a diagonal term of token t alone and
    two decay rates, a skip term (dv from both kernels), a query-side normaliser of token t
    alone. Gradients against float64 autograd of the brute force and of the torch backend."""
    path = tmp_path / f"{which}.hla"
    path.write_text(UNSHIPPED[which])
    params = {"normalize": True} if normalize else {}
    n_in = 4 if which == "two_kv" else 3
    gen = torch.Generator().manual_seed(24)
    B, T, H, d = 1, 45, 2, 8
    x = [torch.rand(B, T, H, d, generator=gen) + 0.1 for _ in range(n_in - 1)] + \
        [torch.randn(B, T, H, d, generator=gen)]
    g = -torch.rand(B, T, H, generator=gen) if gated else None
    leaves = [t.clone().requires_grad_() for t in x + ([g] if gated else [])]
    op = hladsl.load(str(path), backend="triton", chunk_size=C, **params)
    with launch.switched(ATTENTION_FORM="always"):
        o, _ = op(*leaves[:n_in], g=leaves[n_in] if gated else None, scale=1.0)
        w = torch.randn(o.shape, generator=gen)
        got = _grads(o, leaves, w)
    assert backward_calls == [C]
    ref = [t.detach().double().requires_grad_() for t in leaves]
    want = _grads(_unshipped_reference(which, ref[:n_in], ref[n_in] if gated else None, normalize), ref, w)
    torch_op = hladsl.load(str(path), backend="torch", **params)
    by_torch = _grads(torch_op(*ref[:n_in], g=ref[n_in] if gated else None, scale=1.0)[0], ref, w)
    for n, (a, b, c) in enumerate(zip(got, want, by_torch)):
        assert _rel(c, b) <= 1e-9, f"input {n}: the torch backend against the brute force"
        assert _rel(a, b) <= GRAD_BAR, f"input {n}: relative error {_rel(a, b):.2e}"


# -- 4. which calls train on it --------------------------------------------------------------

def _power():
    return hladsl.load("power", backend="triton", chunk_size=C, p=2, normalize=True)


def _check_grads(got, leaves, w, normalize=True):
    ref = [x.detach().double().requires_grad_() for x in leaves]
    want = _grads(_brute(*ref[:3], ref[3], p=2, normalize=normalize), ref, w)
    for x, a, b in zip("qkvg", got, want):
        assert _rel(a, b) <= GRAD_BAR, x


def test_a_stateless_call_to_differentiate_trains_on_it(backward_calls):
    q, k, v, g = _routing_inputs()
    leaves = [x.clone().requires_grad_() for x in (q, k, v, g)]
    with launch.switched(ATTENTION_FORM="always"):
        o, state = _power()(*leaves[:3], g=leaves[3])
        w = torch.randn(o.shape, generator=torch.Generator().manual_seed(25))
        got = _grads(o, leaves, w)
    assert backward_calls == [C] and state is None
    _check_grads(got, leaves, w)


@pytest.mark.parametrize("kwargs,mode", [({"output_final_state": True}, "always"), ({}, "never"),
                                         ({"initial_state": True}, "always")],
                         ids=["final-state", "never", "initial-state"])
def test_calls_with_a_state_or_never_train_on_the_chunk_form(kwargs, mode, backward_calls):
    q, k, v, g = _routing_inputs()
    op = _power()
    leaves = [x.clone().requires_grad_() for x in (q, k, v, g)]
    if kwargs.get("initial_state"):
        kwargs = {"initial_state": {n: torch.zeros(2, 2, *s) for n, s in op.state_shapes(8, 8).items()}}
    with launch.switched(ATTENTION_FORM=mode):
        o, _ = op(*leaves[:3], g=leaves[3], **kwargs)
        w = torch.randn(o.shape, generator=torch.Generator().manual_seed(26))
        got = _grads(o, leaves, w)
    assert backward_calls == []
    _check_grads(got, leaves, w)


def test_a_backward_given_no_kept_forward_recomputes_it(backward_calls, attention_calls):  # noqa: F811
    """With nothing kept (the custom op under torch.compile, torch.func: their forward returns
    outputs only) the backward runs the forward's kernel again for o and den, then trains on
    the form."""
    q, k, v, g = _routing_inputs()
    op = _power()
    w = torch.randn(q.shape[:3] + (8,), generator=torch.Generator().manual_seed(27))
    with launch.switched(ATTENTION_FORM="always"):
        got = op.backward_impl([q, k, v], g, q.shape[-1] ** -0.5, [], None, "auto", w, [], kept=None)
    assert backward_calls == [C] and attention_calls == [C]   # the forward again, for den
    _check_grads(got, [q, k, v, g], w)


@pytest.mark.parametrize("normalize,gated", [(False, True), (True, True), (True, False)])
def test_a_bound_training_call_on_it_equals_the_validated_call(normalize, gated, interpreter_binds):
    """An autograd call like an earlier one in all but its data replays that call's launches,
    forward (keeping o and den) and backward (the two gradient kernels; dΛ's gap shares after
    the replay, as after a validated call): o and every gradient bitwise equal."""
    op = hladsl.load("power", backend="triton", chunk_size=C, p=2, normalize=normalize)
    gen = torch.Generator().manual_seed(28)
    steps = []
    for _ in range(3):
        q, k, v, g = _tokens(gen, 2, 48, 2, 8, 8, gated=gated, positive=normalize, strong=False)
        steps.append((q, k, v, g, torch.randn(2, 48, 2, 8, generator=gen)))

    def train(q, k, v, g, do):
        leaves = [x.clone().requires_grad_() for x in (q, k, v, g) if x is not None]
        o, _ = op(*leaves[:3], g=leaves[3] if gated else None)
        o.backward(do)
        return o.detach(), [x.grad for x in leaves]
    with launch.switched(ATTENTION_FORM="always", BOUND_CALLS=False):
        want = [train(*step) for step in steps]
    assert interpreter_binds == []
    with launch.switched(ATTENTION_FORM="always", BOUND_CALLS=True):
        got = [train(*step) for step in steps]
    half = len(interpreter_binds) // 2   # the second and third calls were bound, alike
    assert half and interpreter_binds == interpreter_binds[:half] * 2
    names = [getattr(k, "__name__", None) or k.fn.__name__ for k in interpreter_binds[:half]]
    assert names == ["attention_kernel", "attention_query_grad_kernel", "attention_key_grad_kernel"], names
    for (o, grads), (o_want, grads_want) in zip(got, want):
        assert torch.equal(o, o_want)
        for a, b in zip(grads, grads_want):
            assert torch.equal(a, b)
    assert got[1][1][0].data_ptr() != got[2][1][0].data_ptr()


class _FormTuner(autotune.Tuner):
    """A Tuner whose clock makes ``winner`` the faster form; a schedule is the runner's own
    "auto" rule's (the test turns the kernels' launch tuning off); ``timed``: the forms timed."""

    def __init__(self, path, winner):
        super().__init__(path)
        self.winner, self.timed = winner, []

    def lookup(self, key, fast=None):
        return {"schedule": "auto"} if key.get("runner") not in (None, "form") else super().lookup(key, fast)

    def measure(self, candidate, fn):
        self.timed.append(candidate["form"])
        return 1.0 if candidate["form"] == self.winner else 2.0


@pytest.mark.parametrize("winner", ["attention", "chunk"])
def test_tuning_times_both_forms_and_runs_the_faster(winner, tmp_path, backward_calls, attention_calls,  # noqa: F811
                                                     monkeypatch):
    """Under a tuning session a stateless call times the attention and the chunk form -- its
    forward, and for a call to differentiate its forward and backward -- once per shape class,
    stores the winner and runs it from then on (on CPU too: the rule alone never takes the form
    there); the gradients are the brute force's either way."""
    monkeypatch.setattr(launch, "_tuned", lambda *a, **k: False)   # (the launch rules' configs)
    tuner = _FormTuner(tmp_path / "t.json", winner)
    shape = {"gpu": "Fake GPU", "dims": [["d", 8], ["dv", 8]], "dtype": "torch.float32", "gated": True,
             "bh": 2, "t": 64}
    gen = torch.Generator().manual_seed(32)
    q, k, v, g = _tokens(gen, 1, 40, 2, 8, 8, gated=True, positive=True)
    op = _power()
    with autotune.tuning(tuner, shape):
        for step in range(2):
            leaves = [x.clone().requires_grad_() for x in (q, k, v, g)]
            del backward_calls[:], attention_calls[:]
            o, _ = op(*leaves[:3], g=leaves[3])
            w = torch.randn(o.shape, generator=gen)
            _check_grads(_grads(o, leaves, w), leaves, w)
            assert tuner.timed == ["attention", "chunk"], tuner.timed   # (the first step only)
            # step 0: the attention candidate's run (once: the fake clock runs nothing), then the winner's;
            # step 1: a remembered winner, its kernels alone
            runs = [C] * ((winner == "attention") + (step == 0))
            assert (attention_calls, backward_calls) == (runs, runs), step
        with torch.no_grad():
            del attention_calls[:]
            o_fwd, _ = op(q, k, v, g=g)
        assert tuner.timed == ["attention", "chunk"] * 2
        del attention_calls[:]
        with torch.no_grad():
            op(q, k, v, g=g)
        assert attention_calls == ([C] if winner == "attention" else [])
    torch.testing.assert_close(o_fwd, o.detach(), rtol=1e-5, atol=1e-6)
    stored = {json.loads(key)["training"]: entry for key, entry in json.loads((tmp_path / "t.json").read_text())[
        "entries"].items() if json.loads(key).get("runner") == "form"}
    assert stored == {True: {"form": winner}, False: {"form": winner}}


@pytest.mark.parametrize("d,stages", [(32, 2), (64, 2), (128, 1)])
def test_launch_options_of_its_kernels(d, stages):
    """``launch.attention_launch``: the backward's stages by feature width (1 above 64 wide),
    and bf16 tiles at a feature dim under 64 with chained dots get fp32 tiles (``dot_override``
    sets DOT: run 298 raised a TypeError there, a keyword given twice)."""
    import triton.language as tl
    program = chunk_program(hladsl.compile_spec("power", p=2), 64, (("d", d), ("dv", d)), True)
    first = torch.zeros(1, 1, 2, 64, d, dtype=torch.bfloat16)
    for backward in (False, True):
        got = launch.attention_launch(program, first, chained_dots=True, backward=backward)
        assert got["num_stages"] == (stages if backward else launch.ATTENTION_STAGES)
        want = tl.float32 if d < 64 else launch.dot_dtype(first.dtype, first.device)
        assert got["DOT"] == want, got["DOT"]
        assert got["B_d"] == max(16, d) and got["C"] == 64


def test_a_training_forward_runs_at_the_chunk_its_backward_settled_on(monkeypatch):
    """A backward that had to halve its chunk (no kernel fitting) halves its training forward's
    next time too (``_on_kernels``' fitted chunk, keyed as the forward reads it): otherwise every
    step would keep o and den at the wrong chunk and run the forward twice (the review's probe)."""
    from triton.runtime.errors import OutOfResources
    from hladsl.runtime import attention_forward
    runs = []
    real_b, real_f = attention_bwd_runtime.backward_attention, attention_forward.forward_attention

    def backward(program, *args, **kwargs):
        runs.append(("bwd", program.chunk))
        if program.chunk == 32:
            raise OutOfResources(1 << 20, 1 << 18, "shared memory")
        return real_b(program, *args, **kwargs)

    def forward(program, *args, **kwargs):
        runs.append(("fwd", program.chunk))
        return real_f(program, *args, **kwargs)
    monkeypatch.setattr(attention_bwd_runtime, "backward_attention", backward)
    monkeypatch.setattr(attention_forward, "forward_attention", forward)
    op = hladsl.load("power", backend="triton", chunk_size=32, p=2, normalize=True)
    gen = torch.Generator().manual_seed(29)
    steps = []
    with launch.switched(ATTENTION_FORM="always"):
        for _ in range(2):
            runs.clear()
            q, k, v, g = _tokens(gen, 1, 64, 2, 8, 8, gated=True, positive=True, strong=False)
            leaves = [x.clone().requires_grad_() for x in (q, k, v, g)]
            o, _ = op(*leaves[:3], g=leaves[3])
            o.backward(torch.randn(o.shape, generator=gen))
            steps.append(list(runs))
    # the first step: fwd at 32, its backward halves to 16 (and runs the forward again there)
    assert steps[0] == [("fwd", 32), ("bwd", 32), ("fwd", 16), ("bwd", 16)], steps[0]
    assert steps[1] == [("fwd", 16), ("bwd", 16)], steps[1]


def test_an_input_both_kernels_reach_sums_its_parts_in_fp32(monkeypatch, tmp_path):
    """The skip spec's v has a query-side network (o_t += v_t) and key-side ones: the query
    kernel's part goes to an fp32 buffer the key kernel adds to, not to the bf16 gradient
    (rounded twice, the review found: a tied spec's dx 1.6e-2 in bf16)."""
    path = tmp_path / "skip.hla"
    path.write_text(UNSHIPPED["skip"])
    seen = {}
    real = launch.launch

    def spy(kernel, grid, args, *rest, **kw):
        seen[getattr(kernel, "__name__", None) or kernel.fn.__name__] = {
            k: v.dtype for k, v in args.items() if k.startswith(("dsum_", "dx_")) and k.endswith("_ptr")}
        return real(kernel, grid, args, *rest, **kw)
    monkeypatch.setattr(launch, "launch", spy)
    gen = torch.Generator().manual_seed(30)
    leaves = [torch.randn(1, 40, 2, 8, generator=gen).to(torch.bfloat16).requires_grad_() for _ in range(3)]
    op = hladsl.load(str(path), backend="triton", chunk_size=C)
    with launch.switched(ATTENTION_FORM="always"):
        o, _ = op(*leaves, scale=1.0)
        o.float().sum().backward()
    for name in ("attention_query_grad_kernel", "attention_key_grad_kernel"):
        assert seen[name]["dsum_v_ptr"] == torch.float32 and seen[name]["dx_v_ptr"] == torch.bfloat16, seen
        assert "dsum_k_ptr" not in seen[name]   # (one side only: no buffer)
    assert all(x.grad is not None and x.grad.dtype == torch.bfloat16 for x in leaves)


def _fuzzed_pairwise_specs(count: int, seed: int, tmp_path) -> list:
    """The first ``count`` mutants (tests/fuzz_specs.py, seeded) of linear and power that compile,
    have an attention form, and whose backward networks differ from their origin's (not a
    rename: a coefficient, a zeroed summary, another power), as (path, origin)."""
    import fuzz_specs
    shipped = fuzz_specs.shipped_texts()

    def networks(text: str, name: str):
        path = tmp_path / f"{name}.hla"
        path.write_text(text)
        alg = hladsl.compile_spec(str(path))
        alg = hladsl.compile_spec(str(path), **({"normalize": True} if "normalize" in alg.params else {}))
        ab = attention_backward(chunk_program(alg, C, tuple(sorted((d, 8) for d in alg.dims)), True))
        return path, None if ab is None else sorted(g.text() for g in ab.query + ab.key)
    origins = {o: networks(shipped[o], o)[1] for o in ("linear", "power")}
    out = []
    for k, origin, text in fuzz_specs.mutants(2000, seed):
        if origin not in origins or text == shipped[origin]:
            continue
        try:
            path, got = networks(text, f"m{k}")
        except Exception:   # (most mutants are not specs: the fuzzer's own tests see to those)
            continue
        if got is not None and got != origins[origin]:
            out.append((path, origin))
            if len(out) == count:
                return out
    return out


def test_fuzzed_specs_train_on_their_attention_form(tmp_path, backward_calls, monkeypatch):
    """Specs no one wrote by hand (the fuzzer's mutants of linear and power that have the form
    and another backward, normalised where they can be) get their attention form's backward with
    no new Python: every gradient against the torch backend's float64 autograd. (A longer hunt
    is round 46's: benchmarks/RESULTS.md.)"""
    monkeypatch.setenv("HLADSL_CACHE_DIR", str(tmp_path / "cache"))
    specs = _fuzzed_pairwise_specs(3, 20261129, tmp_path)
    assert len(specs) == 3
    for n, (path, origin) in enumerate(specs):
        alg = hladsl.compile_spec(str(path))
        params = {"normalize": True} if "normalize" in alg.params else {}
        gen = torch.Generator().manual_seed(31 + n)
        x = [torch.rand(1, 40, 2, 8, generator=gen) + 0.1 for _ in alg.inputs]
        g = -torch.rand(1, 40, 2, generator=gen)
        leaves = [t.clone().requires_grad_() for t in x + [g]]
        with launch.switched(ATTENTION_FORM="always"):
            o, _ = hladsl.load(str(path), backend="triton", chunk_size=C, **params)(*leaves[:-1], g=leaves[-1],
                                                                                    scale=1.0)
            w = torch.randn(o.shape, generator=gen)
            got = _grads(o, leaves, w)
        ref = [t.detach().double().requires_grad_() for t in leaves]
        want = _grads(hladsl.load(str(path), backend="torch", **params)(*ref[:-1], g=ref[-1], scale=1.0)[0], ref, w)
        for i, (a, b) in enumerate(zip(got, want)):
            assert _rel(a, b) <= GRAD_BAR, f"{path.name} (from {origin}), input {i}: {_rel(a, b):.2e}"
    assert len(backward_calls) == 3
