"""What the CLI prints: ``hladsl check`` reports and ``hladsl compile --emit
KIND`` (every derivation, generated source, and any pass's result with
``after:PASS``), formatted readably."""
from __future__ import annotations

from pathlib import Path

from hladsl.api import compile_spec
from hladsl.errors import SpecError
from hladsl.frontend.printer import to_text
from hladsl.frontend.specs import load_ast
from hladsl.ir.precision import precision_plan
from hladsl.ir.scan import scan_plan, split_complete_scan, staged_scan
from hladsl.ir.backward import backward_text
from hladsl.ir.checks import serial_flops
from hladsl.ir.lower import bind_params
from hladsl.ir.pipeline import PASS_NAMES, Compilation, Target, compile_spec as run_pipeline

DEFAULT_SIZES = {"d": 64, "dv": 64}


def _algebra(spec, params):
    return compile_spec(spec, until="lower", **params).algebra


def _ast(spec, params, out_dir):
    if params:
        raise SpecError("-p has no effect on --emit ast (the AST is printed before parameters "
                        "are bound)")
    return to_text(load_ast(spec)[0])


def _header(alg, what):
    params = ", ".join(f"{k} = {v}" for k, v in alg.params.items())
    return f"# {alg.name}: {what}" + (f"  ({params})" if params else "") + "\n"


def _ir(spec, params, out_dir, alg=None):
    alg = alg or _algebra(spec, params)
    lines = [_header(alg, "state algebra")]
    for x in alg.summaries:
        role = "combine-only" if x not in alg.streaming else "state"
        sym = "".join(f" symmetric{tuple(x.indices[i] for i in g)}" for g in x.symmetric)
        lines.append(f"{role} {x.name}[{','.join(x.indices)}] : [{','.join(x.dims)}]  "
                     f"weight {x.weight}{sym}")
        lines.append(f"    delta  = {x.delta.text()}")
        for c in x.crosses:
            lines.append(f"    cross  + {c.text()}")
    lines.append(f"output {alg.output_name}[{','.join(alg.output.free)}] = {alg.output.text()}")
    if alg.normalizer is not None:
        lines.append(f"normalizer = {alg.normalizer.text()}    (o = num / (den + {alg.eps}))")
    return "\n".join(lines) + "\n"


def _combine(spec, params, out_dir):
    return _combine_text(compile_spec(spec, until="combine", **params))


def _combine_text(c: Compilation) -> str:
    alg = c.algebra
    combine = dict(c.combine)
    lines = [_header(alg, "associative combine X(AB) = X(A) ⊕ X(B); identity: all zeros, ρ = 1")]
    for x in alg.summaries:
        lines.append(f"{x.name}@AB[{','.join(x.indices)}] = {combine[x.name].text()}")
    lines.append("ρ_AB = ρ_A ρ_B")
    return "\n".join(lines) + "\n"


def _serial(spec, params, out_dir):
    return _serial_text(compile_spec(spec, until="serial", **params))


def _serial_text(c: Compilation) -> str:
    alg = c.algebra
    serial = dict(c.serial)
    flops = serial_flops(alg, {d: DEFAULT_SIZES.get(d, 64) for d in alg.dims})
    lines = [_header(alg, "serial update X_t = X_{t-1} ⊕ token_t (ρ_t = exp g_t)")]
    for x in alg.streaming:
        lines.append(f"{x.name}_t[{','.join(x.indices)}] = {serial[x.name].text()}"
                     f"    # {flops[x.name]} FLOPs")
    lines.append(f"o_t = {alg.output.text()}   (states at t, inclusive)")
    lines.append(f"# {sum(flops.values())} FLOPs/token at d = dv = 64")
    return "\n".join(lines).replace("@prev", "_{t-1}") + "\n"


def _vjp(spec, params, out_dir):
    return _vjp_text(compile_spec(spec, until="vjp", **params))


def _vjp_text(c: Compilation) -> str:
    lines = [_header(c.algebra, "VJP of the combine: dX@AB -> dY@A, dY@B, d log ρ_B")]
    for (name, side), poly in c.vjp:
        label = "dlogρ_B" if name == "log_rho" else f"d{name}@{side}[{','.join(poly.free)}]"
        lines.append(f"{label} = {poly.text()}")
    return "\n".join(lines) + "\n"


