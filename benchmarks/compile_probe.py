"""Compile time, registers and spills of every generated chunk kernel (forward and
backward) for sm_90, without a GPU: the launches of ``forward_triton`` and
``backward_triton`` are recorded on CPU tensors instead of run, then each kernel is
compiled with Triton's own ptxas the way that launch would specialise it.

    python benchmarks/compile_probe.py hla2 [--d 64] [--chunk 64] [--schedule scan|staged] [--ungated]
        [--pairs 32] [--sms 132] [--forward] [--carried] [--only grad_kernel] [--launch NAME=VALUE ...]
        [--out probe.json]

``--pairs`` (sequence, head) pairs on a GPU of ``--sms`` SMs: the launch rules pick the block
widths of that call (hla2's scan at d = 128: 32 pairs on 132 SMs give blocks of 32), not of
the probe's own tiny one.

The launches record a bf16 call's tile dtypes (DOT, SDOT) as on a GPU, not the fp32 tiles
a CPU tensor gets under the interpreter.

Run without TRITON_INTERPRET (the kernels must be real JIT functions). The seconds
are this machine's (a GPU host's CPU compiles faster); the comparison between
kernels and specs is what they are for (DESIGN's bar: no kernel over 60 s on the H100).
"""
from __future__ import annotations

import argparse
import glob
import json
import os
import subprocess
import tempfile
import time

import torch

import hladsl
from hladsl.ir.pipeline import chunk_program
from hladsl.runtime import launch

_TYPES = {torch.float32: "fp32", torch.bfloat16: "bf16", torch.float16: "fp16",
          torch.int32: "i32", torch.int64: "i64"}


def record(name: str, params: dict, d: int, gated: bool, chunk: int = 64, schedule: str = "two_pass",
           pairs: int = 2, n_sms: int = 132, backward: bool = True, carried: bool = False):
    """(kernel, args) of every launch of the forward (a call with nothing to differentiate)
    and, with ``backward``, the backward at a small shape, with the block widths the launch
    rules give ``pairs`` (sequence, head) pairs on ``n_sms`` SMs."""
    from hladsl.runtime.triton_backward import backward_triton
    from hladsl.runtime.triton_forward import forward_triton
    alg = hladsl.compile_spec(name, **params)
    if carried:   # the form a call with no state runs (ir.carried)
        from hladsl.runtime.op import carried_compilation
        found = carried_compilation(alg)
        if found is None:
            raise SystemExit(f"{name} has no carried form")
        alg = found[0].algebra
    program = chunk_program(alg, chunk, tuple(sorted((x, d) for x in alg.dims)), gated)
    N, H, nC = 1, pairs, 2
    tiles = {x: torch.randn(N, H, nC, chunk, d, dtype=torch.bfloat16) for x in alg.inputs}
    lam = (-0.01 * torch.rand(N, H, nC, chunk)).cumsum(-1) if gated else None
    init = {s: torch.zeros(N, H, *program.state_shape(s)) for s, _ in program.states}
    launches = []
    real, real_dot, real_sms = launch.launch, launch.dot_dtype, launch.sms
    launch.launch = lambda kernel, grid, args, may, tiling=None: launches.append((kernel, args))
    launch.dot_dtype = lambda dtype, device=None: real_dot(dtype)   # a GPU's tiles, not the interpreter's
    launch.sms = lambda device: n_sms
    try:
        forward_triton(program, tiles, lam, init, alg.eps, schedule=schedule)
        if backward:
            backward_triton(program, tiles, lam, init,
                            torch.randn(N, H, nC, chunk, d), None, alg.eps, schedule=schedule)
    except Exception:   # a launcher reading a result it recorded instead of computing
        pass
    finally:
        launch.launch, launch.dot_dtype, launch.sms = real, real_dot, real_sms
    return launches


