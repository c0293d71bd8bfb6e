"""The decode step (hladsl.runtime.step, Op.step): the serial update fed in
pieces of 1, 3 and 5 tokens equals op(...) on the whole sequence (float64,
torch backend), in place; the generated Triton kernel under the interpreter
(float32) against the same float64 reference; pooled states (state_indices)."""
import contextlib
import os

os.environ["TRITON_INTERPRET"] = "1"   # before triton is imported anywhere

import pytest  # noqa: E402
import torch  # noqa: E402

import hladsl  # noqa: E402
from hladsl.codegen.step_gen import step_source  # noqa: E402
from hladsl.codegen.step_plan import (  # noqa: E402
    bridge_split,
    shared_splittable,
    splittable,
    step_plan,
    value_free,
)
from hladsl.runtime import launch  # noqa: E402
from hladsl.runtime import step as step_module  # noqa: E402
from hladsl.runtime.step import run_step  # noqa: E402

SPECS = [("linear", {}), ("hla2", {}), ("ahla", {}), ("hla3", {}), ("hla3_masked", {}),
         ("power", {"p": 2}), ("power", {"p": 3})]
IDS = [name + "".join(f"_{k}{v}" for k, v in kw.items()) for name, kw in SPECS]


@pytest.fixture(autouse=True)
def _cache_dir(tmp_path_factory, monkeypatch):
    monkeypatch.setenv("HLADSL_CACHE_DIR", str(tmp_path_factory.getbasetemp() / "hladsl-cache"))


def _rel(ref, out):
    return ((ref.double() - out.double()).abs().max() / ref.double().abs().max()).item()


def _problem(op, gated, normalize, B=2, T=10, H=3, d=5, dv=6, seed=0):
    """q, k, v, g [B, T, H, ...] float64 and an initial state reached by running a
    random prefix (so normalizers stay away from zero), in the op's storage layout."""
    gen = torch.Generator().manual_seed(seed)

    def tokens(length):
        out = [torch.randn(B, length, H, n, generator=gen, dtype=torch.float64) * 0.5
               for n in (d, d, dv)]
        return [x.abs() if normalize else x for x in out]
    g = -torch.rand(B, T, H, generator=gen, dtype=torch.float64) * 0.3 if gated else None
    _, init = op(*tokens(4), output_final_state=True)
    return (*tokens(T), g, init)


def _pieces(T, size):
    return [(a, min(a + size, T)) for a in range(0, T, size)]


@pytest.mark.parametrize("normalize", [False, True], ids=["plain", "normalized"])
@pytest.mark.parametrize("gated", [False, True], ids=["ungated", "gated"])
@pytest.mark.parametrize("spec,params", SPECS, ids=IDS)
def test_step_matches_op(spec, params, gated, normalize):
    op = hladsl.load(spec, normalize=normalize, **params)
    q, k, v, g, init = _problem(op, gated, normalize)
    ref, final = op(q, k, v, g=g, initial_state=init, output_final_state=True)
    for size in (1, 3, 5):
        state = {name: x.clone() for name, x in init.items()}
        storage = {name: x.data_ptr() for name, x in state.items()}
        outs = []
        for a, b in _pieces(q.shape[1], size):
            o, returned = op.step(q[:, a:b], k[:, a:b], v[:, a:b], g=None if g is None else g[:, a:b],
                                  state=state, backend="torch")
            assert returned is state
            outs.append(o)
        assert _rel(ref, torch.cat(outs, dim=1)) < 1e-10, size
        for name, x in state.items():
            assert x.data_ptr() == storage[name], name     # updated in place
            assert _rel(final[name], x) < 1e-10, (size, name)


def _triton_check(spec, params, gated, normalize, pieces=(2, 3), d=5, dv=6, block_v=None,
                  bridged=True):
    """``bridged``: where value-free states and value blocks meet, the bridged split
    (launch.STEP_BRIDGED) or the shared split."""
    with launch.switched(STEP_BRIDGED=bridged):
        _triton_run(spec, params, gated, normalize, pieces, d, dv, block_v, bridged)


