"""``hladsl.load(spec, backend="triton")`` end to end on CPU tensors under the
Triton interpreter: the generated forward and backward kernels behind the op's
one autograd path (tiling, scale, gates, varlen, packed and unpacked state
layouts) against the torch backend, float32."""
import os

os.environ["TRITON_INTERPRET"] = "1"   # before any kernel module is generated

import pytest  # noqa: E402
import torch  # noqa: E402

import hladsl  # noqa: E402

# (spec, params, gated, with initial state, varlen): every code path of the wiring
CASES = [("linear", {}, True, True, False), ("hla2", {"normalize": True}, True, True, True),
         ("power", {}, False, True, False), ("ahla", {}, True, False, True)]


def _inputs(name, gen, B, T, H, d, dv, gated, normalize):
    q, k = (torch.randn(B, T, H, d, generator=gen) for _ in range(2))
    if normalize:            # positive features keep the normaliser away from zero
        q, k = q.abs() + 0.1, k.abs() + 0.1
    v = torch.randn(B, T, H, dv, generator=gen)
    g = -0.3 * torch.rand(B, T, H, generator=gen) if gated else None
    return q, k, v, g


@pytest.mark.parametrize("name,params,gated,with_init,varlen", CASES,
                         ids=[c[0] + ("-norm" if c[1] else "") + ("-varlen" if c[4] else "")
                              for c in CASES])
def test_triton_backend_matches_torch(name, params, gated, with_init, varlen):
    gen = torch.Generator().manual_seed(7)
    B, T, H, d, dv = (1, 40, 2, 8, 8) if varlen else (2, 37, 2, 8, 8)
    q, k, v, g = _inputs(name, gen, B, T, H, d, dv, gated, params.get("normalize"))
    cu = torch.tensor([0, 13, 40]) if varlen else None
    n_seq = 2 if varlen else B
    ops = {b: hladsl.load(name, backend=b, chunk_size=16, **params) for b in ("torch", "triton")}
    shapes = ops["torch"].state_shapes(d, dv)
    init = ({n: 0.1 * torch.randn(n_seq, H, *s, generator=gen) for n, s in shapes.items()}
            if with_init else None)
    w_o = torch.randn(B, T, H, dv, generator=gen)
    w_s = {n: torch.randn(n_seq, H, *s, generator=gen) for n, s in shapes.items()}
    grads, outs = {}, {}
    for backend, op in ops.items():
        leaves = [x.clone().requires_grad_() for x in (q, k, v)]
        gl = None if g is None else g.clone().requires_grad_()
        il = None if init is None else {n: x.clone().requires_grad_() for n, x in init.items()}
        o, final = op(*leaves, g=gl, scale=0.5, initial_state=il, output_final_state=True,
                      cu_seqlens=cu)
        loss = (o * w_o).sum() + sum((final[n] * w_s[n]).sum() for n in final)
        wrt = leaves + ([gl] if gl is not None else []) + (list(il.values()) if il else [])
        grads[backend] = torch.autograd.grad(loss, wrt)
        outs[backend] = (o, final)
    torch.testing.assert_close(outs["triton"][0], outs["torch"][0], rtol=1e-4, atol=1e-4)
    for n in shapes:
        torch.testing.assert_close(outs["triton"][1][n], outs["torch"][1][n], rtol=1e-4, atol=1e-4)
    for got, want in zip(grads["triton"], grads["torch"]):
        err = ((got - want).norm() / want.norm()).item()
        assert err < 1e-4, f"relative gradient error {err:.2e}"


def test_triton_backend_on_cpu_needs_the_interpreter(monkeypatch):
    monkeypatch.delenv("TRITON_INTERPRET")
    op = hladsl.load("linear", backend="triton")
    q = torch.randn(1, 4, 1, 4)
    with pytest.raises(ValueError, match="TRITON_INTERPRET=1"):
        op(q, q, q)


