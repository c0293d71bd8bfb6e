"""The derived backward program (hladsl.ir.backward, run by
hladsl.runtime.backward_torch) against torch.autograd of the forward torch chunk
path, float64: several chunks, a padded last chunk, a random initial state and
random cotangents of the output and of the final state."""
import os
from pathlib import Path

import pytest
import torch

import hladsl
from hladsl.ir.backward import Target, backward_program, backward_text, output_size
from hladsl.ir.pipeline import chunk_program
from hladsl.runtime import chunk_torch
from hladsl.runtime.backward_torch import backward_torch, power_chain_rule

N, H, N_CHUNKS, C, PAD = 2, 2, 3, 16, 5   # the last chunk's final PAD positions are padding
SIZES = (("d", 5), ("dv", 3))

from probe_spec import PROBE  # noqa: E402

SPECS = [("linear", {}), ("hla2", {}), ("hla2", {"ridge": 0.3}), ("ahla", {}), ("hla3", {}),
         ("hla3_masked", {}), ("power", {"p": 2}), ("power", {"p": 3}), ("probe", {})]


def _algebra(name, params, normalize, tmp_path_factory):
    if name == "probe":
        path = Path(tmp_path_factory.getbasetemp()) / "backward_probe.hla"
        path.write_text(PROBE)
        name = str(path)
    return hladsl.compile_spec(name, normalize=normalize, **params)


def _inputs(program, gated, seed):
    gen = torch.Generator().manual_seed(seed)
    alg = program.algebra
    sizes = dict(program.sizes)
    valid = torch.ones(N_CHUNKS * C, dtype=torch.float64)
    valid[-PAD:] = 0
    valid = valid.reshape(N_CHUNKS, C, 1)
    tiles = {x: 0.7 * torch.randn(N, H, N_CHUNKS, C, sizes[dim], generator=gen,
                                  dtype=torch.float64) * valid
             for x, dim in alg.inputs.items()}
    lam = None
    if gated:   # padded positions have g = 0, as the op pads them
        g = -0.4 * torch.rand(N, H, N_CHUNKS, C, generator=gen, dtype=torch.float64) * valid[..., 0]
        lam = g.cumsum(-1)
    init = {n: 0.3 * torch.randn(N, H, *program.state_shape(n), generator=gen, dtype=torch.float64)
            for n, _ in program.states}
    dv = output_size(program)
    grad_o = torch.randn(N, H, N_CHUNKS, C, dv, generator=gen, dtype=torch.float64) * valid
    grad_final = {n: torch.randn(N, H, *program.state_shape(n), generator=gen, dtype=torch.float64)
                  for n, _ in program.states}
    return tiles, lam, init, grad_o, grad_final


def _autograd(program, tiles, lam, init, grad_o, grad_final):
    leaves = {f"x_{k}": v.clone().requires_grad_() for k, v in tiles.items()}
    leaves |= {f"s_{k}": v.clone().requires_grad_() for k, v in init.items()}
    if lam is not None:
        leaves["lam"] = lam.clone().requires_grad_()
    toks = {k: leaves[f"x_{k}"] for k in tiles}
    lam_ = leaves.get("lam")
    starts, final = chunk_torch.state_pass(program, toks, lam_, {k: leaves[f"s_{k}"] for k in init},
                                           torch.float64)
    o = chunk_torch.outputs(program, "output", toks, lam_, starts, torch.float64)
    if program.normalizer:
        den = chunk_torch.outputs(program, "normalizer", toks, lam_, starts, torch.float64)
        o = o / (den.unsqueeze(-1) + program.algebra.eps)
    loss = (o * grad_o).sum() + sum((final[k] * grad_final[k]).sum() for k in final)
    names = list(leaves)
    got = torch.autograd.grad(loss, [leaves[n] for n in names], allow_unused=True)
    return {n: (torch.zeros_like(leaves[n]) if g is None else g) for n, g in zip(names, got)}