def _chains(spec, params, out_dir):
    return _chains_text(compile_spec(spec, until="chains", **params))


def _chains_text(c: Compilation) -> str:
    alg, ch = c.algebra, c.chains
    lines = [_header(alg, "chain normal form (state = P ⊕ L_t; n_i are chunk-local token times)")]
    lines.append("output:")
    lines += ["  " + t.text() for t in ch.output]
    if ch.normalizer is not None:
        lines.append("normalizer:")
        lines += ["  " + t.text() for t in ch.normalizer]
    for name, terms in ch.states:
        lines.append(f"{name}(P ⊕ chunk):")
        lines += ["  " + t.text() for t in terms]
    return "\n".join(lines) + "\n"


def _target(sizes: dict | None = None, chunk: int = 64) -> Target:
    return Target(chunk, tuple(sorted((DEFAULT_SIZES | (sizes or {})).items())), True)


def _cost(spec, params, out_dir, sizes=None, chunk=64, token_bytes=2):
    from hladsl.ir.cost import kernel_costs, scan_costs
    c = compile_spec(spec, target=_target(sizes, chunk), **params)
    prog = c.program
    rows = kernel_costs(prog, c.backward, token_bytes)
    lines = [_header(prog.algebra, f"cost per token, two-pass schedule, C = {prog.chunk}, "
                     + ", ".join(f"{d} = {n}" for d, n in prog.sizes)
                     + f", {token_bytes}-byte tokens, fp32 states"),
             f"{'kernel':12s} {'FLOPs/token':>12s} {'bytes/token':>12s} {'FLOP/byte':>10s}  what"]
    for r in rows:
        lines.append(f"{r.kernel:12s} {r.flops_per_token:12.0f} {r.bytes_per_token:12.0f} "
                     f"{r.intensity:10.1f}  {r.what}")
    fwd = rows[:2]
    lines.append(f"{'forward':12s} {sum(r.flops_per_token for r in fwd):12.0f} "
                 f"{sum(r.bytes_per_token for r in fwd):12.0f}")
    lines.append(f"{'fwd + bwd':12s} {sum(r.flops_per_token for r in rows):12.0f} "
                 f"{sum(r.bytes_per_token for r in rows):12.0f}   (the backward also re-runs "
                 f"state_pass)")
    scan = scan_costs(prog, token_bytes, walked=tuple(_forward_scan(prog, False).get("recursions", ())),
                      derived_kernel=_derived_kernel(prog, False))
    staged = scan_costs(prog, token_bytes, two_stages=True,
                        walked=tuple(_forward_scan(prog, True).get("recursions", ())),
                        derived_kernel=_derived_kernel(prog, True))
    stages = " in two stages" if any(r.kernel == "stage" for r in scan) else ""
    for title, label, scan in ((f"the forward's state pass as a chunk scan{stages} (schedule \"scan\")",
                                "scan fwd", scan),
                               ("the same in two stages (schedule \"staged\")", "staged fwd", staged)):
        if scan:
            # (a second stage walking the derived carries comes with its own output row)
            own_output = any(r.kernel == "output" for r in scan)
            lines += ["", f"# {title}: instead of state_pass{' and output' if own_output else ''}"]
            lines += [f"{r.kernel:12s} {r.flops_per_token:12.0f} {r.bytes_per_token:12.0f} "
                      f"{r.intensity:10.1f}  {r.what}" for r in scan]
            rows_in = scan + ([] if own_output else fwd[1:])
            lines.append(f"{label:12s} {sum(r.flops_per_token for r in rows_in):12.0f} "
                         f"{sum(r.bytes_per_token for r in rows_in):12.0f}   (with output)")
    return "\n".join(lines) + "\n"


def _forward_scan(prog, stage_complete: bool) -> dict:
    """The chunk scan of the forward module ``stage_complete`` selects (``codegen.triton_gen``:
    ``recursions`` holds the derived carries it carries by their recursion, ``_derived_recursion``
    in one stage, ``_staged_recursion`` in two); empty where it has none or the program has no
    Triton kernels."""
    from hladsl.codegen.triton_gen import kernel_context
    if not prog.derived:
        return {}
    try:
        return kernel_context(prog, stage_complete)["chunk_scan"] or {}
    except ValueError:
        return {}


