"""Decode-step timings on the GPU (the bar: a step moves its state at >= 60% of copy bandwidth).

    python benchmarks/step_bench.py --out step.json [--sweep] [--specs linear,hla2]
    python benchmarks/step_bench.py --out regs.json --compile-only [--block-v 32]   # no GPU needed

For every shipped spec (bf16 tokens, fp32 state, B = 64, H = 16, d = dv = 64, one
gated token): the generated step kernel's time, the state bytes it moves (read +
write), the achieved GB/s, and a device-to-device copy of the same bytes in the
same run (ratio = copy time / step time: the fraction of copy bandwidth reached).
Times are triton.testing.do_bench medians of a CUDA graph of GRAPH_STEPS launches
divided by GRAPH_STEPS (launch overhead out, the way a captured decode loop runs);
"eager" is do_bench of one Python-level call. fla's fused_recurrent_simple_gla at
the same shape when fla is importable (its state moves once too, [B, H, d, dv]).
Also B = 1 latency of a whole op.step (scaling, kernel, cast) replayed from a CUDA
graph, for linear and hla2. --sweep also times launch variants (warps, value
blocks, packed rows) and reports the best. Prints a markdown table, writes JSON.
"""
from __future__ import annotations

import argparse
import json
import math

import torch
import triton
import triton.testing

import hladsl
from hladsl.codegen.step_plan import bridge_split, shared_splittable, splittable, step_plan
from hladsl.runtime import launch as launch_rules
from hladsl.runtime.step import run_step

SPECS = [("linear", {}), ("hla2", {}), ("ahla", {}), ("hla3", {}), ("hla3_masked", {}),
         ("power", {"p": 2}), ("power", {"p": 3})]
GRAPH_STEPS = 16
DEVICE = "cuda"


def graph_ms(fn, steps=GRAPH_STEPS) -> float:
    """Median ms of one ``fn`` call, from a CUDA graph of ``steps`` calls."""
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for _ in range(2):
            fn()                                  # compile, warm up
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(steps):
            fn()
    return triton.testing.do_bench(graph.replay) / steps


def tokens(B, T, H, d, dv, seed=0):
    gen = torch.Generator(device=DEVICE).manual_seed(seed)
    q = (torch.randn(B, T, H, d, device=DEVICE, generator=gen) / math.sqrt(d)).bfloat16()
    k = (torch.randn(B, T, H, d, device=DEVICE, generator=gen) / math.sqrt(d)).bfloat16()
    v = torch.randn(B, T, H, dv, device=DEVICE, generator=gen).bfloat16()
    g = torch.nn.functional.logsigmoid(4 + torch.randn(B, T, H, device=DEVICE, generator=gen))
    return q, k, v, g


