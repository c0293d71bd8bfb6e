"""The chunk-parallel state pass (``schedule="scan"``: ``delta_kernel`` over every chunk at
once, then ``scan_kernel`` walking the deltas; ``codegen.triton_gen._chunk_scan``) and the
backward's chunk-parallel reverse pass (``rdelta_kernel``, ``rscan_kernel``; in two
stages ``rstage_kernel``, ``rstage_scan_kernel`` too; ``codegen.triton_bwd._reverse_scan``)
under the Triton interpreter (CPU, float32) against the float64 torch backend: outputs,
final states and every gradient, dense and varlen, with and without an initial state, over
one and two value blocks."""
import os
from pathlib import Path

os.environ["TRITON_INTERPRET"] = "1"   # before triton is imported anywhere

import pytest  # noqa: E402
import torch  # noqa: E402

import hladsl  # noqa: E402
from hladsl.codegen import triton_gen  # noqa: E402
from hladsl.ir.pipeline import chunk_program  # noqa: E402
from hladsl.ir.backward import backward_program  # noqa: E402
from hladsl.ir.scan import staged_reverse, staged_scan  # noqa: E402
from hladsl.runtime import autotune, launch  # noqa: E402
from test_recursion import S_AND_C  # noqa: E402


@pytest.fixture(autouse=True)
def _cache_dir(tmp_path_factory, monkeypatch):
    monkeypatch.setenv("HLADSL_CACHE_DIR", str(tmp_path_factory.getbasetemp() / "hladsl-cache"))


@pytest.fixture
def launched(monkeypatch):
    """Names of the kernels the walking launches ran (the scan must not be a no-op),
    ``launched.grids``: each one's grid, ``launched.args``: each one's arguments."""
    names = _Launched()
    real = launch.launch_narrowing

    def spy(kernel, *args, **kwargs):
        name = kernel.fn.__name__ if hasattr(kernel, "fn") else kernel.__name__
        names.append(name)
        grid = real(kernel, *args, **kwargs)
        names.grids.append((name, grid))
        names.args.append((name, args[2]))
        return grid
    monkeypatch.setattr(launch, "launch_narrowing", spy)
    for module in ("triton_forward", "triton_backward"):
        monkeypatch.setattr(f"hladsl.runtime.{module}.launch.launch_narrowing", spy)
    return names


@pytest.fixture
def output_args(monkeypatch):
    """The arguments of every output kernel launch."""
    found = []
    real = launch.launch

    def spy(kernel, grid, args, *rest):
        if kernel.fn.__name__ == "output_kernel":
            found.append(args)
        return real(kernel, grid, args, *rest)
    monkeypatch.setattr(launch, "launch", spy)
    return found


class _Launched(list):
    def __init__(self):
        super().__init__()
        self.grids, self.args = [], []


# (spec, params, gated, initial state, varlen, dv): every spec with a chunk scan; HLA2's G
# reads S's delta, its normalised form h too, and ridge adds an identity term
CASES = [("hla2", {}, True, True, False, 8), ("hla2", {}, False, False, False, 8),
         ("hla2", {"normalize": True, "ridge": 0.3}, True, True, True, 8),
         ("hla2", {}, True, True, True, 32), ("linear", {}, True, True, False, 8),
         ("linear", {"normalize": True}, False, False, True, 8),
         # chunk summaries no state holds (ir.scan.AuxDelta): AHLA's Σ k qᵀ, HLA3-masked's three
         ("ahla", {}, True, True, False, 8), ("ahla", {"normalize": True}, False, False, True, 8),
         ("hla3_masked", {}, True, True, False, 8), ("hla3_masked", {"normalize": True}, True, False, True, 8)]


def _loss_and_grads(op, tensors, init, w_o, w_s, cu, scale):
    q, k, v, g = tensors
    leaves = [x.clone().requires_grad_() for x in (q, k, v)]
    gl = None if g is None else g.clone().requires_grad_()
    il = None if init is None else {n: x.clone().requires_grad_() for n, x in init.items()}
    o, final = op(*leaves, g=gl, scale=scale, initial_state=il, output_final_state=True, cu_seqlens=cu)
    loss = (o * w_o).sum() + sum((final[n] * w_s[n]).sum() for n in final)
    wrt = leaves + ([gl] if gl is not None else []) + (list(il.values()) if il else [])
    return o, final, torch.autograd.grad(loss, wrt)


def _check_scan_schedule(name, params, gated, with_init, dv, shapes, seed, cu=None, schedule="scan",
                         grad_tol=1e-4):
    """The "scan" schedule (or ``schedule``) in fp32 under the interpreter against the float64 torch program:
    outputs (1e-5), final states (1e-5) and every gradient (``grad_tol``); the outputs and final
    states of a call with nothing to differentiate too (the forward's own state pass: under
    autograd it runs the backward's, launch.KEEP_STATE_PASS)."""
    gen = torch.Generator().manual_seed(seed)
    B, T, H, d = shapes
    q, k = (0.5 * torch.randn(B, T, H, d, generator=gen, dtype=torch.float64) for _ in range(2))
    if params.get("normalize"):
        q, k = q.abs() + 0.1, k.abs() + 0.1
    v = torch.randn(B, T, H, dv, generator=gen, dtype=torch.float64)
    g = -0.3 * torch.rand(B, T, H, generator=gen, dtype=torch.float64) if gated else None
    n_seq = B if cu is None else cu.numel() - 1
    ref = hladsl.load(name, backend="torch", chunk_size=16, **params)
    op = hladsl.load(name, backend="triton", chunk_size=16, **params)
    op.schedule = schedule
    states = ref.state_shapes(d, dv)
    init = ({n: 0.2 * torch.randn(n_seq, H, *s, generator=gen, dtype=torch.float64).abs()
             for n, s in states.items()} if with_init else None)
    w_o = torch.randn(B, T, H, dv, generator=gen, dtype=torch.float64)
    w_s = {n: torch.randn(n_seq, H, *s, generator=gen, dtype=torch.float64) for n, s in states.items()}
    want_o, want_f, want_g = _loss_and_grads(ref, (q, k, v, g), init, w_o, w_s, cu, 0.5)

    def f32(x):
        return None if x is None else x.float()
    init32 = None if init is None else {n: f32(x) for n, x in init.items()}
    try:
        with torch.no_grad():
            plain_o, plain_f = op(*map(f32, (q, k, v)), g=f32(g), scale=0.5, initial_state=init32,
                                  output_final_state=True, cu_seqlens=cu)
        got_o, got_f, got_g = _loss_and_grads(
            op, tuple(map(f32, (q, k, v, g))), init32, f32(w_o), {n: f32(x) for n, x in w_s.items()}, cu, 0.5)
    finally:   # hladsl.load is memoised: other tests get this op
        op.schedule = "auto"

    def rel(a, b):
        return ((a.double() - b).norm() / b.norm()).item()
    for o, final in ((plain_o, plain_f), (got_o, got_f)):
        assert rel(o, want_o) < 1e-5
        for n in states:
            assert rel(final[n], want_f[n]) < 1e-5, n
    for a, b in zip(got_g, want_g):
        assert rel(a, b) < grad_tol


@pytest.mark.parametrize("name,params,gated,with_init,varlen,dv", CASES,
                         ids=[f"{c[0]}{'-norm' if c[1] else ''}-{'gated' if c[2] else 'plain'}"
                              f"{'-init' if c[3] else ''}{'-varlen' if c[4] else ''}-dv{c[5]}" for c in CASES])
def test_scan_schedule_matches_torch_float64(name, params, gated, with_init, varlen, dv, launched):
    _check_scan_schedule(name, params, gated, with_init, dv, (1, 70, 2, 8) if varlen else (2, 53, 2, 8), 11,
                         torch.tensor([0, 21, 22, 70]) if varlen else None)
    states = hladsl.load(name, backend="torch", chunk_size=16, **params).state_names
    # the plain forward and the forward under autograd both ran the chunk-parallel pass (the
    # latter the backward's, which the backward reads: launch.KEEP_STATE_PASS), and so did the
    # backward's reverse pass (AHLA's reads its forward chunk summary Σ k qᵀ, HLA3-masked's
    # chunk-start states beside its three summaries)
    assert launched.count("delta_kernel") == 2 and launched.count("scan_kernel") == 2
    assert launched.count("rdelta_kernel") == 1 and launched.count("rscan_kernel") == 1
    assert "state_pass_kernel" not in launched and "reverse_kernel" not in launched
    # dense: d-states the scan's programs own whole write their chunk-end cotangents over
    # their parts (HLA3-masked's scan has no split: every one); varlen: none
    args = dict(launched.args)["rscan_kernel"]
    written = {n for n in states if f"rdeltas_{n}" in args}
    shared = {n for n in written if args[f"dends_{n}"].data_ptr() == args[f"rdeltas_{n}"].data_ptr()}
    assert shared == set() if varlen else (shared == written if name == "hla3_masked" else bool(shared))


STAGED_CASES = [({}, True, True, False), ({"normalize": True}, False, False, True)]


@pytest.mark.parametrize("params,gated,with_init,varlen", STAGED_CASES,
                         ids=["gated-init-dense", "norm-plain-varlen"])