def _derived_kernel(prog, stage_complete: bool) -> bool:
    """Does that forward module's scan form the derived carries in ``derived_kernel``
    (``runtime.launch.DERIVED_KERNEL``)?"""
    from hladsl.runtime import launch
    return bool(_forward_scan(prog, stage_complete).get("derived_kernel")) and launch.DERIVED_KERNEL


def _chunk(spec, params, out_dir):
    return _program_text(compile_spec(spec, target=_target(), **params).program)


def _program_text(prog) -> str:
    alg, sizes = prog.algebra, prog.sizes
    lines = [_header(alg, f"chunk program, C = 64, {', '.join(f'{d} = {n}' for d, n in sizes)}")]

    def term_lines(t):
        out = [f"  term {t.coef:+g} · {t.source}"]
        names = [o.text() for o in t.operands]
        idx = [o.indices for o in t.operands]
        for s in t.plan.steps:
            names.append(f"%{len(names)}")
            idx.append(s.indices)
            out.append(f"      {names[-1]}[{','.join(s.indices)}] = {names[s.left]} · {names[s.right]}"
                       f"   ({s.flops} MACs)")
        return out
    for pd in prog.packed:
        lines.append(f"packed {pd.name}: the {pd.size} non-decreasing {pd.power}-index tuples over "
                     f"{pd.base}; held packed: " + ", ".join(
                         f"{n}[{', '.join(prog.state_dims(n))}]" for n, _ in prog.states
                         if prog.is_packed(n)))
    recursions = _scan_recursions(prog)
    for d in prog.derived:
        lines.append(f"derived {d.name}[{','.join(d.poly.free)}] = {d.poly.text()}")
        if d.name in recursions:
            scans, text = recursions[d.name]
            lines.append(f"  the {scans} forward scan{'s carry' if ' and ' in scans else ' carries'} it by its "
                         f"own recursion (ir.recursion): {text}")
        elif any(_derived_kernel(prog, stage_complete) for stage_complete in (False, True)):
            lines.append("  the two-stage forward scan forms it at every chunk start once both stages are done "
                         "(derived_kernel); the output kernel loads it")
    lines += precision_plan(prog).describe()
    lines.append("output terms (parallel over chunks):")
    for t in prog.output:
        lines += term_lines(t)
    if prog.normalizer:
        lines.append("normalizer terms:")
        for t in prog.normalizer:
            lines += term_lines(t)
    for name, terms in prog.states:
        lines.append(f"state pass {name} (sequential over chunks):")
        for t in terms:
            lines += term_lines(t)
    plan = scan_plan(prog)
    lines += plan.describe()
    staged = staged_scan(prog, plan)
    if staged is not None:
        lines += staged.describe()
    elif (alternative := split_complete_scan(prog, plan)) is not None:
        lines += [f"  or, for a forward with nothing to differentiate, where the scan's products reach "
                  f"runtime.launch.STAGED_SCAN_MACS a chunk and head (or schedule \"staged\"): "
                  f"{alternative.describe()[0]}"]
    flops = prog.flops()
    lines.append(f"# per chunk and head: {flops['output']} output MACs, {flops['state']} state MACs")
    return "\n".join(lines) + "\n"


def _ir_text(c: Compilation) -> str:
    return _ir(None, None, None, c.algebra)


def _check_text(c: Compilation) -> str:
    return "\n".join(c.check) + "\n"


def _source(backend: str, what: str):
    def emit(spec, params, out_dir):
        if backend == "triton":
            from hladsl.codegen.triton_gen import generate
        else:
            from hladsl.codegen.torch_gen import generate
        program = compile_spec(spec, target=_target(), **params).program
        return _written(generate(program), out_dir, f"{program.algebra.name}_{backend}.py",
                        f"{what} for {program.algebra.name}: d = dv = 64, C = 64, gated")
    return emit


def _written(source: str, out_dir: str | None, filename: str, what: str) -> str:
    """``source`` itself, or where it was written when an output directory is given."""
    if out_dir is None:
        return source
    path = Path(out_dir) / filename
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(source)
    return f"wrote {path} ({what})\n"


_triton = _source("triton", "Triton kernels, state pass + output")


def _triton_step(spec, params, out_dir):
    from hladsl.codegen.step_gen import step_source
    alg = compile_spec(spec, until="lower", **params).algebra
    return _written(step_source(alg, dict(_target().sizes), True), out_dir,
                    f"{alg.name}_triton_step.py", f"Triton decode step for {alg.name}: d = dv = 64, gated")