def _rel(a, b):
    scale = b.norm().item()
    return (a - b).norm().item() / scale if scale > 0 else (a - b).norm().item()


@pytest.mark.parametrize("name,params", SPECS, ids=[f"{n}{p}" for n, p in SPECS])
@pytest.mark.parametrize("gated", [False, True])
@pytest.mark.parametrize("normalize", [False, True])
def test_backward_equals_autograd(name, params, gated, normalize, tmp_path_factory):
    alg = _algebra(name, params, normalize, tmp_path_factory)
    sizes = SIZES if params.get("p", 2) < 3 else (("d", 4), ("dv", 3))
    program = chunk_program(alg, C, sizes, gated)
    tiles, lam, init, grad_o, grad_final = _inputs(program, gated, seed=len(name) + 7 * gated)
    ref = _autograd(program, tiles, lam, init, grad_o, grad_final)
    d_tiles, d_lam, d_init = backward_torch(program, tiles, lam, init, grad_o, grad_final,
                                            alg.eps)
    for x in tiles:
        assert _rel(d_tiles[x], ref[f"x_{x}"]) <= 1e-9, x
    for s in init:
        assert _rel(d_init[s], ref[f"s_{s}"]) <= 1e-9, s
    if gated:
        assert _rel(d_lam, ref["lam"]) <= 1e-9
    else:
        assert d_lam is None


def test_power_chain_rule_matches_autograd():
    gen = torch.Generator().manual_seed(3)
    x = torch.randn(2, 5, 4, generator=gen, dtype=torch.float64, requires_grad=True)
    env = chunk_torch.Env({"x": x}, None, {}, 5, torch.float64)
    for p in (2, 3):
        for weighted in (False, True):
            env._cache.clear()
            spow = env.power("x", "", p, weighted)
            ds = torch.randn(spow.shape, generator=gen, dtype=torch.float64)
            (ref,) = torch.autograd.grad(spow, x, ds)
            got = power_chain_rule(x.detach(), ds, p, weighted)
            assert _rel(got, ref) <= 1e-12


def test_backward_program_text_names_its_sources():
    alg = hladsl.compile_spec("hla2", normalize=True)
    program = chunk_program(alg, 64, (("d", 64), ("dv", 64)), True)
    bwd = backward_program(program)
    text = backward_text(bwd)
    assert "== reverse state pass ==" in text and "== gradient pass ==" in text
    for g in bwd.all_terms():
        assert g.term.source in text
    targets = {g.target for g in bwd.all_terms()}
    assert targets == {Target.TOKEN, Target.CARRY, Target.DERIVED, Target.LAM, Target.LAM_END}
    ungated = backward_program(chunk_program(alg, 64, (("d", 64), ("dv", 64)), False))
    assert not any(g.target in (Target.LAM, Target.LAM_END) for g in ungated.all_terms())


GPU_CASES = [("linear", {}), ("hla2", {}), ("ahla", {}), ("hla3", {}), ("hla3_masked", {}),
             ("power", {"p": 2})]


@pytest.mark.skipif(not torch.cuda.is_available() or os.environ.get("TRITON_INTERPRET") == "1",
                    reason="needs a GPU (the interpreter tests are tests/test_triton_backward.py)")