@pytest.fixture
def rules():
    """rules(name, value): a launch rule constant set for this test (launch.switched,
    which forgets the plans made under the old value), restored after it."""
    with contextlib.ExitStack() as stack:
        yield lambda name, value: stack.enter_context(launch.switched(**{name: value}))


def _triton_run(spec, params, gated, normalize, pieces, d, dv, block_v, bridged):
    op = hladsl.load(spec, normalize=normalize, **params)
    q, k, v, g, init = _problem(op, gated, normalize, B=2, T=sum(pieces), H=2, d=d, dv=dv)
    ref, final = op(q, k, v, g=g, initial_state=init, output_final_state=True)
    state = {name: x.float() for name, x in init.items()}
    storage = {name: x.data_ptr() for name, x in state.items()}
    outs, a = [], 0
    for n in pieces:
        tokens = {"q": (q[:, a:a + n] * d ** -0.5).float(), "k": k[:, a:a + n].float(),
                  "v": v[:, a:a + n].float()}
        gates = None if g is None else g[:, a:a + n].float()
        outs.append(run_step(op.algebra, tokens, gates, state, backend="triton", block_v=block_v))
        a += n
    o = torch.cat(outs, dim=1)
    assert o.dtype == torch.float32
    assert _rel(ref, o) < 1e-5
    for name, x in state.items():
        assert x.data_ptr() == storage[name], name
        assert _rel(final[name], x) < 1e-5, name
    # a shared split (value blocks, value-free states; bridged where the cut does not
    # apply) leaves its counters at zero
    counters = step_module.counters_of(state[op.algebra.streaming[0].name])
    plan = step_plan(op.algebra, {"d": d, "dv": dv})
    shared = shared_splittable(plan) and (not bridged or bridge_split(plan) is None)
    if block_v is not None and block_v < dv and shared:
        assert counters is not None and not counters.any()


@pytest.mark.parametrize("spec,params,gated,normalize", [
    ("linear", {}, True, True), ("linear", {}, False, False), ("hla2", {}, True, True),
    ("hla2", {}, False, False), ("ahla", {}, True, False), ("hla3", {}, True, True),
    ("hla3_masked", {}, False, True), ("power", {"p": 2}, True, True),
    ("power", {"p": 2}, False, False), ("power", {"p": 3}, True, False)],
    ids=lambda x: str(x).replace(" ", ""))
def test_triton_step_interpreter(spec, params, gated, normalize):
    _triton_check(spec, params, gated, normalize)


@pytest.mark.parametrize("spec,params", [("linear", {}), ("power", {"p": 2})], ids=["linear", "power"])
def test_triton_step_value_blocks(spec, params):
    """dv = 20 in blocks of 16 (every state holds dv: each block owns its slice);
    one token at a time (the decode case)."""
    _triton_check(spec, params, True, False, pieces=(1, 1), d=4, dv=20, block_v=16)


@pytest.mark.parametrize("spec,params,dv,block_v", [
    ("power", {"p": 2}, 5, None), ("power", {"p": 2}, 20, 16), ("hla3", {}, 20, 16),
    ("hla2", {}, 5, None)], ids=["power_whole", "power_shared_split", "hla3_bridged", "hla2_bridged"])
def test_triton_step_long_input_in_launches(spec, params, dv, block_v):
    """Kernels with packed dims take at most launch.STEP_MAX_TOKENS tokens a launch, as
    does the bridged split (its scratch holds one piece); longer inputs run as consecutive
    launches on the updated state, the last one shorter (power's z: a value-free row
    state, which the shared split's last block updates again from its old rows; hla2 and
    hla3 normalised: the bridges' scratch reused by each piece)."""
    with launch.switched(STEP_MAX_TOKENS=2):
        _triton_check(spec, params, True, True, pieces=(5,), d=4, dv=dv, block_v=block_v)