@pytest.mark.parametrize("name,params", [("linear", {}), ("hla2", {})])
def test_varlen_lays_sequences_in_one_row_of_chunks(name, params):
    """cu_seqlens: one long sequence beside short and empty ones costs their total length
    in chunks (not count × longest), and each sequence, gated, from its own initial state,
    gives what it gives alone (forward, final state, gradients; float64 torch reference)."""
    from hladsl.runtime import op as op_module
    gen = torch.Generator().manual_seed(3)
    lengths, C, H, d = [37, 0, 5, 16], 16, 2, 8
    cu = torch.tensor([0] + torch.tensor(lengths).cumsum(0).tolist())
    T = sum(lengths)
    q, k, v, g = _inputs(name, gen, 1, T, H, d, d, True, False)
    tri = hladsl.load(name, backend="triton", chunk_size=C, **params)
    ref = hladsl.load(name, backend="torch", chunk_size=C, **params)
    shapes = tri.state_shapes(d, d)
    init = {n: 0.1 * torch.randn(len(lengths), H, *s, generator=gen) for n, s in shapes.items()}
    laid = op_module._varlen_layout({"q": q}, None, cu, C, one_row=True)
    assert laid[0]["q"].shape[:2] == (1, (3 + 0 + 1 + 1) * C)     # Σ ceil(len / C) chunks
    assert laid[3].tolist() == [0, 3, 3, 4, 5]

    leaves = [x.clone().requires_grad_() for x in (q, k, v, g)]
    il = {n: x.clone().requires_grad_() for n, x in init.items()}
    o, final = tri(*leaves[:3], g=leaves[3], initial_state=il, output_final_state=True, cu_seqlens=cu)
    w = torch.randn(o.shape, generator=gen)
    grads = torch.autograd.grad((o * w).sum() + sum(x.sum() for x in final.values()), leaves + list(il.values()))
    for s, (a, b) in enumerate(zip(cu[:-1].tolist(), cu[1:].tolist())):
        one = [x[:, a:b].double().requires_grad_() for x in (q, k, v, g)]
        i1 = {n: x[s:s + 1].double().requires_grad_() for n, x in init.items()}
        o1, f1 = ref(*one[:3], g=one[3], initial_state=i1, output_final_state=True)
        want = torch.autograd.grad((o1 * w[:, a:b].double()).sum() + sum(x.sum() for x in f1.values()),
                                   one + list(i1.values()), allow_unused=True)
        torch.testing.assert_close(o[:, a:b].double(), o1, rtol=1e-4, atol=1e-4)
        for n in shapes:
            torch.testing.assert_close(final[n][s:s + 1].double(), f1[n], rtol=1e-4, atol=1e-4)
        for got, exp in zip([x[:, a:b] for x in grads[:4]], want[:4]):
            if b > a:
                torch.testing.assert_close(got.double(), exp, rtol=1e-4, atol=1e-4)
        for n, got, exp in zip(init, grads[4:], want[4:]):
            torch.testing.assert_close(got[s:s + 1].double(), exp, rtol=1e-4, atol=1e-4)


def test_fp16_query_gradient_is_scaled_inside_the_kernel():
    """The kernels see scaled queries (q · d^-1/2): d(scaled q) = dq / scale can pass fp16's
    65504 where dq does not. The scale is applied before the fp16 store (hla2, gated,
    d = 24: dq reaches ~1.9e4, d(scaled q) ~9.5e4)."""
    gen = torch.Generator().manual_seed(0)
    xs = [torch.randn(2, 37, 3, 24, generator=gen) for _ in range(3)]
    gate = -0.2 * torch.rand(2, 37, 3, generator=gen)
    tri = hladsl.load("hla2", backend="triton", chunk_size=16)
    ref = hladsl.load("hla2", backend="torch", chunk_size=16)
    half = [x.half().requires_grad_() for x in xs]
    tri(*half, g=gate.half())[0].float().pow(2).sum().backward()
    wide = [x.double().requires_grad_() for x in xs]
    ref(*wide, g=gate.double())[0].pow(2).sum().backward()
    assert 65504 * 24 ** -0.5 < wide[0].grad.abs().max() < 65504   # the case this guards
    for got, want in zip(half, wide):
        assert torch.isfinite(got.grad).all()
        assert ((got.grad.double() - want.grad).norm() / want.grad.norm()).item() < 1e-2


