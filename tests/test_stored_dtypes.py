"""What the backward stores rounded to its state-dot dtype (SDOT: bf16 for bf16 inputs on a GPU)
where nothing reads it sharper: chunk starts that every kernel reads only as SDOT dot operands
(``triton_gen.starts_read_as_sdot``, the same bits in half the bytes) and the reverse scan's
d-states of a call that forms no d initial state (``launch.d_states_dtype``). The interpreter's
SDOT is fp32, so the bf16 choice is forced here where a test needs it stored."""
import pytest
import torch

import hladsl
from hladsl.codegen.triton_bwd import backward_kernels
from hladsl.codegen.triton_gen import starts_read_as_sdot
from hladsl.ir.pipeline import algebra_compilation, chunk_program, program_for
from hladsl.runtime import launch
from hladsl.runtime.op import carried_compilation
from oracles import oracle

_WRITER = '''
@triton.jit
def writer(
    starts_A, starts_B,
):
    st_A = st_A + 1.0
    tl.store(starts_A + offs, st_A)
    tl.store(starts_B + offs, st_B)
'''
_READER = '''
@triton.jit
def reader(
    starts_A, starts_B, starts_C, starts_D, starts_E,
):
    st_A = tl.load(starts_A + offs)  # A at the chunk start
    t1 = _dot(raw_k, st_A, SDOT, PREC)
    t2 = _dot(tl.trans(st_A), _dot(raw_q, raw_k, DOT, PREC), SDOT, PREC)
    st_B = tl.load(starts_B + offs)
    t3 = tl.sum(st_B * t1, axis=1)
    st_C = tl.load(starts_C + offs)
    t4 = _dot(raw_k, st_C, DOT, PREC)
    other = tl.load(starts_D + offs)
    t5 = _dot(raw_k, other, SDOT, PREC)
    st_E = tl.load(starts_E + offs)
    t6 = _dot(raw_k, st_E, SDOT, PREC) + st_E
    st_F = tl.load(starts_F + offs) * decay
    t7 = _dot(raw_k, st_F, SDOT, PREC)
    st_G = tl.load(starts_G + offs)
    t8 = _dot(raw_k, st_G * decay, SDOT, PREC)
    tl.store(starts_H + offs, tl.load(starts_H + offs) + 1.0)
'''


def test_starts_read_only_as_state_dot_operands_are_found():
    """Stored anywhere, read only as an SDOT operand (A): in SDOT; read elementwise (B), in a
    DOT product (C), loaded under another name (D), used beside its dot (E), loaded into an
    expression (F), an operand computed from it (G), loaded inside its own store (H): fp32. A
    kernel text that is not a function as the templates write them: nothing."""
    assert starts_read_as_sdot([_WRITER + _READER], "ABCDEFGH") == {"A"}
    assert starts_read_as_sdot([_WRITER, _READER], "ABCDEFGH") == {"A"}
    assert starts_read_as_sdot([_WRITER], "ABCDEFG") == set("ABCDEFG")
    assert starts_read_as_sdot(["@triton.jit\nreader = make_reader()\n"], "A") == frozenset()


def test_shipped_programs_store_the_starts_their_kernels_round():
    """What the rule takes for the shipped programs (d = 64, every module variant): the states
    read only through SDOT dots; none where the precision plan makes state reads exact (hla3
    as written) or where a gated program's dΛ networks read them elementwise."""
    want = {("linear", False): {"S"}, ("ahla", False): {"P", "E"}, ("hla3_masked", False): {"S", "P", "H"},
            ("hla3_masked", True): {"H"}, ("hla3", False): set(), ("linear", True): {"S"}}
    for (name, normalize), states in want.items():
        alg = hladsl.compile_spec(name, normalize=normalize)
        for stage_complete in (False, True):
            program = program_for(algebra_compilation(alg), 64, (("d", 64), ("dv", 64)), False)
            assert backward_kernels(program, stage_complete)[1]["starts_sdot"] == states, (name, normalize)
    program = program_for(algebra_compilation(hladsl.compile_spec("hla3_masked")), 64, (("d", 64), ("dv", 64)), True)
    assert backward_kernels(program)[1]["starts_sdot"] == frozenset()


