"""``benchmarks/proto_window.py``, the windowed hybrid prototype of power p = 2's forward whose GPU
times RESULTS.md round 47 records: its kernels (gathered and row-tiled) under the Triton
interpreter against the op, so the numbers stay numbers of a correct computation."""
import os

os.environ["TRITON_INTERPRET"] = "1"   # before any kernel module is generated

import sys  # noqa: E402
from pathlib import Path  # noqa: E402

import pytest  # noqa: E402
import torch  # noqa: E402

import hladsl  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
import proto_window  # noqa: E402


@pytest.mark.parametrize("rows", [False, True, "paired", "sliced"],
                         ids=["gathered", "row-tiles", "paired-row-tiles", "sliced-output"])
@pytest.mark.parametrize("W", [16, 32])
def test_the_windowed_prototype_matches_the_op(rows, W):
    op = hladsl.load("power", p=2)
    gen = torch.Generator().manual_seed(3)
    B, T, H, d = 1, 64, 2, 16
    q, k = (torch.randn(B, T, H, d, generator=gen) * d ** -0.5 for _ in range(2))
    v = torch.randn(B, T, H, d, generator=gen)
    g = -0.05 * torch.rand(B, T, H, generator=gen)
    want = op(q, k, v, g=g, scale=1.0)[0]
    got = proto_window.windowed(op, q, k, v, g, W, R=16, BA={"paired": 8, "sliced": 4}.get(rows, 16), rows=bool(rows),
                                paired=rows in ("paired", "sliced"), C=16, sliced=rows == "sliced")
    assert ((got - want).norm() / want.norm()).item() < 1e-5
