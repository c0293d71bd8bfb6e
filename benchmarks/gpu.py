"""GPU validation and timing of the generated kernels (run on an H100).

    python benchmarks/gpu.py check [SPECS [DIMS [VARIANTS [SCHEDULE]]]]
        # bf16 kernels vs the fp32 torch chunk program, e.g. check hla3 128 gated fused
    python benchmarks/gpu.py bench [NAMES]       # forward timings next to fla and SDPA
    python benchmarks/gpu.py schedules SPECS     # two-pass vs fused forward times

Timings use triton.testing.do_bench (median ms), all baselines in the same run.
"""
from __future__ import annotations

import json
import math
import os
import sys
import time
import traceback

import torch
import triton

import hladsl
from hladsl.runtime import launch

SPECS = [("linear", {}), ("hla2", {}), ("ahla", {}), ("hla3", {}), ("hla3_masked", {}),
         ("power", {"p": 2})]


def rms_ratio(ref, out):
    ref, out = ref.float(), out.float()
    return ((ref - out).pow(2).mean().sqrt() / ref.pow(2).mean().sqrt()).item()


def inputs(B, T, H, d, dv, dtype, gated, seed=0):
    gen = torch.Generator(device="cuda").manual_seed(seed)
    q = torch.randn(B, T, H, d, device="cuda", generator=gen).to(dtype)
    k = (torch.randn(B, T, H, d, device="cuda", generator=gen) / math.sqrt(d)).to(dtype)
    v = torch.randn(B, T, H, dv, device="cuda", generator=gen).to(dtype)
    g = (torch.nn.functional.logsigmoid(4 + torch.randn(B, T, H, device="cuda", generator=gen))
         if gated else None)
    return q, k, v, g


def check(names=None, dims=(64, 128), T=8192, B=1, H=4, variants=("ungated", "gated"),
          schedule="auto"):
    rows = []
    for name, params in SPECS:
        if names and name not in names:
            continue
        for d in dims:
            for gated, normalize in ((False, False), (True, True)):
                    if ("gated" if gated else "ungated") not in variants:
                        continue
                    op = hladsl.load(name, normalize=normalize,
                                     chunk_size=int(os.environ.get("HLADSL_CHECK_CHUNK", 64)), **params)
                    op.schedule = schedule
                    q, k, v, g = inputs(B, T, H, d, d, torch.bfloat16, gated)
                    if normalize:   # keep denominators away from zero
                        q, k = q.abs(), k.abs()
                    row = dict(spec=name, d=d, T=T, gated=gated, normalize=normalize,
                               schedule=schedule)
                    try:
                        start = time.time()
                        o, st = op(q, k, v, g=g, output_final_state=True)
                        torch.cuda.synchronize()
                        row["first_call_s"] = round(time.time() - start, 1)
                        row["chunk"] = sorted(set(launch._FITTING.values()))
                        op.backend = "torch"
                        ref, ref_st = op(q.float(), k.float(), v.float(), g=g,
                                         output_final_state=True)
                        row["o_rms_ratio"] = rms_ratio(ref, o)
                        row["state_rms_ratio"] = max(rms_ratio(ref_st[n], st[n]) for n in ref_st)
                        row["ok"] = row["o_rms_ratio"] <= 1e-2 and row["state_rms_ratio"] <= 1e-2
                        op.backend = "auto"
                        if not gated:     # gradients: Triton forward, torch-recompute backward
                            qq, kk, vv = (x[:, :1024].float().requires_grad_() for x in (q, k, v))
                            ref = torch.autograd.grad(op(qq, kk, vv)[0].pow(2).sum(), [qq, kk, vv])
                            op.backend = "torch"
                            got = torch.autograd.grad(op(qq, kk, vv)[0].pow(2).sum(), [qq, kk, vv])
                            row["grad_rms_ratio"] = max(rms_ratio(a, b) for a, b in zip(ref, got))
                    except Exception as exc:   # report and go on: one failure must not hide the rest
                        row["error"] = f"{type(exc).__name__}: {str(exc)[:300]}"
                        traceback.print_exc()
                    rows.append(row)
                    print(json.dumps(row), flush=True)
    return rows