_GATED_READER = '''
@triton.jit
def reader(
    starts_A, starts_B, starts_C, starts_D, starts_E,
):
    st_A = tl.load(starts_A + offs)
    t1 = _dot(raw_k, st_A, SDOT, PREC)
    t2 = tl.sum(tl.sum(ct_end_A * st_A, axis=1), axis=0)
    st_B = tl.load(starts_B + offs)
    t3 = _dot(raw_k, st_B, SDOT, PREC)
    t4 = tl.sum(tl.sum(ct_end_B * st_B * decay, axis=1), axis=0)
    st_C = tl.load(starts_C + offs)
    t5 = _dot(raw_k, st_C, SDOT, PREC)
    t6 = tl.sum(tl.sum(ct_end_A * st_C, axis=1), axis=0)
    st_D = tl.load(starts_D + offs)
    t7 = _dot(raw_k, st_D, SDOT, PREC)
    t8 = tl.sum(tl.sum(ct_end_D.to(tl.float32) * st_D.to(tl.float32), axis=1), axis=0)
    st_E = tl.load(starts_E + offs)
    t9 = _dot(raw_k, st_E, SDOT, PREC)
    other = tl.sum(tl.sum(ct_end_E * st_E, axis=1), axis=0)
'''


def test_dlam_inner_products_of_the_starts_are_taken_only_when_asked():
    """A sum of the start times the state's own chunk-end cotangent into a temp, a statement of
    its own (A; D with both cast to fp32: gated programs' dΛ scalars), is a read the rounded rule
    accepts; one with another factor (B), with another state's cotangent (C) or into a name that
    is not a temp (E) is not. Each is besides read by an SDOT dot. The exact rule accepts none."""
    assert starts_read_as_sdot([_GATED_READER], "ABCDE") == frozenset()
    assert starts_read_as_sdot([_GATED_READER], "ABCDE", inner_products=True) == {"A", "D"}


def test_gated_programs_take_rounded_starts_only_by_the_rounded_rule():
    """Every shipped gated program's backward reads its starts besides SDOT dots only in dΛ's inner
    products: the rounded rule (``starts_sdot_rounded``, ``launch.rounded_starts``) takes the states
    the ungated program takes; the exact rule, none."""
    for name in ("linear", "ahla", "hla3_masked", "power"):
        compilation = algebra_compilation(hladsl.compile_spec(name))
        ungated, gated = (backward_kernels(program_for(compilation, 64, (("d", 64), ("dv", 64)), g))[1]
                          for g in (False, True))
        assert gated["starts_sdot"] == frozenset(), name
        assert gated["starts_sdot_rounded"] == ungated["starts_sdot"] != frozenset(), name


def test_a_stateless_gated_backward_reads_rounded_starts(stored, monkeypatch):
    """Carried hla2, gated, no state (STATELESS_GATED_STARTS_IN_SDOT): its gradient kernels read bf16
    starts of S and W0, and the output and every gradient, dg included (the inner products), stay
    within their rounding of the float64 oracle (1e-2). With the rule off, fp32 starts."""
    torch.manual_seed(7)
    T, d = 150, 8
    base = [torch.randn(T, d, dtype=torch.float64) for _ in range(3)]
    g0 = -0.3 * torch.rand(T, dtype=torch.float64)
    op = hladsl.load("hla2", backend="triton")
    op.schedule = "scan"
    try:
        monkeypatch.setattr(launch, "STATELESS_GATED_STARTS_IN_SDOT", False)
        launch.forget_plans()
        op(*(x.float()[None, :, None].requires_grad_() for x in base), g=g0.float()[None, :, None])[0].sum().backward()
        assert {args["starts_S"] for name, args in stored if name == "grad_kernel"} == {torch.float32}
        monkeypatch.setattr(launch, "STATELESS_GATED_STARTS_IN_SDOT", True)
        launch.forget_plans()
        stored.clear()
        xs = [x.float().requires_grad_() for x in base]
        g = g0.float().requires_grad_()
        o, _ = op(*(x[None, :, None] for x in xs), g=g[None, :, None], scale=1.0)
        cot = torch.randn(T, d, dtype=torch.float64)
        o[0, :, 0].backward(cot.float())
    finally:
        op.schedule = "auto"
    grad = [args for name, args in stored if name == "grad_kernel"]
    assert grad and all(args[f"starts_{n}"] == torch.bfloat16 for args in grad for n in ("S", "W0"))
    refs = [x.clone().requires_grad_() for x in base]
    g_ref = g0.clone().requires_grad_()
    ref = oracle("hla2", *refs, g_ref)
    ref.backward(cot)
    for what, got, want in [("o", o[0, :, 0].detach(), ref.detach()), ("dg", g.grad, g_ref.grad)] + [
            (n, x.grad, r.grad) for n, x, r in zip(("dq", "dk", "dv"), xs, refs)]:
        err = ((got.double() - want).norm() / want.norm()).item()
        assert err < 1e-2, f"{what}: {err:.2e}"