def reverse_scan_lines(bwd) -> list[str]:
    """How the chunk-parallel reverse pass (``ir.scan.reverse_scan``) splits the d-state
    updates, or why there is none."""
    from hladsl.ir.scan import has_chunk_scan, reverse_scan, staged_reverse
    split = reverse_scan(bwd) if has_chunk_scan(bwd.forward) else None
    staged = staged_reverse(bwd)
    if split is None:
        return (["reverse scan: none (the forward has no one-stage chunk scan, or a d-state update walks the tokens)"]
                + (staged.describe() if staged else []))
    lines = [f"reverse scan: {len(split.parallel)} d-state networks every chunk at once (no chunk-end "
             f"cotangent), then a scan of {len(split.carry)} carry networks"
             + (f" and {len(split.scan)} reading forward chunk deltas:" if split.scan else "")]
    lines += [f"  {g.text()}" for g in split.scan]
    if staged:   # (launch.backward_module: after the complete scan in two stages, which keeps no delta)
        lines += [f"after a state pass in two stages, {line}" for line in staged.describe()]
    return lines


def _scan_recursions(prog) -> dict[str, tuple[str, str]]:
    """The derived carries a forward scan carries by their recursion -> (which scans: "one-stage",
    "two-stage" or both; the recursion)."""
    found: dict[str, tuple[list[str], str]] = {}
    for stage_complete in (False, True):
        scan = _forward_scan(prog, stage_complete)
        for name, text in scan.get("recursions", {}).items():
            found.setdefault(name, ([], text))[0].append("two-stage" if scan["stage"] else "one-stage")
    return {name: (" and ".join(dict.fromkeys(scans)), text) for name, (scans, text) in found.items()}


def _chunk_bwd(spec, params, out_dir):
    from hladsl.ir.precision import quotient_cancelling
    compiled = compile_spec(spec, target=_target(), **params)
    bwd = compiled.backward
    _, reasons = quotient_cancelling(bwd)
    if precision_plan(compiled.program).exact_backward:
        reasons = ("every product reading a state or d-state (the program cancels at degree three "
                   "or more: its d-states cancel in each token's gradient)",) + tuple(reasons)
    text = backward_text(bwd) + "\n".join(reverse_scan_lines(bwd)) + "\n"
    if reasons:   # where the backward keeps cotangent products fp32-accurate, and why
        text += "\n" + "\n".join(["precision: cotangent products stay fp32-accurate in:"]
                                  + [f"  {r}" for r in reasons]) + "\n"
    return text


def _triton_bwd(spec, params, out_dir):
    from hladsl.codegen.triton_bwd import triton_bwd_source
    return triton_bwd_source(compile_spec(spec, target=_target(), **params).program)


def _attention(spec, params, out_dir):
    """The attention form (``ir.attention``): its pairwise terms and its kernel, or why there is none."""
    from hladsl.ir.attention import attention_form, why_not
    program = compile_spec(spec, target=_target(), **params).program
    form = attention_form(program)
    if form is None:
        return f"# {program.algebra.name}: no attention form ({why_not(program)}): calls run the chunk form\n"
    from hladsl.codegen.attention_gen import attention_bwd_source
    from hladsl.ir.attention import attention_backward
    terms = "".join(f"#   {t.coef:+g} · {t.source}\n" for t in form.output + form.normalizer)
    bwd = attention_backward(program)
    networks = "".join(f"#   {side}: {g.text()}\n" for side in ("query", "key") for g in getattr(bwd, side))
    source = attention_bwd_source(program)
    kernel = source[source.index("@triton.jit\ndef attention_kernel"):]
    return (f"# {program.algebra.name}: attention form (stateless calls, launch.use_attention_form), "
            f"C = {program.chunk}; its pairwise terms:\n{terms}"
            f"# its backward's networks, by the kernel summing them (query: over key chunks; key: over "
            f"query chunks):\n{networks}"
            f"# (the module also holds the forward's kernels and helpers: --emit triton)\n\n{kernel}")


