"""Accuracy of each Triton schedule, forward and backward, against the fp32 torch backend:
RMS error ratios of o, the final states and every gradient (q, k, v, g), same inputs for all
schedules, so a schedule's precision can be compared with the others' (e.g. the chunk-parallel
"scan" against the walking "two_pass").

    python benchmarks/schedule_check.py [--specs hla2 hla2:normalize=true ahla] [--schedules two_pass scan]
        [--T 2048] [--B 1] [--H 4] [--d 64] [--dtype bf16] [--positive] [--json out.json]

--positive: q and k positive and small (|x| / 8 + 0.05), as a normalised spec wants them; the
default draws them as hladsl bench does. Gates: -0.05 * U(0, 1) per token (slow decay). On a
machine without CUDA it runs the generated kernels under the Triton interpreter at the given
(small) shapes: ``TRITON_INTERPRET=1 python benchmarks/schedule_check.py --T 40 --d 8 --dtype fp32``.
"""
from __future__ import annotations

import argparse
import json
import os

import torch

import hladsl
from hladsl.bench import parse_spec

DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}


def rms_ratio(got: torch.Tensor, want: torch.Tensor) -> float:
    got, want = got.double(), want.double()
    return ((got - want).pow(2).mean().sqrt() / want.pow(2).mean().sqrt()).item()


def run(op, tokens, g, weights, dtype):
    """(o, final states, grads of tokens and g) of one call whose loss weighs o and the states."""
    leaves = [x.to(dtype).requires_grad_() for x in tokens]
    gate = g.clone().requires_grad_()
    o, final = op(*leaves, g=gate, output_final_state=True)
    loss = (o.double() * weights["o"]).sum() + sum((final[n].double() * weights[n]).sum() for n in final)
    grads = torch.autograd.grad(loss, leaves + [gate])
    return o, final, dict(zip([*op.inputs, "g"], grads))


def check(spec: str, schedules, B, T, H, d, dtype, positive, device, chunk):
    name, params = parse_spec(spec)
    ref = hladsl.load(name, backend="torch", chunk_size=chunk, **params)
    op = hladsl.load(name, backend="triton", chunk_size=chunk, **params)
    gen = torch.Generator(device=device).manual_seed(0)
    tokens = []
    for x in ref.inputs:
        t = torch.randn(B, T, H, d, device=device, generator=gen)
        if positive:
            t = t.abs() / 8 + 0.05
        elif ref.algebra.inputs[x] != ref.out_dim and x not in ref.queries:
            t = t / d ** 0.5
        tokens.append(t)
    g = -0.05 * torch.rand(B, T, H, device=device, generator=gen)
    shapes = ref.state_shapes(**{dim: d for dim in ref.algebra.dims})
    weights = {"o": torch.randn(B, T, H, d, device=device, generator=gen, dtype=torch.float64)}
    weights.update({n: torch.randn((B, H) + s, device=device, generator=gen, dtype=torch.float64)
                    for n, s in shapes.items()})
    want_o, want_f, want_g = run(ref, tokens, g, weights, torch.float32)
    rows = []
    for schedule in schedules:
        row = {"spec": spec, "schedule": schedule, "B": B, "T": T, "H": H, "d": d,
               "dtype": str(dtype).replace("torch.", ""), "positive": positive}
        op.schedule = schedule
        try:
            o, final, grads = run(op, tokens, g, weights, dtype)
            row["o"] = rms_ratio(o, want_o)
            row["states"] = max(rms_ratio(final[n], want_f[n]) for n in want_f)
            row.update({f"d{x}": rms_ratio(grads[x], want_g[x]) for x in want_g})
        except Exception as exc:   # report it and go on: one failure must not hide the rest
            row["error"] = f"{type(exc).__name__}: {str(exc)[:300]}"
        finally:
            op.schedule = "auto"
        rows.append(row)
        print(json.dumps(row), flush=True)
    return rows


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--specs", nargs="+", default=["hla2", "hla2:normalize=true", "ahla"])
    parser.add_argument("--schedules", nargs="+", default=["two_pass", "scan"])
    parser.add_argument("--B", type=int, default=1)
    parser.add_argument("--T", type=int, default=2048)
    parser.add_argument("--H", type=int, default=4)
    parser.add_argument("--d", type=int, default=64)
    parser.add_argument("--chunk", type=int, default=64)
    parser.add_argument("--dtype", choices=sorted(DTYPES), default="bf16")
    parser.add_argument("--positive", action="store_true")
    parser.add_argument("--json", default="")
    args = parser.parse_args(argv)
    device = "cuda" if torch.cuda.is_available() else "cpu"
    if device == "cpu" and os.environ.get("TRITON_INTERPRET") != "1":
        parser.error("without CUDA, set TRITON_INTERPRET=1 (the generated kernels run in the interpreter)")
    rows = []
    for spec in args.specs:
        rows += check(spec, args.schedules, args.B, args.T, args.H, args.d, DTYPES[args.dtype],
                      args.positive, device, args.chunk)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=1)


if __name__ == "__main__":
    main()
