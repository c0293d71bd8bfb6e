"""Each generated kernel of one call, timed alone under launch variants (a tuning aid):

    python benchmarks/kernel_sweep.py hla2 linear [--T 4096] [--gated] [--mode fwd+bwd]
        [--kernels state_pass reverse] [--json out.json]

One call of the op records every launch the launch layer makes (kernel, grid, arguments,
the value-dim tiling a split kernel allows); each launch is then replayed with
``do_bench`` under its default configuration and under warps x stages x value-dim blocks
(narrow blocks of kernels with chained dots run with fp32 tiles, as ``launch.dot_override``
rules: the narrow bf16 chains are what Hopper miscompiles). Replays write into the call's
own buffers, so values are garbage; only times are reported. Winners here are candidates
for the launch layer's rules: claims still come from ``hladsl bench``.
"""
from __future__ import annotations

import argparse
import json
import os
import sys

import torch
import triton
from triton.runtime.errors import OutOfResources

sys.path.insert(0, os.path.dirname(__file__))
from profile_kernels import spec_call  # noqa: E402

from hladsl.bench import parse_spec  # noqa: E402
from hladsl.runtime import launch  # noqa: E402

WARPS = (4, 8)
STAGES = (2, 3, 4)
WIDTHS = (16, 32, 64)


def record(call) -> list[tuple]:
    """(kernel, grid, args, tiling) of every launch.launch of one call."""
    seen = []
    original = launch.launch

    def recording(kernel, grid, args, may_fall_back, tiling=None):
        original(kernel, grid, args, may_fall_back, tiling)
        used = dict(args)
        key = launch._fallback_key(kernel, args)
        used.update(launch.FALLBACKS[launch._WORKING.get(key, 0)] if may_fall_back else {})
        seen.append((kernel, grid, used, tiling))
    launch.launch = recording
    try:
        call()
        torch.cuda.synchronize()
    finally:
        launch.launch = original
    return seen


def variants(grid, args, tiling):
    """(label, grid, args) of every configuration tried, the recorded one first."""
    yield "default", grid, args
    blocks = [({}, grid, {})]
    if tiling is not None:
        # packed dims keep their tile; every other split dim tries each width
        names = [n for n in _split_names(tiling) if f"pk_{n[2:]}_idx" not in args]
        for width in WIDTHS if names else ():
            chosen = {n: width for n in names}
            g, block = tiling.retile(chosen)
            blocks.append((chosen, g, block))
    for chosen, g, block in blocks:
        for w in WARPS:
            for s in STAGES:
                label = " ".join(f"{k}={v}" for k, v in chosen.items()) + f" w{w} s{s}"
                yield label.strip(), g, {**args, **block, "num_warps": w, "num_stages": s}


def _split_names(tiling) -> set[str]:
    # the block names retile sets: ask it with no choice
    _, block = tiling.retile({})
    return {k for k in block if k.startswith("B_")}


def time_us(kernel, grid, args) -> float | None:
    try:
        kernel[grid](**args)
        torch.cuda.synchronize()
    except OutOfResources:
        return None
    return 1e3 * triton.testing.do_bench(lambda: kernel[grid](**args), warmup=5, rep=40,
                                         return_mode="median")


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("specs", nargs="+")
    parser.add_argument("--T", type=int, default=4096)
    parser.add_argument("--B", type=int, default=2)
    parser.add_argument("--H", type=int, default=16)
    parser.add_argument("--d", type=int, default=64)
    parser.add_argument("--gated", action="store_true")
    parser.add_argument("--mode", choices=("fwd", "fwd+bwd"), default="fwd+bwd")
    parser.add_argument("--kernels", nargs="*", default=None, help="kernel name filter")
    parser.add_argument("--json", default=None)
    args = parser.parse_args(argv)
    report = {}
    for spec in args.specs:
        call = spec_call(*parse_spec(spec), args.B, args.T, args.H, args.d, args.gated,
                         args.mode == "fwd+bwd")
        # a bound forward call launches its kernels directly after its first call, past the
        # launch.launch that record() sees (run 182 recorded no launch of a forward)
        with launch.switched(BOUND_CALLS=False):
            call()
            launches = record(call)
        print(f"\n== {spec} {args.mode} B={args.B} T={args.T} H={args.H} d={args.d}"
              f"{' gated' if args.gated else ''}: {len(launches)} launches", flush=True)
        rows = []
        for i, (kernel, grid, kargs, tiling) in enumerate(launches):
            name = kernel.fn.__name__ if hasattr(kernel, "fn") else str(kernel)
            if args.kernels and not any(f in name for f in args.kernels):
                continue
            times = {}
            for label, g, a in variants(grid, kargs, tiling):
                times[label] = time_us(kernel, g, a)
            ok = {k: v for k, v in times.items() if v is not None}
            best = min(ok, key=ok.get)
            print(f"  [{i}] {name:22s} grid {str(grid):16s} default {ok['default']:8.1f} us   "
                  f"best {ok[best]:8.1f} us ({best})", flush=True)
            rows.append(dict(kernel=name, grid=list(grid), times=times))
        report[spec] = rows
        torch.cuda.empty_cache()
    if args.json:
        with open(args.json, "w") as f:
            json.dump(report, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
