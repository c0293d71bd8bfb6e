"""Chunk program -> torch source (the CPU path of the op): one function per
term, each plan step one ``torch.einsum`` with the step's equation as a comment.
Rendered from templates/chunk_torch.py.jinja with StrictUndefined and cached
like the Triton module (hladsl.codegen.cache)."""
from __future__ import annotations


from hladsl.codegen.templates import render_template, template_text

from hladsl.ir.chunk import ChunkProgram, TermProgram
from hladsl.ir.contract import plan
from hladsl.ir.evaluate import letters_for
from hladsl.version import __version__
from hladsl.ir.operands import Kind, Operand, exhaustive

TEMPLATE = "chunk_torch.py.jinja"


def _unsupported(op: Operand) -> str:
    raise ValueError(f"{op.kind} operands have no torch lowering in the forward program")


_OPERAND_EXPR = exhaustive({
    Kind.TOKEN: lambda op: f'env.token("{op.name}")',
    Kind.POWER: lambda op: f'env.power("{op.name}", "{op.packed}", {op.power}, {op.weighted})',
    Kind.CARRY: lambda op: f'env.carry("{op.name}")',
    Kind.DERIVED: lambda op: f'env.derived("{op.name}")',
    Kind.MASK: lambda op: f'env.mask("{op.rel}", {op.weight})',
    Kind.DECAY: lambda op: f'env.decay("{op.anchor}", {op.weight})',
    Kind.COTANGENT: _unsupported}, "the torch lowering")


def _operand_expr(op: Operand) -> str:
    return _OPERAND_EXPR[op.kind](op)


def _contraction(exprs, labels, indices, steps, result, output, coef,
                 var_prefix: str = "x") -> tuple[list[str], str]:
    """Lines computing one contraction into variables ``<var_prefix><n>`` (named
    here, never rewritten afterwards: spec names in strings and comments stay
    as they are)."""
    names = letters_for([i for idx in indices for i in idx] + list(output))
    lines, values = [], []
    for n, (expr, label, idx) in enumerate(zip(exprs, labels, indices)):
        lines.append(f"{var_prefix}{n} = {expr}  # {label}")
        values.append((f"{var_prefix}{n}", idx, label))
    for step in steps:
        (a, ia, _la), (b, ib, _lb) = values[step.left], values[step.right]
        spec = (f"...{''.join(names[i] for i in ia)},...{''.join(names[i] for i in ib)}"
                f"->...{''.join(names[i] for i in step.indices)}")
        var = f"{var_prefix}{len(values)}"
        lines.append(f'{var} = torch.einsum("{spec}", {a}, {b})  # [{",".join(step.indices)}] = {a} · {b}')
        values.append((var, step.indices, var))
    var, idx, _ = values[result]
    extra = "".join(names[i] for i in idx)
    want = "".join(names[i] for i in output)
    if extra != want:   # sum away a time index / reorder to the output's order
        lines.append(f'{var} = torch.einsum("...{extra}->...{want}", {var})')
    return lines, (var if coef == 1 else f"{coef!r} * {var}")


def _term(fn: str, term: TermProgram) -> dict:
    labels = [o.text() for o in term.operands]
    lines, result = _contraction([_operand_expr(o) for o in term.operands], labels,
                                 [o.indices for o in term.operands], term.plan.steps,
                                 term.plan.result, term.output, term.coef)
    return dict(fn=fn, source=term.source, lines=lines, result=result)


def _derived(program: ChunkProgram) -> list[dict]:
    out = []
    alg = program.algebra
    dims = dict(program.sizes)
    for d in program.derived:
        lines, parts = [], []
        for m, mono in enumerate(d.poly.terms):
            sizes = {}
            for f in mono.factors:
                sizes.update((i, dims[s]) for i, s in zip(f.indices, alg.summary(f.name).dims))
            p = plan(tuple(f.indices for f in mono.factors), d.poly.free, tuple(sorted(sizes.items())))
            body, res = _contraction([f'env.carry("{f.name}")' for f in mono.factors],
                                     [str(f) for f in mono.factors], [f.indices for f in mono.factors],
                                     p.steps, p.result, d.poly.free, float(mono.coef),
                                     var_prefix=f"m{m}_x")
            lines += body
            parts.append(res)
        out.append(dict(name=d.name, free=",".join(d.poly.free), text=d.poly.text(),
                        lines=lines, result=" + ".join(parts)))
    return out


def context(program: ChunkProgram) -> dict:
    alg = program.algebra
    terms, output, normalizer, states = [], [], [], []
    for n, t in enumerate(program.output):
        terms.append(_term(f"output_{n}", t))
        output.append(f"output_{n}")
    for n, t in enumerate(program.normalizer):
        terms.append(_term(f"normalizer_{n}", t))
        normalizer.append(f"normalizer_{n}")
    for name, ts in program.states:
        entries = []
        for n, t in enumerate(ts):
            fn = f"state_{name}_{n}"
            terms.append(_term(fn, t))
            entries.append((fn, any(o.kind is Kind.CARRY for o in t.operands), t.carry_weight))
        states.append((name, entries))
    sizes = ", ".join(f"{k} = {v}" for k, v in program.sizes)
    return dict(name=alg.name, chunk=program.chunk, sizes=sizes, gated=program.gated,
                output_text=f"{alg.output_name}[{','.join(alg.output.free)}] = {alg.output.text()}",
                derived=_derived(program), terms=terms, output=output, normalizer=normalizer,
                states=states)


def render(ctx: dict) -> str:
    return render_template(TEMPLATE, version=__version__, **ctx)


def generate(program: ChunkProgram) -> str:
    return render(context(program))


_MODULES: dict = {}


def torch_module(program: ChunkProgram):
    """The imported generated module for ``program`` (disk-cached)."""
    hit = _MODULES.get(program)
    if hit is None:
        from hladsl.codegen.cache import cache_key, load_module
        ctx = context(program)
        key = cache_key(ctx, template_text(TEMPLATE))
        hit = _MODULES[program] = load_module(f"{ctx['name']}_torch", key, lambda: render(ctx))
    return hit
