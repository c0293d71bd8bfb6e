"""``hladsl bench``: time specs beside the installed baselines.

    hladsl bench                                   # CUDA if present, every shipped spec
    hladsl bench --specs linear hla2 power:p=3 --T 4096 16384 --modes fwd step
    hladsl bench --device cpu --quick              # tiny shapes, under a minute

Modes: "fwd" (the op's forward, no autograd), "fwd+bwd" (forward, then backward from a
fixed random cotangent of the output, ``FwdBwd``), "mem" (peak CUDA memory one fwd+bwd call allocates beyond its
inputs, MB; CUDA only), "step" (decode: one token per sequence through ``op.step`` on a
state; for SDPA one query against a KV cache of T tokens). Baselines, in this order
when installed: fla ``chunk_simple_gla`` / ``fused_recurrent_simple_gla`` (CUDA),
torch SDPA causal (always), retention ``power_retention`` p = 2 (CUDA, gated as it
always is, no decode step). Ratios are to the first baseline that ran at each shape.
CUDA times are ``triton.testing.do_bench`` medians; CPU times the median of a
simple timer loop. Writes a table (stdout), JSON and a PNG plot; progress goes to
stderr. ``benchmarks/gpu.py bench`` is ``hladsl bench``; its ``schedules`` is
``hladsl bench --schedule two_pass fused``; only its ``check`` (bf16 kernels against
the fp32 torch program, forward and gradients) stays there: an accuracy test, not a
timing.
"""
from __future__ import annotations

import argparse
import json
import math
import platform
import statistics
import sys
import time

import torch

import hladsl
from hladsl.errors import SpecError
from hladsl.runtime import launch

BASELINES = ("fla", "sdpa", "retention")
MODES = ("fwd", "fwd+bwd", "mem", "step")
SCHEDULES = launch.SCHEDULES
DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32,
          "fp64": torch.float64}


class Unavailable(Exception):
    """This candidate cannot run here (not installed, no CUDA, no such mode)."""


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--specs", nargs="+", default=None, metavar="SPEC[:K=V,...]",
                        help="spec names or .hla paths, parameters after a colon "
                             "(power:p=3); default: every shipped spec")
    parser.add_argument("--baselines", nargs="*", default=list(BASELINES), choices=BASELINES,
                        help="baselines to time when installed (none: give the flag alone)")
    parser.add_argument("--T", nargs="+", type=int, default=None, help="sequence lengths")
    parser.add_argument("--d", nargs="+", type=int, default=None, help="head dims (dv = d)")
    parser.add_argument("--modes", nargs="+", default=list(MODES), choices=MODES)
    parser.add_argument("--B", type=int, default=None, help="batch size (fwd, fwd+bwd)")
    parser.add_argument("--step-batch", type=int, default=None,
                        help="batch size of the decode step (default 64 on CUDA)")
    parser.add_argument("--H", type=int, default=None, help="heads")
    parser.add_argument("--dtype", choices=sorted(DTYPES), default=None,
                        help="input dtype (default bf16 on CUDA, fp32 on CPU)")
    parser.add_argument("--device", choices=("cuda", "cpu"), default=None,
                        help="default: cuda when available")
    parser.add_argument("--gated", action="store_true",
                        help="give specs and fla a data-dependent log gate")
    parser.add_argument("--schedule", nargs="+", default=["auto"], choices=SCHEDULES,
                        help="Triton schedules to time for each spec (several: side by side)")
    parser.add_argument("--launch", nargs="+", action="append", default=[], metavar="NAME=VALUE",
                        help="launch rule constants (hladsl.runtime.launch, e.g. REVERSE_IN_PLACE=false): "
                             "each spec is timed with the defaults and again with these, side by side "
                             "(repeat --launch for more variants, one row each)")
    parser.add_argument("--backward-seed", choices=SEEDS, default="cotangent",
                        help="fwd+bwd and mem: the backward from a fixed random cotangent, gradients "
                             "reset between timed calls (default), or from out.float().sum() with "
                             "gradients accumulating (the harness of rounds <= 30)")
    parser.add_argument("--quick", action="store_true", help="small shapes, short timing")
    parser.add_argument("--json", default="hladsl-bench.json", help="where to write the JSON")
    parser.add_argument("--plot", default="hladsl-bench.png",
                        help="where to write the PNG plot ('' for none)")


# -- what is timed ---------------------------------------------------------------------
def parse_spec(text: str) -> tuple[str, dict]:
    name, _, rest = text.partition(":")
    params = {}
    for item in filter(None, rest.split(",")):
        key, eq, value = item.partition("=")
        if not eq:
            raise ValueError(f"--specs {text}: expected key=value after the colon, got '{item}'")
        params[key.strip()] = launch.parse_value(value.strip())
    return name, params


