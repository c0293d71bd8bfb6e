"""Seconds from a process's start to its first hla2 call's result, cold and warm cache
(issue 13's bar: a cold process with a warm cache reaches its first hla2 call in <= 5 s).

    python benchmarks/cold_start.py [--spec hla2] [--backward] [--cache DIR] [--out cold.json] [--device cpu]

Runs the same child process twice against one cache directory (hladsl's generated
sources and Triton's compiled kernels, both under ``--cache``, emptied first): the first
compiles everything (cold cache), the second only loads (warm cache). Each child times,
from before ``import torch``: the imports, ``hladsl.load``, the first call (forward, or
forward + backward with ``--backward``) up to ``torch.cuda.synchronize()``. The parent
also reports each child's wall time from spawn to exit (the interpreter's own start
included). Measures CUDA; ``--device cpu`` runs the torch path (a smoke test of the script).
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time

CHILD = r"""
import time
t0 = time.perf_counter()
import json, sys
import torch
t_torch = time.perf_counter()
import hladsl
t_import = time.perf_counter()
op = hladsl.load(sys.argv[1])
t_load = time.perf_counter()
backward, device = sys.argv[2] == "1", sys.argv[3]
sync = torch.cuda.synchronize if device == "cuda" else (lambda: None)
q, k, v = (torch.randn(1, 1024, 4, 64, device=device, dtype=torch.bfloat16,
                       requires_grad=backward) for _ in range(3))
sync()
t_inputs = time.perf_counter()
o, _ = op(q, k, v)
if backward:
    o.float().square().mean().backward()
sync()
t_call = time.perf_counter()
print(json.dumps({"import_torch_s": t_torch - t0, "import_hladsl_s": t_import - t_torch,
                  "load_s": t_load - t_import, "inputs_and_cuda_init_s": t_inputs - t_load,
                  "first_call_s": t_call - t_inputs, "to_first_result_s": t_call - t0}))
"""


def child(spec: str, backward: bool, cache: str, device: str) -> dict:
    env = dict(os.environ, HLADSL_CACHE_DIR=os.path.join(cache, "hladsl"),
               TRITON_CACHE_DIR=os.path.join(cache, "triton"))
    start = time.perf_counter()
    out = subprocess.run([sys.executable, "-c", CHILD, spec, "1" if backward else "0", device], env=env,
                         capture_output=True, text=True, check=False)
    wall = time.perf_counter() - start
    if out.returncode:
        return {"error": out.stderr[-2000:], "wall_s": wall}
    return {**json.loads(out.stdout.strip().splitlines()[-1]), "wall_s": wall}


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--spec", default="hla2")
    ap.add_argument("--backward", action="store_true", help="first call is forward + backward")
    ap.add_argument("--cache", default=None, help="cache directory (default: a temporary one)")
    ap.add_argument("--out", default=None, help="JSON file to write")
    ap.add_argument("--device", default="cuda", help="cpu: a smoke test of this script (torch path)")
    a = ap.parse_args()
    cache = a.cache or tempfile.mkdtemp(prefix="hladsl-cold-")
    shutil.rmtree(cache, ignore_errors=True)
    os.makedirs(cache)
    rows = {"spec": a.spec, "backward": a.backward,
            "cold_cache": child(a.spec, a.backward, cache, a.device),
            "warm_cache": child(a.spec, a.backward, cache, a.device)}
    for name in ("cold_cache", "warm_cache"):
        r = rows[name]
        print(f"{a.spec} {'fwd+bwd' if a.backward else 'fwd'} {name}: "
              + (f"wall {r['wall_s']:.2f} s, to first result {r['to_first_result_s']:.2f} s "
                 f"(torch {r['import_torch_s']:.2f}, load {r['load_s']:.2f}, "
                 f"CUDA init {r['inputs_and_cuda_init_s']:.2f}, call {r['first_call_s']:.2f})"
                 if "error" not in r else f"error: {r['error'][-300:]}"))
    if a.out:
        with open(a.out, "w") as f:
            json.dump(rows, f, indent=1)


if __name__ == "__main__":
    main()
