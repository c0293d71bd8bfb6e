"""Generated Triton backward kernels under the Triton interpreter (CPU, float32)
against the float64 torch backward program (itself checked against autograd in
tests/test_backward.py): several chunks, strided token tiles, an initial state,
packed symmetric states over several tiles of the packed dim."""
import os

os.environ["TRITON_INTERPRET"] = "1"   # before triton is imported anywhere

import pytest
import torch

import hladsl
from hladsl.ir.backward import output_size
from hladsl.ir.pipeline import chunk_program
from hladsl.runtime.backward_torch import backward_torch

C, N_CHUNKS, N, H = 16, 3, 1, 2

from power_specs import PREFIXED_DIM_POWER, SHARED_DIM_POWER  # noqa: E402
from probe_spec import PROBE  # noqa: E402

# (spec, params, dims, gated, normalize): every shipped spec gated and not; the
# normalizer of four; power's packed dim over several tiles (p = 2 at d = 16:
# 136 entries, p = 3 at d = 8: 120; tiles of 64)
CASES = [(name, {}, (8, 8), gated, False)
         for name in ("linear", "hla2", "ahla", "hla3", "hla3_masked") for gated in (False, True)]
CASES += [("power", {"p": 2}, (16, 8), gated, False) for gated in (False, True)]
CASES += [("hla2", {"ridge": 0.3}, (8, 16), True, True), ("ahla", {}, (8, 8), True, True),
          ("hla3_masked", {}, (8, 8), False, True), ("linear", {}, (16, 16), True, True),
          ("power", {"p": 3}, (8, 8), True, True), ("probe", {}, (8, 8), True, True),
          ("probe", {}, (8, 8), False, False)]


@pytest.fixture(autouse=True)
def _cache_dir(tmp_path_factory, monkeypatch):
    monkeypatch.setenv("HLADSL_CACHE_DIR", str(tmp_path_factory.getbasetemp() / "hladsl-cache"))


def _rel(a, b):
    scale = b.norm().item()
    return (a.double() - b).norm().item() / scale if scale > 0 else a.norm().item()


def _assert_grads_match_torch(program, tiles, lam, init, grad_o, grad_final, eps, grads, tol=1e-4):
    """(d tiles, d lam, d init) against ``backward_torch`` in float64, each to ``tol`` relative."""
    d_tiles, d_lam, d_init = grads
    ref_tiles, ref_lam, ref_init = backward_torch(program, tiles, lam, init, grad_o, grad_final, eps)
    for x in tiles:
        assert _rel(d_tiles[x], ref_tiles[x]) <= tol, x
    assert (d_lam is None and ref_lam is None) if not program.gated else _rel(d_lam, ref_lam) <= tol
    for s in init:
        assert _rel(d_init[s], ref_init[s]) <= tol, s


def _inputs(program, normalize, seed):
    """Tiles as Op._forward makes them (strided views of [N, T, H, dim])."""
    gen = torch.Generator().manual_seed(seed)
    sizes = dict(program.sizes)
    tiles = {}
    for x, dim in program.algebra.inputs.items():
        t = 0.5 * torch.randn(N, N_CHUNKS * C, H, sizes[dim], generator=gen, dtype=torch.float64)
        t = t.abs() if normalize else t     # keeps den away from 0
        tiles[x] = t.reshape(N, N_CHUNKS, C, H, -1).permute(0, 3, 1, 2, 4)
    lam = None
    if program.gated:
        lam = (-0.3 * torch.rand(N, H, N_CHUNKS, C, generator=gen, dtype=torch.float64)).cumsum(-1)
    init = {s: 0.3 * torch.randn(N, H, *program.state_shape(s), generator=gen, dtype=torch.float64)
            for s, _ in program.states}
    if normalize:
        init = {s: x.abs() for s, x in init.items()}
    grad_o = torch.randn(N, H, N_CHUNKS, C, output_size(program), generator=gen,
                         dtype=torch.float64)
    grad_final = {s: torch.randn(x.shape, generator=gen, dtype=torch.float64) for s, x in init.items()}
    return tiles, lam, init, grad_o, grad_final