def _split_cases():
    """Every spec, gated and not, normalised and not; where some states lack dv, under
    both splits of value-free states (the bridged split falls back to the shared one
    where it does not apply, so "bridged" covers that too)."""
    for (spec, params), name in zip(SPECS, IDS):
        for normalize in (False, True):
            plan = step_plan(hladsl.load(spec, normalize=normalize, **params).algebra, {"d": 4, "dv": 20})
            for gated in (False, True):
                for split in ("bridged", "shared") if value_free(plan) else ("bridged",):
                    yield pytest.param(spec, params, gated, normalize, split,
                                       id=f"{name}-{'gated' if gated else 'ungated'}-"
                                          f"{'normalized' if normalize else 'plain'}-{split}")


@pytest.mark.parametrize("spec,params,gated,normalize,split", list(_split_cases()))
def test_triton_step_value_blocks_every_spec(spec, params, gated, normalize, split):
    """dv = 20 in blocks of 16 (two blocks, the second one ragged), multi-token
    pieces. Specs whose states all hold dv split their states; the others (hla2's
    S, hla3's SK/SQ, every normalizer state) run the bridged split (free_kernel
    updates them and writes the bridges, value_kernel's blocks read those) or, where
    it does not apply (power's z, on packed rows) or is switched off, the shared
    split: every block reads the old value-free states, the last block writes them.
    Under the interpreter the programs run one after another, so a first block that
    wrote S in place would feed the next block the new S and fail here."""
    op = hladsl.load(spec, normalize=normalize, **params)
    plan = step_plan(op.algebra, {"d": 4, "dv": 20})
    assert splittable(plan) or shared_splittable(plan)
    assert shared_splittable(plan) == bool(value_free(plan))
    _triton_check(spec, params, gated, normalize, pieces=(1, 3), d=4, dv=20, block_v=16,
                  bridged=split == "bridged")


def test_bridged_split_is_the_default_for_value_free_states(monkeypatch, rules):
    """The launch rule runs hla2 (S has no dv) as free_kernel, one program per (row,
    head), then value_kernel over value blocks, which holds C and G only; both read and
    write one scratch of bridges, allocated with o (one allocation a step)."""
    from hladsl.codegen.step_gen import step_kernel
    rules("STEP_BRIDGED_BLOCK", 16)
    assert launch.STEP_BRIDGED and launch.step_value_block(20, False, True, bridged=True) == 16
    assert launch.step_value_block(20, True, False) == 32       # linear: whole
    assert launch.step_value_block(20, False, False) == 32
    op = hladsl.load("hla2")
    module, ctx = step_kernel(op.algebra, {"d": 4, "dv": 20}, True)
    assert ctx["free_names"] == ["S"] and ctx["value_names"] == ["C", "G"]
    assert ctx["bridges"] == [{"name": "br0", "dims": ["d"]}] and ctx["bridge_width"] == 4
    calls = []

    def spy(kernel, name):
        class Spy:
            arg_names = kernel.arg_names

            def __getitem__(self, grid):
                def run(**kwargs):
                    calls.append((name, grid, kwargs["br_ptr"], kwargs.get("o_ptr"),
                                  sorted(k for k in kwargs if k.startswith("st_"))))
                    return kernel[grid](**kwargs)
                return run
        return Spy()
    for name in ("free_kernel", "value_kernel"):
        monkeypatch.setattr(module, name, spy(getattr(module, name), name))
    _triton_check("hla2", {}, True, False, pieces=(2,), d=4, dv=20)
    (free, grid_f, br_f, _, st_f), (value, grid_v, br_v, o, st_v) = calls
    assert (free, value) == ("free_kernel", "value_kernel")
    assert grid_f == (2 * 2,) and grid_v == (2 * 2 * 2,)
    assert st_f == ["st_S_ptr"] and st_v == ["st_C_ptr", "st_G_ptr"]
    assert br_f is br_v and br_f.shape == (2 * 2 * 2 * 4,) and br_f.dtype == torch.float32
    assert o.untyped_storage().data_ptr() == br_f.untyped_storage().data_ptr()


