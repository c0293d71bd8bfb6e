"""Temporary: GPU check of generated kernels vs chunk_torch (removed after use)."""
import sys, time
import torch, triton
import hladsl
from hladsl.ir.chunk import chunk_program
from hladsl.runtime import chunk_torch
from hladsl.codegen.triton_run import forward_triton


def case(name, gated, normalize, dtype, d=64, dv=64, C=64, N=2, H=4, nC=8, **kw):
    alg = hladsl.compile_spec(name, normalize=normalize, **kw)
    dims = {"d": d, "dv": dv}
    prog = chunk_program(alg, C, tuple(sorted(dims.items())), gated)
    g = torch.Generator(device="cuda").manual_seed(0)
    tiles = {x: torch.randn(N, H, nC, C, dims[dm], generator=g, device="cuda") * d ** -0.5
             for x, dm in alg.inputs.items()}
    if normalize:
        tiles = {x: t.abs() for x, t in tiles.items()}
    lam = (-torch.rand(N, H, nC, C, generator=g, device="cuda") * 0.1).cumsum(-1) if gated else None
    init = {s.name: torch.zeros((N, H) + tuple(dims[x] for x in s.dims), device="cuda") for s in alg.streaming}
    t64 = {k: v.double() for k, v in tiles.items()}
    l64 = None if lam is None else lam.double()
    starts, final = chunk_torch.state_pass(prog, t64, l64, {k: v.double() for k, v in init.items()}, torch.float64)
    num = chunk_torch.outputs(prog, prog.output, t64, l64, starts, torch.float64)
    if alg.normalizer is not None:
        den = chunk_torch.outputs(prog, prog.normalizer, t64, l64, starts, torch.float64)
        num = num / (den.unsqueeze(-1) + alg.eps)
    tin = {k: v.to(dtype) for k, v in tiles.items()}
    t = time.time()
    o, fin = forward_triton(prog, tin, lam, init, alg.eps)
    torch.cuda.synchronize()
    el = time.time() - t
    rms = lambda x: x.double().pow(2).mean().sqrt().item()
    eo = rms(num - o) / rms(num)
    ef = max(rms(final[k] - fin[k]) / max(rms(final[k]), 1e-30) for k in final)
    ms = triton.testing.do_bench(lambda: forward_triton(prog, tin, lam, init, alg.eps))
    print(f"{name:12s} g={gated:d} n={normalize:d} {str(dtype)[6:]:8s} d={d} out={eo:.1e} state={ef:.1e} "
          f"first={el:.1f}s bench={ms:.3f}ms", flush=True)


if __name__ == "__main__" and sys.argv[1] != "one":
    names = sys.argv[1].split(",")
    dts = [getattr(torch, x) for x in sys.argv[2].split(",")]
    d = int(sys.argv[3]) if len(sys.argv) > 3 else 64
    for n in names:
        for dt in dts:
            for gated, norm in ((True, False), (False, True)):
                try:
                    case(n, gated, norm, dt, d=d, dv=d)
                except Exception as e:
                    print(f"{n} g={gated} n={norm} {dt} FAILED: {type(e).__name__}: {str(e)[:800]}", flush=True)


def bench(name, T, dtype=torch.bfloat16, gated=False, B=2, H=16, d=64, C=64, precision="tf32x3"):
    alg = hladsl.compile_spec(name)
    dims = {"d": d, "dv": d}
    prog = chunk_program(alg, C, tuple(sorted(dims.items())), gated)
    nC = T // C
    x = {n: torch.randn(B, T, H, d, device="cuda", dtype=dtype) * d ** -0.5 for n in alg.inputs}
    tiles = {n: t.reshape(B, nC, C, H, d).permute(0, 3, 1, 2, 4) for n, t in x.items()}
    lam = (-torch.rand(B, H, nC, C, device="cuda") * 0.1).cumsum(-1) if gated else None
    init = {s.name: torch.zeros((B, H) + tuple(dims[v] for v in s.dims), device="cuda") for s in alg.streaming}
    forward_triton(prog, tiles, lam, init, 1e-6, precision=precision)
    ms = triton.testing.do_bench(lambda: forward_triton(prog, tiles, lam, init, 1e-6, precision=precision))
    print(f"bench {name:8s} T={T:6d} {str(dtype)[6:]} gated={gated:d} {ms:.3f} ms", flush=True)


def split_times(name, T, dtype=torch.bfloat16, gated=False, B=2, H=16, d=64, C=64):
    from torch.profiler import profile, ProfilerActivity
    alg = hladsl.compile_spec(name)
    dims = {"d": d, "dv": d}
    prog = chunk_program(alg, C, tuple(sorted(dims.items())), gated)
    nC = T // C
    x = {n: torch.randn(B, T, H, d, device="cuda", dtype=dtype) * d ** -0.5 for n in alg.inputs}
    tiles = {n: t.reshape(B, nC, C, H, d).permute(0, 3, 1, 2, 4) for n, t in x.items()}
    lam = (-torch.rand(B, H, nC, C, device="cuda") * 0.1).cumsum(-1) if gated else None
    init = {s.name: torch.zeros((B, H) + tuple(dims[v] for v in s.dims), device="cuda") for s in alg.streaming}
    for _ in range(3):
        forward_triton(prog, tiles, lam, init, 1e-6)
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(10):
            forward_triton(prog, tiles, lam, init, 1e-6)
        torch.cuda.synchronize()
    for e in prof.key_averages():
        if "kernel" in e.key:
            print(f"  {name} T={T} {e.key[:40]:40s} {e.device_time / 1000:.3f} ms avg", flush=True)


