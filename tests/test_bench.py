"""``hladsl bench`` on the CPU: the table, the JSON and the PNG (no plotting library
needed: hladsl.plot falls back to its own PNG writer)."""
from __future__ import annotations

import json
import struct
import zlib

import torch

from hladsl.bench import FwdBwd, parse_spec, time_ms
from hladsl.cli import main


def read_png(path):
    """(width, height, RGB rows) of an 8-bit RGB PNG with filter 0 rows (as written)."""
    with open(path, "rb") as f:
        data = f.read()
    assert data[:8] == b"\x89PNG\r\n\x1a\n"
    pos, chunks = 8, {}
    while pos < len(data):
        (length,) = struct.unpack(">I", data[pos:pos + 4])
        kind, body = data[pos + 4:pos + 8], data[pos + 8:pos + 8 + length]
        (crc,) = struct.unpack(">I", data[pos + 8 + length:pos + 12 + length])
        assert crc == zlib.crc32(kind + body) & 0xFFFFFFFF
        chunks[kind] = chunks.get(kind, b"") + body
        pos += 12 + length
    width, height = struct.unpack(">II", chunks[b"IHDR"][:8])
    return width, height, zlib.decompress(chunks[b"IDAT"]), chunks[b"IHDR"][8:10]


def test_bench_cpu_writes_table_json_and_png(tmp_path, capsys):
    out_json, out_png = tmp_path / "b.json", tmp_path / "b.png"
    rc = main(["bench", "--device", "cpu", "--quick", "--specs", "linear", "power:p=2",
               "--T", "16", "32", "--d", "8", "--modes", "fwd", "fwd+bwd", "step",
               "--json", str(out_json), "--plot", str(out_png)])
    assert rc == 0
    captured = capsys.readouterr()
    table = captured.out
    assert "ratio" in table.splitlines()[0]
    for what in ("sdpa causal", "hladsl linear", "hladsl power(p=2)"):
        assert what in table
    assert "[1/" in captured.err and "compiling" in captured.err   # progress on stderr

    result = json.loads(out_json.read_text())
    assert result["config"]["device"].startswith("cpu")
    assert result["config"]["versions"]["torch"] == torch.__version__
    rows = result["rows"]
    timed = [r for r in rows if "ms" in r]
    # sdpa and the two specs at 2 lengths x 3 modes; fla / retention skipped on the CPU
    assert len(timed) == 3 * 2 * 3
    assert all(r["ms"] > 0 and r["ratio"] > 0 for r in timed)
    assert all(r["ratio"] == 1.0 for r in timed if r["what"] == "sdpa causal")
    # the cost model's FLOPs over the time, for hladsl's own forward and fwd+bwd rows
    modelled = [r for r in timed if r["what"].startswith("hladsl") and r["mode"] != "step"]
    assert len(modelled) == 2 * 2 * 2 and all(r["tflops"] > 0 for r in modelled)
    assert "TFLOP/s" in table.splitlines()[0]
    assert {r["what"] for r in rows if "skipped" in r} == {"fla simple_gla", "retention p=2 gated"}

    width, height, raw, depth_colour = read_png(out_png)
    if depth_colour == b"\x08\x02":   # our writer: RGB rows, filter 0, check there are lines
        assert len(raw) == height * (1 + 3 * width)
        stride = 1 + 3 * width
        colours = {raw[y * stride + 1 + 3 * x:y * stride + 4 + 3 * x]
                   for y in range(0, height, 2) for x in range(0, width, 2)}
        assert len(colours) > 4
    assert width > 200 and height > 200


def test_bench_rejects_bad_spec_parameters(capsys):
    assert main(["bench", "--device", "cpu", "--specs", "power:p", "--json", "", "--plot", ""]) == 1
    assert "key=value" in capsys.readouterr().err
    assert main(["bench", "--device", "cpu", "--specs", "nosuchspec", "--json", "", "--plot", ""]) == 1
    assert "nosuchspec" in capsys.readouterr().err
    assert parse_spec("power:p=3,normalize=true") == ("power", {"p": 3, "normalize": True})