@pytest.mark.parametrize("name,params,dims,gated,normalize", CASES,
                         ids=[f"{c[0]}{c[1] or ''}-d{c[2][0]}-{'gated' if c[3] else 'plain'}"
                              f"{'-normalized' if c[4] else ''}" for c in CASES])
@pytest.mark.parametrize("schedule", ["two_pass", "fused"])
def test_triton_backward_matches_torch(name, params, dims, gated, normalize, schedule, tmp_path):
    from hladsl.runtime.triton_backward import backward_triton
    if name == "probe":
        (tmp_path / "backward_probe.hla").write_text(PROBE)
        name = str(tmp_path / "backward_probe.hla")
    alg = hladsl.compile_spec(name, normalize=normalize, **params)
    program = chunk_program(alg, C, (("d", dims[0]), ("dv", dims[1])), gated)
    if schedule == "fused" and program.packed:
        from hladsl.runtime.triton_backward import backward_triton as run
        with pytest.raises(ValueError, match="no fused backward"):
            run(program, {}, None, {}, torch.zeros(0), None, alg.eps, schedule="fused")
        return
    tiles, lam, init, grad_o, grad_final = _inputs(program, normalize, seed=sum(dims) + gated)
    ref_tiles, ref_lam, ref_init = backward_torch(program, tiles, lam, init, grad_o, grad_final,
                                                  alg.eps)

    def f32(d):
        return {k: v.float() for k, v in d.items()}
    d_tiles, d_lam, d_init = backward_triton(program, f32(tiles), None if lam is None else lam.float(),
                                             f32(init), grad_o.float(), f32(grad_final), alg.eps,
                                             schedule=schedule)
    for x in tiles:
        assert d_tiles[x].dtype == torch.float32 and d_tiles[x].shape == ref_tiles[x].shape
        assert _rel(d_tiles[x], ref_tiles[x]) <= 1e-4, x
    for s in init:
        assert _rel(d_init[s], ref_init[s]) <= 1e-4, s
    if gated:
        assert _rel(d_lam, ref_lam) <= 1e-4
    else:
        assert d_lam is None


SPLITS = [("linear", {}, True, []), ("hla2", {}, False, ["S"]),
          ("hla2", {"ridge": 0.3}, True, ["S", "m", "h"]), ("hla3_masked", {}, True, ["S", "m", "z"]),
          ("hla3", {}, False, ["SK", "SQ"])]


@pytest.mark.parametrize("name,params,normalize,partial", SPLITS,
                         ids=[f"{c[0]}{'-normalized' if c[2] else ''}" for c in SPLITS])
@pytest.mark.parametrize("varlen", [False, True], ids=["dense", "varlen"])
def test_reverse_pass_split_over_value_blocks(name, params, normalize, partial, varlen):
    """The reverse pass runs one program per value block. Where every transpose keeps the
    value dim free (linear) a d-state without it is computed whole by every block and
    written by block 0; where one sums over it (hla2: dS += dW Cᵀ) each block holds a
    partial sum of such d-states (block 0 from d final state, d den's networks in block 0
    only), which the gradient kernel and d initial state sum. Two blocks here, 16 wide."""
    from hladsl.codegen.triton_bwd import backward_kernels
    from hladsl.runtime.triton_backward import backward_triton
    alg = hladsl.compile_spec(name, normalize=normalize, **params)
    program = chunk_program(alg, C, (("d", 16), ("dv", 32)), True)
    _, ctx = backward_kernels(program)
    assert ctx["reverse_splits"] == ["dv"] and ctx["reverse_partial"] == partial
    tiles, lam, init, grad_o, grad_final = _inputs(program, normalize, seed=5)
    seq_chunks = None
    if varlen:   # two sequences of 2 and 1 chunks in one row: d initial state per sequence
        seq_chunks = torch.tensor([0, 2, 3], dtype=torch.int32)
        init = {k: torch.cat([v, 0.5 * v]) for k, v in init.items()}
        grad_final = {k: torch.cat([v, -v]) for k, v in grad_final.items()}
    ref = _varlen_reference(program, tiles, lam, init, grad_o, grad_final, alg.eps, seq_chunks)
    got = backward_triton(program, {k: v.float() for k, v in tiles.items()}, lam.float(),
                          {k: v.float() for k, v in init.items()}, grad_o.float(),
                          {k: v.float() for k, v in grad_final.items()}, alg.eps, reverse_block=16,
                          seq_chunks=seq_chunks)
    for x in tiles:
        assert _rel(got[0][x], ref[0][x]) <= 1e-4, x
    assert _rel(got[1], ref[1]) <= 1e-4
    for s in init:
        assert got[2][s].shape == init[s].shape
        assert _rel(got[2][s], ref[2][s]) <= 1e-4, s


