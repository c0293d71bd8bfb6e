"""The cost model (``hladsl compile SPEC --emit cost``) against counts done by hand."""
import pytest

from hladsl.api import compile_spec
from hladsl.emit import emit
from hladsl.ir.cost import kernel_costs
from hladsl.ir.pipeline import Target


def test_linear_costs_by_hand():
    C, d, dv = 16, 8, 4
    c = compile_spec("linear", target=Target(C, (("d", d), ("dv", dv)), gated=False))
    state, output = kernel_costs(c.program, token_bytes=2)
    # state pass: S += Kᵀ V; output: q S_P + ((Q Kᵀ) ⊙ L) V
    assert state.flops_per_token == 2 * (C * d * dv) / C
    assert output.flops_per_token == 2 * (C * d * dv + C * C * d + C * C + C * C * dv) / C
    # reads k, v (bf16) and writes S (fp32); reads q, k, v and S, writes o (bf16)
    assert state.bytes_per_token == (C * (d + dv) * 2 + d * dv * 4) / C
    assert output.bytes_per_token == (C * (2 * d + dv) * 2 + d * dv * 4 + C * dv * 2) / C


@pytest.mark.parametrize("name", ["hla2", "power"])
def test_cost_rows_cover_forward_and_backward(name):
    c = compile_spec(name, target=Target(64, (("d", 64), ("dv", 64)), True))
    rows = kernel_costs(c.program, c.backward)
    assert [r.kernel for r in rows] == ["state_pass", "output", "reverse", "gradient"]
    assert all(r.flops_per_token > 0 and r.bytes_per_token > 0 for r in rows)


def test_emit_cost_takes_sizes_and_chunk():
    small = emit("hla2", "cost", {}, None, {"d": 32, "dv": 32}, 32)
    assert "C = 32, d = 32, dv = 32" in small and "fwd + bwd" in small
    big = emit("hla2", "cost", {}, None, {"d": 128, "dv": 128}, 64)

    def forward_flops(text):
        (line,) = [x for x in text.splitlines() if x.startswith("forward")]
        return float(line.split()[1])
    assert forward_flops(big) > 4 * forward_flops(small)   # d³ terms per token grow 8×