@pytest.mark.parametrize("name,params", [("hla2", {"normalize": True}), ("power", {})],
                         ids=["hla2", "power"])
def test_query_scale_applied_in_the_kernels_as_torch_would(monkeypatch, name, params):
    """launch.SCALE_QUERIES_IN_KERNEL: the kernels multiply the query tiles by scale as they
    load them (hla2's q also feeds its state C; power's φ(q) is gathered from packed
    slots), or torch does before them. float32: the same bits either way, forward and
    backward, with a scale that is not a power of two; and both match the torch backend."""
    from hladsl.runtime import launch
    gen = torch.Generator().manual_seed(3)
    q, k, v, g = _inputs(name, gen, 2, 37, 2, 8, 8, True, params.get("normalize"))
    results = {}
    for in_kernel in (True, False):
        monkeypatch.setattr(launch, "SCALE_QUERIES_IN_KERNEL", in_kernel)
        leaves = [x.clone().requires_grad_() for x in (q, k, v, g)]
        op = hladsl.load(name, backend="triton", chunk_size=16, **params)
        o = op(*leaves[:3], g=leaves[3], scale=0.37)[0]
        o.pow(2).sum().backward()
        results[in_kernel] = [o.detach()] + [x.grad for x in leaves]
    for got, want in zip(results[True], results[False]):
        assert torch.equal(got, want)
    wide = [x.double().requires_grad_() for x in (q, k, v, g)]
    ref = hladsl.load(name, backend="torch", chunk_size=16, **params)
    o = ref(*wide[:3], g=wide[3], scale=0.37)[0]
    o.pow(2).sum().backward()
    for got, want in zip(results[True], [o.detach()] + [x.grad for x in wide]):
        # relative to the whole tensor: dg of the first token is a cancelling sum that is 0
        # exactly (no initial state), float32 noise elementwise
        assert ((got.double() - want).norm() / want.norm()).item() < 1e-5


@pytest.mark.parametrize("name", ["linear", "ahla", "power", "hla2"])
def test_chunk_starts_stored_in_the_output_dot_dtype(monkeypatch, force_bf16_starts, name):
    """launch.starts_dtype: chunk-start states the output kernel reads only as SDOT dot
    operands are stored in SDOT's dtype (bf16 on a GPU; fp32 on CPU, so forced here): the
    kernels store and read them so, and the output is the fp32 one within bf16 rounding of
    those states. hla2 reads its states elementwise too: they stay fp32, the same bits (under
    the two-pass schedule; its scan's derived starts: test_chunk_scan)."""
    from hladsl.runtime import launch
    gen = torch.Generator().manual_seed(5)
    q, k, v, g = _inputs(name, gen, 2, 37, 2, 8, 8, True, False)
    op = hladsl.load(name, backend="triton", chunk_size=16)
    monkeypatch.setattr(op, "schedule", "two_pass")   # (hladsl.load is memoised: restored)
    with launch.switched(CARRY_DERIVED=False):   # hla2 as written (its carried form reads S, W0 by dots)
        want = op(q, k, v, g=g)[0]
        stored = force_bf16_starts()
        got = op(q, k, v, g=g)[0]
    assert stored and all(stored) == (name != "hla2") and any(stored) == (name != "hla2")
    if name == "hla2":
        assert torch.equal(got, want)
    else:
        err = ((got - want).norm() / want.norm()).item()
        assert 0 < err < 1e-2