def test_two_stage_scan_matches_torch_float64(params, gated, with_init, varlen, launched):
    """HLA3's chunk scan in two stages (``ir.scan.staged_scan``): SK, SQ, P (m) scanned, every
    chunk's increment of G1, G2, G3 (h1, h2, h3) at once from their stored chunk starts, then
    those scanned -- outputs, final states and every gradient against the float64 torch
    program, as the one-stage scans above. The backward's reverse pass runs in two stages
    too (``ir.scan.staged_reverse``, the transpose): dG1, dG2, dG3 (dh1, dh2, dh3) scanned,
    every chunk's increment of dSK, dSQ, dP (dm) from their stored chunk ends, then those
    scanned; no forward delta read, nothing walks the tokens."""
    _check_scan_schedule("hla3", params, gated, with_init, 8, (1, 70, 2, 8) if varlen else (2, 53, 2, 8), 11,
                         torch.tensor([0, 21, 22, 70]) if varlen else None)
    upper = 6 if params else 3   # G1, G2, G3 (h1, h2, h3): one stage_kernel launch each
    lower = ("SK", "SQ", "P", "m") if params else ("SK", "SQ", "P")   # the forward's (its upper's reads)
    for kernel, launches in (("delta_kernel", 2), ("scan_kernel", 2), ("stage_kernel", 2 * upper),
                             ("stage_scan_kernel", 2), ("rdelta_kernel", 1), ("rscan_kernel", 1),
                             ("rstage_kernel", len(lower)), ("rstage_scan_kernel", 1)):
        assert launched.count(kernel) == launches, kernel
    parts = [args["PART"] for name, args in launched.args if name == "stage_kernel"]
    assert parts == list(range(upper)) * 2
    assert [args["PART"] for name, args in launched.args if name == "rstage_kernel"] == list(range(len(lower)))
    assert "state_pass_kernel" not in launched and "reverse_kernel" not in launched
    args = dict(launched.args)
    assert {k for k in args["stage_kernel"] if k.startswith("starts_")} == {f"starts_{n}" for n in lower}
    # the reverse stages: the forward's upper states are the reverse's lower ones and back
    firsts = ("G1", "G2", "G3", "h1", "h2", "h3") if params else ("G1", "G2", "G3")
    assert {k[len("dends_"):] for k in args["rscan_kernel"] if k.startswith("dends_")} == set(firsts)
    assert {k for k in args["rstage_kernel"] if k.startswith("starts_")} == {f"starts_{n}" for n in lower}
    assert {k[len("dends_"):] for k in args["rstage_kernel"] if k.startswith("dends_")} == set(firsts)
    assert {k[len("rdeltas_"):] for k in args["rstage_kernel"] if k.startswith("rdeltas_")} == set(lower)
    # the lower d-states' ends the increments read are the ones the first scan wrote
    for n in firsts:
        assert args["rstage_kernel"][f"dends_{n}"] is args["rscan_kernel"][f"dends_{n}"]


# (spec, params, gated, initial state, varlen): complete chunk scans that split in two stages
COMPLETE_STAGED = [("hla2", {}, True, True, False), ("hla2", {"normalize": True, "ridge": 0.3}, False, False, True),
                   ("ahla", {}, True, False, False), ("hla3_masked", {"normalize": True}, True, True, True)]


@pytest.mark.parametrize("name,params,gated,with_init,varlen", COMPLETE_STAGED,
                         ids=[f"{c[0]}{'-norm' if c[1] else ''}-{'gated' if c[2] else 'plain'}"
                              f"{'-init' if c[3] else ''}{'-varlen' if c[4] else ''}" for c in COMPLETE_STAGED])
def test_complete_scan_in_two_stages_matches_torch_float64(name, params, gated, with_init, varlen, launched):
    """Schedule "staged": a complete chunk scan in two stages (``launch.forward_module``,
    ``ir.scan.staged_scan(complete=True)``) -- the lower states scanned, every chunk's
    increment of the upper ones from their stored starts, those scanned -- in a forward with
    nothing to differentiate (the output kernel forms the derived carries itself) and in the
    backward's state pass, which the forward under autograd runs (``launch.backward_module``),
    storing every state's starts; the reverse pass then in two stages too
    (``ir.scan.staged_reverse``: no forward delta to read). Outputs, final states and
    gradients against the float64 torch program."""
    _check_scan_schedule(name, params, gated, with_init, 8, (1, 70, 2, 8) if varlen else (2, 53, 2, 8), 11,
                         torch.tensor([0, 21, 22, 70]) if varlen else None, schedule="staged")
    program = chunk_program(hladsl.compile_spec(name, **params), 16, (("d", 8), ("dv", 8)), gated)
    forward = staged_scan(program, complete=True)
    reverse = staged_reverse(backward_program(program))
    assert forward.upper and staged_scan(program) is None   # (one stage unless asked)
    # the plain call and the one under autograd: two stages (one stage_kernel launch an upper
    # state); the backward's reverse pass: two stages (one rstage_kernel launch an upper d-state)
    stages = ["delta_kernel", "scan_kernel"] + ["stage_kernel"] * len(forward.upper) + ["stage_scan_kernel"]
    assert launched[:2 * len(stages)] == stages * 2
    reversed_ = ["rdelta_kernel", "rscan_kernel"] + ["rstage_kernel"] * len(reverse.upper) + ["rstage_scan_kernel"]
    for kernel in set(stages + reversed_):
        assert launched.count(kernel) == (stages.count(kernel) * 2 or reversed_.count(kernel)), kernel
    assert "state_pass_kernel" not in launched and "reverse_kernel" not in launched
    assert "derived_kernel" not in launched
    plain_args, kept_args = [args for kernel, args in launched.args if kernel == "stage_kernel"][::len(forward.upper)]
    stage = triton_gen.kernel_context(program, stage_complete=True)["chunk_scan"]["stage"]
    reads = lambda args: {k[len("starts_"):] for k in args if k.startswith("starts_")}   # noqa: E731
    # HLA2's forward second stage walks its derived carries (test_the_second_stage_walks_the_derived_carries);
    # the backward's carries the states themselves, whose starts it reads
    assert reads(plain_args) == ({"S"} if stage["derived"] else set(forward.reads))
    assert bool(stage["derived"]) == (name == "hla2")
    assert reads(kept_args) == set(forward.reads)


def test_auto_stages_a_complete_scan_past_its_sequential_products():
    """``launch.forward_module`` under "auto": two stages where the one-stage scan's carried x
    delta products reach STAGED_SCAN_MACS a chunk and head -- HLA3-masked at d = 64 (4 d^3),
    HLA2 at d = 128 (d^3) -- not HLA2 at d = 64 (d^3 = 2^18); never where the scan has no
    second stage to split off (linear) or has only two stages (HLA3: its "scan")."""
    def context(name, d):
        program = chunk_program(hladsl.compile_spec(name), 64, (("d", d), ("dv", d)), False)
        return triton_gen.kernel_context(program)
    macs = {(name, d): context(name, d)["stageable_scan_macs"]
            for name, d in (("hla2", 64), ("hla2", 128), ("hla3_masked", 64), ("linear", 64), ("hla3", 64))}
    assert macs == {("hla2", 64): 64 ** 3, ("hla2", 128): 128 ** 3, ("hla3_masked", 64): 4 * 64 ** 3,
                    ("linear", 64): 0, ("hla3", 64): 0}
    taken = {key: launch.forward_module("auto", {"stageable_scan_macs": m})[1] for key, m in macs.items()}
    assert taken == {("hla2", 64): False, ("hla2", 128): True, ("hla3_masked", 64): True,
                     ("linear", 64): False, ("hla3", 64): False}
    assert launch.forward_module("two_pass", {"stageable_scan_macs": 4 * 64 ** 3}) == ("two_pass", False)
    assert launch.forward_module("staged", {"stageable_scan_macs": 64 ** 3}) == ("scan", True)
    # no second stage to split off (linear) or two stages only (HLA3): "staged" is their "scan"
    assert launch.forward_module("staged", {"stageable_scan_macs": 0}) == ("scan", False)
    with launch.switched(AUTO_STAGED_SCAN=False):
        assert launch.forward_module("auto", {"stageable_scan_macs": 4 * 64 ** 3}) == ("auto", False)


def test_plans_of_one_and_two_stages_never_mix(launched, monkeypatch):
    """A forward's launch plan is made for one module variant (one stage, or a complete scan in
    two): calls of either kind in any order, with no plan forgotten between them, each run their
    own kernels and match float64 (a one-stage plan once served a two-stage call: the scan's
    plan, then "staged"; the forward under autograd's, then a call with nothing to differentiate).
    Under autograd the forward runs the backward's state pass: in two stages too under "staged"
    (``launch.backward_module``), from the backward module of that variant."""
    gen = torch.Generator().manual_seed(5)
    q, k = (0.5 * torch.randn(2, 53, 2, 8, generator=gen, dtype=torch.float64) for _ in range(2))
    v = torch.randn(2, 53, 2, 8, generator=gen, dtype=torch.float64)
    want = hladsl.load("hla2", backend="torch", chunk_size=16)(q, k, v)[0]
    op = hladsl.load("hla2", backend="triton", chunk_size=16)
    # HLA2 as written (its W0 a derived carry, walked by the second stage), not its carried form
    with launch.switched(CARRY_DERIVED=False):
        launch.forget_plans()
        try:
            for schedule, grad in (("staged", True), ("staged", False), ("scan", False), ("staged", False),
                                   ("scan", True), ("staged", False), ("auto", True), ("auto", False)):
                op.schedule = schedule
                launched.clear()
                leaves = [x.float().requires_grad_(grad) for x in (q, k, v)]
                with torch.set_grad_enabled(grad):
                    o = op(*leaves)[0]
                assert ((o.detach().double() - want).norm() / want.norm()).item() < 1e-5, (schedule, grad)
                assert ("stage_kernel" in launched) == (schedule == "staged"), (schedule, grad, launched)
        finally:
            op.schedule = "auto"