def test_bench_times_launch_switches_side_by_side(tmp_path, capsys):
    """--launch NAME=VALUE: each spec timed with launch's defaults and with the switches
    (one process, an A/B); launch's constants are restored afterwards."""
    from hladsl.runtime import launch
    before = launch.REVERSE_IN_PLACE
    out_json = tmp_path / "b.json"
    rc = main(["bench", "--device", "cpu", "--quick", "--specs", "linear", "--baselines", "--T", "16",
               "--d", "8", "--modes", "fwd", "--launch", "REVERSE_IN_PLACE=false",
               "--launch", "REVERSE_IN_PLACE=false", "FORWARD_CHUNK=32", "--json", str(out_json), "--plot", ""])
    assert rc == 0
    whats = [r["what"] for r in json.loads(out_json.read_text())["rows"] if "ms" in r]
    assert whats == ["hladsl linear", "hladsl linear {REVERSE_IN_PLACE=False}",
                     "hladsl linear {REVERSE_IN_PLACE=False,FORWARD_CHUNK=32}"]
    assert launch.REVERSE_IN_PLACE is before and launch.FORWARD_CHUNK is None
    assert main(["bench", "--device", "cpu", "--launch", "NO_SUCH_RULE=1", "--json", "", "--plot", ""]) == 1
    assert "no launch rule constant 'NO_SUCH_RULE'" in capsys.readouterr().err
    assert main(["bench", "--device", "cpu", "--launch", "REVERSE_IN_PLACE=3", "--json", "", "--plot", ""]) == 1
    assert "launch.REVERSE_IN_PLACE is a bool, got 3" in capsys.readouterr().err


def test_launch_switch_checks_its_value_and_forgets_plans():
    from hladsl.runtime import launch
    cache = launch.plan_cache()
    cache["shape"] = object()
    old = launch.REVERSE_IN_PLACE
    with launch.switched(REVERSE_IN_PLACE=False):
        assert launch.REVERSE_IN_PLACE is False and not cache
    assert launch.REVERSE_IN_PLACE is old
    for bad in (("REVERSE_IN_PLACE", 3), ("TENSOR_CORE_DTYPES", True), ("reverse_in_place", True)):
        try:
            launch.switch(*bad)
        except ValueError as exc:
            assert bad[0] in str(exc)
        else:
            raise AssertionError(f"switch{bad} was accepted")


def test_fwd_bwd_harness_seeds_a_fixed_cotangent_and_resets_grads(tmp_path):
    """The default training-step harness: the backward from one fixed cotangent, the
    leaves' gradients reset before every timed call (no accumulating add is timed);
    --backward-seed sum keeps the old harness (a sum's backward, gradients accumulating)."""
    x = torch.randn(4, 3, requires_grad=True)
    step = FwdBwd(lambda: (x * 2, None), [x, None])
    step()
    first = x.grad.clone()
    assert torch.equal(first, 2 * step._cotangent) and step._cotangent.abs().sum() > 0
    time_ms(step, "cpu", True, "fwd+bwd")
    assert torch.equal(x.grad, first)   # reset before each call: one call's gradient
    step.seed = "sum"
    x.grad = None
    step()
    step()
    assert torch.equal(x.grad, torch.full_like(x, 4.0))
    out_json = tmp_path / "b.json"
    assert main(["bench", "--device", "cpu", "--quick", "--specs", "linear", "--baselines", "--T", "16",
                 "--d", "8", "--modes", "fwd+bwd", "--backward-seed", "sum", "--json", str(out_json),
                 "--plot", ""]) == 0
    assert [r["what"] for r in json.loads(out_json.read_text())["rows"] if "ms" in r] == ["hladsl linear"]
