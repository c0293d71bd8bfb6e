"""The torch chunk program (the CPU path of the op) against the derived serial
recurrence, float64, across sequence lengths around chunk boundaries."""
import pytest
import torch

import hladsl
from hladsl.frontend.specs import shipped_names

LENGTHS = [1, 63, 64, 65, 200]
CHUNKS = [16, 32, 64]


def _inputs(T, gated, seed=0):
    gen = torch.Generator().manual_seed(seed)
    q, k = (torch.randn(1, T, 2, 4, generator=gen, dtype=torch.float64) for _ in range(2))
    v = torch.randn(1, T, 2, 3, generator=gen, dtype=torch.float64)
    g = -0.3 * torch.rand(1, T, 2, generator=gen, dtype=torch.float64) if gated else None
    return q, k, v, g


def _rel(a, b):
    """Relative error; an exactly zero reference (e.g. G after one token) must be matched exactly."""
    scale = b.norm().item()
    return (a - b).norm().item() / scale if scale > 0 else (a - b).norm().item()


@pytest.mark.parametrize("name", shipped_names())
@pytest.mark.parametrize("gated", [False, True])
@pytest.mark.parametrize("normalize", [False, True])
def test_chunk_program_equals_serial(name, gated, normalize):
    op = hladsl.load(name, normalize=normalize)
    for T in LENGTHS:
        q, k, v, g = _inputs(T, gated, seed=T)
        ref, ref_state = op.serial(q, k, v, g=g, scale=0.5)
        for chunk in CHUNKS:
            op.chunk_size = chunk
            out, state = op(q, k, v, g=g, scale=0.5, output_final_state=True)
            assert _rel(out, ref) <= 1e-9, (T, chunk)
            for key in ref_state:
                assert _rel(state[key], ref_state[key]) <= 1e-9, (T, chunk, key)


def test_hla3_chunk_program_has_no_segment_maps():
    """DESIGN section 4, erratum 4: no d^3 intermediates, no 4-index carries."""
    from hladsl.ir.pipeline import chunk_program
    alg = hladsl.compile_spec("hla3", normalize=True)
    prog = chunk_program(alg, 64, (("d", 64), ("dv", 64)), True)
    terms = prog.output + prog.normalizer + tuple(t for _, ts in prog.states for t in ts)
    for term in terms:
        assert all(len(o.indices) <= 2 for o in term.operands if o.kind == "carry")
        assert all(len(s.indices) <= 2 for s in term.plan.steps), term.source
    assert {n for n, _ in prog.states} == {"SK", "SQ", "P", "m", "G1", "G2", "G3", "h1", "h2", "h3"}


UNPACKABLE_POWER = """
mechanism power_mixed {
  dims d, dv
  input q[d], k[d], v[dv]
  state U[i, j, e] = k[i] k[j] v[e]  symmetric(i, j)
  output o[e] = q[i] q[j] U[i, j, e] + q[i] k[j] U[i, j, e]
}
"""


def test_symmetric_states_are_packed_where_every_use_allows():
    """power's U and z are held packed (2080 rows at d = 64), read through spow(q)
    with multiplicities and written through spow(k); HLA2's S (read as S C) is not."""
    from hladsl.ir.pipeline import chunk_program
    sizes = (("d", 64), ("dv", 64))
    power = chunk_program(hladsl.compile_spec("power", normalize=True), 64, sizes, True)
    assert power.state_shape("U") == (2080, 64) and power.state_shape("z") == (2080,)
    assert [(pd.base, pd.power, pd.size) for pd in power.packed] == [("d", 2, 2080)]
    powers = [o for t in power.output + power.normalizer + tuple(t for _, ts in power.states
                                                                    for t in ts)
              for o in t.operands if o.kind == "power"]
    assert {(o.name, o.weighted) for o in powers} == {("q", True), ("k", False)}
    assert max(s.flops for t in power.output for s in t.plan.steps) == 64 * 2080 * 64
    p3 = chunk_program(hladsl.compile_spec("power", p=3), 64, sizes, True)
    assert p3.state_shape("U") == (45760, 64)
    for name in ("hla2", "hla3", "hla3_masked"):
        prog = chunk_program(hladsl.compile_spec(name), 64, sizes, True)
        assert not prog.packed, name


def test_a_state_with_one_unpackable_use_stays_unpacked(tmp_path):
    # q_t[i] k_t[j] U[i,j,e] contracts the group with two different vectors
    path = tmp_path / "power_mixed.hla"
    path.write_text(UNPACKABLE_POWER)
    from hladsl.ir.pipeline import chunk_program
    prog = chunk_program(hladsl.compile_spec(str(path)), 16, (("d", 4), ("dv", 3)), True)
    assert not prog.packed and prog.state_shape("U") == (4, 4, 3)
    op = hladsl.load(str(path))
    q, k, v, g = _inputs(40, True)
    ref, ref_state = op.serial(q, k, v, g=g)
    out, state = op(q, k, v, g=g, output_final_state=True)
    assert _rel(out, ref) <= 1e-9 and state["U"].shape == (1, 2, 10, 3)
    assert _rel(state["U"], ref_state["U"]) <= 1e-9