@pytest.mark.parametrize("gated,by_term", [(False, False), (True, False), (True, True)],
                         ids=["plain", "gated", "gated-by-term"])
def test_two_stage_scan_over_two_value_blocks(gated, by_term, launched, monkeypatch):
    """The two-stage scan's increments split the value dim (two blocks of 16): the lower states
    without it (SK, SQ) are read whole by every block (both scans walk flat layouts); chunk starts and
    outputs against the float64 torch program. ``by_term``: the increments one term a launch
    (``launch.STAGE_PARTS`` "term", off by default), each adding its state's earlier ones; the
    parts one module holds both ways (``part_sets``)."""
    from hladsl.runtime.chunk_torch import outputs, state_pass
    from hladsl.runtime.triton_forward import forward_triton
    from test_triton_backward import _inputs
    monkeypatch.setattr(launch, "STAGE_PARTS", "term" if by_term else "state")
    alg = hladsl.compile_spec("hla3")
    program = chunk_program(alg, 16, (("d", 8), ("dv", 32)), gated)
    tiles, lam, init, _, _ = _inputs(program, False, seed=4)
    starts, final = state_pass(program, tiles, lam, init, torch.float64)
    want = outputs(program, "output", tiles, lam, starts, torch.float64)
    o, got = forward_triton(program, {k: v.float() for k, v in tiles.items()}, None if lam is None else lam.float(),
                            {k: v.float() for k, v in init.items()}, alg.eps, schedule="scan", state_block=16)
    assert ("stage_kernel", (3, 2, 2)) in launched.grids and ("stage_scan_kernel", (2, 1)) in launched.grids
    assert launched.count("stage_kernel") == (12 if by_term else 3)   # G1, G2, G3: 4 terms each
    parts = [args["PART"] for name, args in launched.args if name == "stage_kernel"]
    assert parts == (list(range(3, 15)) if by_term else [0, 1, 2])
    assert (o.double() - want).norm() / want.norm() < 1e-5
    for s in final:
        assert (got[s].double() - final[s]).norm() / final[s].norm() < 1e-5, s


@pytest.mark.parametrize("name,parts", [("hla2", "state"), ("hla3_masked", "state"), ("hla3_masked", "term")])
def test_final_states_alone_in_two_stages(name, parts, launched, monkeypatch):
    """Context parallelism's segment pass (``states_only``: the final states, no output kernel)
    with a complete scan in two stages: the first stage still stores the chunk starts its
    second stage's increments read; gated, from an initial state, over two value blocks,
    against the float64 torch program. ``parts``: the stage kernel's launches one a state or
    one a term (``launch.STAGE_PARTS``; HLA3-masked's upper states have several terms each)."""
    from hladsl.runtime.chunk_torch import state_pass
    from hladsl.runtime.triton_forward import forward_triton
    from test_triton_backward import _inputs
    monkeypatch.setattr(launch, "STAGE_PARTS", parts)
    alg = hladsl.compile_spec(name)
    program = chunk_program(alg, 16, (("d", 8), ("dv", 32)), True)
    tiles, lam, init, _, _ = _inputs(program, False, seed=6)
    _, want = state_pass(program, tiles, lam, init, torch.float64)
    o, got = forward_triton(program, {k: v.float() for k, v in tiles.items()}, lam.float(),
                            {k: v.float() for k, v in init.items()}, alg.eps, schedule="staged", state_block=16,
                            states_only=True)
    assert o is None and "stage_kernel" in launched and "stage_scan_kernel" in launched
    sets = triton_gen.kernel_context(program, stage_complete=True)["chunk_scan"]["stage"]["part_sets"]
    assert [a["PART"] for n, a in launched.args if n == "stage_kernel"] == sets[parts]
    assert (len(sets["term"]) > len(sets["state"])) == (name == "hla3_masked")
    for s in want:
        assert (got[s].double() - want[s]).norm() / want[s].norm() < 1e-5, s


@pytest.mark.parametrize("params,gated", [({}, True), ({"normalize": True}, False)], ids=["gated", "norm-plain"])
def test_the_second_stage_walks_the_derived_carries(params, gated, launched, output_args, monkeypatch):
    """HLA2's complete scan in two stages (schedule "staged", "auto" at d = 128) with its derived
    carries' recursion (``triton_gen._staged_recursion``): ``stage_kernel`` computes every chunk's
    increment of W0 (and Wn0) from S's chunk starts and deltas and the tokens,
    ``stage_scan_kernel`` walks them, stores them at each chunk start and recovers G (and h) at
    the end; the output kernel loads them (DERIVED_STARTS) and no chunk start of C, G (m, h) is
    stored. Over two value blocks, from an initial S that is not symmetric (held as given: W0
    reads it as its definition does), outputs and final states against the float64 torch program.
    The first stage's updates are elementwise (a decayed carry plus a delta): its scan kernel
    walks the states' flat layout in blocks (``flat``, here 4 blocks of 64 elements: S's 64 in
    the first, C's 256 in all four, m's 8), the grid no longer split over the value dim."""
    from hladsl.runtime.chunk_torch import outputs, state_pass
    from hladsl.runtime.triton_forward import forward_triton
    from test_triton_backward import _inputs
    monkeypatch.setattr(launch, "FLAT_SCAN_BLOCK", 64)
    launch.forget_plans()
    alg = hladsl.compile_spec("hla2", **params)
    program = chunk_program(alg, 16, (("d", 8), ("dv", 32)), gated)
    tiles, lam, init, _, _ = _inputs(program, bool(params), seed=6)
    assert (init["S"] - init["S"].transpose(-1, -2)).abs().max() > 0.1
    starts, want = state_pass(program, tiles, lam, init, torch.float64)
    want_o = outputs(program, "output", tiles, lam, starts, torch.float64)
    if params:
        want_o = want_o / (outputs(program, "normalizer", tiles, lam, starts, torch.float64)[..., None] + alg.eps)
    o, got = forward_triton(program, {k: v.float() for k, v in tiles.items()}, None if lam is None else lam.float(),
                            {k: v.float() for k, v in init.items()}, alg.eps, schedule="staged", state_block=16)
    assert ((o.double() - want_o).norm() / want_o.norm()).item() < 1e-5
    for s in want:
        assert ((got[s].double() - want[s]).norm() / want[s].norm()).item() < 1e-5, s
    args = dict(launched.args)
    derived = ["dr_W0", "dr_Wn0"] if params else ["dr_W0"]
    assert {k for k in args["stage_kernel"] if k.startswith(("starts_", "deltas_"))} \
        == {"starts_S", "deltas_S"} | {f"deltas_{d}" for d in derived}
    assert {k for k in args["stage_scan_kernel"] if k.startswith("dstart_")} == {f"dstart_{d}" for d in derived}
    assert ("stage_kernel", (3, 2, 2)) in launched.grids and ("stage_scan_kernel", (2, 2)) in launched.grids
    assert ("scan_kernel", (2, 4)) in launched.grids
    (out,) = output_args
    assert out["DERIVED_STARTS"] is True
    for n in ["C", "G"] + (["m", "h"] if params else []):   # (parameters only: the final states stand in)
        assert out[f"starts_{n}"] is got[n], n
    assert out["starts_S"].shape[2] == 3 and out["starts_S"].dtype == torch.float32   # (stage_kernel reads it)


@pytest.mark.parametrize("params,gated,varlen,on", [({}, False, False, True), ({"normalize": True}, True, False, True),
                                                   ({}, True, True, True), ({"normalize": True}, True, False, False)],
                         ids=["plain", "gated-norm", "gated-varlen", "off"])