@pytest.mark.parametrize("name,schedule", [("hla2", "two_pass"), ("hla2", "fused"), ("linear", "two_pass")])
def test_no_initial_state_and_no_final_gradient_are_zeros_the_kernels_make(name, schedule):
    """init_states=None (HAS_INIT False) and no final-state gradient (HAS_DFINAL False): the
    kernels start from zero states and d-states without reading any buffer, and give what
    explicit zero tensors give; over two value blocks (a partial-sum reverse pass for hla2,
    whose block 0 alone would load d final state)."""
    from hladsl.runtime.triton_backward import backward_triton
    from hladsl.runtime.triton_forward import forward_triton
    alg = hladsl.compile_spec(name)
    program = chunk_program(alg, C, (("d", 8), ("dv", 32)), True)
    tiles, lam, init, grad_o, _ = _inputs(program, False, seed=11)
    tiles, lam, grad_o = {k: v.float() for k, v in tiles.items()}, lam.float(), grad_o.float()
    zeros = {k: torch.zeros_like(v, dtype=torch.float32) for k, v in init.items()}
    o0, f0 = forward_triton(program, tiles, lam, zeros, alg.eps, schedule=schedule, state_block=16)
    o1, f1 = forward_triton(program, tiles, lam, None, alg.eps, schedule=schedule, state_block=16)
    assert torch.equal(o0, o1) and all(torch.equal(f0[s], f1[s]) for s in f0)
    g0 = backward_triton(program, tiles, lam, zeros, grad_o, zeros, alg.eps, schedule=schedule,
                         reverse_block=16)
    g1 = backward_triton(program, tiles, lam, None, grad_o, None, alg.eps, schedule=schedule,
                         reverse_block=16)
    assert all(torch.equal(g0[0][x], g1[0][x]) for x in tiles) and torch.equal(g0[1], g1[1])
    assert all(torch.equal(g0[2][s], g1[2][s]) for s in g0[2])
    ref = backward_torch(program, {k: v.double() for k, v in tiles.items()}, lam.double(),
                         {k: v.double() for k, v in zeros.items()}, grad_o.double(), None, alg.eps)
    assert all(_rel(g1[0][x], ref[0][x]) <= 1e-4 for x in tiles)
    with pytest.raises(ValueError, match="init_states: expected a dict"):   # the torch program's
        backward_torch(program, tiles, lam, None, grad_o, None, alg.eps)    # are explicit


def _too_little_shared_memory(monkeypatch, kernel_name: str) -> list:
    """From here on, launches of ``kernel_name`` wider than 16 in the value dim raise
    OutOfResources at every launch fallback (as HLA2's reverse kernel at d = 128 does on the
    H100); returns the list of the B_dv widths launched (failed or not), in order."""
    from triton.runtime.errors import OutOfResources
    from hladsl.runtime import launch, progress
    real, widths = progress.first_launch, []

    def small_smem(kernel, options, fn):   # every compile of a variant, tuned or not
        if kernel.fn.__name__ == kernel_name:
            widths.append(options["B_dv"])
            if options["B_dv"] > 16:
                raise OutOfResources(262144, 232448, "shared memory")
        return real(kernel, options, fn)
    monkeypatch.setattr(progress, "first_launch", small_smem)
    monkeypatch.setattr(launch, "_WORKING", {})
    monkeypatch.setattr(launch, "_TOO_WIDE", set())
    return widths


