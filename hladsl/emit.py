"""``hladsl compile --emit KIND``: what a spec compiles to, printed readably."""
from __future__ import annotations

from hladsl.errors import SpecError

DEFAULT_SIZES = {"d": 64, "dv": 64}


def _algebra(spec, params):
    from hladsl.ir.lower import lower_spec
    return lower_spec(spec, **params)


def _ast(spec, params, out_dir):
    from hladsl.frontend.printer import to_text
    from hladsl.frontend.specs import load_ast
    if params:
        raise SpecError("-p has no effect on --emit ast (the AST is printed before parameters "
                        "are bound)")
    return to_text(load_ast(spec)[0])


def _header(alg, what):
    params = ", ".join(f"{k} = {v}" for k, v in alg.params.items())
    return f"# {alg.name}: {what}" + (f"  ({params})" if params else "") + "\n"


def _ir(spec, params, out_dir):
    alg = _algebra(spec, params)
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
    from hladsl.ir.combine import combine
    alg = _algebra(spec, params)
    lines = [_header(alg, "associative combine X(AB) = X(A) ⊕ X(B); identity: all zeros, ρ = 1")]
    for x in alg.summaries:
        lines.append(f"{x.name}@AB[{','.join(x.indices)}] = {combine(alg, x).text()}")
    lines.append("ρ_AB = ρ_A ρ_B")
    return "\n".join(lines) + "\n"


def _serial(spec, params, out_dir):
    from hladsl.ir.checks import serial_flops
    from hladsl.ir.combine import serial
    alg = _algebra(spec, params)
    flops = serial_flops(alg, {d: DEFAULT_SIZES.get(d, 64) for d in alg.dims})
    lines = [_header(alg, "serial update X_t = X_{t-1} ⊕ token_t (ρ_t = exp g_t)")]
    for x in alg.streaming:
        lines.append(f"{x.name}_t[{','.join(x.indices)}] = {serial(alg, x).text()}"
                     f"    # {flops[x.name]} FLOPs")
    lines.append(f"o_t = {alg.output.text()}   (states at t, inclusive)")
    lines.append(f"# {sum(flops.values())} FLOPs/token at d = dv = 64")
    return "\n".join(lines).replace("@prev", "_{t-1}") + "\n"


def _vjp(spec, params, out_dir):
    from hladsl.ir.combine import vjp
    alg = _algebra(spec, params)
    lines = [_header(alg, "VJP of the combine: dX@AB -> dY@A, dY@B, d log ρ_B")]
    for (name, side), poly in sorted(vjp(alg).items()):
        label = "dlogρ_B" if name == "log_rho" else f"d{name}@{side}[{','.join(poly.free)}]"
        lines.append(f"{label} = {poly.text()}")
    return "\n".join(lines) + "\n"


def _chains(spec, params, out_dir):
    from hladsl.ir.chains import output_chains, summary_chains
    alg = _algebra(spec, params)
    lines = [_header(alg, "chain normal form (state = P ⊕ L_t; n_i are chunk-local token times)")]
    lines.append("output:")
    lines += ["  " + t.text() for t in output_chains(alg)]
    if alg.normalizer is not None:
        lines.append("normalizer:")
        lines += ["  " + t.text() for t in output_chains(alg, alg.normalizer)]
    for x in alg.streaming:
        lines.append(f"{x.name}(P ⊕ chunk):")
        lines += ["  " + t.text() for t in summary_chains(alg, x)]
    return "\n".join(lines) + "\n"


def _chunk(spec, params, out_dir):
    from hladsl.ir.chunk import chunk_program
    alg = _algebra(spec, params)
    sizes = tuple(sorted((d, DEFAULT_SIZES.get(d, 64)) for d in alg.dims))
    prog = chunk_program(alg, 64, sizes, True)
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
    for d in prog.derived:
        lines.append(f"derived {d.name}[{','.join(d.poly.free)}] = {d.poly.text()}")
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
    flops = prog.flops()
    lines.append(f"# per chunk and head: {flops['output']} output MACs, {flops['state']} state MACs")
    return "\n".join(lines) + "\n"


EMITTERS = {"ast": _ast, "ir": _ir, "combine": _combine, "serial": _serial, "vjp": _vjp,
            "chains": _chains, "chunk": _chunk}


def register(kind: str, fn) -> None:
    EMITTERS[kind] = fn


def emit(spec: str, kind: str | None, params: dict, out_dir: str | None) -> str:
    kind = kind or "default"     # write the Triton module and say where
    if kind not in EMITTERS:
        try:   # code generators register themselves on import
            import hladsl.codegen.emitters  # noqa: F401
        except ImportError:
            pass
    if kind not in EMITTERS:
        raise SpecError(f"--emit {kind} is not available in this build")
    return EMITTERS[kind](spec, params, out_dir)