def test_shared_split_when_not_bridged(monkeypatch, rules):
    """With launch.STEP_BRIDGED off, hla2 runs the shared split in one launch
    (SHARED, with this state's counters), which it leaves at zero."""
    from hladsl.codegen.step_gen import step_kernel
    rules("STEP_SHARED_BLOCK", 16)
    assert launch.step_value_block(20, False, True) == 16
    op = hladsl.load("hla2")
    module, ctx = step_kernel(op.algebra, {"d": 4, "dv": 20}, True)
    assert ctx["shared"] and ctx["free"] == ["S"] and not hasattr(module, "state_kernel")
    calls = []
    kernel = module.step_kernel

    class Spy:
        arg_names = kernel.arg_names

        def __getitem__(self, grid):
            def run(**kwargs):
                calls.append((grid, kwargs["SHARED"], kwargs["cnt_ptr"]))
                return kernel[grid](**kwargs)
            return run
    monkeypatch.setattr(module, "step_kernel", Spy())
    _triton_check("hla2", {}, True, False, pieces=(2,), d=4, dv=20, bridged=False)
    (grid, shared, counters), = calls
    assert grid == (2 * 2 * 2,) and shared and counters.shape == (2 * 2,) and not counters.any()


@pytest.mark.parametrize("spec,normalize,bridges", [
    ("hla2", False, ["q S_t"]), ("hla2", True, ["q S_t", "den"]),
    ("hla3", False, ["k SQ_t-1", "q SK_t-1", "SK_t-1 k SQ_t-1", "q SK_t SQ_t"]),
    ("hla3_masked", False, ["k q q S_t-1", "q S_t-1"]), ("linear", True, ["den"]),
    ("linear", False, None), ("power", True, None)],
    ids=["hla2", "hla2_normalized", "hla3", "hla3_masked", "linear_normalized", "linear", "power"])
def test_bridge_split_cuts_value_terms_at_value_free_subtrees(spec, normalize, bridges):
    """The bridges are the value-free contractions that read a state (one each, however
    many terms read it: HLA3's kᵀSQ_{t-1} feeds G1 and G3), never grown by an outer
    product with a token (k[a] (kᵀSQ)[b] stays in the value blocks); the value plan reads no
    value-free state; no split without value-free states (linear) or where one is on
    packed rows (power's z)."""
    alg = hladsl.load(spec, normalize=normalize, **({"p": 2} if spec == "power" else {})).algebra
    plan = step_plan(alg, {"d": 4, "dv": 6})
    split = bridge_split(plan)
    if bridges is None:
        assert split is None
        return
    got = []
    for b in split.bridges:
        if not b.dims:
            got.append("den")
            assert b.terms == plan.normalizer
            continue
        (t,) = b.terms
        time = "_t-1" if b.prefix == "st" else "_t"
        got.append(" ".join(o.name + (time if o.kind.value == "carry" else "") for o in t.operands))
    assert got == bridges
    free = set(value_free(plan))
    assert [n for n, _ in split.free.states] == list(value_free(plan))
    reads = {o.name for _, ts in split.value.states for t in ts + split.value.output for o in t.operands}
    assert not reads & free and {n for n, _ in split.value.states} == {n for n, _ in plan.states} - free


@pytest.mark.parametrize("spec,normalize,rows", [
    ("hla2", True, {"S"}), ("hla3", False, {"SK", "SQ"}), ("hla3_masked", False, {"S"}),
    ("hla3", True, set())], ids=["hla2", "hla3", "hla3_masked", "hla3_normalized"])
def test_value_free_updates_alone_hold_symmetric_states_on_packed_rows(spec, normalize, rows):
    """The outputs read HLA2's S whole (q S C), so the step holds it whole; its update
    alone (the shared split's last block) only produces it from k k and passes it, so
    that plan holds it on packed rows -- the same storage, read without a gather.
    Normalised HLA3's h1..h3 read SK and SQ in their updates: whole there too."""
    alg = hladsl.load(spec, normalize=normalize).algebra
    plan = step_plan(alg, {"d": 4, "dv": 6})
    free = value_free(plan)
    alone = step_plan(alg, {"d": 4, "dv": 6}, only=free)
    assert not any(plan.row_dim(n) for n in free)
    assert {n for n in free if alone.row_dim(n)} == rows
    assert [n for n, _ in alone.states] == list(free) and not alone.output and not alone.normalizer