@pytest.mark.parametrize("tuned", [False, True], ids=["untuned", "tuned"])
def test_reverse_pass_that_does_not_fit_runs_narrower_blocks(monkeypatch, tmp_path, tuned):
    """A reverse kernel over the GPU's shared memory at every launch fallback (HLA2's at
    d = 128 on the H100, injected here for blocks wider than 16) runs in narrower value
    blocks (launch.narrower), with partial d-state sums over twice the blocks, and its
    plan keeps the width that fit -- an autotuning session's trials too (they retile
    from the narrowed widths: the buffers are sized by the number of blocks)."""
    import contextlib
    from hladsl.runtime import autotune, triton_backward
    grids = _too_little_shared_memory(monkeypatch, "reverse_kernel")
    session = contextlib.nullcontext()
    if tuned:
        tuner = autotune.Tuner(str(tmp_path / "tune.json"), timer=lambda fn: (fn(), 1.0)[1])
        session = autotune.tuning(tuner, {"gpu": "fake", "dims": [["d", 16]], "dtype": "fp32",
                                          "gated": True, "bh": 2, "t": 48})
    alg = hladsl.compile_spec("hla2")
    program = chunk_program(alg, C, (("d", 16), ("dv", 32)), True)
    tiles, lam, init, grad_o, grad_final = _inputs(program, False, seed=7)
    ref = backward_torch(program, tiles, lam, init, grad_o, grad_final, alg.eps)
    for call in range(2):   # the second call starts at the width that fit
        grids.clear()
        with session if call == 0 else contextlib.nullcontext():
            got = triton_backward.backward_triton(
                program, {k: v.float() for k, v in tiles.items()}, lam.float(),
                {k: v.float() for k, v in init.items()}, grad_o.float(),
                {k: v.float() for k, v in grad_final.items()}, alg.eps, reverse_block=32,
                schedule="two_pass")
        for x in tiles:
            assert _rel(got[0][x], ref[0][x]) <= 1e-4, x
        for s in init:
            assert _rel(got[2][s], ref[2][s]) <= 1e-4, s
        if call == 0:
            assert 32 in grids and grids[-1] == 16
    assert grids in ([], [16])    # no attempt at the width that did not fit on the second call


def test_varlen_calls_remember_the_width_that_did_not_fit(monkeypatch):
    """A varlen call builds a new plan each time; the reverse-pass width that fit no
    launch fallback (injected above 16) is still not launched again on the next call."""
    from hladsl.runtime import triton_backward
    widths = _too_little_shared_memory(monkeypatch, "reverse_kernel")
    alg = hladsl.compile_spec("hla2")
    program = chunk_program(alg, C, (("d", 16), ("dv", 32)), True)
    tiles, lam, init, grad_o, grad_final = _inputs(program, False, seed=9)
    seq_chunks = torch.tensor([0, 2, 3], dtype=torch.int32)
    init = {k: torch.cat([v, 0.5 * v]) for k, v in init.items()}
    grad_final = {k: torch.cat([v, -v]) for k, v in grad_final.items()}
    ref = _varlen_reference(program, tiles, lam, init, grad_o, grad_final, alg.eps, seq_chunks)
    for call in range(2):
        widths.clear()
        got = triton_backward.backward_triton(
            program, {k: v.float() for k, v in tiles.items()}, lam.float(),
            {k: v.float() for k, v in init.items()}, grad_o.float(),
            {k: v.float() for k, v in grad_final.items()}, alg.eps, reverse_block=32,
            seq_chunks=seq_chunks)
        for x in tiles:
            assert _rel(got[0][x], ref[0][x]) <= 1e-4, x
        for s in init:
            assert _rel(got[2][s], ref[2][s]) <= 1e-4, s
        assert 32 not in widths if call else widths[0] == 32 and widths[-1] == 16
    assert widths in ([], [16])


