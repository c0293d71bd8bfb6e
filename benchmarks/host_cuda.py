"""Where the host time of an op call goes on a GPU machine (real kernels, CUDA tensors).

For each case and shape: wall µs per call over a loop with one sync at the end (at small
shapes the GPU idles: this is the host cost), do_bench's median, the µs spent inside
kernel launches (timed around every launch: Triton's ``kernel[grid](...)`` or
``runtime.direct``'s launch of the compiled kernel; a bound forward call, ``runtime.binding``,
launches through ``direct.Bound`` and is not counted), and fla's
``chunk_simple_gla`` / ``fused_recurrent_simple_gla`` beside them when installed. With
``--profile`` a cProfile of one case's fwd+bwd (sorted by own time). With ``--ab`` every
hladsl row runs twice, launching through ``kernel[grid]`` (direct off) and directly.

    PYTHONPATH=$PWD python benchmarks/host_cuda.py [--n 200] [--profile linear] [--step] [--ab]
"""
from __future__ import annotations

import argparse
import cProfile
import pstats
import time

import torch

import hladsl
from hladsl.runtime import direct, progress

LAUNCH_S = [0.0, 0]
_depth = [0]


def _timed(launch_fn):
    """``launch_fn`` with its wall time added to LAUNCH_S (outermost calls only)."""
    def timed(*args, **kwargs):
        if _depth[0]:
            return launch_fn(*args, **kwargs)
        _depth[0] += 1
        t0 = time.perf_counter()
        try:
            return launch_fn(*args, **kwargs)
        finally:
            _depth[0] -= 1
            LAUNCH_S[0] += time.perf_counter() - t0
            LAUNCH_S[1] += 1
    return timed


# every way a kernel is launched: a first launch, a remembered variant, a direct launch
progress.first_launch = _timed(progress.first_launch)
direct.call = _timed(direct.call)
direct.cached = _timed(direct.cached)


def inputs(B, T, H, d, gated, grad):
    gen = torch.Generator(device="cuda").manual_seed(0)
    q, k, v = (torch.randn(B, T, H, d, device="cuda", generator=gen, dtype=torch.bfloat16)
               .requires_grad_(grad) for _ in range(3))
    g = None
    if gated:
        g = torch.nn.functional.logsigmoid(4 + torch.randn(B, T, H, device="cuda", generator=gen))
        g.requires_grad_(grad)
    return q, k, v, g


def hladsl_fn(spec, B, T, H, d, gated, mode):
    op = hladsl.load(spec)
    q, k, v, g = inputs(B, T, H, d, gated, mode == "fb")
    do = torch.randn_like(v)
    if mode == "fwd":
        def fn():
            with torch.no_grad():
                return op(q, k, v, g=g)
    else:
        def fn():
            o, _ = op(q, k, v, g=g)
            o.backward(do)
    return fn


def fla_fn(B, T, H, d, gated, mode):
    from fla.ops.simple_gla import chunk_simple_gla
    q, k, v, g = inputs(B, T, H, d, gated, mode == "fb")
    do = torch.randn_like(v)
    if mode == "fwd":
        def fn():
            with torch.no_grad():
                return chunk_simple_gla(q, k, v, g=g, scale=d ** -0.5)
    else:
        def fn():
            o, _ = chunk_simple_gla(q, k, v, g=g, scale=d ** -0.5)
            o.backward(do)
    return fn


def wall_us(fn, n):
    for _ in range(5):
        fn()
    torch.cuda.synchronize()
    LAUNCH_S[:] = [0.0, 0]
    t0 = time.perf_counter()
    for _ in range(n):
        fn()
    torch.cuda.synchronize()
    wall = (time.perf_counter() - t0) / n * 1e6
    return wall, LAUNCH_S[0] / n * 1e6, LAUNCH_S[1] / n


def bench_ms(fn):
    import triton.testing
    return triton.testing.do_bench(fn, warmup=25, rep=100, return_mode="median")