def test_the_derived_kernel_forms_the_derived_carries(params, gated, varlen, on, launched, output_args):
    """HLA3's scan runs in two stages whose second walks the states (its W0's recursion has no
    chunk terms): ``derived_kernel`` forms W0 (and Wn0) at every chunk start from the starts both
    stages stored, over two value blocks, and the output kernel loads them (DERIVED_STARTS) --
    outputs and final states against the float64 torch program, from an initial state; G1..G3
    (h1..h3) starts are still stored (the derived kernel reads them). The second stage's walk is
    elementwise (``flat``: one block of 256 elements, the largest state's). DERIVED_KERNEL off (an A/B switch): the
    output kernel forms them itself."""
    from hladsl.runtime.chunk_torch import outputs, state_pass
    from hladsl.runtime.triton_forward import forward_triton
    from test_triton_backward import _inputs
    launch.forget_plans()
    alg = hladsl.compile_spec("hla3", **params)
    program = chunk_program(alg, 16, (("d", 8), ("dv", 32)), gated)
    tiles, lam, init, _, _ = _inputs(program, bool(params), seed=7)
    seq_chunks = None
    if varlen:   # sequences of 1 and 2 chunks in one row (N = 1)
        seq_chunks = torch.tensor([0, 1, 3], dtype=torch.int32)
        tiles = {k: v[:1].clone() for k, v in tiles.items()}
        tiles = {k: torch.cat([v, v.flip(2)], dim=2)[:, :, :3] for k, v in tiles.items()}
        lam = torch.cat([lam[:1], lam[:1]], dim=2)[:, :, :3]
        init = {k: torch.cat([v[:1], -0.5 * v[:1]]) for k, v in init.items()}
    with launch.switched(DERIVED_KERNEL=on):
        o, got = forward_triton(program, {k: v.float() for k, v in tiles.items()},
                                None if lam is None else lam.float(), {k: v.float() for k, v in init.items()},
                                alg.eps, schedule="scan", state_block=16, seq_chunks=seq_chunks)
    pieces = [(slice(0, 1), slice(0, 1), 0), (slice(0, 1), slice(1, 3), 1)] if varlen else [(slice(None), slice(None), None)]
    for rows, chunks, seq in pieces:
        part = {k: v[rows, :, chunks] for k, v in tiles.items()}
        start = init if seq is None else {k: v[seq:seq + 1] for k, v in init.items()}
        gates = None if lam is None else lam[rows, :, chunks]
        starts, want = state_pass(program, part, gates, start, torch.float64)
        want_o = outputs(program, "output", part, gates, starts, torch.float64)
        if params:
            want_o = want_o / (outputs(program, "normalizer", part, gates, starts, torch.float64)[..., None] + alg.eps)
        assert ((o[rows, :, chunks].double() - want_o).norm() / want_o.norm()).item() < 1e-5
        for s in want:
            final = got[s] if seq is None else got[s][seq:seq + 1]
            assert ((final.double() - want[s]).norm() / want[s].norm()).item() < 1e-5, s
    args = dict(launched.args)
    assert ("stage_scan_kernel", (4 if varlen else 2, 1)) in launched.grids   # (walkers, flat blocks)
    (out,) = output_args
    if not on:
        assert "derived_kernel" not in launched and out["DERIVED_STARTS"] is False
        return
    derived = ["dr_W0", "dr_Wn0"] if params else ["dr_W0"]
    uppers = ["G1", "G2", "G3"] + (["h1", "h2", "h3"] if params else [])
    lowers = ["SK", "SQ", "P"] + (["m"] if params else [])
    assert {k for k in args["derived_kernel"] if k.startswith("starts_")} == {f"starts_{n}" for n in lowers + uppers}
    assert ("derived_kernel", (3, 2, 2)) in launched.grids   # (chunks, sequence·head, value blocks)
    assert out["DERIVED_STARTS"] is True
    for d in derived:
        assert out[f"dstart_{d}"] is args["derived_kernel"][f"dstart_{d}"]
    for n in uppers:   # stored by the second stage's scan, read by the derived kernel
        assert args["derived_kernel"][f"starts_{n}"] is args["stage_scan_kernel"][f"starts_{n}"], n
        assert args["derived_kernel"][f"starts_{n}"].shape[2] == 3


def test_the_kept_state_pass_feeds_the_derived_kernel(launched, output_args, monkeypatch):
    """An eager forward under autograd runs the backward's state pass and keeps it
    (``launch.KEEP_STATE_PASS``); its output kernel reads those starts, and HLA3's derived
    carries come from ``derived_kernel`` run on them (the backward's state pass stores every
    state's starts) -- o and every gradient against the float64 torch op. HLA3 as written: a
    call with no state runs its carried form unless ``CARRY_PRODUCTS`` is off."""
    gen = torch.Generator().manual_seed(12)
    B, T, H, d = 1, 40, 2, 8
    q, k, v = (0.5 * torch.randn(B, T, H, d, generator=gen, dtype=torch.float64) for _ in range(3))
    g = -0.1 * torch.rand(B, T, H, generator=gen, dtype=torch.float64)
    w = torch.randn(B, T, H, d, generator=gen, dtype=torch.float64)
    ref = hladsl.load("hla3", backend="torch", chunk_size=16)
    op = hladsl.load("hla3", backend="triton", chunk_size=16)
    monkeypatch.setattr(op, "schedule", "scan")   # (hladsl.load is memoised)

    def loss_and_grads(m, dtype):
        leaves = [x.to(dtype).requires_grad_() for x in (q, k, v, g)]
        o, _ = m(*leaves[:3], g=leaves[3])
        return o.detach().double(), [x.double() for x in torch.autograd.grad((o * w.to(dtype)).sum(), leaves)]
    want_o, want = loss_and_grads(ref, torch.float64)
    with launch.switched(CARRY_PRODUCTS=False):
        got_o, got = loss_and_grads(op, torch.float32)
    assert launched.count("derived_kernel") == 1 and [a["DERIVED_STARTS"] for a in output_args] == [True]
    rel = lambda a, b: ((a - b).norm() / b.norm()).item()   # noqa: E731
    assert rel(got_o, want_o) < 1e-5
    for a, b in zip(got, want):
        assert rel(a, b) < 1e-4


def test_a_derived_carry_summing_over_the_value_dim(tmp_path, launched):
    """A derived carry that sums over the value dim in one product (P[a, f] P[c, f] P[c, e]: f
    is dv) while the same summed index name is d in another (W0's SK SQ P product) is never
    formed by blocks of the value dim: no derived kernel (each block would hold part of the
    sum), the output kernel forms it whole -- against the float64 torch program over two value
    blocks of the scan."""
    from hladsl.codegen.triton_gen import kernel_context
    from hladsl.runtime.chunk_torch import outputs, state_pass
    from hladsl.runtime.triton_forward import forward_triton
    from test_triton_backward import _inputs
    text = (Path(hladsl.__file__).parent / "specs" / "hla3.hla").read_text().replace("mechanism hla3 {", "mechanism hla3_extra {")
    text = text.replace("- G3[a, e])\n", "- G3[a, e] + P[a, f] P[c, f] P[c, e])\n", 1)
    assert "P[a, f] P[c, f]" in text
    path = tmp_path / "hla3_extra.hla"
    path.write_text(text)
    alg = hladsl.compile_spec(str(path))
    program = chunk_program(alg, 16, (("d", 8), ("dv", 32)), True)
    assert kernel_context(program)["chunk_scan"]["derived_kernel"] is None
    tiles, lam, init, _, _ = _inputs(program, False, seed=3)
    o, _ = forward_triton(program, {k: v.float() for k, v in tiles.items()}, lam.float(),
                          {k: v.float() for k, v in init.items()}, alg.eps, schedule="scan", state_block=16)
    assert ("stage_kernel", (3, 2, 2)) in launched.grids and "derived_kernel" not in launched
    starts, _ = state_pass(program, tiles, lam, init, torch.float64)
    want = outputs(program, "output", tiles, lam, starts, torch.float64)
    assert ((o.double() - want).norm() / want.norm()).item() < 1e-5


@pytest.mark.parametrize("name,schedule", [("ahla", "scan"), ("hla2", "scan"), ("linear", "two_pass")])
def test_scan_schedule_at_the_long_chunk(name, schedule, launched):
    """The chunk size "auto" takes on a GPU for programs with a chunk scan
    (launch.LONG_CHUNK), with the schedule it takes there (linear walks: its walk splits):
    two chunks of 128 and a partial third, gated, from an initial state, forward and
    backward, in fp32 against the float64 torch program."""
    gen = torch.Generator().manual_seed(5)
    B, T, H, d = 1, 300, 2, 8
    q, k, v = (0.5 * torch.randn(B, T, H, d, generator=gen, dtype=torch.float64) for _ in range(3))
    g = -0.05 * torch.rand(B, T, H, generator=gen, dtype=torch.float64)
    ref = hladsl.load(name, backend="torch", chunk_size=16)
    op = hladsl.load(name, backend="triton", chunk_size=launch.LONG_CHUNK)
    op.schedule = schedule
    shapes = ref.state_shapes(d, d)
    init = {n: 0.2 * torch.randn(B, H, *s, generator=gen, dtype=torch.float64).abs() for n, s in shapes.items()}
    w_o = torch.randn(B, T, H, d, generator=gen, dtype=torch.float64)
    w_s = {n: torch.randn(B, H, *s, generator=gen, dtype=torch.float64) for n, s in shapes.items()}
    want = _loss_and_grads(ref, (q, k, v, g), init, w_o, w_s, None, 0.5)
    try:
        got = _loss_and_grads(op, tuple(x.float() for x in (q, k, v, g)), {n: x.float() for n, x in init.items()},
                              w_o.float(), {n: x.float() for n, x in w_s.items()}, None, 0.5)
    finally:
        op.schedule = "auto"

    def rel(a, b):
        return ((a.double() - b).norm() / b.norm()).item()
    assert rel(got[0], want[0]) < 1e-5
    for n in shapes:
        assert rel(got[1][n], want[1][n]) < 1e-5, n
    for a, b in zip(got[2], want[2]):
        assert rel(a, b) < 1e-4
    walk = "scan_kernel" if schedule == "scan" else "state_pass_kernel"
    assert launched.count(walk) == 1   # the forward's, kept for the backward (launch.KEEP_STATE_PASS)
    assert dict(launched.args)[walk]["C"] == launch.LONG_CHUNK


def test_scan_kernel_splits_the_value_dim_and_reads_no_tokens():
    """HLA2's scan kernel: G's cross term is one fp32 product of S's delta with the carried
    C (ir.precision keeps it exact), no token pointer, no chained dots: it may be split."""
    from hladsl.codegen.triton_gen import kernel_context, generate
    program = chunk_program(hladsl.compile_spec("hla2"), 64, (("d", 64), ("dv", 64)), True)
    ctx = kernel_context(program)
    cs = ctx["chunk_scan"]
    assert cs["deltas"] == ["S", "C", "G"]
    assert not cs["scan_chained_dots"] and ctx["state_chained_dots"]
    source = generate(program)
    scan = source.split("def scan_kernel(")[1]
    assert "in_k_ptr" not in scan and "in_q_ptr" not in scan
    assert "_dot(dl_S, st_C, tl.float32, PREC)" in scan
    delta = source.split("def delta_kernel(")[1].split("@triton.jit")[0]
    assert "st_" not in delta   # from zero: no carried state