def parse_switches(items: list[str]) -> dict:
    """--launch NAME=VALUE ... -> {NAME: value}, each checked against launch's constants."""
    out = {}
    for item in items:
        name, eq, text = item.partition("=")
        if not eq:
            raise ValueError(f"--launch {item}: expected NAME=VALUE")
        value = launch.parse_value(text.strip())
        try:
            launch.check_switch(name.strip(), value)
        except ValueError as exc:
            raise ValueError(f"--launch {item}: {exc}") from None
        out[name.strip()] = value
    return out


def _inputs(B, T, H, d, dtype, device, gated, grad=False, seed=0):
    gen = torch.Generator(device=device).manual_seed(seed)
    q = torch.randn(B, T, H, d, device=device, generator=gen).to(dtype)
    k = (torch.randn(B, T, H, d, device=device, generator=gen) / math.sqrt(d)).to(dtype)
    v = torch.randn(B, T, H, d, device=device, generator=gen).to(dtype)
    g = _log_gates(B, T, H, device) if gated else None
    if grad:
        q, k, v = (x.requires_grad_() for x in (q, k, v))
    return q, k, v, g


def _log_gates(B, T, H, device):
    gen = torch.Generator(device=device).manual_seed(1)
    return torch.nn.functional.logsigmoid(4 + torch.randn(B, T, H, device=device, generator=gen))


def _grad_mode(mode):
    """The mode a candidate is built for: "mem" measures a fwd+bwd call."""
    return "fwd+bwd" if mode == "mem" else mode


SEEDS = ("cotangent", "sum")


class FwdBwd:
    """What a training step asks of a candidate: its forward, then its backward.
    ``seed`` "cotangent" (the default): the backward from a fixed random cotangent of
    the output, the leaves' ``.grad`` reset to None between timed calls and outside the
    timed region (do_bench's ``grad_to_none``), as after ``zero_grad(set_to_none=True)``.
    "sum": ``out.float().sum().backward()`` with gradients accumulating -- the harness of
    rounds <= 30, which times a cast, a reduction, its broadcast and one add per leaf
    besides the candidate's own kernels (0.4 ms of fla's 1.26 at T = 16k, run 213)."""

    def __init__(self, fn, leaves):
        self.fn, self.seed, self._cotangent = fn, "cotangent", None
        self.leaves = [x for x in leaves if x is not None and x.requires_grad]

    def __call__(self):
        out = self.fn()
        out = out[0] if isinstance(out, tuple) else out
        if self.seed == "sum":
            out.float().sum().backward()
            return
        if self._cotangent is None:   # made at the first (untimed) call: the output's shape
            gen = torch.Generator(device=out.device).manual_seed(2)
            self._cotangent = torch.randn(out.shape, generator=gen, device=out.device).to(out.dtype)
        out.backward(self._cotangent)

    def reset_grads(self):
        for x in self.leaves:
            x.grad = None


def spec_case(name, params, schedule, switches=None):
    """switches: launch rule constants set while this candidate is built and timed."""
    op = hladsl.load(name, **params)

    def tokens(B, T, H, d, dtype, device, grad):
        """One [B, T, H, d] tensor per declared token input (every dim of size d);
        inputs off the value dim are scaled by d^-0.5, as keys usually are."""
        gen = torch.Generator(device=device).manual_seed(0)
        out = []
        for n in op.inputs:
            x = torch.randn(B, T, H, d, device=device, generator=gen)
            if op.algebra.inputs[n] != op.out_dim and n not in op.queries:
                x = x / math.sqrt(d)
            out.append(x.to(dtype).requires_grad_(grad))
        return out

    def build(mode, shape):   # timed right after it is built: the schedule holds meanwhile
        B, T, H, d, dtype, device, gated, step_batch = shape
        op.schedule = schedule
        for key, value in (switches or {}).items():
            launch.switch(key, value)
        rows = step_batch if mode == "step" else B
        g = _log_gates(rows, 1 if mode == "step" else T, H, device) if gated else None
        if mode == "step":
            args = tokens(step_batch, 1, H, d, dtype, device, False)
            state_dtype = torch.float64 if dtype == torch.float64 else torch.float32
            sizes = {dim: d for dim in op.algebra.dims}
            state = {n: torch.zeros((step_batch, H) + s, dtype=state_dtype, device=device)
                     for n, s in op.state_shapes(**sizes).items()}
            return lambda: op.step(*args, g=g, state=state)
        args = tokens(B, T, H, d, dtype, device, mode == "fwd+bwd")

        def fn():
            return op(*args, g=g)

        timed = FwdBwd(fn, args) if mode == "fwd+bwd" else fn
        # the algebra these calls run (no state in or out: the carried form where launch takes
        # it), whose cost model's FLOPs give the TFLOP/s column
        timed.algebra = (op._carried_op(args[0], None, False) or op).algebra
        return timed
    return build