def test_shared_split_counters_stay_zero_when_state_rows_repeat():
    """Repeated state_indices (a padded batch pointing at one slot): those rows' updates
    race, as any two writes of one row, but the counters must come back to zero, or every
    later step on the slot would take a wrong block for the last one."""
    op = hladsl.load("hla2")
    B, H, d, dv = 3, 2, 4, 20
    gen = torch.Generator().manual_seed(3)
    q, k, v = (torch.rand(B, 1, H, n, generator=gen) for n in (d, d, dv))
    pool = {name: torch.zeros((4, H) + shape) for name, shape in op.state_shapes(d, dv).items()}
    rows = torch.tensor([2, 2, 0])
    with launch.switched(STEP_BRIDGED=False):
        run_step(op.algebra, {"q": q, "k": k, "v": v}, None, pool, rows, backend="triton", block_v=16)
    counters = step_module.counters_of(pool["S"])
    assert counters is not None and counters.shape == (4 * H,) and not counters.any()


VALUE_SUM_SPEC = """
mechanism value_sum {
  dims d, dv
  input q[d], k[d], v[dv]
  param normalize = true, eps = 1e-6
  state S[i, e] = k[i] v[e]
  state z[i] = k[i]
  output o[e] = q[i] S[i, e]
  normalizer = q[i] S[i, e] v[e] + q[i] z[i]
}
"""


def test_value_blocks_refused_when_a_term_sums_the_value_dim(tmp_path):
    """A normalizer summing S over dv needs every block of S in each program:
    neither split is legal, so block_v is refused and the default runs whole."""
    path = tmp_path / "value_sum.hla"
    path.write_text(VALUE_SUM_SPEC)
    op = hladsl.load(str(path))
    plan = step_plan(op.algebra, {"d": 4, "dv": 20})
    assert value_free(plan) == ("z",) and not splittable(plan) and not shared_splittable(plan)
    q, k, v = (torch.rand(2, 1, 2, n, dtype=torch.float32) for n in (4, 4, 20))
    state = {name: torch.zeros((2, 2) + shape) for name, shape in op.state_shapes(4, 20).items()}
    with pytest.raises(ValueError, match="cannot split"):
        run_step(op.algebra, {"q": q, "k": k, "v": v}, None, state, backend="triton", block_v=16)
    o = run_step(op.algebra, {"q": q, "k": k, "v": v}, None, state, backend="triton")
    state64 = {name: torch.zeros((2, 2) + shape, dtype=torch.float64)
               for name, shape in op.state_shapes(4, 20).items()}
    ref = run_step(op.algebra, {"q": q.double(), "k": k.double(), "v": v.double()}, None, state64)
    assert _rel(ref, o) < 1e-5


@pytest.mark.parametrize("block_v", [None, 16], ids=["whole", "shared_split"])
@pytest.mark.parametrize("spec,params", [("hla2", {}), ("power", {"p": 2})], ids=["hla2", "power"])
def test_triton_step_float64_strided_tokens(spec, params, block_v):
    """fp64 states run the kernel in fp64 (ACC); tokens may be any strided view."""
    op = hladsl.load(spec, normalize=True, **params)
    dv = 5 if block_v is None else 20
    q, k, v, g, init = _problem(op, True, True, B=2, T=3, H=2, d=4, dv=dv)
    ref, final = op(q, k, v, g=g, initial_state=init, output_final_state=True)
    state = {name: x.clone() for name, x in init.items()}
    k_strided = k.permute(0, 2, 1, 3).contiguous().permute(0, 2, 1, 3)    # [B, T, H, d] view
    assert not k_strided.is_contiguous()
    o = run_step(op.algebra, {"q": q * 4 ** -0.5, "k": k_strided, "v": v}, g, state,
                 backend="triton", block_v=block_v)
    assert o.dtype == torch.float64 and _rel(ref, o) < 1e-10
    for name, x in state.items():
        assert _rel(final[name], x) < 1e-10, name