@pytest.mark.parametrize("name,params", GPU_CASES, ids=[n for n, _ in GPU_CASES])
@pytest.mark.parametrize("normalize", [False, True])
def test_gpu_backward_triton(name, params, normalize):
    """On the GPU at d = 64, C = 64: fp32 tiles (tf32x3) against the float64 torch
    backward to 1e-3 relative, bf16 tiles by RMS error ratio (DESIGN section 7)."""
    from hladsl.runtime.triton_backward import backward_triton
    alg = hladsl.compile_spec(name, normalize=normalize, **params)
    program = chunk_program(alg, 64, (("d", 64), ("dv", 64)), True)
    gen = torch.Generator().manual_seed(0)
    n, h, n_chunks, chunk = 2, 4, 8, 64
    tiles = {x: torch.randn(n, h, n_chunks, chunk, 64, generator=gen, dtype=torch.float64) * 0.3
             for x in alg.inputs}
    if normalize:
        tiles = {x: t.abs() for x, t in tiles.items()}
    tiles["q"] = tiles["q"] * 64 ** -0.5
    lam = (-0.1 * torch.rand(n, h, n_chunks, chunk, generator=gen, dtype=torch.float64)).cumsum(-1)
    init = {s: 0.1 * torch.randn(n, h, *program.state_shape(s), generator=gen,
                                 dtype=torch.float64).abs() for s, _ in program.states}
    grad_o = torch.randn(n, h, n_chunks, chunk, 64, generator=gen, dtype=torch.float64)
    grad_final = {s: torch.randn(x.shape, generator=gen, dtype=torch.float64) for s, x in init.items()}

    def on(d, dtype):
        return {k: v.to("cuda", dtype) for k, v in d.items()}
    for dtype in (torch.float32, torch.bfloat16):
        # the reference sees the tiles as the kernels do (rounded to bf16): what is
        # left is the kernels' own error
        seen = {k: v.to(dtype).double() for k, v in tiles.items()}
        ref = backward_torch(program, seen, lam, init, grad_o.to(dtype).double(), grad_final, alg.eps)
        got = backward_triton(program, on(tiles, dtype), lam.float().cuda(), on(init, torch.float32),
                              grad_o.to("cuda", dtype), on(grad_final, torch.float32), alg.eps)
        if dtype == torch.float32:
            def close(a, b):
                return _rel(a.double().cpu(), b) <= 1e-3
        else:
            def close(a, b):
                return _rms_ratio(a, b) <= 1e-2
        for x in tiles:
            assert close(got[0][x], ref[0][x]), (dtype, x)
        assert close(got[1], ref[1]), (dtype, "lam")
        for s in init:
            assert close(got[2][s], ref[2][s]), (dtype, s)


def _rms_ratio(out, ref):
    out, ref = out.double().cpu(), ref.double()
    return ((out - ref).pow(2).mean().sqrt() / ref.pow(2).mean().sqrt().clamp_min(1e-300)).item()