def sdpa_case(mode, shape):
    from torch.nn.functional import scaled_dot_product_attention as sdpa
    B, T, H, d, dtype, device, gated, step_batch = shape
    if mode == "step":   # one query against a KV cache of T tokens
        q, _, _, _ = _inputs(step_batch, 1, H, d, dtype, device, False)
        _, k, v, _ = _inputs(step_batch, T, H, d, dtype, device, False)
        q, k, v = (x.transpose(1, 2).contiguous() for x in (q, k, v))
        return lambda: sdpa(q, k, v)
    q, k, v, _ = _inputs(B, T, H, d, dtype, device, False)
    q, k, v = (x.transpose(1, 2).contiguous().requires_grad_(mode == "fwd+bwd") for x in (q, k, v))

    def fn():
        return sdpa(q, k, v, is_causal=True)

    return FwdBwd(fn, (q, k, v)) if mode == "fwd+bwd" else fn


def fla_case(mode, shape):
    B, T, H, d, dtype, device, gated, step_batch = shape
    if device != "cuda":
        raise Unavailable("fla runs on CUDA only")
    try:
        from fla.ops.simple_gla import chunk_simple_gla, fused_recurrent_simple_gla
    except ImportError as exc:
        raise Unavailable(f"fla not installed ({exc})") from None
    if mode == "step":
        q, k, v, g = _inputs(step_batch, 1, H, d, dtype, device, gated)
        state = torch.zeros(step_batch, H, d, d, device=device, dtype=torch.float32)
        return lambda: fused_recurrent_simple_gla(q, k, v, g=g, scale=d ** -0.5,
                                                  initial_state=state, output_final_state=True)
    q, k, v, g = _inputs(B, T, H, d, dtype, device, gated, grad=mode == "fwd+bwd")

    def fn():
        return chunk_simple_gla(q, k, v, g=g, scale=d ** -0.5)

    return FwdBwd(fn, (q, k, v)) if mode == "fwd+bwd" else fn


def retention_case(mode, shape):
    B, T, H, d, dtype, device, gated, step_batch = shape
    if device != "cuda":
        raise Unavailable("retention runs on CUDA only")
    if mode == "step":
        raise Unavailable("retention has no decode step here")
    try:
        from retention import power_retention
    except ImportError as exc:
        raise Unavailable(f"retention not installed ({exc})") from None
    q, k, v, _ = _inputs(B, T, H, d, dtype, device, False, grad=mode == "fwd+bwd")
    log_g = torch.nn.functional.logsigmoid(torch.randn(B, T, H, device=device))

    def fn():
        return power_retention(q, k, v, log_g, deg=2, chunk_size=1024)

    return FwdBwd(fn, (q, k, v)) if mode == "fwd+bwd" else fn


BASELINE_CASES = {
    "fla": ("fla simple_gla", fla_case),
    "sdpa": ("sdpa causal", sdpa_case),
    "retention": ("retention p=2 gated", retention_case),
}


# -- timing ----------------------------------------------------------------------------
def time_ms(fn, device, quick, mode) -> float:
    grad = torch.enable_grad() if mode == "fwd+bwd" else torch.no_grad()
    fresh = isinstance(fn, FwdBwd) and fn.seed == "cotangent"   # grads reset between calls, untimed
    with grad:
        if device == "cuda":
            import triton.testing
            return triton.testing.do_bench(fn, warmup=5 if quick else 25, rep=20 if quick else 100,
                                           grad_to_none=fn.leaves if fresh else None,
                                           return_mode="median")
        budget, samples, start = (0.05 if quick else 0.5), [], time.perf_counter()
        while len(samples) < 5 or (time.perf_counter() - start < budget and len(samples) < 100):
            if fresh:
                fn.reset_grads()
            t0 = time.perf_counter()
            fn()
            samples.append((time.perf_counter() - t0) * 1e3)
        return statistics.median(samples)