def bench(Ts=(4096, 16384, 65536), B=2, H=16, d=64, names=None):
    from torch.nn.functional import scaled_dot_product_attention as sdpa
    rows = []

    def timed(label, T, fn, leaves=None):
        """forward alone, or with ``leaves`` a training step as ``hladsl bench`` times it"""
        from hladsl.bench import FwdBwd
        backward = leaves is not None
        try:
            if backward:
                step = FwdBwd(fn, leaves)
                ms = triton.testing.do_bench(step, warmup=25, rep=100, grad_to_none=step.leaves,
                                             return_mode="median")
            else:
                with torch.no_grad():
                    ms = triton.testing.do_bench(fn, warmup=25, rep=100, return_mode="median")
            row = dict(what=label, T=T, ms=round(ms, 3), mode="fwd+bwd" if backward else "fwd")
        except Exception as exc:
            row = dict(what=label, T=T, error=f"{type(exc).__name__}: {str(exc)[:200]}")
        rows.append(row)
        print(json.dumps(row), flush=True)

    for T in Ts:
        q, k, v, g = inputs(B, T, H, d, d, torch.bfloat16, gated=False)
        qt, kt, vt = (x.transpose(1, 2).contiguous() for x in (q, k, v))
        timed("sdpa flash causal", T, lambda: sdpa(qt, kt, vt, is_causal=True))
        try:
            from fla.ops.simple_gla import chunk_simple_gla
            timed("fla chunk_simple_gla (no gate)", T,
                  lambda: chunk_simple_gla(q, k, v, scale=d ** -0.5))
        except Exception as exc:
            print(json.dumps(dict(what="fla", error=str(exc)[:200])))
        for name, params in SPECS:
            if names and name not in names:
                continue
            op = hladsl.load(name, **params)
            timed(f"hladsl {name}", T, lambda: op(q, k, v))
            lg = torch.nn.functional.logsigmoid(torch.randn(B, T, H, device="cuda"))
            timed(f"hladsl {name} gated", T, lambda: op(q, k, v, g=lg))   # as retention is
            if name in ("linear", "hla2") and T <= 16384:   # fwd + bwd (generated backward kernels)
                qg, kg, vg = (x.detach().clone().requires_grad_() for x in (q, k, v))
                timed(f"hladsl {name}", T, lambda: op(qg, kg, vg), (qg, kg, vg))
        if not names or "fla" in names:
            qg, kg, vg = (x.detach().clone().requires_grad_() for x in (q, k, v))
            qtg, ktg, vtg = (x.detach().clone().requires_grad_() for x in (qt, kt, vt))
            timed("sdpa flash causal", T, lambda: sdpa(qtg, ktg, vtg, is_causal=True), (qtg, ktg, vtg))
            try:
                from fla.ops.simple_gla import chunk_simple_gla
                timed("fla chunk_simple_gla (no gate)", T,
                      lambda: chunk_simple_gla(qg, kg, vg, scale=d ** -0.5), (qg, kg, vg))
            except Exception as exc:
                print(json.dumps(dict(what="fla", error=str(exc)[:200])))
        op = hladsl.load("linear")
        timed("hladsl linear gated", T, lambda: op(q, k, v, g=g if g is not None else
                                                  torch.full_like(q[..., 0], -0.01, dtype=torch.float32)))
        if names and "retention" not in names:
            continue
        try:
            from retention import power_retention
            lg = torch.nn.functional.logsigmoid(torch.randn(B, T, H, device="cuda"))
            timed("retention power_retention p=2 gated chunk 1024", T,
                  lambda: power_retention(q, k, v, lg, deg=2, chunk_size=1024))
        except Exception as exc:
            print(json.dumps(dict(what="retention", error=str(exc)[:200])))
    return rows


def schedules(names, T=16384, d=64, H=16, batches=(2, 16)):
    """Forward time of the two-pass and the fused schedule side by side."""
    rows = []
    for B in batches:
        q, k, v, g = inputs(B, T, H, d, d, torch.bfloat16, gated=True)
        for name in names:
            op = hladsl.load(name)
            for schedule in ("two_pass", "fused"):
                op.schedule = schedule
                row = dict(spec=name, B=B, H=H, T=T, d=d, schedule=schedule)
                try:
                    with torch.no_grad():
                        row["ms"] = round(triton.testing.do_bench(lambda: op(q, k, v, g=g), warmup=25,
                                                                  rep=100, return_mode="median"), 3)
                except Exception as exc:
                    row["error"] = f"{type(exc).__name__}: {str(exc)[:200]}"
                rows.append(row)
                print(json.dumps(row), flush=True)
    return rows


if __name__ == "__main__":
    what = sys.argv[1] if len(sys.argv) > 1 else "check"
    names = sys.argv[2].split(",") if len(sys.argv) > 2 else None
    dims = tuple(int(x) for x in sys.argv[3].split(",")) if len(sys.argv) > 3 else (64, 128)
    variants = sys.argv[4].split(",") if len(sys.argv) > 4 else ("ungated", "gated")
    schedule = sys.argv[5] if len(sys.argv) > 5 else "auto"
    if what == "check":
        rows = check(names, dims, variants=variants, schedule=schedule)
    elif what == "schedules":
        rows = schedules(names)
    else:
        rows = bench(names=names)
    out = os.environ.get("OUT")
    if out:
        tag = "_".join([what] + (names or []) + [str(d) for d in dims] + list(variants) + [schedule])
        with open(os.path.join(out, f"{tag}.json"), "w") as f:
            json.dump(rows, f, indent=1)