@pytest.mark.parametrize("backend,dv,bridged", [("torch", 5, True), ("triton", 5, True),
                                                ("triton", 20, True), ("triton", 20, False)],
                         ids=["torch", "triton", "triton_value_blocks", "triton_shared_split"])
@pytest.mark.parametrize("spec,params", [("hla2", {}), ("power", {"p": 2})], ids=["hla2", "power"])
def test_state_indices_pool(spec, params, backend, dv, bridged):
    """A shuffled pool of state slots: row b reads and writes slot idx[b]; the same
    rows as separate calls, the other slots untouched. At dv = 20 the value dim is
    split in blocks of 16: hla2 by the bridged split (free_kernel indexes the pool, the
    scratch the batch), or the shared one (counters per pool slot); power's z is on
    packed rows, so it takes the shared split either way."""
    with launch.switched(STEP_SHARED_BLOCK=16, STEP_BRIDGED_BLOCK=16, STEP_BRIDGED=bridged):
        _pool_check(spec, params, backend, dv)


def _pool_check(spec, params, backend, dv):
    op = hladsl.load(spec, normalize=True, **params)
    dtype = torch.float64 if backend == "torch" else torch.float32
    gen = torch.Generator().manual_seed(1)
    B, T, H, d, N = 3, 2, 2, 4, 6
    q, k, v = (torch.rand(B, T, H, n, generator=gen, dtype=dtype) for n in (d, d, dv))
    g = -torch.rand(B, T, H, generator=gen, dtype=dtype) * 0.2
    pool = {}
    for name, shape in op.state_shapes(d, dv).items():
        pool[name] = torch.zeros((N, H) + shape, dtype=dtype)
    # fill the pool with valid states (symmetric ones included) by a step from zero
    filler = torch.rand(N, 3, H, d, generator=gen, dtype=dtype)
    op.step(filler, filler, torch.rand(N, 3, H, dv, generator=gen, dtype=dtype), state=pool,
            backend=backend)
    before = {name: x.clone() for name, x in pool.items()}
    idx = torch.tensor([4, 0, 2])
    o, _ = op.step(q, k, v, g=g, state=pool, state_indices=idx, backend=backend)
    tol = 1e-12 if dtype == torch.float64 else 1e-5
    for b in range(B):
        alone = {name: x[idx[b]:idx[b] + 1].clone() for name, x in before.items()}
        o_b, _ = op.step(q[b:b + 1], k[b:b + 1], v[b:b + 1], g=g[b:b + 1], state=alone,
                         backend=backend)
        assert _rel(o_b, o[b:b + 1]) < tol
        for name in pool:
            assert _rel(alone[name][0], pool[name][idx[b]]) < tol, name
    for row in set(range(N)) - set(idx.tolist()):
        for name in pool:
            assert torch.equal(pool[name][row], before[name][row])


def test_power_rows_never_full():
    """Power attention's states are held on their packed rows in the kernel."""
    alg = hladsl.load("power", p=3).algebra
    plan = step_plan(alg, {"d": 64, "dv": 64})
    assert [pd.size for pd in plan.packed] == [45760]
    assert plan.dims_of("U") == (plan.packed[0].name, "dv")
    source = step_source(alg, {"d": 64, "dv": 64}, True)
    assert "offs_d[:, None, None]" not in source and "D_d_pow3" in source
    compile(source, "<step>", "exec")


def test_step_source_comments_serial_equations():
    alg = hladsl.load("hla2").algebra
    source = step_source(alg, {"d": 8, "dv": 8}, False)
    assert "G_t[i,e] = ρ_t k_t[_0] k_t[i] C_{t-1}[_0,e] + ρ_t^2 G_{t-1}[i,e]" in source
    assert "rho" not in source.split("def step_kernel")[1]     # ungated: no decay code