def test_state_pass_that_does_not_fit_runs_narrower_blocks(monkeypatch):
    """The state pass (forward, and recomputed by the backward) over shared memory at every
    launch fallback (injected above width 16) runs narrower value blocks instead of the
    whole call halving its chunk: the forward with the same results as blocks of 16 asked
    for, the backward (which takes no state block) matching float64. (Not bitwise against
    its unnarrowed self: the interpreter's matmuls of [.., 16] and [.., 32] tiles may round
    differently, as numpy 2.4's do.)"""
    from hladsl.runtime import triton_forward
    from hladsl.runtime.triton_backward import backward_triton
    alg = hladsl.compile_spec("hla3")
    program = chunk_program(alg, C, (("d", 8), ("dv", 32)), True)
    tiles, lam, init, grad_o, grad_final = _inputs(program, False, seed=3)
    args = ({k: v.float() for k, v in tiles.items()}, lam.float(), {k: v.float() for k, v in init.items()})
    want_o, want_f = triton_forward.forward_triton(program, *args, alg.eps, schedule="two_pass",
                                                   state_block=16)
    ref = backward_torch(program, {k: v.double() for k, v in tiles.items()}, lam.double(),
                         {k: v.double() for k, v in init.items()}, grad_o.double(), None, alg.eps)
    widths = _too_little_shared_memory(monkeypatch, "state_pass_kernel")
    o, f = triton_forward.forward_triton(program, *args, alg.eps, schedule="two_pass", state_block=32)
    assert widths[0] == 32 and widths[-1] == 16
    assert torch.equal(o, want_o) and all(torch.equal(f[n], want_f[n]) for n in f)
    widths.clear()
    got = backward_triton(program, *args, grad_o.float(), None, alg.eps, reverse_block=16)
    assert 16 in widths
    for x in tiles:
        assert _rel(got[0][x], ref[0][x]) <= 1e-4, x
    for s in init:
        assert _rel(got[2][s], ref[2][s]) <= 1e-4, s


def _varlen_reference(program, tiles, lam, init, grad_o, grad_final, eps, seq_chunks):
    """backward_torch per sequence (float64), concatenated back into the one row."""
    if seq_chunks is None:
        return backward_torch(program, tiles, lam, init, grad_o, grad_final, eps)
    bounds = seq_chunks.tolist()
    parts = []
    for n, (lo, hi) in enumerate(zip(bounds, bounds[1:])):
        parts.append(backward_torch(program, {k: v[:, :, lo:hi] for k, v in tiles.items()},
                                    lam[:, :, lo:hi], {k: v[n:n + 1] for k, v in init.items()},
                                    grad_o[:, :, lo:hi], {k: v[n:n + 1] for k, v in grad_final.items()},
                                    eps))
    d_tiles = {x: torch.cat([p[0][x] for p in parts], dim=2) for x in tiles}
    d_lam = torch.cat([p[1] for p in parts], dim=2)
    d_init = {s: torch.cat([p[2][s] for p in parts]) for s in init}
    return d_tiles, d_lam, d_init


def test_triton_backward_missing_final_grad_is_zero(tmp_path):
    """grad_final may leave out states (or be None): their cotangent is zero."""
    from hladsl.runtime.triton_backward import backward_triton
    alg = hladsl.compile_spec("hla2")
    program = chunk_program(alg, C, (("d", 8), ("dv", 8)), True)
    tiles, lam, init, grad_o, _ = _inputs(program, False, seed=1)
    ref = backward_torch(program, tiles, lam, init, grad_o, None, alg.eps)
    got = backward_triton(program, {k: v.float() for k, v in tiles.items()}, lam.float(),
                          {k: v.float() for k, v in init.items()}, grad_o.float(), None, alg.eps)
    for s in init:
        assert _rel(got[2][s], ref[2][s]) <= 1e-4, s
    assert _rel(got[1], ref[1]) <= 1e-4


def test_triton_bwd_source_names_every_gradient_term():
    from hladsl.codegen.steps import comment
    from hladsl.codegen.triton_bwd import triton_bwd_source
    from hladsl.ir.backward import backward_program
    alg = hladsl.compile_spec("power", p=2, normalize=True)
    program = chunk_program(alg, 64, (("d", 64), ("dv", 64)), True)
    src = triton_bwd_source(program)
    compile(src, "<triton_bwd>", "exec")
    for kernel in ("state_pass_kernel", "cotangent_kernel", "reverse_kernel", "grad_kernel"):
        assert f"def {kernel}(" in src
    for g in backward_program(program).all_terms():
        assert comment(g.term.source) in src, g.term.source
    assert "one-hot" in src    # the packed power's gradient goes back through one-hot dots


@pytest.mark.parametrize("p,dims,shared", [(2, (12, 8), False), (3, (8, 8), False), (2, (32,), True)],
                         ids=["p2-d12", "p3", "p2-value-dim-split"])
