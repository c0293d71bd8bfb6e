"""Host (Python) cost of one op call on the Triton path, kernels not executed.

Runs the Triton path on CPU tensors under TRITON_INTERPRET=1 with every kernel
launch stubbed out (``launch.launch`` still builds its key and walks its
fallbacks; only ``kernel[grid](**args)`` does nothing), so what is timed is our
own Python plus the torch ops around the kernels. Counts kernel launches and
aten ops (a TorchDispatchMode around forward_impl / backward_impl, and the
profiler's top-level aten ops for the whole call, custom op and autograd included).

    PYTHONPATH=$PWD python benchmarks/host_overhead.py [--stages] [--counts] [--profile CASE:fwd|fb] [--large]
"""
from __future__ import annotations

import argparse
import collections
import cProfile
import os
import pstats
import time

os.environ["TRITON_INTERPRET"] = "1"

import torch
from torch.utils._python_dispatch import TorchDispatchMode

import hladsl
from hladsl.runtime import launch as launch_mod

LAUNCHES = collections.Counter()
_ORIG_LAUNCH = launch_mod.launch


class _NoRun:
    """Stands for a jitted kernel: indexing by a grid gives a callable that does nothing."""

    def __init__(self, kernel):
        self.name = getattr(kernel, "__name__", None) or getattr(getattr(kernel, "fn", None),
                                                                  "__name__", "kernel")

    def __getitem__(self, grid):
        return self._call

    def _call(self, **args):
        LAUNCHES[self.name] += 1


_FAKES: dict = {}


def fake_launch(kernel, grid, args, may_fall_back, *rest):
    fake = _FAKES.setdefault(id(kernel), _NoRun(kernel))
    _ORIG_LAUNCH(fake, grid, args, may_fall_back, *rest)


launch_mod.launch = fake_launch


class AtenCounter(TorchDispatchMode):
    def __init__(self):
        super().__init__()
        self.ops = collections.Counter()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.ops[str(func.overloadpacket.__name__)] += 1
        return func(*args, **(kwargs or {}))


CASES = {
    "linear": {"spec": "linear", "gated": False},
    "linear_g": {"spec": "linear", "gated": True},
    "hla2": {"spec": "hla2", "gated": False},
}


def make(case, B, T, H, d, dtype, grad):
    c = CASES[case]
    op = hladsl.load(c["spec"], backend="triton")
    gen = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(B, T, H, d, generator=gen, dtype=torch.float32).to(dtype)
               .requires_grad_(grad) for _ in range(3))
    g = None
    if c["gated"]:
        g = (-torch.rand(B, T, H, generator=gen)).requires_grad_(grad)
    return op, (q, k, v), g


def call_fwd(op, xs, g):
    with torch.no_grad():
        return op(*xs, g=g)


def call_fwd_bwd(op, xs, g, do):
    o, _ = op(*xs, g=g)
    o.backward(do)


def timeit(fn, n):
    for _ in range(3):
        fn()
    t0 = time.perf_counter()
    for _ in range(n):
        fn()
    return (time.perf_counter() - t0) / n * 1e6


def bench(case, B, T, H, d, dtype, n):
    op, xs, g = make(case, B, T, H, d, dtype, grad=False)
    fwd = timeit(lambda: call_fwd(op, xs, g), n)
    LAUNCHES.clear()
    call_fwd(op, xs, g)
    fwd_launches = sum(LAUNCHES.values())
    op, xs, g = make(case, B, T, H, d, dtype, grad=True)
    do = torch.randn(B, T, H, d).to(dtype)
    fb = timeit(lambda: call_fwd_bwd(op, xs, g, do), n)
    LAUNCHES.clear()
    call_fwd_bwd(op, xs, g, do)
    fb_launches = sum(LAUNCHES.values())
    return fwd, fb, fwd_launches, fb_launches - fwd_launches, dict(LAUNCHES)


