"""AST -> canonical spec text. ``parse(to_text(spec)) == spec`` for every spec."""
from __future__ import annotations

from hladsl.frontend import ast


def number_text(value: bool | int | float) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    return repr(value)


def index_text(index: ast.Index) -> str:
    return index.name if index.count is None else f"{index.name}^{index.count}"


def indices_text(indices) -> str:
    return "[" + ", ".join(index_text(i) for i in indices) + "]"


def factor_text(factor: ast.Factor) -> str:
    if isinstance(factor, ast.Tensor):
        side = f"@{factor.side}" if factor.side else ""
        return f"{factor.name}{side}{indices_text(factor.indices)}"
    if isinstance(factor, ast.Number):
        return number_text(factor.value)
    if isinstance(factor, ast.ParamRef):
        return factor.name
    return f"({sum_text(factor.expr)})"


def sum_text(expr: ast.Sum) -> str:
    out = []
    for n, term in enumerate(expr.terms):
        body = " ".join(factor_text(f) for f in term.factors)
        if n == 0:
            out.append(("-" if term.sign < 0 else "") + body)
        else:
            out.append(("- " if term.sign < 0 else "+ ") + body)
    return " ".join(out)


def state_text(s: ast.StateDecl) -> str:
    line = f"state {s.name}{indices_text(s.indices)} = {sum_text(s.delta)}"
    if s.cross is not None:
        line += f" cross {sum_text(s.cross)}"
    if s.decay is not None:
        line += f" decay {s.decay}"
    for group in s.symmetric:
        line += " symmetric(" + ", ".join(index_text(i) for i in group) + ")"
    if s.combine_only:
        line += " combine_only"
    return line


def to_text(spec: ast.Spec) -> str:
    """The canonical form: one declaration per line, fixed spacing and order."""
    body = []
    if spec.dims:
        body.append("dims " + ", ".join(spec.dims))
    if spec.inputs:
        body.append("input " + ", ".join(f"{i.name}[{i.dim}]" for i in spec.inputs))
    if spec.params:
        body.append("param " + ", ".join(f"{p.name} = {number_text(p.value)}" for p in spec.params))
    if spec.states:
        body.append("")
        body.extend(state_text(s) for s in spec.states)
    if spec.output is not None or spec.normalizer is not None:
        body.append("")
    if spec.output is not None:
        o = spec.output
        body.append(f"output {o.name}{indices_text(o.indices)} = {sum_text(o.expr)}")
    if spec.normalizer is not None:
        body.append(f"normalizer = {sum_text(spec.normalizer)}")
    lines = [f"mechanism {spec.name} {{"] + [("  " + b if b else "") for b in body] + ["}"]
    return "\n".join(lines) + "\n"
