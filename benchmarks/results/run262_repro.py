"""Round 39, run 262: the fp32 faults of runs 260-261 (fp32 inputs, B = 1, T = 1024, H = 2, as
tests/gpu/fp32_worker.py) with every launch recorded: the launches with fp32 dot tiles at 8
warps (kernel, precision, tiles), and the last launch where the call fails.
    python3 run262_repro.py SPEC GATED(0/1)     (HLADSL_LAUNCH="NAME=VALUE ...": launch changes)"""
import os
import sys

import torch
import triton.language as tl

import gpu_support as gs
from hladsl.runtime import direct

spec, gated = gs.BY_ID[sys.argv[1]], sys.argv[2] == "1"
last, wide = [], {}
call, cached = direct.call, direct.cached


def note(kernel, grid, args):
    name = getattr(getattr(kernel, "fn", kernel), "__name__", str(kernel))
    shown = {k: v for k, v in args.items() if k.isupper() or k.startswith(("B_", "num_"))}
    last[:] = [f"{name} grid={tuple(grid)} {shown}"]
    if args.get("num_warps") == 8 and tl.float32 in (args.get("DOT"), args.get("SDOT")):
        tiles = {k: v for k, v in args.items() if (k == "C" or k.startswith("B_")) and type(v) is int}
        wide[(name, str(args.get("PREC")), args.get("PART"), tuple(sorted(tiles.items())))] = True


def recorded(kernel, grid, args, key_args=None):
    note(kernel, grid, args)
    return call(kernel, grid, args, key_args)


def recorded_cached(kernel, grid, args):
    note(kernel, grid, args)
    return cached(kernel, grid, args)


direct.call, direct.cached = recorded, recorded_cached
B, T, H = 1, 1024, 2
gen = gs.generator(0)
tokens = gs.tokens(spec, B, T, H, spec.d, spec.d, torch.float32, False, gen)
leaves = {n: x.requires_grad_() for n, x in tokens.items()}
if gated:
    leaves["g"] = gs.gates(B, T, H, gen).float().requires_grad_()
label = f"{spec.id} gated={gated} {os.environ.get('HLADSL_LAUNCH', '')}"
try:
    o = gs.load(spec, "auto")(*(leaves[n] for n in tokens), g=leaves.get("g"))[0]
    o.backward(torch.randn_like(o))
    torch.cuda.synchronize()
    print(f"{label}: OK |dq| {next(iter(leaves.values())).grad.norm():.4g}")
except Exception as exc:
    print(f"{label}: FAILED {type(exc).__name__}: {str(exc)[:160]}")
    print("  last launch:", last[0][:700] if last else None)
for name, prec, part, tiles in wide:
    print(f"  8 warps, fp32 dots: {name} part {part} {prec} {dict(tiles)}")