@pytest.mark.parametrize("name,params", [("power", {"p": 2})])
def test_programs_without_a_chunk_scan_refuse_the_schedule(name, params):
    """A packed state (power): no chunk scan; asked for explicitly it raises, under auto it
    walks. (HLA3's walking terms get the two-stage scan above.)"""
    from hladsl.codegen.triton_gen import kernel_context
    from hladsl.runtime.triton_forward import forward_triton
    program = chunk_program(hladsl.compile_spec(name, **params), 16, (("d", 8), ("dv", 8)), False)
    assert kernel_context(program)["chunk_scan"] is None
    tiles = {x: torch.zeros(1, 1, 2, 16, 8) for x in program.algebra.inputs}
    with pytest.raises(autotune.Unavailable, match="no chunk-parallel state pass"):
        forward_triton(program, tiles, None, None, 1e-6, schedule="scan")


class _Tile:   # [N, H, nC, C, d] of a token input
    def __init__(self, dtype, chunks):
        self.dtype, self.shape, self.device = dtype, (2, 16, chunks, 64, 64), torch.device("cuda")


def test_auto_takes_the_chunk_scan_where_the_walk_cannot_split(monkeypatch):
    """Under auto: the scan where the walking pass has chained bf16 dots (it cannot split
    its value dim, launch.state_block) and there is more than one chunk; fp32 tiles split
    the walk itself; two_pass and fused never scan."""
    cs = {"deltas": ["S"], "aux": [], "stage": None}
    assert launch.use_chunk_scan("auto", cs, _Tile(torch.bfloat16, 4), walk_chained=True)
    # one reading chunk summaries no state holds: only when asked for (not measured yet)
    assert not launch.use_chunk_scan("auto", {**cs, "aux": ["aux_E_1"]}, _Tile(torch.bfloat16, 4), True)
    assert launch.use_chunk_scan("scan", {**cs, "aux": ["aux_E_1"]}, _Tile(torch.bfloat16, 4), True)
    assert not launch.use_chunk_scan("auto", cs, _Tile(torch.bfloat16, 1), walk_chained=True)
    assert not launch.use_chunk_scan("auto", cs, _Tile(torch.float32, 4), walk_chained=True)
    assert not launch.use_chunk_scan("auto", cs, _Tile(torch.bfloat16, 4), walk_chained=False)
    assert not launch.use_chunk_scan("auto", None, _Tile(torch.bfloat16, 4), walk_chained=True)
    assert not launch.use_chunk_scan("two_pass", cs, _Tile(torch.bfloat16, 4), walk_chained=True)
    assert launch.use_chunk_scan("scan", cs, _Tile(torch.float32, 1), walk_chained=False)
    # a two-stage scan: under auto while launch.AUTO_STAGED_SCAN
    staged = {**cs, "stage": {"states": []}}
    assert launch.use_chunk_scan("auto", staged, _Tile(torch.bfloat16, 4), walk_chained=True)
    monkeypatch.setattr(launch, "AUTO_STAGED_SCAN", False)
    assert not launch.use_chunk_scan("auto", staged, _Tile(torch.bfloat16, 4), walk_chained=True)
    assert launch.use_chunk_scan("scan", staged, _Tile(torch.bfloat16, 4), walk_chained=True)


def test_the_backward_stages_its_complete_scan_where_its_reverse_pass_would_walk(monkeypatch):
    """``launch.backward_module``: under "auto", the backward module whose state pass is the
    complete scan in two stages and whose reverse pass is then the two-stage one where the
    one-stage module's reverse pass would walk and the scan's products reach STAGED_SCAN_MACS --
    HLA3-masked (its one-stage scan holds aux summaries, AUTO_SCAN_AUX), not AHLA at d = 64 (its
    walk is short: d^3 products), HLA2 (its reverse scan reads its deltas), HLA3 (its own scan
    has two stages) or linear (nothing to split); "staged" wherever the complete scan splits;
    never the walking schedules; fp32 tiles (a walk that splits) keep one stage."""
    from hladsl.codegen.triton_bwd import backward_context

    def context(name):
        return backward_context(chunk_program(hladsl.compile_spec(name), 64, (("d", 64), ("dv", 64)), True))
    contexts = {name: context(name) for name in ("hla3_masked", "ahla", "hla2", "hla3", "linear")}
    bf16 = _Tile(torch.bfloat16, 4)
    assert {n: launch.backward_module("auto", c, bf16) for n, c in contexts.items()} == {
        "hla3_masked": True, "ahla": False, "hla2": False, "hla3": False, "linear": False}
    with launch.switched(STAGED_SCAN_MACS=64 ** 3):
        assert launch.backward_module("auto", contexts["ahla"], bf16)
    assert {n: launch.backward_module("staged", c, bf16) for n, c in contexts.items()} == {
        "hla3_masked": True, "ahla": True, "hla2": True, "hla3": False, "linear": False}
    for schedule in ("scan", "two_pass", "fused"):
        assert not any(launch.backward_module(schedule, c, bf16) for c in contexts.values())
    assert not launch.backward_module("auto", contexts["hla3_masked"], _Tile(torch.float32, 4))
    wide = _Tile(torch.bfloat16, 4)
    wide.shape = (2, 16, 4, 64, 128)   # [N, H, nC, C, d]: d = 128, not yet timed
    assert not launch.backward_module("auto", contexts["hla3_masked"], wide)
    assert launch.backward_module("staged", contexts["hla3_masked"], wide)
    for switch in ("AUTO_STAGED_BACKWARD", "AUTO_STAGED_SCAN"):
        with launch.switched(**{switch: False}):
            assert not launch.backward_module("auto", contexts["hla3_masked"], bf16)
            assert launch.backward_module("staged", contexts["hla3_masked"], bf16)
    with launch.switched(STAGED_REVERSE=False):   # (its reverse pass would walk: the one-stage module)
        assert not launch.backward_module("staged", contexts["hla2"], bf16)
    # a complete scan that splits with a reverse pass that does not: one stage
    assert not launch.backward_module("staged", {**contexts["hla2"], "staged_reverse": False}, bf16)
    # the variant's reverse pass: two stages, reading no forward delta
    staged = backward_context(chunk_program(hladsl.compile_spec("hla3_masked"), 64, (("d", 64), ("dv", 64)), True),
                              stage_complete=True)
    assert staged["forward"]["chunk_scan"]["stage"] and staged["reverse_scan"]["stage"]
    assert not contexts["hla3_masked"]["reverse_scan"]["stage"]


@pytest.mark.parametrize("prefetch", [True, False], ids=["prefetch", "no-prefetch"])
def test_the_two_stage_backward_over_flat_blocks(prefetch, launched, monkeypatch):
    """The two-stage backward's reverse scans walk flat blocks that do not divide the d-states
    (d x dv = 8 x 12 = 96 elements, blocks of 64: the second part masked), with and without
    the prefetch of the next chunk's parts, over sequences some of which are empty (first,
    middle, last: walkers with no chunk) -- outputs, final states and every gradient against
    the float64 torch program."""
    monkeypatch.setattr(launch, "FLAT_SCAN_BLOCK", 64)
    monkeypatch.setattr(launch, "SCAN_PREFETCH", prefetch)
    _check_scan_schedule("hla3_masked", {"normalize": True}, True, True, 12, (1, 70, 2, 8), 13,
                         torch.tensor([0, 0, 21, 21, 22, 70, 70]), schedule="staged")
    walkers = 6 * 2   # (sequences, heads)
    for kernel in ("rscan_kernel", "rstage_scan_kernel"):
        assert (kernel, (walkers, 2)) in launched.grids, kernel
        assert dict(launched.args)[kernel]["PREFETCH"] is prefetch


TWO_BLOCK_CASES = [(name, params, varlen, True) for name, params in
                   [("hla2", {}), ("hla2", {"normalize": True}), ("ahla", {})] for varlen in (False, True)]
TWO_BLOCK_CASES.append(("hla2", {}, False, False))   # launch.REVERSE_IN_PLACE off
# the two-stage reverse pass: both of its scans split (dSK, dSQ whole in every block)
TWO_BLOCK_CASES += [("hla3", {}, varlen, True) for varlen in (False, True)]


@pytest.mark.parametrize("name,params,varlen,in_place", TWO_BLOCK_CASES,
                         ids=[f"{c[0]}{'-norm' if c[1] else ''}-{'varlen' if c[2] else 'dense'}"
                              f"{'' if c[3] else '-separate'}" for c in TWO_BLOCK_CASES])
