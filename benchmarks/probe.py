"""Probe one spec's kernels on the GPU under one launch variant (a debugging aid):

    CUDA_LAUNCH_BLOCKING=1 python benchmarks/probe.py hla3 128 state:DOT=fp32 chunk=32

Runs forward_triton on bf16 inputs (B=1, H=4, T=1024), synchronising after each
kernel, and prints the RMS error ratio against the fp32 torch chunk program."""
import json
import sys
import time

import torch
import triton.language as tl

import hladsl
from hladsl.runtime.triton_forward import forward_triton
from hladsl.ir.pipeline import chunk_program
from hladsl.runtime import chunk_torch

VALUES = {"fp32": tl.float32, "bf16": tl.bfloat16}


def main(name, d, *variant):
    options = {"state_options": {}, "output_options": {}}
    chunk = 64
    for item in variant:
        key, value = item.split("=")
        value = VALUES.get(value, value)
        value = int(value) if isinstance(value, str) and value.isdigit() else value
        if key == "chunk":
            chunk = value
        elif key.startswith("state:"):
            options["state_options"][key[6:]] = value
        elif key.startswith("output:"):
            options["output_options"][key[7:]] = value
        else:
            options[key] = value
    alg = hladsl.compile_spec(name)
    d = int(d)
    program = chunk_program(alg, chunk, (("d", d), ("dv", d)), False)
    gen = torch.Generator(device="cuda").manual_seed(0)
    n_chunks = 1024 // chunk
    tiles = {x: torch.randn(1, 4, n_chunks, chunk, d, device="cuda", generator=gen) / (d ** 0.5 if x == "k" else 1)
             for x in ("q", "k", "v")}
    init = {s.name: torch.zeros((1, 4) + program.state_shape(s.name), device="cuda")
            for s in alg.streaming}
    row = {"spec": name, "d": d, "variant": list(variant)}
    try:
        start = time.time()
        o, _ = forward_triton(program, {k: v.bfloat16() for k, v in tiles.items()}, None, init,
                              alg.eps, **options)
        torch.cuda.synchronize()
        row["s"] = round(time.time() - start, 1)
        tiles = {k: v.bfloat16().float() for k, v in tiles.items()}
        starts, _ = chunk_torch.state_pass(program, tiles, None, init, torch.float32)
        ref = chunk_torch.outputs(program, "output", tiles, None, starts, torch.float32)
        row["o_rms_ratio"] = ((ref - o).pow(2).mean().sqrt() / ref.pow(2).mean().sqrt()).item()
    except Exception as exc:
        import traceback
        row["error"] = f"{type(exc).__name__}: {str(exc)[:200]}"
        row["where"] = [f"{f.name}:{f.lineno}" for f in traceback.extract_tb(exc.__traceback__)
                        if "hladsl" in f.filename]
    print(json.dumps(row), flush=True)


if __name__ == "__main__":
    main(*sys.argv[1:])