def copy_ms(nbytes: int) -> float:
    """A device-to-device copy of ``nbytes`` (read ``nbytes``, write ``nbytes``)."""
    src = torch.empty(nbytes // 4, device=DEVICE)
    dst = torch.empty_like(src)
    return graph_ms(lambda: dst.copy_(src))


def variants(plan, sweep: bool):
    """Launch overrides to time (the first: the default). Where the bridged split
    applies, the shared split (bridged=False) and whole value blocks are timed too."""
    bridged = bridge_split(plan) is not None
    out = [{}]
    if bridged:
        out += [{"bridged": False}, {"block_v": 64}, {"free_warps": 4}, {"free_warps": 16}]
    if not sweep:
        return out
    out += [{"num_warps": w} for w in (2, 4, 8, 16)]
    if splittable(plan) or shared_splittable(plan):
        out += [{"block_v": bv, "num_warps": w} for bv in (16, 32, 64) for w in (4, 8, 16)]
    if bridged:
        out += [{"bridged": False, "block_v": bv, "num_warps": w} for bv in (32, 64) for w in (4, 8)]
        out += [{"free_warps": 8}, {"block_v": 64, "num_warps": 4}]
    if plan.packed:
        out += [{"packed_rows": r, "num_warps": w} for r in (16, 32, 128) for w in (4, 8)]
    return out


def bench_spec(name, params, B, H, d, dv, sweep):
    op = hladsl.load(name, **params)
    q, k, v, g = tokens(B, 1, H, d, dv)
    toks = {"q": q, "k": k, "v": v}
    state = {n: torch.zeros((B, H) + s, device=DEVICE) for n, s in op.state_shapes(d, dv).items()}
    state_bytes = sum(x.numel() * x.element_size() for x in state.values())
    moved = 2 * state_bytes                                   # read once, written once
    plan = step_plan(op.algebra, {"d": d, "dv": dv})
    label = name + "".join(f" {k}={v}" for k, v in params.items())
    row = dict(spec=label, B=B, H=H, d=d, dv=dv, state_MB=state_bytes / 1e6, moved_MB=moved / 1e6)
    row["copy_ms"] = copy_ms(state_bytes)
    row["copy_GBps"] = moved / row["copy_ms"] / 1e6
    results = []
    for launch in variants(plan, sweep):
        try:
            with split_rule(launch):
                ms = graph_ms(lambda launch=launch: run_step(op.algebra, toks, g, state, backend="triton",
                                                             **overrides(launch)))
        except Exception as exc:       # a variant that does not compile or fit
            results.append(dict(launch=launch, error=str(exc)[:200]))
            continue
        results.append(dict(launch=launch, ms=ms))
    ok = [r for r in results if "ms" in r]
    default = results[0]
    best = min(ok, key=lambda r: r["ms"]) if ok else default
    row.update(step_ms=default.get("ms"), best_ms=best.get("ms"), best_launch=best["launch"],
               variants=results)
    if row["step_ms"]:
        row["step_GBps"] = moved / row["step_ms"] / 1e6
        row["ratio"] = row["copy_ms"] / row["step_ms"]
    if row["best_ms"]:
        row["best_ratio"] = row["copy_ms"] / row["best_ms"]
    with split_rule(best["launch"]):
        row["eager_ms"] = triton.testing.do_bench(
            lambda: run_step(op.algebra, toks, g, state, backend="triton", **overrides(best["launch"])))
    return row


def split_rule(launch: dict):
    """launch.STEP_BRIDGED and STEP_FREE_WARPS as a variant's "bridged" and
    "free_warps" say, for its calls."""
    return launch_rules.switched(STEP_BRIDGED=launch.get("bridged", launch_rules.STEP_BRIDGED),
                                 STEP_FREE_WARPS=launch.get("free_warps", launch_rules.STEP_FREE_WARPS))


def overrides(launch: dict) -> dict:
    return {k: v for k, v in launch.items() if k not in ("bridged", "free_warps")}


def bench_fla(B, H, d, dv):
    try:
        from fla.ops.simple_gla import fused_recurrent_simple_gla
    except Exception as exc:
        return dict(spec="fla fused_recurrent_simple_gla", error=f"not importable: {exc}"[:200])
    q, k, v, g = tokens(B, 1, H, d, dv)
    state = torch.zeros(B, H, d, dv, device=DEVICE)
    moved = 2 * state.numel() * 4

    def call():
        return fused_recurrent_simple_gla(q, k, v, g, scale=d ** -0.5, initial_state=state,
                                          output_final_state=True)
    row = dict(spec="fla fused_recurrent_simple_gla", B=B, H=H, d=d, dv=dv, moved_MB=moved / 1e6)
    try:
        row["copy_ms"] = copy_ms(moved // 2)
        row["copy_GBps"] = moved / row["copy_ms"] / 1e6
        row["step_ms"] = graph_ms(call)
        row["eager_ms"] = triton.testing.do_bench(call)
        row["step_GBps"] = moved / row["step_ms"] / 1e6
        row["ratio"] = row["copy_ms"] / row["step_ms"]
    except Exception as exc:
        row["error"] = str(exc)[:200]
    return row


def latency_b1(name, H, d, dv, sweep=False):
    """One whole op.step (validation, kernel) for B = 1, replayed from a CUDA graph;
    with ``sweep`` also the kernel alone (run_step) under each launch variant."""
    op = hladsl.load(name)
    q, k, v, g = tokens(1, 1, H, d, dv)
    state = {n: torch.zeros((1, H) + s, device=DEVICE) for n, s in op.state_shapes(d, dv).items()}
    ms = graph_ms(lambda: op.step(q, k, v, g=g, state=state), steps=1)
    row = dict(spec=name, B=1, H=H, d=d, dv=dv, graph_latency_us=ms * 1e3,
               eager_latency_us=triton.testing.do_bench(
                   lambda: op.step(q, k, v, g=g, state=state)) * 1e3)
    if sweep:
        toks = {"q": q, "k": k, "v": v}
        plan = step_plan(op.algebra, {"d": d, "dv": dv})
        row["variants"] = []
        for launch in variants(plan, True):
            try:
                with split_rule(launch):
                    us = 1e3 * graph_ms(lambda launch=launch: run_step(
                        op.algebra, toks, g, state, backend="triton", **overrides(launch)), steps=1)
            except Exception as exc:
                row["variants"].append(dict(launch=launch, error=str(exc)[:200]))
                continue
            row["variants"].append(dict(launch=launch, graph_us=us))
        ok = [r for r in row["variants"] if "graph_us" in r]
        if ok:
            best = min(ok, key=lambda r: r["graph_us"])
            row.update(best_graph_us=best["graph_us"], best_launch=best["launch"])
    return row


def compile_only(B, H, d, T=1, warps=None, block_v=None) -> list[dict]:
    """Compile every spec's step kernels for sm_90 without a GPU (Triton's own
    ptxas) and report registers and spills per thread at the default launch
    (value block from launch.step_value_block unless ``block_v``)."""
    from hladsl.codegen.step_gen import PACKED_ROWS, step_kernel
    from hladsl.codegen.triton_gen import block_size
    from hladsl.runtime import launch
    from hladsl.runtime.step import _elements, _warps
    rows = []
    for name, params in SPECS:
        alg = hladsl.load(name, **params).algebra
        module, ctx = step_kernel(alg, {"d": d, "dv": d}, True)
        plan = step_plan(alg, {"d": d, "dv": d})
        width = block_v or launch.step_value_block(d, ctx["split"], ctx["shared"])
        consts = {f"str_{x['name']}_f": 1 for x in ctx["inputs"]}
        consts.update({f"str_{s['name']}_{s['axes'] - 1}": 1 for s in ctx["states"]})
        for dim, n in ctx["sizes"]:
            consts[f"D_{dim}"], consts[f"B_{dim}"] = n, block_size(n)
        consts[f"B_{plan.value_dim}"] = width
        for pd in ctx["packed"]:    # as runtime.step._Setup: whole where only the free update walks it
            consts[f"D_{pd['name']}"] = pd["size"]
            consts[f"B_{pd['name']}"] = (PACKED_ROWS if pd["name"] in plan.packed_names()
                                         else min(launch.STEP_FREE_ROWS, block_size(pd["size"])))
        consts.update(T_BLOCK=max(2, triton.next_power_of_2(T)), INDEXED=False, ACC=tl_float32())
        if ctx["shared"]:
            consts["SHARED"] = width < block_size(d)
        if T == 1:
            consts["T"] = 1
        label = name + "".join(f" {k}={v}" for k, v in params.items())
        if ctx["bridges"] and launch.STEP_BRIDGED:
            width = block_v or launch.step_value_block(d, ctx["split"], ctx["shared"], bridged=True)
            consts.update({f"B_{plan.value_dim}": width, "BR_W": ctx["bridge_width"]})
            free_warps = launch.step_free_warps(_elements(plan, block_size(d), PACKED_ROWS,
                                                          ctx["free_names"])[0])
            nw = warps or _warps(plan, width, PACKED_ROWS, ctx["value_names"])
            row = dict(spec=label, block_v=width, warps=nw, free_warps=free_warps,
                       resources=_resources(module.value_kernel, consts, nw),
                       free_resources=_resources(module.free_kernel, consts, free_warps))
            rows.append(row)
            print(json.dumps(row), flush=True)
            continue
        everything = [n for n, _ in plan.states]
        nw = warps or _warps(plan, width, PACKED_ROWS, everything, ctx["shared"] and width < block_size(d))
        row = dict(spec=label, block_v=width, warps=nw,
                   resources=_resources(module.step_kernel, consts, nw))
        rows.append(row)
        print(json.dumps(row), flush=True)
    return rows


def tl_float32():
    import triton.language as tl
    return tl.float32


def _resources(fn, consts: dict, warps: int) -> list[str]:
    """cuobjdump's REG/STACK/... line of ``fn`` compiled for sm_90 with ``consts``."""
    import glob
    import os
    import subprocess
    import tempfile

    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource
    cuobjdump = glob.glob(os.path.join(os.path.dirname(triton.__file__),
                                       "backends/nvidia/bin/cuobjdump"))[0]
    consts = {k: v for k, v in consts.items() if k in fn.arg_names}
    sig = {}
    for p in fn.params:
        n = p.name
        if n in consts or p.is_constexpr:
            sig[n] = "constexpr"
        elif n.endswith(("_idx", "rows_ptr", "cnt_ptr")):
            sig[n] = "*i32"
        elif n.startswith("in_"):
            sig[n] = "*bf16"
        elif n.endswith(("_ptr", "_mult")):
            sig[n] = "*fp32"
        else:
            sig[n] = "fp32" if n == "eps" else "i32"
    # as a launch specialises them: pointers and strides divisible by 16
    aligned = {(fn.arg_names.index(n),): [["tt.divisibility", 16]] for n, t in sig.items()
               if t != "constexpr" and n not in ("T", "H", "eps") and not n.startswith("str_g")}
    src = ASTSource(fn=fn, signature=sig, attrs=aligned,
                    constexprs={(fn.arg_names.index(k),): v for k, v in consts.items()})
    kernel = triton.compile(src, target=GPUTarget("cuda", 90, 32), options={"num_warps": warps})
    with tempfile.NamedTemporaryFile("wb", suffix=".cubin", delete=False) as f:
        f.write(kernel.asm["cubin"])
    info = subprocess.run([cuobjdump, "--dump-resource-usage", f.name],
                          capture_output=True, text=True, check=False).stdout
    os.unlink(f.name)
    return [line.strip() for line in info.splitlines() if "REG:" in line]


def table(rows, latencies) -> str:
    lines = ["| spec | state MB | step µs | GB/s | copy µs | copy GB/s | ratio | best µs (launch) | best ratio | eager µs |",
             "|---|---|---|---|---|---|---|---|---|---|"]

    def us(x):
        return f"{x * 1e3:.1f}" if isinstance(x, float) else "-"
    for r in rows:
        if "error" in r and "step_ms" not in r:
            lines.append(f"| {r['spec']} | {r['error']} |||||||||")
            continue
        lines.append(
            f"| {r['spec']} | {r.get('state_MB', r.get('moved_MB', 0) / 2):.1f} | {us(r.get('step_ms'))} "
            f"| {r.get('step_GBps', 0):.0f} | {us(r.get('copy_ms'))} | {r.get('copy_GBps', 0):.0f} "
            f"| {r.get('ratio', 0):.2f} | {us(r.get('best_ms'))} ({r.get('best_launch', '')}) "
            f"| {r.get('best_ratio', 0):.2f} | {us(r.get('eager_ms'))} |")
    lines += ["", "| B = 1 op.step | graph µs | eager µs | best kernel graph µs (launch) |", "|---|---|---|---|"]
    for r in latencies:
        best = f"{r['best_graph_us']:.1f} ({r['best_launch']})" if "best_graph_us" in r else "-"
        lines.append(f"| {r['spec']} | {r['graph_latency_us']:.1f} | {r['eager_latency_us']:.1f} | {best} |")
    return "\n".join(lines)


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", required=True, help="JSON file to write")
    parser.add_argument("--sweep", action="store_true", help="also time launch variants")
    parser.add_argument("--specs", default="", help="comma-separated spec names (default: all)")
    parser.add_argument("-B", type=int, default=64)
    parser.add_argument("-H", type=int, default=16)
    parser.add_argument("-d", type=int, default=64)
    parser.add_argument("--block-v", type=int, default=None,
                        help="--compile-only at this value block (default: the launch rule's)")
    parser.add_argument("--compile-only", action="store_true",
                        help="compile the kernels for sm_90 (no GPU needed): registers, spills")
    args = parser.parse_args()
    if args.compile_only:
        rows = [r for w in ([None] + ([2, 4, 8, 16] if args.sweep else []))
                for r in compile_only(args.B, args.H, args.d, warps=w, block_v=args.block_v)]
        with open(args.out, "w") as f:
            json.dump({"triton": triton.__version__, "compile_only": rows}, f, indent=1)
        return
    wanted = set(filter(None, args.specs.split(",")))
    rows = []
    for name, params in SPECS:
        if wanted and name not in wanted:
            continue
        try:
            rows.append(bench_spec(name, params, args.B, args.H, args.d, args.d, args.sweep))
        except Exception as exc:
            rows.append(dict(spec=name, params=params, error=str(exc)[:300]))
        print(json.dumps({k: v for k, v in rows[-1].items() if k != "variants"}), flush=True)
        torch.cuda.empty_cache()
    rows.append(bench_fla(args.B, args.H, args.d, args.d))
    latencies = [latency_b1(name, args.H, args.d, args.d, args.sweep) for name in ("linear", "hla2")
                 if not wanted or name in wanted]
    print(table(rows, latencies))
    with open(args.out, "w") as f:
        json.dump({"device": torch.cuda.get_device_name(), "triton": triton.__version__,
                   "torch": torch.__version__, "rows": rows, "b1": latencies}, f, indent=1)


if __name__ == "__main__":
    main()