def _carried(spec, params, out_dir):
    from hladsl.ir.carried import carried_text
    from hladsl.runtime.op import carried_compilation, carried_kernels_error
    alg = _algebra(spec, params)
    text = carried_text(alg)
    found = carried_compilation(alg)
    if found is None:
        return text
    compilation, products = found
    error = carried_kernels_error(compilation)
    if error is not None:
        return text + f"kernels: none ({error}): calls run the spec as written\n"
    from hladsl.runtime import launch
    switches = {"CARRY_DERIVED": launch.CARRY_DERIVED}
    if products:
        switches["CARRY_PRODUCTS"] = launch.CARRY_PRODUCTS
    runs = "calls with no state in or out run them" if all(switches.values()) else "calls run the spec as written"
    said = ", ".join(f"launch.{k}={'on' if v else 'off'}" for k, v in switches.items())
    with_products = f"; with product summaries ({', '.join(products)})" if products else ""
    return text + f"kernels: generated{with_products} ({said}): {runs}\n"


def _cp(spec, params, out_dir):
    from hladsl.runtime.context_parallel import cp_plan_text
    alg = _algebra(spec, params)
    sizes = {d: DEFAULT_SIZES.get(d, 64) for d in alg.dims}
    return cp_plan_text(alg, sizes, world_size=2, heads=16) + "\n"

# after:PASS printers, one per pass of ir.pipeline.PASSES (a test checks the coverage)
PASS_TEXT = {"lower": _ir_text, "check": _check_text, "serial": _serial_text,
             "combine": _combine_text, "vjp": _vjp_text, "chains": _chains_text,
             "chunk": lambda c: _program_text(c.chunk),
             "pack_symmetric": lambda c: _program_text(c.program),
             "backward": lambda c: backward_text(c.backward)}

EMITTERS = {"ast": _ast, "ir": _ir, "combine": _combine, "serial": _serial, "vjp": _vjp,
            "chains": _chains, "chunk": _chunk, "carried": _carried, "attention": _attention,
            "triton": _triton, "cp": _cp,
            "chunk_bwd": _chunk_bwd, "triton_bwd": _triton_bwd, "cost": _cost,
            "triton_step": _triton_step,
            "torch": _source("torch", "torch chunk program"),
            "default": lambda spec, params, out_dir: _triton(spec, params, out_dir or ".")}
EMIT_KINDS = [k for k in EMITTERS if k != "default"] + [f"after:{p}" for p in PASS_NAMES]


def emit(spec: str, kind: str | None, params: dict, out_dir: str | None,
         sizes: dict | None = None, chunk: int = 64) -> str:
    kind = kind or "default"     # write the Triton module and say where
    if kind.startswith("after:"):
        name = kind[len("after:"):]
        if name not in PASS_TEXT:
            raise SpecError(f"--emit {kind}: no pass named '{name}' (passes: {', '.join(PASS_NAMES)})")
        c = compile_spec(spec, until=name, target=_target(), verify=True, **params)
        return f"# after pass '{name}'\n" + PASS_TEXT[name](c)
    if kind not in EMITTERS:
        raise SpecError(f"--emit {kind} is not available; choose one of {', '.join(EMIT_KINDS)}")
    if kind == "cost":
        return _cost(spec, params, out_dir, sizes, chunk)
    if sizes or chunk != 64:
        raise SpecError("--size and --chunk apply to --emit cost")
    return EMITTERS[kind](spec, params, out_dir)


def check_report(name_or_path, **params) -> str:
    """``hladsl check``: every verification, as report lines."""
    spec, display, source = load_ast(name_or_path)
    try:
        bound = bind_params(spec, params)
        if "normalize" in bound and "normalize" not in params:
            bound["normalize"] = True      # check the normalizer's summaries too
        c = run_pipeline(spec, bound, source, until="check")
    except SpecError as exc:   # lowering's own errors are located here too
        exc.path = display
        raise exc.located(display, source)
    alg = c.algebra
    lines = ["syntax, names, indices, sides, dependency graph ... ok"] + list(c.check)
    streaming = ", ".join(f"{x.name}[{','.join(x.dims)}]" for x in alg.streaming)
    helpers = [x.name for x in alg.summaries if x not in alg.streaming]
    lines.append(f"streaming state: {streaming}")
    if helpers:
        lines.append(f"combine-only (never carried): {', '.join(helpers)}")
    flops = serial_flops(alg, {d: 64 for d in alg.dims})
    lines.append(f"serial update: {sum(flops.values())} FLOPs/token at "
                 f"{', '.join(f'{d}=64' for d in alg.dims)}")
    return f"{display}: OK\n" + "\n".join("  " + line for line in lines)