@pytest.mark.parametrize("bounds", [[3, 10, 20], [0, 10, 15], [0, 12, 8, 20]])
def test_bad_cu_seqlens_are_refused_without_value_checks(monkeypatch, bounds):
    """On CUDA the value checks are off (they sync); the varlen layout reads cu_seqlens
    anyway and refuses bounds that would give a wrong-shaped output."""
    from hladsl.runtime import op as op_module
    monkeypatch.setattr(op_module, "value_checks", lambda x: False)
    op = hladsl.load("linear", backend="triton", chunk_size=16)
    q = torch.randn(1, 20, 2, 8)
    with pytest.raises(ValueError, match="cu_seqlens must rise from 0 to T = 20"):
        op(q, q, q, cu_seqlens=torch.tensor(bounds))


@pytest.mark.parametrize("name", ["linear", "hla2"])
def test_bf16_on_the_interpreter_matches_the_torch_backend(name):
    """bf16 tokens through the generated kernels on CPU: the interpreter's tiles multiply in
    fp32 (its bf16 dot is wrong), so the result is the bf16-input result within bf16 rounding."""
    gen = torch.Generator().manual_seed(0)
    xs = [torch.randn(1, 40, 2, 16, generator=gen) for _ in range(3)]
    tri = hladsl.load(name, backend="triton", chunk_size=16)
    ref = hladsl.load(name, backend="torch", chunk_size=16)
    leaves = [x.bfloat16().requires_grad_() for x in xs]
    o = tri(*leaves)[0]
    o.float().pow(2).sum().backward()
    wide = [x.bfloat16().double().requires_grad_() for x in xs]
    r = ref(*wide)[0]
    r.pow(2).sum().backward()
    assert ((o.double() - r).norm() / r.norm()).item() < 1e-2
    for got, want in zip(leaves, wide):
        assert ((got.grad.double() - want.grad).norm() / want.grad.norm()).item() < 2e-2


@pytest.mark.parametrize("name,params,with_final,schedule", [
    ("hla2", {}, True, "auto"), ("linear", {"normalize": True}, False, "auto"), ("power", {}, True, "auto"),
    ("hla3_masked", {"normalize": True}, True, "staged")])
def test_carry_gradient_stops_after_the_reverse_pass(name, params, with_final, schedule):
    """``Op.carry_grad_impl`` (context parallelism's first backward step): the initial
    state's gradient from the output's cotangent and, where given, the final states',
    without the gradient kernels, on the generated kernels as from torch's autograd of
    the whole op (gated, float32); "staged": after the complete scan in two stages, the
    reverse pass in two stages (``launch.backward_module``)."""
    from hladsl.runtime import triton_backward
    gen = torch.Generator().manual_seed(3)
    B, T, H, d = 2, 37, 2, 8
    q, k, v, g = _inputs(name, gen, B, T, H, d, d, True, params.get("normalize"))
    ref = hladsl.load(name, backend="torch", chunk_size=16, **params)
    op = hladsl.load(name, backend="triton", chunk_size=16, **params)
    shapes = ref.state_shapes(d, d)
    init = {n: (0.1 * torch.randn(B, H, *s, generator=gen)).requires_grad_() for n, s in shapes.items()}
    w_o = torch.randn(B, T, H, d, generator=gen)
    w_f = {n: torch.randn(B, H, *s, generator=gen) for n, s in shapes.items()} if with_final else None
    o, final = ref(q, k, v, g, initial_state=init, output_final_state=True)
    loss = (o * w_o).sum() + (sum((final[n] * w_f[n]).sum() for n in final) if with_final else 0)
    want = torch.autograd.grad(loss, list(init.values()))
    ran = []
    launchers = {name: getattr(triton_backward.launch, name) for name in ("launch", "launch_narrowing")}

    def spying(real):
        def spy(kernel, *args, **kwargs):
            ran.append(kernel.fn.__name__ if hasattr(kernel, "fn") else kernel.__name__)
            return real(kernel, *args, **kwargs)
        return spy
    for name_, real in launchers.items():
        setattr(triton_backward.launch, name_, spying(real))
    op.schedule = schedule
    try:
        got = op.carry_grad_impl([q, k, v], g, None, [x.detach() for x in init.values()], w_o,
                                 [w_f[n] for n in shapes] if with_final else None)
    finally:
        op.schedule = "auto"   # (hladsl.load is memoised)
        for name_, real in launchers.items():
            setattr(triton_backward.launch, name_, real)
    for a, b in zip(got, want):
        assert ((a - b).norm() / b.norm()).item() < 1e-4
    assert {"reverse_kernel", "rscan_kernel"} & set(ran) and "grad_kernel" not in ran, ran
    assert ("stage_kernel" in ran and "rstage_scan_kernel" in ran) == (schedule == "staged"), ran


