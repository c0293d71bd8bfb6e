"""Generated Triton chunk kernels under the Triton interpreter (CPU, float32)
against the torch chunk program (float64), plus golden sources and the cache.

HLADSL_UPDATE_GOLDEN=1 rewrites tests/golden/codegen/*.py from the generator."""
import os

os.environ["TRITON_INTERPRET"] = "1"   # before triton is imported anywhere

import importlib  # noqa: E402
from pathlib import Path  # noqa: E402

import pytest  # noqa: E402
import torch  # noqa: E402

import hladsl  # noqa: E402
from hladsl.frontend.specs import shipped_names  # noqa: E402
from hladsl.ir.pipeline import chunk_program  # noqa: E402
from hladsl.runtime import chunk_torch  # noqa: E402

GOLDEN = Path(__file__).parent / "golden" / "codegen"

# a first-order variant that is not shipped: an extra query-value summary and a
# parameter, read by both the output and the normalizer
MIXED_SPEC = """
mechanism linear_mix {
  dims d, dv
  input q[d], k[d], v[dv]
  param normalize = false, eps = 1e-6, beta = 0.5
  state S[i, e] = k[i] v[e]
  state Q[i, e] = q[i] v[e]
  state z[i] = k[i]
  state y[i] = q[i]
  output o[e] = q[i] (S[i, e] - beta Q[i, e])
  normalizer = q[i] (z[i] + beta y[i])
}
"""


@pytest.fixture(autouse=True)
def _cache_dir(tmp_path_factory, monkeypatch):
    monkeypatch.setenv("HLADSL_CACHE_DIR", str(tmp_path_factory.getbasetemp() / "hladsl-cache"))


def _rms_ratio(ref, out):
    ref, out = ref.double(), out.double()
    return ((ref - out).pow(2).mean().sqrt() / ref.pow(2).mean().sqrt().clamp_min(1e-300)).item()


