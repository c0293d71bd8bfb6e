"""One case per process: python run231_case.py SPEC_ID GATED T D [MODE]; prints RMS ratios or the failure."""
import os
import sys
import time
import traceback
import torch
from gpu_support import Spec, Inputs, Ratios, check_against_reference, gates, generator, initial_state, load, tokens, TOL, BY_ID
W = Spec("hla2w", os.path.abspath("benchmarks/exp/hla2w.hla"), scan=True)
spec = W if sys.argv[1] == "hla2w" else BY_ID[sys.argv[1]]
gated, T, d = sys.argv[2] == "1", int(sys.argv[3]), int(sys.argv[4])
mode = sys.argv[5] if len(sys.argv) > 5 else "check"
gen = generator(1000 + d)
op = load(spec, "auto")
try:
    if mode == "check":
        ref = load(spec, "torch")
        inputs = Inputs(tokens(spec, 1, T, 4, d, d, torch.bfloat16, False, gen),
                        gates(1, T, 4, gen) if gated else None,
                        initial_state(spec, False, 1, 4, d, d, gated, gen))
        r = Ratios()
        t0 = time.time()
        check_against_reference(op, ref, inputs, r, TOL[torch.bfloat16], gen)
        print(f"{spec.id} gated={gated} T={T} d={d} ({time.time()-t0:.0f} s): " +
              ", ".join(f"{w} {x:.3e}" for w, x, _ in r.rows), flush=True)
    else:   # fwd / bwd without states, one schedule
        op.schedule = mode.split(":")[1] if ":" in mode else "auto"
        q, k, v = (torch.randn(2, T, 16, d, device="cuda", dtype=torch.bfloat16, requires_grad=True) for _ in range(3))
        g = -torch.rand(2, T, 16, device="cuda") * 0.05 if gated else None
        o = op(q, k, v, g=g) if gated else op(q, k, v)
        o = o[0] if isinstance(o, tuple) else o
        if mode.startswith("bwd"):
            o.backward(torch.randn_like(o))
        torch.cuda.synchronize()
        print(f"{spec.id} gated={gated} T={T} d={d} {mode}: ok, o rms {o.float().square().mean().sqrt().item():.3e}", flush=True)
except Exception as e:
    print(f"FAILED {spec.id} gated={gated} T={T} d={d} {mode}: {repr(e)[:300]}", flush=True)
    tb = traceback.format_exc().splitlines()
    print("\n".join(line for line in tb if "hladsl" in line or "kernel" in line)[-2500:], flush=True)