def compile_one(kernel, args: dict) -> dict:
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource
    options = {k: args[k] for k in ("num_warps", "num_stages", "maxnreg") if k in args}
    sig, consts, attrs = {}, {}, {}
    for p in kernel.params:
        n = p.name
        value = args.get(n)
        if p.is_constexpr:
            sig[n], consts[n] = "constexpr", value
        elif isinstance(value, torch.Tensor):
            sig[n] = "*" + _TYPES[value.dtype]
            attrs[(kernel.arg_names.index(n),)] = [["tt.divisibility", 16]]
        elif isinstance(value, bool):
            sig[n] = "i1"
        elif isinstance(value, int):
            if value == 1:   # a launch specialises ints equal to 1 into constants
                sig[n], consts[n] = "constexpr", 1
            else:
                sig[n] = "i32" if abs(value) < 2 ** 31 else "i64"
                if value % 16 == 0:
                    attrs[(kernel.arg_names.index(n),)] = [["tt.divisibility", 16]]
        else:
            sig[n] = "fp32"
    src = ASTSource(fn=kernel, signature=sig, attrs=attrs,
                    constexprs={(kernel.arg_names.index(k),): v for k, v in consts.items()})
    start = time.time()
    compiled = triton.compile(src, target=GPUTarget("cuda", 90, 32), options=options)
    seconds = time.time() - start
    cuobjdump = glob.glob(os.path.join(os.path.dirname(triton.__file__),
                                       "backends/nvidia/bin/cuobjdump"))
    usage = ""
    if cuobjdump:
        with tempfile.NamedTemporaryFile("wb", suffix=".cubin", delete=False) as f:
            f.write(compiled.asm["cubin"])
        out = subprocess.run([cuobjdump[0], "--dump-resource-usage", f.name],
                             capture_output=True, text=True, check=False).stdout
        os.unlink(f.name)
        usage = " ".join(line.strip() for line in out.splitlines() if "REG:" in line)
    return {"kernel": kernel.fn.__name__, "seconds": round(seconds, 1), "resources": usage,
            "dynamic_shared": getattr(compiled.metadata, "shared", None), **options}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("spec")
    parser.add_argument("-p", "--param", action="append", default=[], metavar="KEY=VALUE")
    parser.add_argument("--d", type=int, default=64)
    parser.add_argument("--chunk", type=int, default=64)
    parser.add_argument("--ungated", action="store_true")
    parser.add_argument("--schedule", default="two_pass", choices=("two_pass", "scan", "staged"),
                        help="staged: a forward's complete scan in two stages (the backward's is one)")
    parser.add_argument("--forward", action="store_true", help="the forward's kernels only")
    parser.add_argument("--carried", action="store_true", help="the spec's carried form (ir.carried)")
    parser.add_argument("--pairs", type=int, default=2, help="(sequence, head) pairs of the call")
    parser.add_argument("--sms", type=int, default=132, help="SMs of the GPU the widths are chosen for")
    parser.add_argument("--launch", nargs="+", default=[], metavar="NAME=VALUE",
                        help="launch rule constants set while recording (as hladsl bench's)")
    parser.add_argument("--only", default=None, metavar="KERNEL",
                        help="compile only the launches of this kernel (e.g. grad_kernel)")
    parser.add_argument("--out", default=None, help="write the rows as JSON here")
    args = parser.parse_args()
    from hladsl.bench import parse_switches
    for name, value in parse_switches(args.launch).items():
        launch.switch(name, value)
    if os.environ.get("TRITON_INTERPRET") == "1":
        parser.error("unset TRITON_INTERPRET: the probe compiles real kernels")
    # a fresh Triton cache unless one is given: cached kernels would time as 0 s
    os.environ.setdefault("TRITON_CACHE_DIR", tempfile.mkdtemp(prefix="hladsl-probe-"))
    params = {k: int(v) for k, v in (item.split("=", 1) for item in args.param)}
    rows = []
    for kernel, kargs in record(args.spec, params, args.d, not args.ungated, args.chunk,
                                 args.schedule, args.pairs, args.sms, not args.forward, args.carried):
        if args.only and kernel.fn.__name__ != args.only:
            continue
        which = {k: kargs[k] for k in ("TARGETS", "PART", "PARTS", "LAM") if k in kargs}
        row = dict(**which, spec=args.spec, d=args.d, chunk=args.chunk, gated=not args.ungated, **compile_one(kernel, kargs))
        rows.append(row)
        print(json.dumps(row), flush=True)
    if args.out:
        with open(args.out, "w") as f:
            json.dump(rows, f, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
