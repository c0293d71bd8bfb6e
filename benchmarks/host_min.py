"""Host (Python) µs per call, kernels stubbed, as the best of several repetitions.

``host_overhead.py`` breaks one call down; this prints one stable number per case for
before/after comparisons of the host path on a noisy machine: the minimum over
``--reps`` loops of ``--n`` calls of forward, forward + backward and ``op.step``
(B = 64, one token), on CPU tensors under TRITON_INTERPRET=1 with every kernel launch
stubbed out (``host_overhead``'s stub, and a no-op ``direct.call`` for the step).

    PYTHONPATH=$PWD python benchmarks/host_min.py [--specs linear hla2] [--n 200] [--reps 7]
"""
from __future__ import annotations

import argparse
import os
import sys
import time

os.environ["TRITON_INTERPRET"] = "1"
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import host_overhead  # noqa: E402,F401  (stubs launch.launch)
import torch  # noqa: E402

import hladsl  # noqa: E402
from hladsl.runtime import direct  # noqa: E402

direct.call = lambda kernel, grid, args, key_args=None: None   # the step's launches


def best_us(fn, n: int, reps: int) -> float:
    for _ in range(20):
        fn()
    best = float("inf")
    for _ in range(reps):
        t0 = time.perf_counter()
        for _ in range(n):
            fn()
        best = min(best, (time.perf_counter() - t0) / n * 1e6)
    return best


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--specs", nargs="+", default=["linear", "hla2"])
    ap.add_argument("--n", type=int, default=200)
    ap.add_argument("--reps", type=int, default=7)
    ap.add_argument("--no-step", action="store_true", help="skip op.step (a tree whose step does "
                                                            "not launch through runtime.direct)")
    a = ap.parse_args()
    print(f"{'spec':10s} {'fwd us':>8s} {'fwd+bwd us':>11s} {'step us':>8s}")
    for spec in a.specs:
        op = hladsl.load(spec, backend="triton")
        x = [torch.randn(1, 64, 1, 64, dtype=torch.bfloat16) for _ in range(3)]
        grads = [t.clone().requires_grad_() for t in x]
        do = torch.randn(1, 64, 1, 64, dtype=torch.bfloat16)

        def fb():
            o, _ = op(*grads)
            o.backward(do)
        tok = [torch.randn(64, 1, 16, 64, dtype=torch.bfloat16) for _ in range(3)]
        state = {n: torch.zeros((64, 16) + s) for n, s in op.state_shapes(64, 64).items()}
        step = float("nan") if a.no_step else best_us(lambda: op.step(*tok, state=state), a.n, a.reps)
        print(f"{spec:10s} {best_us(lambda: op(*x), a.n, a.reps):8.1f} {best_us(fb, a.n, a.reps):11.1f} "
              f"{step:8.1f}", flush=True)


if __name__ == "__main__":
    main()