def test_power_factors_picked_by_dots_gathers_and_loads_agree(p, dims, shared, monkeypatch, tmp_path):
    """The packed power factors x[T, α_r] are picked from the loaded token tile by one-hot
    dots (``triton_gen.slot_columns``), by ``tl.gather`` of that tile (POWER_COLUMNS
    "gather") or by gathered loads from memory ("load"); all read the same values, so forward
    and backward agree bitwise in float32 (one value times 1 per output; d = 12: a padded
    tile), and all match float64. Where x's dim is the output's value dim,
    split here over blocks of 16 in the state and reverse passes (the loaded tile then holds
    one block), the columns stay gathered loads."""
    from hladsl.codegen import triton_bwd, triton_gen
    from hladsl.runtime import launch
    from hladsl.runtime.triton_backward import backward_triton
    from hladsl.runtime.triton_forward import forward_triton
    name = "power"
    if shared:
        (tmp_path / "powshared.hla").write_text(SHARED_DIM_POWER)
        name = str(tmp_path / "powshared.hla")
    alg = hladsl.compile_spec(name, p=p, normalize=True)
    sizes = (("d", dims[0]),) if shared else (("d", dims[0]), ("dv", dims[1]))
    program = chunk_program(alg, C, sizes, True)
    tiles, lam, init, grad_o, grad_final = _inputs(program, True, seed=11)
    blocks = {"state_block": 16} if shared else {}

    def f32(d):
        return {k: v.float() for k, v in d.items()}
    runs = {}
    for mode in ("dot", "gather", "load"):
        monkeypatch.setattr(triton_gen, "POWER_COLUMNS", mode)
        monkeypatch.setattr(triton_gen, "_MODULES", {})    # the modules are rendered anew
        monkeypatch.setattr(triton_bwd, "_MODULES", {})
        launch.forget_plans()
        o, final = forward_triton(program, f32(tiles), lam.float(), f32(init), alg.eps, **blocks)
        grads = backward_triton(program, f32(tiles), lam.float(), f32(init), grad_o.float(),
                                f32(grad_final), alg.eps, reverse_block=16 if shared else None)
        src = "".join(open(hit[1].__file__).read()
                      for hit in list(triton_gen._MODULES.values()) + list(triton_bwd._MODULES.values()))
        token_gathers = src.count("offs_t[:, None] * str_k_t + t")   # a gathered load of k's columns
        by_dot = "the tile's columns picked by a dot" in src
        by_gather = "tl.gather(raw_k" in src
        assert (token_gathers > 0) == (mode == "load" or shared)
        assert by_dot == (mode == "dot" and not shared) and by_gather == (mode == "gather" and not shared)
        runs[mode] = (o, final, *grads)
    launch.forget_plans()
    o, final, d_tiles, d_lam, d_init = runs["dot"]
    for mode in ("gather", "load"):
        other = runs[mode]
        assert torch.equal(o, other[0]) and torch.equal(d_lam, other[3]), mode
        for got, ref in ((final, other[1]), (d_tiles, other[2]), (d_init, other[4])):
            assert got.keys() == ref.keys() and all(torch.equal(got[k], ref[k]) for k in got), mode
    _assert_grads_match_torch(program, tiles, lam, init, grad_o, grad_final, alg.eps, (d_tiles, d_lam, d_init))


# a power whose base dim the state pass splits (its value dim is not splittable: V holds two of it)
SPLIT_BASE_POWER = """mechanism powsplit {
  dims d, dv
  input q[d], k[d], v[dv], u[dv]
  param p = 2
  state U[i^p, e] = k[i^p] v[e]  symmetric(i^p)
  state V[e, f] = v[e] v[f]
  output o[e] = q[i^p] U[i^p, e] + u[f] V[f, e]
}
"""