@pytest.mark.parametrize("name", ["hla2", "power"])
def test_op_level_gradients_through_the_tiling(name):
    """The wiring the op needs, end to end in float64: tokens [B, T, H, d] padded and
    tiled as Op._forward_chunked does, backward_torch, d tiles untiled, dΛ -> dg by
    gate_grad; equal to autograd through the op's torch path (T not a multiple of C)."""
    from hladsl.runtime.backward_torch import gate_grad
    from hladsl.runtime.packing import pack, unpack
    op = hladsl.load(name, normalize=True)
    op.chunk_size = 16
    B, T, Hh, d, dv, scale = 2, 37, 2, 4, 3, 0.5
    gen = torch.Generator().manual_seed(11)
    q, k = (torch.randn(B, T, Hh, d, generator=gen, dtype=torch.float64).abs() for _ in range(2))
    v = torch.randn(B, T, Hh, dv, generator=gen, dtype=torch.float64).abs()
    g = -0.3 * torch.rand(B, T, Hh, generator=gen, dtype=torch.float64)
    shapes = op.state_shapes(d, dv)
    init = {s: 0.2 * torch.rand(B, Hh, *shapes[s], generator=gen, dtype=torch.float64) for s in shapes}
    grad_o = torch.randn(B, T, Hh, dv, generator=gen, dtype=torch.float64)
    grad_final = {s: torch.randn(B, Hh, *shapes[s], generator=gen, dtype=torch.float64) for s in shapes}

    leaves = [x.clone().requires_grad_() for x in (q, k, v, g)]
    init_leaves = {s: x.clone().requires_grad_() for s, x in init.items()}
    o, final = op(*leaves[:3], g=leaves[3], scale=scale, initial_state=init_leaves,
                  output_final_state=True)
    loss = (o * grad_o).sum() + sum((final[s] * grad_final[s]).sum() for s in final)
    ref = torch.autograd.grad(loss, leaves + list(init_leaves.values()))

    # the op's layout: pad T to chunks, [B, T, H, x] -> [B, H, nC, C, x]; lam = in-chunk cumsum
    alg, C = op.algebra, 16
    n_chunks = -(-T // C)
    pad = n_chunks * C - T
    dims = {"d": d, "dv": dv}
    program = chunk_program(alg, C, tuple(sorted(dims.items())), True)

    def tile(x):
        x = torch.nn.functional.pad(x, (0, 0, 0, 0, 0, pad))
        return x.reshape(B, n_chunks, C, Hh, -1).permute(0, 3, 1, 2, 4)

    def untile(x):
        return x.permute(0, 2, 3, 1, 4).reshape(B, n_chunks * C, Hh, -1)[:, :T]
    tiles = {"q": tile(q * scale), "k": tile(k), "v": tile(v)}
    lam = torch.nn.functional.pad(g, (0, 0, 0, pad)).reshape(B, n_chunks, C, Hh).permute(0, 3, 1, 2)
    lam = lam.cumsum(-1)
    summaries = {s.name: s for s in alg.streaming}

    # the op unpacks an initial state the program holds unpacked and packs its final
    # state: the cotangent of a packed final goes through pack's transpose, the
    # initial state's gradient through unpack's transpose (both by autograd here)
    def held(name, x):
        return x if program.is_packed(name) else unpack(summaries[name], x, dims)

    def final_cotangent(name, ct):
        if program.is_packed(name):
            return ct
        full = unpack(summaries[name], init[name], dims).requires_grad_()
        return torch.autograd.grad(pack(summaries[name], full, dims), full, ct)[0]

    def init_gradient(name, grad):
        if program.is_packed(name):
            return grad
        packed = init[name].clone().requires_grad_()
        return torch.autograd.grad(unpack(summaries[name], packed, dims), packed, grad)[0]
    d_tiles, d_lam, d_init = backward_torch(
        program, tiles, lam, {s: held(s, x) for s, x in init.items()}, tile(grad_o),
        {s: final_cotangent(s, x) for s, x in grad_final.items()}, alg.eps)
    dg = gate_grad(d_lam).permute(0, 2, 3, 1).reshape(B, n_chunks * C, Hh)[:, :T]
    got = [untile(d_tiles["q"]) * scale, untile(d_tiles["k"]), untile(d_tiles["v"]), dg]
    got += [init_gradient(s, x) for s, x in d_init.items()]
    names = ["q", "k", "v", "g"] + list(d_init)
    for what, a, b in zip(names, got, ref):
        assert _rel(a, b) <= 1e-9, what


def test_bad_tensors_name_the_argument():
    alg = hladsl.compile_spec("hla2")
    program = chunk_program(alg, C, SIZES, True)
    tiles, lam, init, grad_o, grad_final = _inputs(program, True, seed=0)
    cases = [
        ({"tiles": {k: v for k, v in tiles.items() if k != "k"}}, "tiles: missing input"),
        ({"tiles": {**tiles, "v": tiles["v"][..., :2]}}, r"tiles\['v'\]"),
        ({"lam": None}, "lam must be given"),
        ({"lam": lam[..., :3]}, "lam: expected"),
        ({"grad_o": grad_o[..., :2]}, "grad_o: expected"),
        ({"init_states": {k: v for k, v in init.items() if k != "G"}}, r"init_states\['G'\]: .*missing"),
        ({"grad_final": {**grad_final, "S": grad_final["S"][..., :2]}}, r"grad_final\['S'\]"),
    ]
    good = {"tiles": tiles, "lam": lam, "init_states": init, "grad_o": grad_o, "grad_final": grad_final}
    for change, message in cases:
        args = {**good, **change}
        with pytest.raises(ValueError, match=message):
            backward_torch(program, args["tiles"], args["lam"], args["init_states"], args["grad_o"],
                           args["grad_final"], alg.eps)