def _defaults(args, device):
    cuda = device == "cuda"
    quick = args.quick
    def pick(a, b, c, e):
        return (a if quick else b) if cuda else (c if quick else e)

    return dict(
        T=args.T or pick([1024, 4096], [4096, 16384], [64, 128], [256, 1024]),
        d=args.d or pick([64], [64], [16], [32]),
        B=args.B or pick(2, 2, 1, 1),
        H=args.H or pick(16, 16, 2, 2),
        step_batch=args.step_batch or pick(64, 64, 2, 4),
        dtype=DTYPES[args.dtype] if args.dtype else (torch.bfloat16 if cuda else torch.float32))


def _progress(text, end="\n"):
    print(text, end=end, file=sys.stderr, flush=True)


def run(args) -> int:
    device = args.device or ("cuda" if torch.cuda.is_available() else "cpu")
    if device == "cuda" and not torch.cuda.is_available():
        print("hladsl bench: --device cuda but CUDA is not available", file=sys.stderr)
        return 1
    cfg = _defaults(args, device)
    try:
        specs = [parse_spec(s) for s in (args.specs or _shipped())]
        candidates = [BASELINE_CASES[b] for b in BASELINES if b in args.baselines]
        groups = [parse_switches(items) for items in args.launch]
        # with --launch: every spec with the defaults, then with each group of switches (each
        # build sets every switched constant, so the order of candidates does not matter)
        defaults = _launch_defaults(groups)
        variants = [(defaults, "")] + [({**defaults, **g}, " {" + _fmt(g) + "}") for g in groups]
        for name, params in specs:
            for schedule in args.schedule:
                for switches, tag in variants:
                    label = "hladsl " + name + (f"({_fmt(params)})" if params else "")
                    if len(args.schedule) > 1:
                        label += f" [{schedule}]"
                    label += tag
                    candidates.append((label, spec_case(name, params, schedule, switches)))
    except (ValueError, SpecError) as exc:
        print(f"hladsl bench: {exc}", file=sys.stderr)
        return 1
    try:
        return _time_candidates(args, device, cfg, candidates)
    finally:
        for key, value in defaults.items():
            launch.switch(key, value)


def _launch_defaults(groups: list[dict]) -> dict:
    rules = launch.rule_constants()
    return {k: rules[k] for g in groups for k in g}


def _time_candidates(args, device, cfg, candidates) -> int:
    shapes = [(mode, T, d) for mode in args.modes for d in cfg["d"] for T in cfg["T"]]
    total, rows, n = len(shapes) * len(candidates), [], 0
    for mode, T, d in shapes:
        shape = (cfg["B"], T, cfg["H"], d, cfg["dtype"], device, args.gated, cfg["step_batch"])
        for label, build in candidates:
            n += 1
            row = dict(what=label, mode=mode, T=T, d=d)
            _progress(f"[{n}/{total}] {mode} T={T} d={d} {label}: ", end="")
            try:
                if mode == "mem" and device != "cuda":
                    raise Unavailable("memory is measured on CUDA only")
                fn = build(_grad_mode(mode), shape)
                if isinstance(fn, FwdBwd):
                    fn.seed = args.backward_seed
                _progress("compiling/tuning... ", end="")
                start = time.perf_counter()
                _first_call(fn, _grad_mode(mode), device)
                row["first_call_s"] = round(time.perf_counter() - start, 3)
                if mode == "mem":
                    row["mb"] = round(peak_extra_mb(fn), 1)
                    _progress(f"{row['mb']:.4g} MB")
                    rows.append(row)
                    torch.cuda.empty_cache()
                    continue
                row["ms"] = round(time_ms(fn, device, args.quick, mode), 4)
                if hasattr(fn, "algebra") and mode in ("fwd", "fwd+bwd"):
                    flops = model_flops(fn.algebra, mode, cfg["B"] * T * cfg["H"], d, args.gated)
                    row["tflops"] = float(f"{flops / (row['ms'] * 1e-3) / 1e12:.4g}")
                _progress(f"{row['ms']:.4g} ms")
            except Unavailable as exc:
                row["skipped"] = str(exc)
                _progress(f"skipped ({exc})")
            except Exception as exc:   # report and go on: one failure must not hide the rest
                row["error"] = f"{type(exc).__name__}: {str(exc)[:300]}"
                _progress(f"error: {row['error']}")
            if device == "cuda":
                torch.cuda.empty_cache()
            rows.append(row)
    _add_ratios(rows)
    print(format_table(rows, device, cfg))
    config = dict(device=_device_name(device), dtype=str(cfg["dtype"]).replace("torch.", ""),
                  B=cfg["B"], H=cfg["H"], step_batch=cfg["step_batch"], gated=args.gated,
                  quick=args.quick, versions=_versions(), python=platform.python_version(),
                  timer="triton.testing.do_bench median" if device == "cuda" else
                        "median of a timer loop")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(dict(config=config, rows=rows), f, indent=1)
        print(f"wrote {args.json}")
    if args.plot:
        from hladsl.plot import line_plot
        how = line_plot(args.plot, _panels(rows), f"hladsl bench {config['device']} "
                                                  f"{config['dtype']} B={cfg['B']} H={cfg['H']}")
        print(f"wrote {args.plot}" + ("" if how == "matplotlib" else
                                      " (built-in plotter: matplotlib is not installed)"))
    return 0