@pytest.mark.parametrize("mode", ["auto", "dot", "gather", "load"])
def test_power_columns_of_a_split_base_dim_are_loaded(mode, monkeypatch, tmp_path):
    """Where the state pass splits the packed power's base dim (d, in blocks of 16 here) its token
    tile holds one block of d, so the columns x[T, α_r] -- any α_r -- are loaded from memory in
    every mode; forward and backward against the float64 torch program."""
    from hladsl.codegen import triton_bwd, triton_gen
    from hladsl.codegen.triton_gen import _Lowering, _state_splits
    from hladsl.runtime import launch
    from hladsl.runtime.chunk_torch import outputs, state_pass
    from hladsl.runtime.triton_backward import backward_triton
    from hladsl.runtime.triton_forward import forward_triton
    (tmp_path / "powsplit.hla").write_text(SPLIT_BASE_POWER)
    alg = hladsl.compile_spec(str(tmp_path / "powsplit.hla"))
    program = chunk_program(alg, C, (("d", 32), ("dv", 8)), True)
    low = _Lowering(program)
    assert _state_splits(low, low.o_dim) == ["d_pow2", "d"]
    monkeypatch.setattr(triton_gen, "POWER_COLUMNS", mode)
    monkeypatch.setattr(triton_gen, "_MODULES", {})
    monkeypatch.setattr(triton_bwd, "_MODULES", {})
    launch.forget_plans()
    tiles, lam, init, grad_o, grad_final = _inputs(program, False, seed=13)
    starts, final = state_pass(program, tiles, lam, init, torch.float64)
    want = outputs(program, "output", tiles, lam, starts, torch.float64)

    def f32(d):
        return {k: v.float() for k, v in d.items()}
    o, got = forward_triton(program, f32(tiles), lam.float(), f32(init), alg.eps, state_block=16)
    d_tiles, d_lam, d_init = backward_triton(program, f32(tiles), lam.float(), f32(init), grad_o.float(),
                                             f32(grad_final), alg.eps, reverse_block=16)
    launch.forget_plans()
    assert _rel(o, want) <= 1e-5 and all(_rel(got[s], final[s]) <= 1e-5 for s in final)
    _assert_grads_match_torch(program, tiles, lam, init, grad_o, grad_final, alg.eps, (d_tiles, d_lam, d_init))


@pytest.mark.parametrize("p,d,dv,gated,normalize", [(2, 32, 8, True, True), (3, 20, 8, False, False)],
                         ids=["p2-normalised-gated", "p3"])
def test_power_row_tiles_match_float64(p, d, dv, gated, normalize, monkeypatch):
    """POWER_COLUMNS "rows": the forward's state and output passes (and the backward's cotangent
    and recomputed state pass, the same lowering) walk the packed dim in row tiles
    (``packing.row_tiles``): a prefix of p - 1 fixed indices times an aligned block of the last.
    At tiles of 16 over d = 32 (p = 2) or 20 (p = 3) a prefix has one or two blocks, its first
    partly not its own; the forward (with an initial state) against the float64 torch program,
    the gradients against ``backward_torch``; the reverse and gradient kernels keep the dots."""
    import re
    from hladsl.codegen import triton_bwd, triton_gen
    from hladsl.runtime import launch
    from hladsl.runtime.chunk_torch import outputs, state_pass
    from hladsl.runtime.triton_backward import backward_triton
    from hladsl.runtime.triton_forward import forward_triton
    monkeypatch.setattr(triton_gen, "POWER_COLUMNS", "rows")
    monkeypatch.setattr(triton_gen, "_MODULES", {})
    monkeypatch.setattr(triton_bwd, "_MODULES", {})
    launch.forget_plans()
    alg = hladsl.compile_spec("power", p=p, normalize=normalize)
    program = chunk_program(alg, C, (("d", d), ("dv", dv)), gated)
    tiles, lam, init, grad_o, grad_final = _inputs(program, normalize, seed=17)
    starts, final = state_pass(program, tiles, lam, init, torch.float64)
    want = outputs(program, "output", tiles, lam, starts, torch.float64)
    if normalize:
        want = want / (outputs(program, "normalizer", tiles, lam, starts, torch.float64) + alg.eps)[..., None]

    def f32(x):
        return {k: v.float() for k, v in x.items()}
    lam32 = None if lam is None else lam.float()
    for block in (16, None):   # tiles of 16: two blocks a prefix; the default 64: one
        o, got = forward_triton(program, f32(tiles), lam32, f32(init), alg.eps, packed_block=block)
        assert _rel(o, want) <= 1e-5 and all(_rel(got[s], final[s]) <= 1e-5 for s in final), block
    grads = backward_triton(program, f32(tiles), lam32, f32(init), grad_o.float(), f32(grad_final), alg.eps)
    for module in (triton_gen.kernels(program)[0], triton_bwd.backward_kernels(program)[0]):
        for kernel in re.split(r"@triton\.jit\ndef ", open(module.__file__).read())[1:]:
            name = kernel.split("(")[0]
            if name in ("state_pass_kernel", "output_kernel", "cotangent_kernel"):
                assert "the row tile's aligned slice" in kernel and "picked by a dot" not in kernel, name
            elif name in ("reverse_kernel", "grad_kernel"):
                assert "row tile" not in kernel and "picked by a dot" in kernel, name
    launch.forget_plans()
    _assert_grads_match_torch(program, tiles, lam, init, grad_o, grad_final, alg.eps, grads)