def step_rows(n):
    rows = []
    for spec in ("linear", "hla2"):
        op = hladsl.load(spec)
        for B, gated in ((1, False), (64, False), (1, True), (64, True)):
            q, k, v, g = inputs(B, 1, 16, 64, gated, False)
            _, state = op(q, k, v, g=g, output_final_state=True)
            wall, lus, nl = wall_us(lambda: op.step(q, k, v, g=g, state=state), n)
            rows.append((f"{spec} step B={B}{' gated' if gated else ''}", wall, lus, nl,
                         bench_ms(lambda: op.step(q, k, v, g=g, state=state))))
    try:
        from fla.ops.simple_gla import fused_recurrent_simple_gla
        for B, gated in ((1, False), (64, False), (1, True), (64, True)):
            q, k, v, g = inputs(B, 1, 16, 64, gated, False)
            st = torch.zeros(B, 16, 64, 64, device="cuda")

            def call():
                return fused_recurrent_simple_gla(q, k, v, g, scale=64 ** -0.5, initial_state=st,
                                                  output_final_state=True)
            wall, _, _ = wall_us(call, n)
            rows.append((f"fla fused_recurrent B={B}{' gated' if gated else ''}", wall, 0.0, 0, bench_ms(call)))
    except ImportError as exc:
        print("fla:", exc)
    return rows


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--n", type=int, default=200)
    ap.add_argument("--profile", default=None, help="spec whose small fwd+bwd is cProfiled")
    ap.add_argument("--step", action="store_true")
    ap.add_argument("--no-table", action="store_true", help="skip the fwd / fwd+bwd table")
    ap.add_argument("--ab", action="store_true", help="each hladsl row with direct launches off, then on")
    ap.add_argument("--no-bound", action="store_true",
                    help="forward calls validate every time (launch.BOUND_CALLS off: no bound calls)")
    a = ap.parse_args()
    if a.no_bound:
        from hladsl.runtime import launch
        launch.switch("BOUND_CALLS", False)
    settings = (False, True) if a.ab else (direct.ENABLED,)
    shapes = [(1, 64, 1, 64), (2, 4096, 16, 64)]
    if a.profile:
        profile(a.profile, shapes[0], a.n)
    print(f"{'case':40s} {'wall us':>9s} {'in launches us':>15s} {'launches':>9s} {'do_bench ms':>12s}")
    for shape in [] if a.no_table else shapes:
        for label, spec, gated in (("linear", "linear", False), ("linear gated", "linear", True),
                                   ("hla2", "hla2", False), ("fla", None, False)):
            for mode in ("fwd", "fb"):
                for on in settings if spec else (direct.ENABLED,):
                    direct.ENABLED = on
                    try:
                        fn = (fla_fn(*shape, gated, mode) if spec is None
                              else hladsl_fn(spec, *shape, gated, mode))
                    except ImportError as exc:
                        print(label, exc)
                        continue
                    wall, lus, nl = wall_us(fn, a.n)
                    tag = "" if spec is None or not a.ab else (" direct" if on else " jit")
                    print(f"{label + ' ' + mode + tag + ' ' + str(shape):40s} {wall:9.1f} {lus:15.1f} "
                          f"{nl:9.1f} {bench_ms(fn):12.3f}", flush=True)
    if a.step:
        for on in settings:
            direct.ENABLED = on
            for label, wall, lus, nl, ms in step_rows(a.n):
                tag = " direct" if a.ab and on else " jit" if a.ab else ""
                print(f"{label + tag:40s} {wall:9.1f} {lus:15.1f} {nl:9.1f} {ms:12.4f}", flush=True)


def profile(spec, shape, n):
    """cProfile of ``n`` fwd+bwd calls, by own time and by cumulative time."""
    fn = hladsl_fn(spec, *shape, False, "fb")
    for _ in range(5):
        fn()
    pr = cProfile.Profile()
    pr.enable()
    for _ in range(n):
        fn()
    torch.cuda.synchronize()
    pr.disable()
    st = pstats.Stats(pr)
    st.sort_stats("tottime").print_stats(45)
    st.sort_stats("cumulative").print_stats(45)


if __name__ == "__main__":
    main()