@pytest.mark.parametrize("gated", [False, True])
def test_carried_hla3_reads_its_starts_only_as_state_dot_operands_ungated(gated):
    """Carried hla3's kernels (backward and forward modules) read SK, SQ, P and W0 at a chunk
    start only in SDOT products; gated, its gradient's dΛ networks multiply each elementwise with
    its d-state, so they stay fp32."""
    compilation, _ = carried_compilation(hladsl.compile_spec("hla3"))
    program = program_for(compilation, 16, (("d", 8), ("dv", 8)), gated)
    assert backward_kernels(program)[1]["starts_sdot"] == (frozenset() if gated else {"SK", "SQ", "P", "W0"})


@pytest.fixture
def stored(monkeypatch):
    """The dtypes of the starts and d-states each kernel launch got, by kernel name; bf16 chosen
    wherever the rules allow it (the interpreter's fp32 SDOT would never choose it)."""
    found = []
    real = launch.launch

    def spy(kernel, grid, args, *rest, **kwargs):
        name = kernel.fn.__name__ if hasattr(kernel, "fn") else kernel.__name__
        found.append((name, {k: x.dtype for k, x in args.items()
                             if isinstance(x, torch.Tensor) and k.startswith(("starts_", "dends_", "rdeltas_"))}))
        return real(kernel, grid, args, *rest, **kwargs)
    monkeypatch.setattr(launch, "launch", spy)
    monkeypatch.setattr(launch, "starts_dtype", lambda as_sdot, sdot: torch.bfloat16 if as_sdot else torch.float32)
    monkeypatch.setattr(launch, "d_states_dtype", lambda sdot, sharp=True: torch.float32 if sharp else torch.bfloat16)
    launch.forget_plans()   # (plans hold the dtypes: none kept after)
    yield found
    launch.forget_plans()


def test_a_stateless_backward_reads_rounded_starts_and_d_states(stored):
    """Carried hla3 without a state, the reverse pass a chunk scan: its gradient kernels read bf16
    starts of SK, SQ, P, W0 and bf16 chunk-end d-states, and the output and every gradient stay
    within their rounding (2^-9 of each) of the float64 oracle (1e-2; fp32 storage gives 1e-4:
    test_carried)."""
    torch.manual_seed(5)
    T, d = 150, 8    # three chunks of 64 (the interpreter's)
    base = [torch.randn(T, d, dtype=torch.float64) for _ in range(3)]
    op = hladsl.load("hla3", backend="triton")
    op.schedule = "scan"
    try:
        xs = [x.float().requires_grad_() for x in base]
        o, _ = op(*(x[None, :, None] for x in xs), scale=1.0)
        cot = torch.randn(T, d, dtype=torch.float64)
        o[0, :, 0].backward(cot.float())
    finally:
        op.schedule = "auto"
    grad = [args for name, args in stored if name == "grad_kernel"]
    assert grad and all(args[f"starts_{n}"] == torch.bfloat16 for args in grad for n in ("SK", "SQ", "P", "W0"))
    assert all(x == torch.bfloat16 for args in grad for k, x in args.items() if k.startswith("dends_"))
    refs = [x.clone().requires_grad_() for x in base]
    ref = oracle("hla3", *refs, None)
    ref.backward(cot)
    for what, got, want in [("o", o[0, :, 0].detach(), ref.detach())] + [
            (n, x.grad, r.grad) for n, x, r in zip(("dq", "dk", "dv"), xs, refs)]:
        err = ((got.double() - want).norm() / want.norm()).item()
        assert err < 1e-2, f"{what}: {err:.2e}"


def test_d_states_stay_sharp_where_a_d_initial_state_is_formed(stored):
    """hla2 as written with an initial state (its d initial state sums the d-states: ungated d C_init
    cancels, launch.d_states_dtype) keeps fp32 d-states; the same call without one stores bf16."""
    op = hladsl.load("hla2", backend="triton")
    op.schedule = "scan"
    q, k, v = (torch.randn(1, 150, 1, 8) for _ in range(3))
    init = {n: torch.randn(1, 1, *s) for n, s in op.state_shapes(8, 8).items()}
    try:
        for state in (init, None):
            stored.clear()
            xs = [x.clone().requires_grad_() for x in (q, k, v)]
            o, _ = op(*xs, initial_state=state, output_final_state=state is not None)
            o.sum().backward()
            dends = {x for name, args in stored if name == "grad_kernel" for k, x in args.items()
                     if k.startswith("dends_")}
            assert dends == ({torch.float32} if state is not None else {torch.bfloat16}), (state is None, dends)
    finally:
        op.schedule = "auto"