def test_bad_arguments():
    op = hladsl.load("linear")
    q = torch.randn(2, 1, 3, 4)
    state = {"S": torch.zeros(2, 3, 4, 4)}
    with pytest.raises(ValueError, match="state"):
        op.step(q, q, q, state={"S": torch.zeros(2, 3, 4, 5)})
    with pytest.raises(ValueError, match="state_indices"):
        op.step(q, q, q, state=state, state_indices=torch.zeros(2))
    with pytest.raises(ValueError, match="tokens"):
        run_step(op.algebra, {"q": q, "k": q}, None, state)
    with pytest.raises(ValueError, match="backend"):
        run_step(op.algebra, {"q": q, "k": q, "v": q}, None, state, backend="cuda")
    with pytest.raises(ValueError, match="g must be"):
        op.step(q, q, q, g=torch.zeros(2, 1), state=state)


def test_op_step_from_zero_state_and_dtype():
    """state=None starts from zeros (op(...) without an initial state); o comes
    back in q's dtype and the state in fp32 for fp32 inputs."""
    op = hladsl.load("hla2", normalize=True)
    q, k, v, g, _ = _problem(op, True, True, T=4)
    ref, final = op(q, k, v, g=g, output_final_state=True)
    o, state = op.step(q, k, v, g=g)
    assert _rel(ref, o) < 1e-10 and all(_rel(final[n], state[n]) < 1e-10 for n in final)
    o32, state32 = op.step(q.float(), k.float(), v.float(), g=g.float())
    assert o32.dtype == torch.float32 and all(x.dtype == torch.float32 for x in state32.values())
    assert _rel(ref, o32) < 1e-5


def test_emit_triton_step(tmp_path):
    """``hladsl compile SPEC --emit triton_step`` prints (or writes) the step kernel."""
    from hladsl.emit import emit
    text = emit("power", "triton_step", {"p": 3}, None)
    assert "def step_kernel" in text and "U_t[i#1,i#2,i#3,e]" in text
    assert "wrote" in emit("hla2", "triton_step", {}, str(tmp_path))
    compile((tmp_path / "hla2_triton_step.py").read_text(), "hla2_triton_step.py", "exec")


# not shipped: four token inputs, a packed row state (U) next to whole states (S, z),
# an output reading both kinds (phase 1 and the packed-row loop add into one o)
MIXED_SPEC = """
mechanism mixed_power {
  dims d, dv
  input q[d], k[d], u[d], v[dv]
  param normalize = false, eps = 1e-6
  state U[i^2, e] = k[i^2] v[e]  symmetric(i^2)
  state S[i, e] = u[i] v[e]
  state z[i] = k[i]
  output o[e] = q[i^2] U[i^2, e] + 0.5 q[i] S[i, e]
  normalizer = q[i] z[i]
}
"""


@pytest.mark.parametrize("normalize", [False, True], ids=["plain", "normalized"])
def test_new_spec_mixed_rows_and_whole_states(tmp_path, normalize):
    path = tmp_path / "mixed_power.hla"
    path.write_text(MIXED_SPEC)
    op = hladsl.load(str(path), normalize=normalize)
    assert step_plan(op.algebra, {"d": 4, "dv": 5}).dims_of("U") == ("d_pow2", "dv")
    gen = torch.Generator().manual_seed(0)
    q, k, u = (torch.rand(2, 6, 3, 4, generator=gen, dtype=torch.float64) for _ in range(3))
    v = torch.rand(2, 6, 3, 5, generator=gen, dtype=torch.float64)
    g = -torch.rand(2, 6, 3, generator=gen, dtype=torch.float64) * 0.3
    _, init = op(q, k, u, v, g, output_final_state=True)
    ref, final = op(q, k, u, v, g, initial_state=init, output_final_state=True)
    for backend in ("torch", "triton"):     # fp64 through the kernel too (ACC = fp64)
        state = {name: x.clone() for name, x in init.items()}
        o = torch.cat([op.step(q[:, a:b], k[:, a:b], u[:, a:b], v[:, a:b], g[:, a:b], state=state,
                               backend=backend)[0] for a, b in ((0, 4), (4, 6))], dim=1)
        assert _rel(ref, o) < 1e-10, backend
        assert all(_rel(final[n], state[n]) < 1e-10 for n in final), backend


