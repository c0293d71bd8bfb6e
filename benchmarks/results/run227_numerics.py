"""D_STATES_IN_SDOT off / on: RMS ratios of o, final states and every gradient against the fp32
torch reference (T = 8192, B = 1, H = 4, d = 64, bf16, with an initial state and final-state
cotangents, as tests/gpu/test_gpu_numerics.py), and hla2 at T = 65536 against float64."""
import time
import torch
from hladsl.runtime import launch
from gpu_support import (BY_ID, Inputs, Ratios, check_against_reference, gates, generator, initial_state,
                         load, tokens, TOL)

rows = []
def case(spec_id, gated, T, ref_dtype=torch.float32, B=1, H=4, d=64):
    spec = BY_ID[spec_id]
    out = {}
    for on in (False, True):
        launch.switch("D_STATES_IN_SDOT", on)
        gen = generator(1000 + d)
        op, ref = load(spec, "auto"), load(spec, "torch")
        inputs = Inputs(tokens(spec, B, T, H, d, d, torch.bfloat16, False, gen),
                        gates(B, T, H, gen) if gated else None,
                        initial_state(spec, False, B, H, d, d, gated, gen))
        r = Ratios()
        t0 = time.time()
        check_against_reference(op, ref, inputs, r, TOL[torch.bfloat16], gen)
        out[on] = {w: x for w, x, _ in r.rows}
        print(f"{spec_id} gated={gated} T={T} on={on} ({time.time()-t0:.0f} s): " +
              ", ".join(f"{w} {x:.3e}" for w, x, _ in r.rows), flush=True)
    for w in out[False]:
        rows.append((spec_id, gated, T, w, out[False][w], out[True][w]))

for spec_id, gated in [("hla2", False), ("hla2", True), ("ahla", False), ("hla3_masked", False), ("hla3_masked", True)]:
    try:
        case(spec_id, gated, 8192)
    except Exception as e:
        print("FAILED", spec_id, gated, repr(e)[:2000], flush=True)
print("\n| spec | gated | T | what | fp32 d-states | bf16 d-states |\n|---|---|---|---|---|---|")
for s, g, T, w, a, b in rows:
    print(f"| {s} | {g} | {T} | {w} | {a:.3e} | {b:.3e} |")