def peak_extra_mb(fn) -> float:
    """Peak CUDA memory one call allocates beyond what was allocated before it."""
    torch.cuda.synchronize()
    torch.cuda.empty_cache()
    before = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    with torch.enable_grad():
        fn()
    torch.cuda.synchronize()
    return (torch.cuda.max_memory_allocated() - before) / 2 ** 20


def _first_call(fn, mode, device):
    with torch.enable_grad() if mode == "fwd+bwd" else torch.no_grad():
        fn()
    if device == "cuda":
        torch.cuda.synchronize()


def _versions():
    """Installed versions of what was (or could have been) timed."""
    from importlib import metadata
    out = {"hladsl": hladsl.__version__, "torch": torch.__version__}
    for dist in ("triton", "fla-core", "flash-linear-attention", "retention"):
        try:
            out[dist] = metadata.version(dist)
        except metadata.PackageNotFoundError:
            pass
    return out


def _shipped():
    from hladsl.frontend.specs import shipped_names
    return shipped_names()


def _fmt(params):
    return ",".join(f"{k}={v}" for k, v in params.items())


def _device_name(device):
    return torch.cuda.get_device_name() if device == "cuda" else f"cpu ({platform.machine()})"


def _add_ratios(rows):
    """ratio = ms (MB for "mem") / that of the first baseline with a value at the shape."""
    first: dict = {}
    for row in rows:
        key = (row["mode"], row["T"], row["d"])
        unit = "mb" if "mb" in row else "ms"
        if unit in row:
            ref = first.setdefault(key, row)
            row["ratio"] = round(row[unit] / ref[unit], 3)
            row["ratio_to"] = ref["what"]


def model_flops(alg, mode, tokens: int, d: int, gated: bool) -> float:
    """FLOPs of one call of the algebra ``alg`` by the cost model (``hladsl compile --emit
    cost``): the two-pass kernels at chunk 64, the backward re-running the state pass."""
    from hladsl.ir.backward import backward_program
    from hladsl.ir.cost import kernel_costs
    from hladsl.ir.pipeline import chunk_program
    program = chunk_program(alg, 64, tuple((dim, d) for dim in alg.dims), gated)
    rows = kernel_costs(program, backward_program(program))
    per_token = sum(r.flops_per_token for r in rows[:2])
    if mode == "fwd+bwd":
        per_token += sum(r.flops_per_token for r in rows[2:]) + rows[0].flops_per_token
    return per_token * tokens


def format_table(rows, device, cfg) -> str:
    width = max(len(r["what"]) for r in rows) if rows else 10
    lines = [f"{'mode':8s} {'T':>7s} {'d':>4s}  {'what':{width}s} {'ms':>10s} {'ratio':>8s} "
             f"{'TFLOP/s':>8s}  vs"]
    lines.append("-" * len(lines[0]))
    for r in rows:
        if "ms" in r or "mb" in r:
            ms = f"{r['ms']:.4g}" if "ms" in r else f"{r['mb']:.5g} MB"
            ratio, vs = f"{r['ratio']:.2f}x", r["ratio_to"]
        else:
            ms, ratio, vs = "-", "", r.get("skipped") or r.get("error", "")
        tflops = f"{r['tflops']:.3g}" if "tflops" in r else ""
        lines.append(f"{r['mode']:8s} {r['T']:>7d} {r['d']:>4d}  {r['what']:{width}s} {ms:>10s} "
                     f"{ratio:>8s} {tflops:>8s}  {vs}")
    return "\n".join(lines)


def _panels(rows):
    panels = []
    for mode in dict.fromkeys(r["mode"] for r in rows):
        for d in dict.fromkeys(r["d"] for r in rows):
            series: dict = {}
            for r in rows:
                value = r.get("mb", r.get("ms"))
                if r["mode"] == mode and r["d"] == d and value is not None:
                    series.setdefault(r["what"], []).append((r["T"], value))
            if series:
                unit = "MB" if mode == "mem" else "ms"
                panels.append(dict(title=f"{mode} d={d}", xlabel="T", ylabel=unit, logx=True,
                                   logy=True, series=series))
    return panels