@pytest.mark.parametrize("backend", ["torch", "triton"])
def test_step_without_tokens_is_a_value_error(backend):
    op = hladsl.load("linear")
    q = torch.zeros(2, 0, 3, 4)
    with pytest.raises(ValueError, match="at least one token"):
        op.step(q, q, q, backend=backend)


def test_decode_call_signature():
    """The key of a bound decode launch (Op.step): only the usual form has one, and it
    changes with anything a launch depends on besides the tensors' data."""
    from hladsl.runtime.op import _step_signature
    op = hladsl.load("hla2")
    q, k, v = (torch.rand(2, 1, 3, 4) for _ in range(3))
    state = {name: torch.zeros((2, 3) + shape) for name, shape in op.state_shapes(4, 4).items()}
    key = _step_signature(op, (q, k, v), {"state": state})
    assert key is not None and key == _step_signature(op, (q.clone(), k, v), {"state": dict(state)})
    for args, kwargs in [((q, k), {"state": state}), ((q, k, v), {}),
                         ((q, k, v), {"state": state, "backend": "triton"}),
                         ((q, k, v), {"state": {"S": state["S"]}}), ((q, k, "v"), {"state": state})]:
        assert _step_signature(op, args, kwargs) is None
    buffer = torch.rand(2, 1, 3, 5)
    others = [((q.double(), k, v), {"state": state}), ((buffer[..., 1:], k, v), {"state": state}),
              ((q, k, v), {"state": state, "scale": 0.5}), ((q, k, v), {"state": state, "g": q[..., 0]})]
    assert len({key, *(_step_signature(op, a, kw) for a, kw in others)}) == 1 + len(others)


@pytest.mark.parametrize("spec,gated,dv", [("linear", True, 6), ("hla2", True, 20), ("hla3", False, 20),
                                           ("power", True, 6)], ids=["linear", "hla2", "hla3", "power"])
def test_bound_decode_fills_each_kernels_tensors(spec, gated, dv, interpreter_binds):
    """Op.step's bound path (BoundStep: no validation, each kernel's pointer parameters
    filled by name from the call) equals the validated path token after token, for one
    launch and for the bridged split's two (hla2 and hla3 at dv = 20: value blocks of 16).
    Direct launches need a GPU; here ``bind`` re-launches through the interpreter with
    the call's tensors in the bound slots -- the names and values are BoundStep's."""
    launched = interpreter_binds
    op = hladsl.load(spec, backend="triton", **({"p": 2} if spec == "power" else {}))
    gen = torch.Generator().manual_seed(5)
    B, T, H, d = 2, 4, 2, 4
    q, k, v = (torch.randn(B, T, H, n, generator=gen) * 0.5 for n in (d, d, dv))
    g = -torch.rand(B, T, H, generator=gen) * 0.3 if gated else None
    zeros = {name: torch.zeros((B, H) + shape) for name, shape in op.state_shapes(d, dv).items()}
    bound_state = {n: x.clone() for n, x in zeros.items()}
    checked_state = {n: x.clone() for n, x in zeros.items()}
    with launch.switched(STEP_BRIDGED_BLOCK=16):
        for t in range(T):   # contiguous copies: one signature for every token
            xs = [x[:, t:t + 1].contiguous() for x in (q, k, v)]
            gt = None if g is None else g[:, t:t + 1].contiguous()
            kw = {} if gt is None else {"g": gt}
            o_bound, _ = op.step(*xs, state=bound_state, **kw)
            o_checked, _ = op.step(*xs, state=checked_state, backend="triton", **kw)
            assert torch.equal(o_bound, o_checked), t
    kernels = 2 if spec in ("hla2", "hla3") else 1
    assert len(launched) == (T - 1) * kernels     # every call after the first was bound
    for name in zeros:
        assert torch.equal(bound_state[name], checked_state[name]), name