@pytest.mark.parametrize("name, normalize, gated, with_state, forced, starts, d_states", [
    # gated with an initial state: dΛ reads the starts beside the dots (the stateless rule only)
    ("linear", False, True, True, False, torch.float32, torch.float32),
    ("linear", False, True, True, True, torch.bfloat16, torch.float32),    # ... unless forced everywhere
    ("hla2", True, True, False, False, torch.float32, torch.float32),      # normalised: the quotient cancels
    ("hla2", True, False, False, False, None, torch.float32),           # normalised: quotient-cancelling d-states
])
def test_what_the_rules_refuse_stays_fp32(stored, monkeypatch, name, normalize, gated, with_state, forced,
                                          starts, d_states):
    """The reverse pass a chunk scan: linear gated with an initial state, the chunk starts its gradient
    kernels read stay fp32 (STATELESS_GATED_STARTS_IN_SDOT is for stateless calls; GATED_STARTS_IN_SDOT
    forces bf16), and so do its d-states (a d initial state is formed); hla2 normalised and stateless,
    whose quotient's cotangents cancel (ir.precision.quotient_cancelling), keeps its d-states fp32,
    and gated its starts too."""
    monkeypatch.setattr(launch, "GATED_STARTS_IN_SDOT", forced)
    op = hladsl.load(name, backend="triton", normalize=normalize)
    op.schedule = "scan"
    q, k, v = (torch.rand(1, 150, 1, 8) + 0.1 for _ in range(3))
    g = -0.2 * torch.rand(1, 150, 1) if gated else None
    init = {n: torch.randn(1, 1, *s) for n, s in op.state_shapes(8, 8).items()} if with_state else None
    try:
        xs = [x.clone().requires_grad_() for x in (q, k, v)]
        op(*xs, g=g, initial_state=init)[0].sum().backward()
    finally:
        op.schedule = "auto"
    grad = [args for kernel, args in stored if kernel == "grad_kernel"]
    assert grad
    if starts is not None:
        assert {x for args in grad for k, x in args.items() if k.startswith("starts_")} == {starts}
    assert {x for args in grad for k, x in args.items() if k.startswith("dends_")} == {d_states}


def test_a_reverse_only_step_keeps_its_d_states_sharp(stored):
    """Context parallelism's first backward step (``reverse_only``) wants the d initial state, so
    its reverse scan stores fp32 d-states even with no initial state given; the full backward of
    the same call, bf16 ones."""
    from test_triton_backward import _inputs
    from hladsl.runtime.triton_backward import backward_triton
    alg = hladsl.compile_spec("linear")
    program = chunk_program(alg, 16, (("d", 8), ("dv", 8)), True)
    tiles, lam, _, grad_o, _ = _inputs(program, False, seed=3)
    for reverse_only, want in ((True, torch.float32), (False, torch.bfloat16)):
        stored.clear()
        backward_triton(program, {k: x.float() for k, x in tiles.items()}, lam.float(), None, grad_o.float(),
                        None, alg.eps, schedule="scan", reverse_only=reverse_only)
        dends = {x for kernel, args in stored if kernel == "rscan_kernel" for k, x in args.items()
                 if k.startswith("dends_")}
        assert dends == {want}, reverse_only


def test_narrow_launches_store_fp32():
    """Where ``dot_override`` sends a chained launch's state dots to fp32 (a chunk or a feature
    dim narrower than 64: a Hopper miscompile's workaround) bf16 stores would not be the bits
    those dots read, so the backward stores fp32 there."""
    import triton.language as tl
    common = {"SDOT": tl.bfloat16}
    for chunk, width, want in ((64, 64, tl.bfloat16), (32, 64, tl.float32), (64, 32, tl.float32)):
        first = torch.zeros(1, 1, 1, chunk, 8, dtype=torch.bfloat16)
        assert launch.stored_sdot(first, common, {"B_d": width, "B_dv": 64}) == want, (chunk, width)


def test_bf16_parts_take_a_spare_fp32_buffer():
    """The reverse scan's parts go into the forward deltas it does not read (no extra memory):
    bf16 parts into the first half of an fp32 one of the same shape."""
    from hladsl.runtime.triton_backward import _part_buffers
    init = torch.zeros(2, 3, 4, 5)
    spare = torch.empty(2, 3, 7, 4, 5)
    written = [{"name": "S"}]
    parts = _part_buffers(written, {"init_S": init}, (2, 3, 7), [spare], torch.bfloat16)["rdeltas_S"]
    assert parts.dtype == torch.bfloat16 and parts.shape == spare.shape and parts.data_ptr() == spare.data_ptr()
    parts.fill_(1.5)   # a view of the buffer's first half: writable, in bounds
    assert _part_buffers(written, {"init_S": init}, (2, 3, 7), [spare], torch.float32)["rdeltas_S"].data_ptr() == \
        spare.data_ptr()
    other = _part_buffers(written, {"init_S": init}, (2, 3, 6), [spare], torch.bfloat16)["rdeltas_S"]
    assert other.data_ptr() != spare.data_ptr() and other.shape == (2, 3, 6, 4, 5)
