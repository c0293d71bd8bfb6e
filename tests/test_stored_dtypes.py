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
from hladsl.ir.pipeline import program_for
from hladsl.runtime import launch
from hladsl.runtime.op import carried_compilation
from oracles import oracle

_KERNELS = '''
@triton.jit
def writer(
    starts_A, starts_B,
):
    st_A = st_A + 1.0
    tl.store(starts_A + offs, st_A)
    tl.store(starts_B + offs, st_B)


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
'''


def test_starts_read_only_as_state_dot_operands_are_found():
    """Stored anywhere, read only as an SDOT operand (A): in SDOT; read elementwise (B), in a
    DOT product (C), loaded under another name (D) or used beside its dot (E): fp32."""
    assert starts_read_as_sdot([_KERNELS], "ABCDE") == {"A"}
    assert starts_read_as_sdot([_KERNELS.split("def reader")[0]], "ABCDE") == set("ABCDE")


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