@pytest.mark.parametrize("name,schedule", [("hla2", "auto"), ("power", "auto"), ("hla3", "scan")])
def test_final_states_alone_skip_the_output_kernel(name, schedule, monkeypatch):
    """``Op.final_state_impl`` (context parallelism's segment pass): the op's final states
    from zero, without launching the output kernel, on the generated kernels (gated); HLA3's
    two-stage scan stores its first stage's chunk starts (the second reads them), not the
    second's."""
    from hladsl.runtime import triton_forward
    gen = torch.Generator().manual_seed(5)
    q, k, v, g = _inputs(name, gen, 2, 37, 2, 8, 8, True, False)
    op = hladsl.load(name, backend="triton", chunk_size=16)
    _, want = hladsl.load(name, backend="torch", chunk_size=16)(q, k, v, g, output_final_state=True)
    ran = []
    real = triton_forward.launch.launch

    def spy(kernel, *args, **kwargs):
        ran.append(kernel.fn.__name__ if hasattr(kernel, "fn") else kernel.__name__)
        return real(kernel, *args, **kwargs)
    monkeypatch.setattr(triton_forward.launch, "launch", spy)
    monkeypatch.setattr(op, "schedule", schedule)   # (restored: hladsl.load is memoised)
    got = dict(zip(op.state_names, op.final_state_impl([q, k, v], g, None, [])))
    for n, x in want.items():
        assert ((got[n] - x).norm() / x.norm()).item() < 1e-5, n
    assert "output_kernel" not in ran
    assert ("stage_scan_kernel" in ran) is (schedule == "scan")


@pytest.mark.parametrize("name,params,gated,with_init,varlen,schedule", [
    ("hla2", {}, False, True, False, "scan"), ("hla2", {}, True, False, False, "scan-groups"),
    ("hla2", {"normalize": True}, True, False, True, "auto"),
    ("linear", {}, True, True, False, "two_pass"), ("ahla", {}, False, False, False, "scan")],
    ids=["hla2-scan", "hla2-scan-groups", "hla2-norm-varlen", "linear-two_pass", "ahla-scan"])
