"""Where one call's GPU time goes: CUDA time per kernel of a spec's fwd or fwd+bwd call
(torch.profiler, after a warm-up call), beside fla's chunk_simple_gla when installed.

    python benchmarks/profile_kernels.py linear hla2 power:p=2 [--T 4096] [--gated]
        [--mode fwd+bwd] [--launch FORWARD_CHUNK=128] [--json out.json] [--launches]

``--launches`` also prints each kernel's first launch: its grid, its block, chunk, warps
and dot-dtype arguments, and the dtype of the chunk-start buffers it reads or writes.

Totals are per call (the profiled calls' kernel time divided by their number); a
kernel name's count is its launches per call. Use do_bench timings (``hladsl bench``)
for claims: the profiler adds its own overhead to short kernels.
"""
from __future__ import annotations

import argparse
import json
import math
from collections import defaultdict

import torch
from torch.profiler import ProfilerActivity, profile

import hladsl
from hladsl.bench import FwdBwd, parse_spec, parse_switches
from hladsl.runtime import launch

CALLS = 5


def kernel_times(fn) -> list[tuple[str, int, float]]:
    """[(kernel name, launches per call, µs per call)], largest first."""
    fn()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(CALLS):
            fn()
        torch.cuda.synchronize()
    totals, counts = defaultdict(float), defaultdict(int)
    for event in prof.events():
        if event.device_type == torch.autograd.DeviceType.CUDA:
            totals[event.name] += event.device_time
            counts[event.name] += 1
    return sorted(((name[:90], counts[name] // CALLS, totals[name] / CALLS) for name in totals),
                  key=lambda row: -row[2])


def launch_lines() -> list[str]:
    """Record the first launch of every (kernel, grid) through ``launch.launch``."""
    lines, seen = [], set()
    original = launch.launch

    def recording(kernel, grid, args, *rest, **kw):
        name = getattr(getattr(kernel, "fn", kernel), "__name__", str(kernel))
        shown = {k: v for k, v in args.items()
                 if k in ("C", "num_warps", "num_stages", "DOT", "SDOT", "PREC", "FLAT")
                 or (k.startswith("B_") and isinstance(v, int))}
        shown.update({k: str(v.dtype).replace("torch.", "") for k, v in args.items()
                      if k.startswith(("starts_", "dstarts_")) and hasattr(v, "dtype")})
        line = f"  {name} grid={tuple(grid)} " + " ".join(f"{k}={v}" for k, v in shown.items())
        if (name, tuple(grid)) not in seen:
            seen.add((name, tuple(grid)))
            lines.append(line)
        return original(kernel, grid, args, *rest, **kw)
    launch.launch = recording
    return lines


def spec_call(name, params, B, T, H, d, gated, backward):
    op = hladsl.load(name, **params)
    gen = torch.Generator(device="cuda").manual_seed(0)
    args = []
    for n in op.inputs:
        x = torch.randn(B, T, H, d, device="cuda", generator=gen)
        if op.algebra.inputs[n] != op.out_dim and n not in op.queries:
            x = x / math.sqrt(d)
        args.append(x.bfloat16().requires_grad_(backward))
    g = (torch.nn.functional.logsigmoid(4 + torch.randn(B, T, H, device="cuda", generator=gen))
         if gated else None)

    return _step(lambda: op(*args, g=g), args, backward)


def fla_call(B, T, H, d, gated, backward):
    from fla.ops.simple_gla import chunk_simple_gla
    q, k, v = [torch.randn(B, T, H, d, device="cuda").bfloat16().requires_grad_(backward)
               for _ in range(3)]
    g = torch.nn.functional.logsigmoid(4 + torch.randn(B, T, H, device="cuda")) if gated else None

    return _step(lambda: chunk_simple_gla(q, k, v, g=g, scale=d ** -0.5), (q, k, v), backward)


def _step(forward, leaves, backward):
    """forward alone, or a training step as ``hladsl bench`` times it (``FwdBwd``: the
    backward from a fixed cotangent, the leaves' gradients reset first, which launches nothing)."""
    if not backward:
        return forward
    step = FwdBwd(forward, leaves)

    def call():
        step.reset_grads()
        step()
    return call


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("specs", nargs="+")
    parser.add_argument("--T", type=int, default=4096)
    parser.add_argument("--B", type=int, default=2)
    parser.add_argument("--H", type=int, default=16)
    parser.add_argument("--d", type=int, default=64)
    parser.add_argument("--gated", action="store_true")
    parser.add_argument("--mode", choices=("fwd", "fwd+bwd"), default="fwd+bwd")
    parser.add_argument("--launch", nargs="+", default=[], metavar="NAME=VALUE",
                        help="launch rule constants set for the hladsl calls (as hladsl bench's)")
    parser.add_argument("--json", default=None)
    parser.add_argument("--launches", action="store_true", help="print each kernel's first launch")
    args = parser.parse_args(argv)
    launches = launch_lines() if args.launches else None
    for name, value in parse_switches(args.launch).items():
        launch.switch(name, value)
    backward = args.mode == "fwd+bwd"
    shape = (args.B, args.T, args.H, args.d, args.gated, backward)
    report = {}
    calls = [(s, lambda s=s: spec_call(*parse_spec(s), *shape)) for s in args.specs]
    try:
        import fla  # noqa: F401
        calls.append(("fla simple_gla", lambda: fla_call(*shape)))
    except ImportError:
        pass
    for label, make in calls:
        try:
            rows = kernel_times(make())
        except Exception as error:   # fla's gated chunk path refuses triton 3.6 on Hopper (its issue 640)
            print(f"\n== {label}: failed: {type(error).__name__}: {str(error)[:200]}")
            continue
        total = sum(r[2] for r in rows)
        print(f"\n== {label} {args.mode} B={args.B} T={args.T} H={args.H} d={args.d}"
              f"{' gated' if args.gated else ''}: {total / 1e3:.3f} ms of kernels, "
              f"{sum(r[1] for r in rows)} launches")
        for name, count, us in rows[:25]:
            print(f"  {us:9.1f} us {100 * us / total:5.1f}%  x{count:<3d} {name}")
        if launches:
            print("\n".join(launches))
            launches.clear()
        report[label] = dict(total_us=total, kernels=rows)
        torch.cuda.empty_cache()
    if args.json:
        with open(args.json, "w") as f:
            json.dump(report, f, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