def _inputs(alg, gated, dims, normalize, n=1, h=2, chunk=16, n_chunks=3, seed=0):
    """Token tiles as Op._forward makes them (strided views of [N, T, H, dim]), lam,
    and initial states reached by running a random prefix (so normalizers stay > 0)."""
    gen = torch.Generator().manual_seed(seed)
    t = chunk * n_chunks

    def tokens(length):
        out = {}
        for name, dim in alg.inputs.items():
            x = torch.randn(n, length, h, dims[dim], generator=gen, dtype=torch.float64) * 0.5
            x = x.abs() if normalize else x
            out[name] = x.reshape(n, length // chunk, chunk, h, -1).permute(0, 3, 1, 2, 4)
        lam = None
        if gated:
            g = -torch.rand(n, h, length // chunk, chunk, generator=gen, dtype=torch.float64) * 0.3
            lam = g.cumsum(-1)
        return out, lam

    program = chunk_program(alg, chunk, tuple(sorted(dims.items())), gated)
    zeros = {s.name: torch.zeros((n, h) + program.state_shape(s.name), dtype=torch.float64)
             for s in alg.streaming}
    prefix, prefix_lam = tokens(chunk)
    _, init = chunk_torch.state_pass(program, prefix, prefix_lam, zeros, torch.float64)
    tiles, lam = tokens(t)
    return program, tiles, lam, init


def _check(alg, gated, dims, normalize, **options):
    from hladsl.runtime.triton_forward import forward_triton
    program, tiles, lam, init = _inputs(alg, gated, dims, normalize)
    starts, final = chunk_torch.state_pass(program, tiles, lam, init, torch.float64)
    ref = chunk_torch.outputs(program, "output", tiles, lam, starts, torch.float64)
    if alg.normalizer is not None:
        den = chunk_torch.outputs(program, "normalizer", tiles, lam, starts, torch.float64)
        ref = ref / (den.unsqueeze(-1) + alg.eps)
    o, fin = forward_triton(program, {k: v.float() for k, v in tiles.items()},
                            None if lam is None else lam.float(),
                            {k: v.float() for k, v in init.items()}, alg.eps, **options)
    assert o.dtype == torch.float32 and o.shape == ref.shape
    assert _rms_ratio(ref, o) <= 1e-5, "output"
    assert set(fin) == set(final)
    for name in final:
        assert _rms_ratio(final[name], fin[name]) <= 1e-5, f"final state {name}"


@pytest.mark.parametrize("gated", [True, False], ids=["gated", "ungated"])
@pytest.mark.parametrize("normalize", [False, True], ids=["raw", "normalized"])
@pytest.mark.parametrize("name", shipped_names())
def test_shipped_specs_match_chunk_torch(name, normalize, gated):
    # d = 6 and dv = 8 are padded to the 16-wide blocks: masked loads and stores
    _check(hladsl.compile_spec(name, normalize=normalize), gated, {"d": 6, "dv": 8}, normalize,
           schedule="two_pass")


@pytest.mark.parametrize("params", [{"p": 3}, {"ridge": 0.5}], ids=["power-p3", "hla2-ridge"])
def test_more_parameters(params):
    name = "power" if "p" in params else "hla2"
    dims = {"d": 4, "dv": 4} if name == "power" else {"d": 16, "dv": 16}
    _check(hladsl.compile_spec(name, normalize=True, **params), True, dims, True)


@pytest.mark.parametrize("name", ["hla2", "hla3"])
def test_state_pass_split_over_value_blocks(name):
    # dv = 40 in blocks of 16: three state-pass programs per head, the last one masked
    _check(hladsl.compile_spec(name, normalize=True), True, {"d": 8, "dv": 40}, True,
           state_block=16, schedule="two_pass")


# linear with a value-only summary besides: a state without the key dim in a program whose
# state pass splits over it
KEY_SPLIT_SPEC = """
mechanism linear_with_values {
  dims d, dv
  input q[d], k[d], v[dv]
  param normalize = false, eps = 1e-6
  state S[i, e] = k[i] v[e]
  state u[e] = v[e]
  state z[i] = k[i]
  output o[e] = q[i] S[i, e] + q[i] z[i] u[e]
  normalizer = q[i] z[i]
}
"""


@pytest.mark.parametrize("schedule", ["two_pass", "scan", "fused"])
def test_state_pass_split_over_key_and_value_blocks(tmp_path, schedule):
    # S[i, e] keeps both dims free: the walk splits over dv (two blocks of 16) and d (three,
    # the last masked); z[i] has no dv, so dv-block 0 alone writes it, u[e] no d, so d-block 0;
    # the scan's delta kernel (grid nC, N*H, blocks: STATE_BLOCK splits it too) takes the six
    # blocks on one axis and unfolds them; the fused kernel splits over dv alone
    from hladsl.codegen.triton_gen import kernel_context
    from hladsl.runtime import launch
    path = tmp_path / "linear_with_values.hla"
    path.write_text(KEY_SPLIT_SPEC)
    alg = hladsl.compile_spec(str(path), normalize=True)
    sizes = (("d", 40), ("dv", 24))
    assert kernel_context(chunk_program(alg, 16, sizes, True))["splits"] == ["dv", "d"]
    assert kernel_context(chunk_program(hladsl.compile_spec("linear"), 16, sizes, True))["splits"] == ["dv", "d"]
    assert kernel_context(chunk_program(hladsl.compile_spec("hla2"), 16, sizes, True))["splits"] == ["dv"]   # S[i, j]
    with launch.switched(STATE_BLOCK=16):
        _check(alg, True, {"d": 40, "dv": 24}, True, schedule=schedule)


@pytest.mark.parametrize("gated", [True, False], ids=["gated", "ungated"])
@pytest.mark.parametrize("name", [n for n in shipped_names() if n != "power"])
def test_fused_schedule_matches_chunk_torch(name, gated):
    # one kernel walking the chunks with the states in registers; dv = 40 in blocks
    # of 16, so states without dv (S, m, ...) are written by block 0 only
    _check(hladsl.compile_spec(name, normalize=True), gated, {"d": 6, "dv": 40}, True,
           schedule="fused", state_block=16)


def test_packed_programs_have_no_fused_schedule():
    from hladsl.runtime.triton_forward import forward_triton
    program, tiles, lam, init = _inputs(hladsl.compile_spec("power"), True, {"d": 4, "dv": 4}, False)
    with pytest.raises(ValueError, match="no fused schedule"):
        forward_triton(program, tiles, lam, init, 1e-6, schedule="fused")


@pytest.mark.parametrize("p", [2, 3])
def test_packed_power_tiles_and_value_blocks(p):
    # power's U is held packed: d = 8 gives 36 (p = 2) or 120 (p = 3) packed rows, in
    # tiles of 16 (the last one masked) both in the state-pass grid and in the
    # output kernel's loop; dv = 24 in blocks of 16; z has no dv, so only dv-block 0
    # writes it
    alg = hladsl.compile_spec("power", normalize=True, p=p)
    program = chunk_program(alg, 16, (("d", 8), ("dv", 24)), True)
    assert program.is_packed("U") and program.is_packed("z")
    _check(alg, True, {"d": 8, "dv": 24}, True, state_block=16, packed_block=16)


@pytest.mark.parametrize("gated", [True, False], ids=["gated", "ungated"])
@pytest.mark.parametrize("normalize", [False, True], ids=["raw", "normalized"])
def test_unshipped_spec_compiles_and_matches(tmp_path, normalize, gated):
    path = tmp_path / "linear_mix.hla"
    path.write_text(MIXED_SPEC)
    _check(hladsl.compile_spec(str(path), normalize=normalize), gated, {"d": 8, "dv": 8},
           normalize)


# -- generated source ------------------------------------------------------------------------

def _golden_source(name):
    from hladsl.codegen.triton_gen import generate
    return generate(chunk_program(hladsl.compile_spec(name), 64, (("d", 64), ("dv", 64)), True))


@pytest.mark.parametrize("name", ["hla2", "ahla"])
def test_golden_source(name):
    path = GOLDEN / f"{name}.py"
    source = _golden_source(name)
    if os.environ.get("HLADSL_UPDATE_GOLDEN") == "1":
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(source)
    assert path.read_text() == source, f"regenerate with HLADSL_UPDATE_GOLDEN=1 and review {path}"


def test_generated_source_is_commented_and_compiles():
    source = _golden_source("hla2")
    compile(source, "hla2.py", "exec")
    assert "# [Tt,Tn0] = in_q[Tt,_0] · in_k[Tn0,_0]   (matmul over _0)" in source
    assert "q_t[_0] q_n1[_1] v_n1[e] k_n0[_0] k_n0[_1]" in source     # a term's equation
    assert "_dot(" in source and "tl.trans(" in source


def test_bad_identifiers_are_rejected():
    from hladsl.codegen.triton_gen import _ident
    for bad in ["x\ny", "1a", "a-b", "", "_x", "a b"]:
        with pytest.raises(ValueError):
            _ident("summary", bad)
    assert _ident("summary", "S_2") == "S_2"


# -- cache -----------------------------------------------------------------------------------

def test_cache_writes_reuses_and_regenerates(tmp_path, monkeypatch, capsys):
    from hladsl.codegen import cache
    monkeypatch.setenv("HLADSL_CACHE_DIR", str(tmp_path))
    monkeypatch.setattr(cache, "_LOADED", {})
    renders = []

    def render():
        renders.append(1)
        return "import triton\nVALUE = 42\n"

    key = cache.cache_key({"program": "demo"}, "template text")
    assert key != cache.cache_key({"program": "demo2"}, "template text")
    assert key != cache.cache_key({"program": "demo"}, "other template")
    module = cache.load_module("demo", key, render)
    assert module.VALUE == 42 and len(renders) == 1
    (entry,) = (tmp_path / "modules").glob("demo_*.py")
    assert module.__file__ == str(entry)
    assert not list((tmp_path / "modules").glob("*.tmp"))

    monkeypatch.setattr(cache, "_LOADED", {})           # a new process: served from disk
    assert cache.load_module("demo", key, render).VALUE == 42 and len(renders) == 1

    for corrupt in ["VALUE = (\n", entry.read_text()[:20]]:   # unimportable; truncated
        entry.write_text(corrupt)
        monkeypatch.setattr(cache, "_LOADED", {})
        assert cache.load_module("demo", key, render).VALUE == 42
    assert len(renders) == 3

    monkeypatch.setenv("HLADSL_PRINT_CODE", "1")
    monkeypatch.setattr(cache, "_LOADED", {})
    cache.load_module("demo", key, render)
    assert "VALUE = 42" in capsys.readouterr().out


def test_kernels_module_is_importable_from_cache(tmp_path, monkeypatch):
    from hladsl.codegen import cache, triton_gen
    monkeypatch.setenv("HLADSL_CACHE_DIR", str(tmp_path))
    monkeypatch.setattr(cache, "_LOADED", {})
    program = chunk_program(hladsl.compile_spec("linear"), 16, (("d", 8), ("dv", 8)), False)
    monkeypatch.setattr(triton_gen, "_MODULES", {})
    module, context = triton_gen.kernels(program)
    assert Path(module.__file__).parent == tmp_path / "modules"
    assert hasattr(module, "state_pass_kernel") and hasattr(module, "output_kernel")
    assert importlib.import_module(module.__name__) is module
    assert not context["gated"] and "lam_ptr" not in Path(module.__file__).read_text()