def test_row_tiles_beside_a_dim_named_after_the_packed_one(tmp_path, monkeypatch):
    """A value dim whose name starts with the packed dim's (d_pow2x beside d_pow2): the row-tiled
    state pass stores its starts at offsets formed in the walk, and only the packed dim's
    offsets are the walk's own (the review's case: a substring rename made d_pow2x's offsets
    ``w_offs_d_pow2x``, never defined). The forward, with an initial state, against float64."""
    from hladsl.codegen import triton_gen
    from hladsl.runtime import launch
    from hladsl.runtime.chunk_torch import outputs, state_pass
    from hladsl.runtime.triton_forward import forward_triton
    monkeypatch.setattr(triton_gen, "POWER_COLUMNS", "rows")
    monkeypatch.setattr(triton_gen, "_MODULES", {})
    launch.forget_plans()
    path = tmp_path / "prefixed.hla"
    path.write_text(PREFIXED_DIM_POWER)
    alg = hladsl.compile_spec(str(path), normalize=True)
    program = chunk_program(alg, C, (("d", 16), ("d_pow2x", 8)), True)
    assert [pd.name for pd in program.packed] == ["d_pow2"]
    tiles, lam, init, _, _ = _inputs(program, True, seed=5)
    starts, final = state_pass(program, tiles, lam, init, torch.float64)
    want = outputs(program, "output", tiles, lam, starts, torch.float64)
    want = want / (outputs(program, "normalizer", tiles, lam, starts, torch.float64) + alg.eps)[..., None]
    o, got = forward_triton(program, {k: v.float() for k, v in tiles.items()}, lam.float(),
                            {k: v.float() for k, v in init.items()}, alg.eps, packed_block=16)
    launch.forget_plans()
    assert _rel(o, want) <= 1e-5 and all(_rel(got[s], final[s]) <= 1e-5 for s in final)


def test_auto_gathers_power_columns_only_in_the_forwards_narrow_kernels():
    """POWER_COLUMNS "auto": the forward lowering's kernels (state and output passes, in either
    module) gather the columns at d <= 64, the reverse and gradient kernels pick them by one-hot
    dots, and at d = 128 every kernel does (run 278: gathering there, or in the backward, is
    slower; runs 287, 288: row tiles there are slower too)."""
    import re
    from hladsl.codegen import triton_bwd, triton_gen
    assert triton_gen.POWER_COLUMNS == "auto"
    for d, forward_gathers in ((64, True), (128, False)):
        program = chunk_program(hladsl.compile_spec("power"), 64, (("d", d), ("dv", d)), True)
        for module in (triton_gen.kernels(program)[0], triton_bwd.backward_kernels(program)[0]):
            for kernel in re.split(r"@triton\.jit\ndef ", open(module.__file__).read())[1:]:
                name = kernel.split("(")[0]
                assert "row tile" not in kernel, (d, name)
                if name in ("state_pass_kernel", "output_kernel"):
                    assert ("tl.gather(raw_" in kernel) is forward_gathers, (d, name)
                    assert ("picked by a dot" in kernel) is not forward_gathers, (d, name)
                elif name in ("reverse_kernel", "grad_kernel"):
                    assert "tl.gather(" not in kernel and "picked by a dot" in kernel, (d, name)