def aten_counts(case, B, T, H, d, dtype):
    """aten ops inside forward_impl and backward_impl (the custom ops' bodies)."""
    op, xs, g = make(case, B, T, H, d, dtype, grad=False)
    scale = float("nan")
    with AtenCounter() as fwd:
        op.forward_impl(list(xs), g, scale, [], None, "auto")
    do = torch.randn(B, T, H, d).to(dtype)
    with AtenCounter() as bwd:
        op.backward_impl(list(xs), g, scale, [], None, "auto", do, [None] * len(op.state_names))
    return fwd.ops, bwd.ops


def profiler_counts(case, B, T, H, d, dtype, backward):
    """Top-level aten ops of a whole call (custom op, autograd), from torch.profiler."""
    op, xs, g = make(case, B, T, H, d, dtype, grad=backward)
    do = torch.randn(B, T, H, d).to(dtype)
    fn = (lambda: call_fwd_bwd(op, xs, g, do)) if backward else (lambda: call_fwd(op, xs, g))
    fn()
    from torch.profiler import ProfilerActivity, profile
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        fn()
    top = collections.Counter()
    allops = 0
    for e in prof.events():
        if not e.name.startswith("aten::"):
            continue
        allops += 1
        p = e.cpu_parent
        while p is not None and not p.name.startswith("aten::"):
            p = p.cpu_parent
        if p is None:
            top[e.name] += 1
    return top, allops


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--profile", default=None, help="case:fwd|fb -- print a cProfile")
    ap.add_argument("--n", type=int, default=200)
    ap.add_argument("--large", action="store_true", help="also count ops at B=2 T=4096 H=16")
    ap.add_argument("--counts", action="store_true", help="print aten op tables")
    ap.add_argument("--stages", action="store_true", help="inclusive us per call of each stage")
    a = ap.parse_args()
    torch.set_num_threads(1)
    if a.stages:
        install_stage_timers()
        for case in CASES:
            for mode in ("fwd", "fb"):
                stage_table(case, mode, a.n)
        return
    small = (1, 64, 1, 64)
    dtype = torch.bfloat16
    if a.profile:
        case, mode = a.profile.split(":")
        op, xs, g = make(case, *small, dtype, grad=(mode == "fb"))
        do = torch.randn(*small).to(dtype)
        fn = (lambda: call_fwd_bwd(op, xs, g, do)) if mode == "fb" else (lambda: call_fwd(op, xs, g))
        for _ in range(5):
            fn()
        pr = cProfile.Profile()
        pr.enable()
        for _ in range(a.n):
            fn()
        pr.disable()
        st = pstats.Stats(pr)
        st.sort_stats("cumulative").print_stats(60)
        st.sort_stats("tottime").print_stats(40)
        return
    print(f"host us/call, B,T,H,d = {small}, {dtype}, {a.n} calls, kernels stubbed")
    print("case      fwd_us  fwdbwd_us  launches_fwd  launches_bwd")
    for case in CASES:
        fwd, fb, lf, lb, per = bench(case, *small, dtype, a.n)
        print(f"{case:9s} {fwd:7.0f} {fb:9.0f} {lf:11d} {lb:12d}   {per}")
    shapes = [small] + ([(2, 4096, 16, 64)] if a.large else [])
    for shape in shapes:
        for case in CASES:
            f, b = aten_counts(case, *shape, dtype)
            tf, af = profiler_counts(case, *shape, dtype, False)
            tb, ab = profiler_counts(case, *shape, dtype, True)
            print(f"\n{case} {shape}: aten ops in forward_impl {sum(f.values())}, backward_impl "
                  f"{sum(b.values())}; whole call top-level fwd {sum(tf.values())} "
                  f"(all nested {af}), fwd+bwd {sum(tb.values())} (all nested {ab})")
            if a.counts:
                print("  forward_impl:", dict(f.most_common()))
                print("  backward_impl:", dict(b.most_common()))
                print("  call fwd top:", dict(tf.most_common()))
                print("  call fwd+bwd top:", dict(tb.most_common()))




# -- stage timers: inclusive µs per call of the functions on the call path ----------------------
STAGES = collections.defaultdict(float)


