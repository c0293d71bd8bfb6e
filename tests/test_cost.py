"""The cost model (``hladsl compile SPEC --emit cost``) against counts done by hand."""
import pytest

from hladsl.api import compile_spec
from hladsl.emit import emit
from hladsl.ir.cost import derived_macs, kernel_costs, scan_costs
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


def test_linear_scan_costs_by_hand():
    """The chunk scan's kernels (``scan_costs``): linear's delta kernel does the walk's token
    work (Kᵀ V) for every chunk at once and writes each chunk's ΔS; its scan only adds them,
    reading ΔS and writing S's start. No second stage: no upper state to split off."""
    C, d, dv = 16, 8, 4
    c = compile_spec("linear", target=Target(C, (("d", d), ("dv", dv)), gated=False))
    delta, scan = scan_costs(c.program, token_bytes=2)
    assert (delta.kernel, scan.kernel) == ("delta", "scan")
    assert delta.flops_per_token == 2 * (C * d * dv) / C
    assert delta.bytes_per_token == (C * (d + dv) * 2 + d * dv * 4) / C
    assert scan.flops_per_token == 0 and scan.bytes_per_token == 2 * d * dv * 4 / C
    assert scan_costs(c.program, two_stages=True) == []


@pytest.mark.parametrize("name", ["hla2", "ahla", "hla3_masked", "hla3"])
def test_two_stage_costs_do_the_walks_token_work(name):
    """In two stages (HLA3's own scan; the others' "staged" split) the delta and stage kernels
    compute every state-pass term over the tokens once, as the walking state pass does: their
    FLOPs add up to its; the sequential kernels do no products. A one-stage scan instead walks
    carried states x delta tiles (HLA2: d^3 MACs a chunk, 2 d^3 / C FLOPs a token)."""
    C, d = 64, 64
    c = compile_spec(name, target=Target(C, (("d", d), ("dv", d)), gated=True))
    walk = kernel_costs(c.program)[0].flops_per_token
    two = scan_costs(c.program, two_stages=name != "hla3")
    assert [r.kernel for r in two] == ["delta", "scan", "stage", "stage_scan"]
    assert two[0].flops_per_token + two[2].flops_per_token == walk
    assert two[1].flops_per_token == two[3].flops_per_token == 0
    one = scan_costs(c.program)
    if name == "hla3":   # its scan has two stages only
        assert one == two and scan_costs(c.program, two_stages=True) == []
    else:
        assert [r.kernel for r in one] == ["delta", "scan"]
    if name == "hla2":
        assert one[1].flops_per_token == 2 * d ** 3 / C


def test_emit_cost_prints_the_scan_schedules():
    text = emit("hla2", "cost", {}, None)
    assert "# the forward's state pass as a chunk scan (schedule \"scan\"): instead of state_pass" in text
    assert "# the same in two stages (schedule \"staged\"): instead of state_pass" in text
    assert "stage_scan" in text
    text = emit("hla3", "cost", {}, None)
    assert "as a chunk scan in two stages (schedule \"scan\")" in text and "\"staged\"" not in text
    assert "chunk scan" not in emit("power", "cost", {"p": 2}, None)


def test_scans_carrying_the_derived_carries():
    """HLA2's scans carry W0 by its recursion (``walked``, what the codegen decides; ``--emit
    cost`` asks it). In two stages the stage kernel's products are those of G's increment it
    replaces, the walk and the first stage move W0 and the starts read (S, not C); the output
    row forms no derived carry (its FLOPs less W0's contraction)."""
    C, d = 64, 64
    c = compile_spec("hla2", target=Target(C, (("d", d), ("dv", d)), gated=True))
    plain = scan_costs(c.program, two_stages=True)
    walk = scan_costs(c.program, two_stages=True, walked=("W0",))
    assert [r.kernel for r in walk] == ["delta", "scan", "stage", "stage_scan", "output"]
    assert walk[0] == plain[0] and walk[2].flops_per_token == plain[2].flops_per_token
    tile = d * d * 4   # S, C, G, W0: d x d fp32
    assert walk[1].bytes_per_token == (2 * tile + tile) / C                   # ΔS, ΔC read; S's starts written
    assert walk[2].bytes_per_token == (3 * C * d * 2 + 4 * C + 3 * tile) / C  # q, k, v, Λ; S start, ΔS; W0's increment
    assert walk[3].bytes_per_token == 2 * tile / C
    output = kernel_costs(c.program)[1]
    assert walk[4].flops_per_token == output.flops_per_token - 2 * derived_macs(c.program) / C == 2 * c.program.flops()["output"] / C
    # one stage (round 26's recursion): one product a chunk, S@N ΔC, for G's update; ΔS, ΔC, ΔG
    # read, S and W0 written
    one = scan_costs(c.program, walked=("W0",))
    assert [r.kernel for r in one] == ["delta", "scan", "output"] and one[2] == walk[4]
    assert one[1].flops_per_token == 2 * d ** 3 / C and one[1].bytes_per_token == 5 * tile / C
    text = emit("hla2", "cost", {}, None)
    assert "# the same in two stages (schedule \"staged\"): instead of state_pass and output" in text
    assert "every chunk's increment of W0 by its recursion" in text
    assert "writes the starts read and W0" in text


def test_the_derived_kernel_row():
    """HLA3's two-stage scan walks the states; ``derived_kernel`` then forms W0 at every chunk
    start (``derived_kernel``, what the codegen and launch.DERIVED_KERNEL decide; ``--emit
    cost`` asks them): W0's contraction moves from the output row to its own, which reads every
    state W0 reads and writes W0; the output row reads W0, not G1..G3."""
    C, d = 64, 64
    c = compile_spec("hla3", target=Target(C, (("d", d), ("dv", d)), gated=True))
    plain = scan_costs(c.program)
    rows = scan_costs(c.program, derived_kernel=True)
    assert [r.kernel for r in rows] == [r.kernel for r in plain] + ["derived", "output"]
    assert rows[:4] == plain
    tile = d * d * 4   # SK, SQ, P, G1..G3, W0: d x d fp32
    assert rows[4].flops_per_token == 2 * derived_macs(c.program) / C
    assert rows[4].bytes_per_token == (6 * tile + tile) / C
    output = kernel_costs(c.program)[1]
    assert rows[5].flops_per_token == output.flops_per_token - rows[4].flops_per_token
    assert rows[5].bytes_per_token == output.bytes_per_token - 3 * tile / C + tile / C
    assert "every chunk's W0 from the stored starts" in emit("hla3", "cost", {}, None)
    assert "forms it at every chunk start once both stages are done (derived_kernel)" in emit("hla3", "chunk", {}, None)
    assert "derived_kernel" not in emit("hla2", "chunk", {}, None)