def test_scan_kernels_over_two_value_blocks(name, params, varlen, in_place, launched, monkeypatch):
    """scan_kernel and rscan_kernel split the value dim (two blocks of 16 here): states without
    it (S, m) and chunk summaries without it (AHLA's Σ k qᵀ) are read whole by every block,
    states written by block 0; in two stages (HLA3) every scan walks the flat layouts instead
    (blocks of 64 elements here: 4 of the largest state); against the float64 torch programs
    (forward and backward), with the reverse scan's cotangents over its parts or in buffers of
    their own."""
    monkeypatch.setattr(launch, "REVERSE_IN_PLACE", in_place)
    monkeypatch.setattr(launch, "FLAT_SCAN_BLOCK", 64)
    from hladsl.runtime.chunk_torch import outputs, state_pass
    from hladsl.runtime.triton_backward import backward_triton
    from hladsl.runtime.triton_forward import forward_triton
    from test_triton_backward import _inputs, _varlen_reference
    alg = hladsl.compile_spec(name, **params)
    program = chunk_program(alg, 16, (("d", 8), ("dv", 32)), True)
    tiles, lam, init, grad_o, grad_final = _inputs(program, bool(params), seed=3)
    seq_chunks = None
    if varlen:   # sequences of 2 and 1 chunks in one row
        seq_chunks = torch.tensor([0, 2, 3], dtype=torch.int32)
        init = {k: torch.cat([v, 0.5 * v]) for k, v in init.items()}
        grad_final = {k: torch.cat([v, -v]) for k, v in grad_final.items()}

    def f32(d):
        return {k: v.float() for k, v in d.items()}
    o, final = forward_triton(program, f32(tiles), lam.float(), f32(init), alg.eps, schedule="scan",
                              state_block=16, seq_chunks=seq_chunks)
    got = backward_triton(program, f32(tiles), lam.float(), f32(init), grad_o.float(), f32(grad_final),
                          alg.eps, schedule="scan", reverse_block=16, seq_chunks=seq_chunks)
    walkers = 4 if varlen else 2     # (sequences, heads) walked; two value blocks each
    staged = name == "hla3"
    # (in two stages the scans walk flat layouts: the largest state's 256 elements in 4 blocks;
    # the reverse's second stage too: dP's)
    assert ("scan_kernel", (walkers, 4 if staged else 2)) in launched.grids
    assert ("rscan_kernel", (walkers, 4 if staged else 2)) in launched.grids
    assert (("rstage_scan_kernel", (walkers, 4)) in launched.grids) == staged
    ref = _varlen_reference(program, tiles, lam, init, grad_o, grad_final, alg.eps, seq_chunks)
    if seq_chunks is None:
        starts, want_final = state_pass(program, tiles, lam, init, torch.float64)
        if not params:
            want_o = outputs(program, "output", tiles, lam, starts, torch.float64)
            assert (o.double() - want_o).norm() / want_o.norm() < 1e-5
        for s in want_final:
            assert (final[s].double() - want_final[s]).norm() / want_final[s].norm() < 1e-5, s

    def rel(a, b):
        return ((a.double() - b).norm() / b.norm()).item()
    for x in tiles:
        assert rel(got[0][x], ref[0][x]) <= 1e-4, x
    assert rel(got[1], ref[1]) <= 1e-4
    for s in init:
        assert rel(got[2][s], ref[2][s]) <= 1e-4, s
    # a d-state with the value dim is written over its own parts (each block reads and
    # writes only its columns); one without it (read whole by every block) never is; in flat
    # walks (two stages) every one is (each element is one program's)
    with_value_dim = {n for n, x in init.items() if x.shape[-1] == 32}   # dv = 32, d = 8
    for kernel in ("rscan_kernel", "rstage_scan_kernel") if staged else ("rscan_kernel",):
        args = dict(launched.args)[kernel]
        parted = {n for n in init if f"rdeltas_{n}" in args}
        shared = {n for n in parted if args[f"dends_{n}"].data_ptr() == args[f"rdeltas_{n}"].data_ptr()}
        own = set() if varlen or not in_place else (parted if staged else with_value_dim & parted)
        assert shared == own, kernel
        assert args.get("IN_PLACE") == bool(own)
        assert varlen or not in_place or shared
    if staged:   # the second stage: dSK, dSQ (without dv) over their parts too
        assert {n for n in init if f"rdeltas_{n}" in args} == {"SK", "SQ", "P"}
        assert varlen or not in_place or not with_value_dim >= shared


# (spec, params, gated, two-level scans): d-states with and without the value dim, AHLA's and
# HLA3-masked's chunk summaries outside the states
BF16_D_STATES = [("hla2", {}, True, False), ("hla2", {"normalize": True}, False, True),
                 ("ahla", {}, True, False), ("hla3_masked", {}, False, False)]


@pytest.mark.parametrize("name,params,gated,grouped", BF16_D_STATES,
                         ids=[f"{c[0]}{'-norm' if c[1] else ''}-{'gated' if c[2] else 'plain'}"
                              f"{'-grouped' if c[3] else ''}" for c in BF16_D_STATES])
def test_d_states_stored_in_bf16(name, params, gated, grouped, launched, monkeypatch):
    """The reverse scan's parts and chunk-end d-states in bf16 (``launch.d_states_dtype``'s
    choice for bf16 inputs on a GPU, forced here, where the interpreter's fp32 tiles give fp32):
    written and read as bf16 buffers, over their parts and in two-level walks, the walks carrying
    fp32. Gradients within bf16's rounding of those d-states (2^-9 relative an element) of the
    float64 program, 1e-2; outputs and final states, which never read them, within fp32's."""
    groups = dict(SCAN_GROUP=2, SCAN_GROUP_FILL=1000) if grouped else {}
    launch.forget_plans()   # (plans hold the dtype: none made with fp32 d-states, none kept after)
    try:
        with monkeypatch.context() as m, launch.switched(**groups):
            m.setattr(launch, "d_states_dtype", lambda sdot, sharp=True: torch.bfloat16)
            _check_scan_schedule(name, params, gated, True, 8, (2, 16 * 7 - 5, 2, 8), 23, grad_tol=1e-2)
    finally:
        launch.forget_plans()
    # (the walk over the groups' own parts reads fp32 buffers: a group's part is an fp32 sum)
    stored = {(n, k): x.dtype for n, (kernel, args) in enumerate(launched.args) if kernel == "rscan_kernel"
              for k, x in args.items() if k.startswith(("rdeltas_", "dends_")) and x.shape[2] == 7}
    assert stored and set(stored.values()) == {torch.bfloat16}, stored
    assert launched.count("rscan_kernel") == (3 if grouped else 1)


def test_d_states_dtype_follows_the_state_dots():
    """bf16 d-states only where the backward's state products run in bf16 (fp32 SDOT: fp32
    or fp16 inputs, the interpreter, the precision plan's exact state reads), and by default
    only where no d initial state or quotient-cancelling d-state needs them sharp."""
    import triton.language as tl
    with launch.switched(D_STATES_IN_SDOT=True):
        assert launch.d_states_dtype(tl.bfloat16) == torch.bfloat16
        assert launch.d_states_dtype(tl.bfloat16, sharp=False) == torch.bfloat16
        assert launch.d_states_dtype(tl.float32) == torch.float32
    with launch.switched(D_STATES_IN_SDOT=False):
        assert launch.d_states_dtype(tl.bfloat16) == torch.float32
        assert launch.d_states_dtype(tl.bfloat16, sharp=False) == torch.bfloat16
        assert launch.d_states_dtype(tl.float32, sharp=False) == torch.float32
        with launch.switched(STATELESS_D_STATES_IN_SDOT=False):   # the rule off: fp32 everywhere
            assert launch.d_states_dtype(tl.bfloat16, sharp=False) == torch.float32


def test_the_reverse_scan_follows_the_chunk_scan():
    """The chunk-parallel reverse pass reads the forward deltas of the chunk scan: it runs
    wherever the state pass was the chunk scan ("scan", or "auto" having taken it) and the
    program has one, never after the walking state pass (launch.use_reverse_scan)."""
    rs = {"states": []}
    assert launch.use_reverse_scan("scan", True, rs)
    assert launch.use_reverse_scan("auto", True, rs)
    assert not launch.use_reverse_scan("two_pass", True, rs)
    assert not launch.use_reverse_scan("auto", False, rs)      # walking state pass: no deltas
    assert not launch.use_reverse_scan("scan", True, None)     # the program has none
    staged = {"states": [], "stage": {"states": []}}           # in two stages (HLA3)
    assert launch.use_reverse_scan("auto", True, staged)
    with launch.switched(STAGED_REVERSE=False):                # the A/B switch: the walk
        assert not launch.use_reverse_scan("auto", True, staged) and launch.use_reverse_scan("auto", True, rs)


@pytest.mark.parametrize("name,params,varlen", [("hla2", {"normalize": True, "ridge": 0.3}, True),
                                                ("ahla", {}, False), ("hla3_masked", {}, False),
                                                ("linear", {"normalize": True}, True)])
def test_split_delta_kernels_on_a_many_sm_gpu(name, params, varlen, monkeypatch, launched):
    """With the SM count of an H100 the launch rules split delta_kernel's and the scan
    kernels' value dim at these small shapes (the CPU counts one SM and never does): the
    scan schedule's outputs and gradients equal the walking two-pass schedule's."""
    from hladsl.runtime import triton_backward, triton_forward
    monkeypatch.setattr(launch, "sms", lambda device: 132)
    monkeypatch.setattr(triton_forward, "_PLANS", {})
    monkeypatch.setattr(triton_backward, "_PLANS", {})
    gen = torch.Generator().manual_seed(5)
    B, T, H, d, dv = (1, 70, 2, 16, 32) if varlen else (2, 40, 2, 16, 32)
    q, k = (0.5 * torch.randn(B, T, H, d, generator=gen) for _ in range(2))
    if params.get("normalize"):
        q, k = q.abs() + 0.1, k.abs() + 0.1
    v = torch.randn(B, T, H, dv, generator=gen)
    g = -0.3 * torch.rand(B, T, H, generator=gen)
    cu = torch.tensor([0, 21, 70]) if varlen else None
    shapes = hladsl.load(name, backend="torch", **params).state_shapes(d, dv)
    n_seq = 2 if varlen else B
    w_s = {n: torch.randn(n_seq, H, *s, generator=gen) for n, s in shapes.items()}
    w_o = torch.randn(B, T, H, dv, generator=gen)
    out = {}
    for schedule in ("two_pass", "scan"):
        op = hladsl.load(name, backend="triton", chunk_size=16, **params)
        op.schedule = schedule
        try:
            out[schedule] = _loss_and_grads(op, (q, k, v, g), None, w_o, w_s, cu, 0.5)
        finally:
            op.schedule = "auto"
    (o1, f1, g1), (o2, f2, g2) = out["two_pass"], out["scan"]
    torch.testing.assert_close(o2, o1, rtol=1e-5, atol=1e-5)
    for n in f1:
        torch.testing.assert_close(f2[n], f1[n], rtol=1e-5, atol=1e-5)
    for a, b in zip(g2, g1):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-4)
    grids = dict(launched.grids)
    assert grids["delta_kernel"][2] > 1 and grids["scan_kernel"][1] > 1, f"nothing was split: {grids}"