def _timed(label, fn):
    def wrapper(*a, **k):
        t0 = time.perf_counter()
        try:
            return fn(*a, **k)
        finally:
            STAGES[label] += time.perf_counter() - t0
    return wrapper


def install_stage_timers():
    from hladsl.runtime import custom_op, triton_backward, triton_forward
    from hladsl.runtime import op as op_mod
    op_mod.Op.__call__ = _timed("Op.__call__ (total)", op_mod.Op.__call__)
    op_mod.Op.bind = _timed("Op.bind", op_mod.Op.bind)
    op_mod.check_inputs = _timed("validate.check_inputs", op_mod.check_inputs)
    op_mod.Op.forward_impl = _timed("Op.forward_impl", op_mod.Op.forward_impl)
    op_mod.Op.backward_impl = _timed("Op.backward_impl", op_mod.Op.backward_impl)
    op_mod._Prepared.__init__ = _timed("_Prepared.__init__", op_mod._Prepared.__init__)
    op_mod._Prepared.finish = _timed("_Prepared.finish", op_mod._Prepared.finish)
    op_mod.Op._scaled = _timed("Op._scaled (in _Prepared)", op_mod.Op._scaled)
    op_mod.program_for = _timed("pipeline.program_for (lru)", op_mod.program_for)
    op_mod.unpack = _timed("packing.unpack", op_mod.unpack)
    op_mod.pack = _timed("packing.pack", op_mod.pack)
    custom_op._fresh = _timed("custom_op._fresh", custom_op._fresh)
    triton_forward.forward_triton = _timed("triton_forward.forward_triton", triton_forward.forward_triton)
    triton_forward.kernels = _timed("triton_gen.kernels (lookup)", triton_forward.kernels)
    triton_forward.constexprs = _timed("triton_gen.constexprs", triton_forward.constexprs)
    triton_forward._token_args = _timed("triton_forward._token_args", triton_forward._token_args)
    triton_forward._packed_tables = _timed("triton_forward._packed_tables", triton_forward._packed_tables)
    triton_backward.backward_triton = _timed("triton_backward.backward_triton", triton_backward.backward_triton)
    triton_backward.backward_kernels = _timed("triton_bwd.backward_kernels (lookup)", triton_backward.backward_kernels)
    triton_backward.check_backward_args = _timed("backward_torch.check_backward_args", triton_backward.check_backward_args)
    triton_backward._token_args = _timed("triton_forward._token_args", triton_backward._token_args)
    triton_backward._packed_tables = _timed("triton_forward._packed_tables", triton_backward._packed_tables)
    triton_backward.constexprs = _timed("triton_gen.constexprs", triton_backward.constexprs)
    launch_mod.launch = _timed("launch.launch (key + fallbacks, kernel stubbed)", launch_mod.launch)
    launch_mod.fitting_chunk = _timed("launch.fitting_chunk", launch_mod.fitting_chunk)
    orig_vjp = torch.func.vjp

    def vjp(f, *xs, **k):
        t0 = time.perf_counter()
        out, pull = orig_vjp(f, *xs, **k)
        STAGES["torch.func.vjp (traced fwd of prepare/finish)"] += time.perf_counter() - t0
        return out, _timed("vjp pullbacks", pull)
    torch.func.vjp = vjp


def stage_table(case, mode, n):
    op, xs, g = make(case, 1, 64, 1, 64, torch.bfloat16, grad=(mode == "fb"))
    do = torch.randn(1, 64, 1, 64).to(torch.bfloat16)
    fn = (lambda: call_fwd_bwd(op, xs, g, do)) if mode == "fb" else (lambda: call_fwd(op, xs, g))
    for _ in range(5):
        fn()
    STAGES.clear()
    t0 = time.perf_counter()
    for _ in range(n):
        fn()
    total = (time.perf_counter() - t0) / n * 1e6
    print(f"\n{case} {mode}: {total:.0f} us/call with timers")
    for label, t in sorted(STAGES.items(), key=lambda kv: -kv[1]):
        print(f"  {t / n * 1e6:8.1f}  {label}")


if __name__ == "__main__":
    main()