def test_forward_keeps_the_state_pass_for_its_backward(monkeypatch, state_passes, name, params, gated, with_init,
                                                       varlen, schedule):
    """Under autograd the forward runs the backward's state pass and keeps its products
    (``launch.KEEP_STATE_PASS``): one state pass per fwd + bwd instead of two, the same
    outputs and final states, gradients equal bit for bit to a backward that recomputes
    (scan-groups: the backward's two-level scan, whose groups' deltas the reverse scan reads)."""
    from hladsl.runtime import launch, triton_backward
    if schedule == "scan-groups":   # groups of two chunks at the interpreter's shapes
        for rule, value in (("SCAN_GROUP", 2), ("SCAN_GROUP_FILL", 1000)):
            monkeypatch.setattr(launch, rule, value)
        schedule = "scan"
    gen = torch.Generator().manual_seed(11)
    B, T, H, d, dv = (1, 50, 2, 8, 8) if varlen else (2, 75, 2, 8, 8)
    q, k, v, g = _inputs(name, gen, B, T, H, d, dv, gated, params.get("normalize"))
    cu = torch.tensor([0, 18, 50]) if varlen else None
    op = hladsl.load(name, backend="triton", chunk_size=16, **params)
    monkeypatch.setattr(op, "schedule", schedule)   # (hladsl.load is memoised: later tests get this op)
    shapes = op.state_shapes(d, dv)
    n_seq = 2 if varlen else B
    init = {n: 0.1 * torch.randn(n_seq, H, *s, generator=gen) for n, s in shapes.items()} if with_init else None
    w_o = torch.randn(B, T, H, dv, generator=gen)
    passes = state_passes

    def fwd_bwd():
        passes.clear()
        leaves = [x.clone().requires_grad_() for x in (q, k, v)]
        gl = None if g is None else g.clone().requires_grad_()
        il = None if init is None else {n: x.clone().requires_grad_() for n, x in init.items()}
        o, final = op(*leaves, g=gl, scale=0.5, initial_state=il, output_final_state=True, cu_seqlens=cu)
        loss = (o * w_o).sum() + sum(x.sum() for x in final.values())
        wrt = leaves + ([gl] if gl is not None else []) + (list(il.values()) if il else [])
        return o.detach(), {n: x.detach() for n, x in final.items()}, torch.autograd.grad(loss, wrt), len(passes)

    with launch.switched(KEEP_STATE_PASS=False):
        o_re, final_re, grads_re, passes_re = fwd_bwd()
    o, final, grads, passes_kept = fwd_bwd()
    assert (passes_re, passes_kept) == (2, 1)
    if cu is None:   # (a varlen plan is not cached) the groups' case ran in groups
        grouped = [p.scan_groups > 1 for p in triton_backward._PLANS.values()]
        assert grouped and all(x == (launch.SCAN_GROUP == 2) for x in grouped)
    # normwise: the recomputing forward may carry a derived carry by its recursion (hla2's W0,
    # triton_gen._derived_recursion), another fp32 rounding of the same sums (each ~1e-7 of float64)
    rel = lambda a, b: ((a - b).norm() / b.norm()).item()   # noqa: E731
    assert rel(o, o_re) < 1e-6
    for n in final:
        assert rel(final[n], final_re[n]) < 1e-6, n
    for got, want in zip(grads, grads_re):
        assert torch.equal(got, want)


def test_kept_states_are_freed_by_the_backward():
    """The kept state pass is saved like the backward's inputs: gone once the backward ran
    (a training loop holds no step's kept tensors into the next)."""
    op = hladsl.load("hla2", backend="triton", chunk_size=16)
    op.schedule = "scan"
    try:
        q, k, v = (torch.randn(1, 40, 2, 8, requires_grad=True) for _ in range(3))
        o, _ = op(q, k, v)
        assert len(o.grad_fn.saved_tensors) > 5   # g, cu_seqlens, q, k, v and the kept tensors
        o.sum().backward()
        with pytest.raises(RuntimeError, match="freed"):
            o.grad_fn.saved_tensors
    finally:
        op.schedule = "auto"


def test_the_forward_keeps_at_the_chunk_the_backward_fit(monkeypatch, state_passes):
    """A backward whose kernels fit only a halved chunk: the forward's kept state pass (at the
    asked chunk) goes unused once, then the forward starts from the backward's fitted chunk."""
    from triton.runtime.errors import OutOfResources

    from hladsl.runtime import triton_backward
    real = triton_backward.backward_triton

    def fits_only_16(program, tiles, *args, **kwargs):
        if program.chunk > 16:
            raise OutOfResources(300000, 232448, "shared memory")
        return real(program, tiles, *args, **kwargs)
    monkeypatch.setattr(triton_backward, "backward_triton", fits_only_16)
    op = hladsl.load("hla2", backend="triton", chunk_size=32)
    gen = torch.Generator().manual_seed(2)
    q, k, v = (torch.randn(1, 70, 2, 8, generator=gen) for _ in range(3))
    counts, grads = [], []
    for _ in range(2):
        state_passes.clear()
        leaves = [x.clone().requires_grad_() for x in (q, k, v)]
        op(*leaves)[0].sum().backward()
        counts.append(len(state_passes))
        grads.append([x.grad for x in leaves])
    assert counts == [2, 1]
    for a, b in zip(*grads):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)