@pytest.mark.parametrize("name,kernel", [("hla2", "rdelta_kernel"), ("hla3", "rstage_kernel")])
def test_a_reverse_scan_that_does_not_fit_runs_the_walking_pass(name, kernel, monkeypatch):
    """rdelta_kernel holds every d-state whole (hla2's at d = 128 needs 262144 B of shared
    memory on sm_90), as does the second stage's rstage_kernel; where no launch fallback fits,
    the backward runs the walking reverse pass, which narrows, and the gradients are the same."""
    from triton.runtime.errors import OutOfResources
    from hladsl.runtime import progress, triton_backward, triton_forward
    from test_triton_backward import _inputs
    from hladsl.runtime.backward_torch import backward_torch
    real = progress.first_launch

    attempted = []

    def small_smem(kernel_of, options, fn):
        if kernel_of.fn.__name__ == kernel:
            attempted.append(kernel)
            raise OutOfResources(262144, 232448, "shared memory")
        return real(kernel_of, options, fn)
    monkeypatch.setattr(progress, "first_launch", small_smem)
    monkeypatch.setattr(launch, "_WORKING", {})
    monkeypatch.setattr(launch, "_TOO_WIDE", set())
    monkeypatch.setattr(triton_backward, "_PLANS", {})
    alg = hladsl.compile_spec(name)
    program = chunk_program(alg, 16, (("d", 8), ("dv", 8)), True)
    tiles, lam, init, grad_o, grad_final = _inputs(program, False, seed=2)
    ref = backward_torch(program, tiles, lam, init, grad_o, grad_final, alg.eps)
    seen = []
    monkeypatch.setattr(triton_backward, "_reverse_pass", _spy(triton_backward._reverse_pass, seen))

    def f32(d):
        return {k: v.float() for k, v in d.items()}
    got = triton_backward.backward_triton(program, f32(tiles), lam.float(), f32(init), grad_o.float(),
                                          f32(grad_final), alg.eps, schedule="scan")
    assert attempted and not next(iter(triton_backward._PLANS.values())).reverse_scan and len(seen) == 1
    for x in tiles:
        assert ((got[0][x].double() - ref[0][x]).norm() / ref[0][x].norm()).item() < 1e-4, x
    for s in init:
        assert ((got[2][s].double() - ref[2][s]).norm() / ref[2][s].norm()).item() < 1e-4, s
    assert triton_forward is not None


def _spy(fn, calls: list):
    def spied(*args, **kwargs):
        calls.append(fn.__name__)
        return fn(*args, **kwargs)
    return spied


def test_auto_leaves_scans_of_summaries_no_state_holds_to_the_tuner(monkeypatch):
    """Under "auto" a chunk scan reading summaries no state holds stays off (measured mixed
    on the H100: launch.AUTO_SCAN_AUX); a tuning session times it beside the others."""
    from hladsl.runtime import autotune
    cs = {"deltas": ["P", "E"], "aux": ["aux_E_1"], "stage": None}
    many_chunks = _Tile(torch.bfloat16, 4)
    assert not launch.use_chunk_scan("auto", cs, many_chunks, True)
    assert launch.use_chunk_scan("auto", {**cs, "aux": []}, many_chunks, True)
    monkeypatch.setattr(autotune, "current", lambda: object())
    assert launch.use_chunk_scan("scan", cs, many_chunks, True)
    assert launch.use_reverse_scan("scan", True, {"states": []})


def test_schedule_check_script_compares_schedules(tmp_path, capsys):
    """benchmarks/schedule_check.py (the GPU accuracy A/B of schedules) under the
    interpreter: every schedule's ratios against the fp32 torch backend, fp32 here."""
    import importlib.util
    import json
    from pathlib import Path
    path = Path(__file__).parents[1] / "benchmarks" / "schedule_check.py"
    spec = importlib.util.spec_from_file_location("schedule_check", path)
    script = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(script)
    out = tmp_path / "check.json"
    script.main(["--specs", "hla2", "--schedules", "two_pass", "scan", "--T", "40", "--d", "8",
                 "--chunk", "16", "--dtype", "fp32", "--json", str(out)])
    rows = json.loads(out.read_text())
    assert [r["schedule"] for r in rows] == ["two_pass", "scan"]
    for r in rows:
        assert "error" not in r, r
        assert max(r[k] for k in ("o", "states", "dq", "dk", "dv", "dg")) < 1e-5, r


@pytest.fixture
def grouped_scans():
    """The two-level scan (launch.scan_groups) at the interpreter's shapes: groups of two
    chunks, taken however many programs the walkers are (the CPU counts one SM), in the
    forward too (by default only the backward groups)."""
    with launch.switched(SCAN_GROUP=2, SCAN_GROUP_FILL=1000, SCAN_GROUP_FORWARD=True):
        yield


# (spec, params, gated, initial state, dv): hla2's G grows by S's delta times the carried C
# (a scan term: a group's delta is not the sum of its chunks'), over one and two value blocks
GROUPED = [("hla2", {}, True, True, 8), ("hla2", {}, False, False, 32),
           ("hla2", {"normalize": True, "ridge": 0.3}, True, True, 8), ("linear", {"normalize": True}, True, True, 8)]


@pytest.mark.parametrize("name,params,gated,with_init,dv", GROUPED,
                         ids=[f"{c[0]}{'-norm' if c[1] else ''}-{'gated' if c[2] else 'plain'}"
                              f"{'-init' if c[3] else ''}-dv{c[4]}" for c in GROUPED])
def test_two_level_scan_matches_torch_float64(name, params, gated, with_init, dv, launched, grouped_scans):
    """Seven chunks in groups of two (the last alone): the forward and reverse scans each in
    three launches (the groups from zero, the walk over the groups, the groups from their
    starts), outputs, final states and every gradient in fp32 against the float64 program."""
    B, H = 2, 2
    _check_scan_schedule(name, params, gated, with_init, dv, (B, 16 * 7 - 5, H, 8), 17)
    # the plain forward, the forward under autograd (the backward's pass, kept for it), reverse:
    # three launches each, the groups' walks
    # over B * H * 4 groups (four groups: 2 + 2 + 2 + 1 chunks), the walk over them B * H
    assert launched.count("scan_kernel") == 6 and launched.count("rscan_kernel") == 3
    for kernel in ("scan_kernel", "rscan_kernel"):
        walkers = [grid[0] for name_, grid in launched.grids if name_ == kernel][:3]
        assert walkers == [B * H * 4, B * H, B * H * 4], (kernel, walkers)


def test_scans_with_chunk_summaries_outside_the_states_stay_one_level(launched, grouped_scans):
    """AHLA's scan reads Σ k qᵀ of each chunk, which no state holds: a group of chunks has no
    such summary to build (no combine), so its scans, forward and reverse, walk every chunk
    in one launch."""
    gen = torch.Generator().manual_seed(3)
    q, k, v = (0.5 * torch.randn(1, 16 * 6, 2, 8, generator=gen).requires_grad_() for _ in range(3))
    op = hladsl.load("ahla", backend="triton", chunk_size=16)
    op.schedule = "scan"
    try:
        op(q, k, v)[0].sum().backward()
    finally:
        op.schedule = "auto"
    # (one state pass: the forward's, kept for the backward, launch.KEEP_STATE_PASS)
    assert launched.count("scan_kernel") == 1 and launched.count("rscan_kernel") == 1


