"""Host cost of one Triton launch on this machine, split into its parts.

For a toy kernel with P pointer arguments (P = 1, 8, 24) and for linear's real output
kernel: µs per launch through ``kernel[grid](**args)`` (JITFunction.run), through
``runtime.direct`` (key + CompiledKernel.run), direct's key alone, and
``CompiledKernel.run`` alone with the argument list prepared; plus an empty
``torch.empty`` + ``add_`` pair for the machine's speed. The GPU idles (tiny grids):
this is host time.

    PYTHONPATH=$PWD python benchmarks/launch_cost.py [--n 2000]
"""
from __future__ import annotations

import argparse
import time

import torch

from hladsl.runtime import direct


def toy(pointers: int):
    """A jitted kernel of ``pointers`` pointer arguments that copies one element."""
    params = ", ".join(f"p{i}" for i in range(pointers))
    src = (f"def toy_{pointers}({params}, n, BLOCK: tl.constexpr):\n"
           f"    offs = tl.arange(0, BLOCK)\n"
           f"    tl.store(p0 + offs, tl.load(p{pointers - 1} + offs, mask=offs < n), mask=offs < n)\n")
    path = f"/tmp/hladsl_launch_cost_{pointers}.py"
    with open(path, "w") as f:
        f.write("import triton\nimport triton.language as tl\n\n@triton.jit\n" + src)
    import importlib.util
    spec = importlib.util.spec_from_file_location(f"toy_{pointers}", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return getattr(module, f"toy_{pointers}")


def per_call_us(fn, n: int) -> float:
    for _ in range(20):
        fn()
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(n):
        fn()
    elapsed = time.perf_counter() - t0
    torch.cuda.synchronize()
    return elapsed / n * 1e6


def rows_for(label, kernel, grid, args, n):
    direct.call(kernel, grid, args)          # compile, remember
    table = direct._param_table(kernel)
    key = direct._key(kernel, table, args)
    compiled = direct._COMPILED[key]
    values = [args.get(k, d) for k, d in zip(table[0], table[2])]
    stream = torch._C._cuda_getCurrentRawStream(torch.cuda.current_device())

    def raw():
        compiled.run(grid[0], 1, 1, stream, compiled.function, compiled.packed_metadata, None,
                     None, None, *values)
    out = [(label, "kernel[grid](**args)", per_call_us(lambda: kernel[grid](**args), n)),
           (label, "direct.cached", per_call_us(lambda: direct.cached(kernel, grid, args), n)),
           (label, "direct key only", per_call_us(lambda: direct._key(kernel, table, args), n)),
           (label, "CompiledKernel.run only", per_call_us(raw, n))]
    return out


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--n", type=int, default=2000)
    a = ap.parse_args()
    x = torch.zeros(1024, device="cuda")
    rows = [("torch", "empty + add_", per_call_us(lambda: torch.empty(16, device="cuda").add_(1), a.n))]
    for p in (1, 8, 24):
        kernel = toy(p)
        args = {f"p{i}": torch.zeros(64, device="cuda") for i in range(p)}
        rows += rows_for(f"toy {p} pointers", kernel, (1,), {**args, "n": 64, "BLOCK": 64}, a.n)
    del x
    import hladsl
    from hladsl.runtime import launch
    op = hladsl.load("linear")
    q, k, v = (torch.randn(1, 64, 1, 64, device="cuda", dtype=torch.bfloat16) for _ in range(3))
    seen = []
    original = launch.launch

    def spy(kernel, grid, args, may_fall_back, tiling=None):
        seen.append((kernel, grid, dict(args)))
        return original(kernel, grid, args, may_fall_back, tiling)
    launch.launch = spy
    op(q, k, v)
    launch.launch = original
    for kernel, grid, args in seen:
        name = getattr(getattr(kernel, "fn", kernel), "__name__", "kernel")
        rows += rows_for(f"linear {name} ({len(args)} args)", kernel, grid, args, a.n)
    for label, what, us in rows:
        print(f"{label:40s} {what:26s} {us:8.1f} us", flush=True)


if __name__ == "__main__":
    main()
