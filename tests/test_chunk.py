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
    from hladsl.ir.chunk import chunk_program
    alg = hladsl.compile_spec("hla3", normalize=True)
    prog = chunk_program(alg, 64, (("d", 64), ("dv", 64)), True)
    terms = prog.output + prog.normalizer + tuple(t for _, ts in prog.states for t in ts)
    for term in terms:
        assert all(len(o.indices) <= 2 for o in term.operands if o.kind == "carry")
        assert all(len(s.indices) <= 2 for s in term.plan.steps), term.source
    assert {n for n, _ in prog.states} == {"SK", "SQ", "P", "m", "G1", "G2", "G3", "h1", "h2", "h3"}