def tune(name, T, B=2, H=16, d=64, C=64, dtype=torch.bfloat16):
    from torch.profiler import profile, ProfilerActivity
    alg = hladsl.compile_spec(name)
    dims = {"d": d, "dv": d}
    prog = chunk_program(alg, C, tuple(sorted(dims.items())), False)
    nC = T // C
    x = {n: torch.randn(B, T, H, d, device="cuda", dtype=dtype) * d ** -0.5 for n in alg.inputs}
    tiles = {n: t.reshape(B, nC, C, H, d).permute(0, 3, 1, 2, 4) for n, t in x.items()}
    init = {s.name: torch.zeros((B, H) + tuple(dims[v] for v in s.dims), device="cuda") for s in alg.streaming}
    for w in (2, 4, 8):
        for st in (1, 2, 3):
            for sb in (16, 32, 64):
                kw = dict(num_warps=w, num_stages=st, state_block=sb)
                try:
                    forward_triton(prog, tiles, None, init, 1e-6, **kw)
                    torch.cuda.synchronize()
                    with profile(activities=[ProfilerActivity.CUDA]) as prof:
                        for _ in range(5):
                            forward_triton(prog, tiles, None, init, 1e-6, **kw)
                        torch.cuda.synchronize()
                    ts = {e.key[:5]: e.device_time / 1000 for e in prof.key_averages() if "kernel" in e.key}
                    print(f"tune {name} T={T} warps={w} stages={st} sb={sb} state={ts.get('state', 0):.3f} out={ts.get('outpu', 0):.3f}", flush=True)
                except Exception as e:
                    print(f"tune {name} {kw} FAILED {type(e).__name__} {str(e)[:200]}", flush=True)


def nan_debug(name="hla3", d=64, dtype=torch.bfloat16):
    alg = hladsl.compile_spec(name)
    dims = {"d": d, "dv": d}
    for C, nC, gated in ((64, 8, True), (64, 1, True), (64, 8, False)):
        prog = chunk_program(alg, C, tuple(sorted(dims.items())), gated)
        g = torch.Generator(device="cuda").manual_seed(0)
        tiles = {x: (torch.randn(2, 4, nC, C, d, generator=g, device="cuda") * d ** -0.5).to(dtype) for x in alg.inputs}
        lam = (-torch.rand(2, 4, nC, C, generator=g, device="cuda") * 0.1).cumsum(-1) if gated else None
        init = {s.name: torch.zeros((2, 4) + tuple(dims[x] for x in s.dims), device="cuda") for s in alg.streaming}
        for w in (4, 8):
            o, fin = forward_triton(prog, tiles, lam, init, 1e-6, num_warps=w)
            bad = torch.isnan(o) | torch.isinf(o)
            print(f"nan {name} C={C} nC={nC} gated={gated} warps={w} nan={bad.sum().item()} "
                  f"chunks={sorted(set(bad.nonzero()[:, 2].tolist()))[:10]} rows={sorted(set(bad.nonzero()[:, 3].tolist()))[:10]} "
                  f"absmax={o[~bad].abs().max().item() if (~bad).any() else 0:.3e}", flush=True)


def one(name, gated, dtype, warps, stages, sb, d=64, nC=8, seed=0):
    alg = hladsl.compile_spec(name)
    dims = {"d": d, "dv": d}
    prog = chunk_program(alg, 64, tuple(sorted(dims.items())), gated)
    g = torch.Generator(device="cuda").manual_seed(seed)
    tiles = {x: (torch.randn(2, 4, nC, 64, d, generator=g, device="cuda") * d ** -0.5) for x in alg.inputs}
    lam = (-torch.rand(2, 4, nC, 64, generator=g, device="cuda") * 0.1).cumsum(-1) if gated else None
    init = {s.name: torch.zeros((2, 4) + tuple(dims[x] for x in s.dims), device="cuda") for s in alg.streaming}
    t64 = {k: v.double() for k, v in tiles.items()}
    l64 = None if lam is None else lam.double()
    starts, final = chunk_torch.state_pass(prog, t64, l64, {k: v.double() for k, v in init.items()}, torch.float64)
    ref = chunk_torch.outputs(prog, prog.output, t64, l64, starts, torch.float64)
    res = []
    for rep in range(3):
        o, fin = forward_triton(prog, {k: v.to(dtype) for k, v in tiles.items()}, lam, init, 1e-6,
                                num_warps=warps, num_stages=stages, state_block=sb)
        torch.cuda.synchronize()
        rms = lambda x: x.double().pow(2).mean().sqrt().item()
        res.append(f"{rms(ref - o) / rms(ref):.1e}")
    print(f"one {name} gated={gated} {dtype} warps={warps} stages={stages} sb={sb}: {res}", flush=True)


if __name__ == "__main__" and sys.argv[1] == "one":
    a = sys.argv[2:]
    one(a[0], a[1] == "1", getattr(torch, a[2]), int(a[3]), None if a[4] == "-" else int(a[4]), int(a[5]))
