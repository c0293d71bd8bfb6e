import os
import time
import torch
from gpu_support import Spec, Inputs, Ratios, check_against_reference, gates, generator, initial_state, load, tokens, TOL, BY_ID
W = Spec("hla2w", os.path.abspath("benchmarks/exp/hla2w.hla"), scan=True)
for spec, gated, T in [(W, False, 8192), (W, True, 8192), (BY_ID["hla2"], False, 8192), (W, False, 65536)]:
    for d in ((64, 128) if T == 8192 and spec is W else (64,)):
        try:
            gen = generator(1000 + d)
            op, ref = load(spec, "auto"), load(spec, "torch")
            inputs = Inputs(tokens(spec, 1, T, 4, d, d, torch.bfloat16, False, gen),
                            gates(1, T, 4, gen) if gated else None,
                            initial_state(spec, False, 1, 4, d, d, gated, gen))
            r = Ratios()
            t0 = time.time()
            check_against_reference(op, ref, inputs, r, TOL[torch.bfloat16], gen)
            print(f"{spec.id} gated={gated} T={T} d={d} ({time.time()-t0:.0f} s): " +
                  ", ".join(f"{w} {x:.3e}" for w, x, _ in r.rows), flush=True)
        except Exception as e:
            print("FAILED", spec.id, gated, T, d, repr(e)[:1500], flush=True)