@pytest.mark.parametrize("gated", [True, False], ids=["gated", "ungated"])
@pytest.mark.parametrize("params", [{}, {"normalize": True}])
def test_the_scan_carries_the_derived_carries_the_output_reads(params, gated, monkeypatch):
    """HLA2's output reads C and G only through W0 = S C - G (and m, h through its
    normaliser's): the one-level scan stores W0 at each chunk start instead of C and G, and
    carries it by its own recursion (ir.recursion: W0' = ρ² W0 + S' ΔC - ΔG), G (and h) not
    at all but recovered at the end (triton_gen._derived_starts, _derived_recursion); the
    output kernel loads W0. Outputs and final states from an initial state: those of the
    kernels contracting W0 themselves (DERIVED_STARTS off) within fp32 rounding, S, C, m
    bitwise, and each the float64 reference's; both paths were taken."""
    seen = []
    real = launch.launch

    def spy(kernel, grid, args, *rest):
        if "DERIVED_STARTS" in args:
            seen.append(args["DERIVED_STARTS"])
        return real(kernel, grid, args, *rest)
    monkeypatch.setattr(launch, "launch", spy)
    op = hladsl.load("hla2", backend="triton", chunk_size=16, **params)
    ref = hladsl.load("hla2", backend="torch", **params)
    gen = torch.Generator().manual_seed(2)
    q, k, v = (0.5 * torch.randn(2, 48, 2, 8, generator=gen).abs() for _ in range(3))
    g = -0.3 * torch.rand(2, 48, 2, generator=gen) if gated else None
    _, init = ref(q[:, :20], k[:, :20], v[:, :20], g=None if g is None else g[:, :20], output_final_state=True)
    monkeypatch.setattr(op, "schedule", "scan")   # (hladsl.load is memoised: restored)
    got = op(q, k, v, g=g, initial_state=init, output_final_state=True)
    with launch.switched(DERIVED_STARTS=False):
        want = op(q, k, v, g=g, initial_state=init, output_final_state=True)
    assert seen == [True, False]
    exact = ref(q.double(), k.double(), v.double(), g=None if g is None else g.double(),
                initial_state={n: x.double() for n, x in init.items()}, output_final_state=True)
    torch.testing.assert_close(got[0], want[0], rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(got[0].double(), exact[0], rtol=1e-5, atol=1e-5)
    for name in want[1]:
        if name in ("S", "C", "m"):   # carried as before
            assert torch.equal(got[1][name], want[1][name]), name
        torch.testing.assert_close(got[1][name], want[1][name], rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(got[1][name].double(), exact[1][name], rtol=1e-5, atol=1e-5)


# HLA2 with G held transposed, and with W0 = S C - 2 G: derived starts, but no recursion the
# scan takes (the dropped state must be W's lone term in W's index order; the recursion of
# the second reads C at the chunk start beside S' ΔC: 2 products, no fewer than today's)
_G_TRANSPOSED = "mechanism g_transposed {" + S_AND_C + """  state G[e, i] = 0  cross S@B[i, j] C@A[j, e]
  output o[e] = q[i] (S[i, j] C[j, e] - G[e, i])
}
"""
_G_TWICE = _G_TRANSPOSED.replace("g_transposed", "g_twice").replace("G[e, i] = 0", "G[i, e] = 0").replace(
    "- G[e, i]", "- 2 G[i, e]")


def test_the_scan_drops_the_state_a_derived_carry_recovers(tmp_path):
    """The generated scan under STORE_DERIVED: G (and h) not updated, W0 by its recursion (one
    product a chunk, S at the chunk's end times C's delta), G formed once at the end; where a
    spec's derived carries have derived starts but no recursion worth taking, the scan keeps
    its states (and the outputs are right either way)."""
    for params, dropped in (({}, ["G"]), ({"normalize": True}, ["G", "h"])):
        cs = triton_gen.kernel_context(chunk_program(hladsl.compile_spec("hla2", **params), 16,
                                                     (("d", 8), ("dv", 8)), True))["chunk_scan"]
        assert cs["dropped"] == dropped
        assert cs["recursion_code"].count("_dot(") == 1 and "_dot(nx_S, dl_C" in cs["recursion_code"]
        assert "dr_W0 = dr_W0 * tl.exp(2 * lam_end)" in cs["recursion_code"]
        assert "st_G = (dr_W0 - rc_G) * -1.0" in cs["recover_code"]
    gen = torch.Generator().manual_seed(4)
    q, k, v = (0.5 * torch.randn(1, 40, 2, 8, generator=gen) for _ in range(3))
    for source in (_G_TRANSPOSED, _G_TWICE):
        path = tmp_path / "spec.hla"
        path.write_text(source)
        cs = triton_gen.kernel_context(chunk_program(hladsl.compile_spec(str(path)), 16,
                                                     (("d", 8), ("dv", 8)), False))["chunk_scan"]
        assert cs["derived_starts"] and not cs["dropped"] and cs["recursion_code"] == ""
        op = hladsl.load(str(path), backend="triton", chunk_size=16)
        op.schedule = "scan"
        with launch.switched(CARRY_DERIVED=False):   # (as written: g_twice has a carried form)
            o = op(q, k, v)[0]
        want = hladsl.load(str(path), backend="torch")(q.double(), k.double(), v.double())[0]
        assert ((o.double() - want).norm() / want.norm()).item() < 1e-5


# HLA2 with G's cross term twice: W0's recursion reads C at the chunk start under ρ_B beside
# S@N ΔC (W0(A⊕B) = ρ² W0(A) - ρ C@A ΔS + S@N ΔC - ΔG): two products a step, no fewer than
# the one-stage scan's, but the two-stage scan takes it (its increments are parallel)
_G_CROSS_TWICE = _G_TWICE.replace("g_twice", "g_cross_twice").replace("cross S@B", "cross 2 S@B").replace(
    "- 2 G[i, e]", "- G[i, e]")


@pytest.mark.parametrize("gated", [False, True], ids=["ungated", "gated"])
def test_a_recursion_reading_a_chunk_start_in_two_stages(gated, tmp_path, launched):
    """The second stage's increment with a START factor under the chunk's decay (ρ_B C@A ΔS,
    ``ir.recursion.chunk_terms``: a carry weight where gated, 1 without gates -- an ungated
    stage kernel once read an undefined lam_end), against the float64 torch program."""
    path = tmp_path / "cross_twice.hla"
    path.write_text(_G_CROSS_TWICE)
    cs = triton_gen.kernel_context(chunk_program(hladsl.compile_spec(str(path)), 16, (("d", 8), ("dv", 8)),
                                                 gated), stage_complete=True)["chunk_scan"]
    assert cs["stage"]["derived"] and {s["name"] for s in cs["stage"]["reads"]} == {"C", "S"}
    gen = torch.Generator().manual_seed(4)
    q, k, v = (0.5 * torch.randn(1, 40, 2, 8, generator=gen) for _ in range(3))
    g = -0.3 * torch.rand(1, 40, 2, generator=gen) if gated else None
    op = hladsl.load(str(path), backend="triton", chunk_size=16)
    op.schedule = "staged"
    o, final = op(q, k, v, g=g, output_final_state=True)
    want, want_final = hladsl.load(str(path), backend="torch")(
        q.double(), k.double(), v.double(), g=None if g is None else g.double(), output_final_state=True)
    assert "stage_scan_kernel" in launched
    assert ((o.double() - want).norm() / want.norm()).item() < 1e-5
    for n in want_final:
        assert ((final[n].double() - want_final[n]).norm() / want_final[n].norm()).item() < 1e-5, n


def test_an_empty_sequence_returns_its_initial_state_to_the_recovery_s_rounding():
    """Varlen with an empty sequence under the recursion: S, C pass through bit for bit; G,
    recovered as S C - W0 once at the end (ir.recursion), within fp32 rounding of S C (and
    not bit for bit: the trade ir.recursion states)."""
    op = hladsl.load("hla2", backend="triton", chunk_size=16)
    gen = torch.Generator().manual_seed(6)
    q, k, v = (0.5 * torch.randn(1, 48, 2, 8, generator=gen) for _ in range(3))
    init = {n: torch.randn(2, 2, *s, generator=gen) for n, s in op.state_shapes(8, 8).items()}
    with launch.switched(SCAN_GROUP=0):
        op.schedule = "scan"
        try:
            _, final = op(q, k, v, initial_state=init, output_final_state=True, cu_seqlens=torch.tensor([0, 0, 48]))
        finally:
            op.schedule = "auto"
    for n in ("S", "C"):
        assert torch.equal(final[n][0], init[n][0]), n
    bound = 8 * init["S"][0].abs().max() * init["C"][0].abs().max()   # |S C| <= d max|S| max|C| (S is held packed)
    err = (final["G"][0] - init["G"][0]).abs().max().item()
    assert 0 < err < 1e-6 * bound.item(), err


@pytest.mark.parametrize("params", [{}, {"normalize": True}])
def test_derived_starts_read_only_by_sdot_dots_are_stored_in_sdot(params, monkeypatch, force_bf16_starts):
    """Under derived starts the output reads W0 only in an SDOT dot, and S only so (W0's
    contraction, the one fp32 reader of S, moved into the scan): both are stored in SDOT's
    dtype (bf16 on a GPU, forced here where SDOT is fp32); the normaliser's Wn0 multiplies
    elementwise and stays fp32. The output is the fp32-starts one within bf16 rounding."""
    ctx = triton_gen.kernel_context(chunk_program(hladsl.compile_spec("hla2", **params), 16,
                                                  (("d", 8), ("dv", 8)), True))
    cs = ctx["chunk_scan"]
    assert {d["name"]: d["starts_sdot"] for d in cs["derived_starts"]} == (
        {"dr_W0": True, "dr_Wn0": False} if params else {"dr_W0": True})
    assert cs["sdot_beside_derived"] == ["S"]
    assert not next(s for s in ctx["states"] if s["name"] == "S")["starts_sdot"]   # (without them)
    op = hladsl.load("hla2", backend="triton", chunk_size=16, **params)
    gen = torch.Generator().manual_seed(3)
    q, k, v = (0.5 * torch.randn(2, 48, 2, 8, generator=gen) for _ in range(3))
    g = -0.3 * torch.rand(2, 48, 2, generator=gen)
    monkeypatch.setattr(op, "schedule", "scan")   # (hladsl.load is memoised: restored)
    want = op(q, k, v, g=g)[0]
    stored = force_bf16_starts()
    got = op(q, k, v, g=g)[0]
    assert sorted(stored) == ([False, True, True] if params else [True, True])   # (Wn0,) W0, S
    err = ((got - want).norm() / want.norm()).item()
    assert 0 < err < 1e-2
