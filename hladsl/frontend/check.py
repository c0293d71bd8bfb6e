"""Semantic checks on the AST: names, index discipline (einsum rules), dims,
segment sides of cross terms, parameters, and the summary dependency graph.

All problems are collected; ``check(spec)`` raises one SpecCheckError or a
SpecErrors listing them, in source order."""
from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field

import networkx as nx

from hladsl.errors import Pos, SpecCheckError, SpecError, SpecErrors
from hladsl.frontend import ast

BUILTIN_EYE = "eye"                 # Kronecker delta eye[i,j]; both indices of one dim
RESERVED_PARAMS = {"normalize": bool, "eps": float}


@dataclass
class _Ctx:
    spec: ast.Spec
    errors: list[SpecError] = field(default_factory=list)
    slot_dims: dict[str, tuple[str | None, ...]] = field(default_factory=dict)

    def err(self, message: str, pos: Pos | None) -> None:
        self.errors.append(SpecCheckError(message, pos))


def _slots(indices) -> tuple[tuple[str, object], ...]:
    """A declared index list as (name, pack count) slots."""
    return tuple((i.name, i.count) for i in indices)


def dependency_graph(spec: ast.Spec) -> nx.DiGraph:
    """Edge X -> Y (attribute side) when Y appears in a cross term of X."""
    graph = nx.DiGraph()
    for s in spec.states:
        graph.add_node(s.name)
        for term in (s.cross.terms if s.cross else ()):
            for f in _tensors(term.factors):
                if spec.state(f.name) is not None:
                    graph.add_edge(s.name, f.name, side=f.side)
    return graph


def _tensors(factors):
    for f in factors:
        if isinstance(f, ast.Tensor):
            yield f
        elif isinstance(f, ast.Group):
            for t in f.expr.terms:
                yield from _tensors(t.factors)


def check(spec: ast.Spec) -> ast.Spec:
    ctx = _Ctx(spec)
    _check_names(ctx)
    _check_params(ctx)
    graph = dependency_graph(spec)
    acyclic = _check_cycles(ctx, graph)
    order = list(reversed(list(nx.topological_sort(graph)))) if acyclic else [s.name for s in spec.states]
    for name in order:
        _check_state(ctx, spec.state(name))
    _check_outputs(ctx)
    if ctx.errors:
        ctx.errors.sort(key=lambda e: (e.pos.line, e.pos.column) if e.pos else (0, 0))
        raise ctx.errors[0] if len(ctx.errors) == 1 else SpecErrors(ctx.errors)
    return spec


def _check_names(ctx: _Ctx) -> None:
    spec, seen = ctx.spec, {}
    entries = [(n, "dim", p) for n, p in zip(spec.dims, spec.dim_pos or [None] * len(spec.dims))]
    entries += [(i.name, "input", i.pos) for i in spec.inputs]
    entries += [(p.name, "param", p.pos) for p in spec.params]
    entries += [(s.name, "state", s.pos) for s in spec.states]
    if spec.output is not None:
        entries.append((spec.output.name, "output", spec.output.pos))
    for name, kind, pos in entries:
        if name == BUILTIN_EYE:
            ctx.err(f"'{BUILTIN_EYE}' is the built-in identity tensor and cannot be declared", pos)
        elif name in seen:
            ctx.err(f"'{name}' is already declared as a {seen[name]}", pos)
        else:
            seen[name] = kind
    for i in spec.inputs:
        if i.dim not in spec.dims:
            ctx.err(f"unknown dim '{i.dim}' (declared dims: {', '.join(spec.dims) or 'none'})", i.pos)
    if not spec.states:
        ctx.err("a mechanism needs at least one state", spec.pos)
    if spec.output is None:
        ctx.err("a mechanism needs an output declaration", spec.pos)


def _check_params(ctx: _Ctx) -> None:
    spec = ctx.spec
    for p in spec.params:
        want = RESERVED_PARAMS.get(p.name)
        if want is bool and not isinstance(p.value, bool):
            ctx.err(f"parameter '{p.name}' must be true or false", p.pos)
        elif want is float and isinstance(p.value, bool):
            ctx.err(f"parameter '{p.name}' must be a number", p.pos)
    has_flag = spec.param("normalize") is not None
    if spec.normalizer is not None:
        for name in RESERVED_PARAMS:
            if spec.param(name) is None:
                ctx.err(f"a normalizer needs the parameter '{name}' (e.g. param normalize = false, "
                        f"eps = 1e-6)", spec.normalizer_pos)
    elif has_flag:
        ctx.err("parameter 'normalize' needs a 'normalizer = ...' declaration", spec.param("normalize").pos)


def _check_cycles(ctx: _Ctx, graph: nx.DiGraph) -> bool:
    try:
        cycle = nx.find_cycle(graph)
    except nx.NetworkXNoCycle:
        return True
    names = [u for u, _ in cycle] + [cycle[0][0]]
    first = ctx.spec.state(names[0])
    ctx.err("summaries depend on each other in a cycle, so the combine is ill-defined: "
            + " -> ".join(names), first.pos)
    return False


def _check_state(ctx: _Ctx, s: ast.StateDecl) -> None:
    lhs = _check_lhs(ctx, s.indices, f"state {s.name}")
    dims: dict[str, str] = {}
    if s.delta.is_zero and s.cross is None:
        ctx.err(f"state '{s.name}' has a zero token delta and no cross terms: it is always zero", s.pos)
    if not s.delta.is_zero:
        for term in s.delta.terms:
            _check_term(ctx, term, lhs, dims, where="delta", state=s)
    if s.cross is not None:
        for term in s.cross.terms:
            _check_term(ctx, term, lhs, dims, where="cross", state=s)
    slot_dims = tuple(dims.get(name) for name, _ in _slots(s.indices))
    for (name, _), dim, index in zip(_slots(s.indices), slot_dims, s.indices):
        if dim is None and not ctx.errors:
            ctx.err(f"cannot infer the dim of index '{name}' of '{s.name}'", index.pos)
    ctx.slot_dims[s.name] = slot_dims
    for group in s.symmetric:
        _check_symmetric(ctx, s, group, dims)


def _check_lhs(ctx: _Ctx, indices, what: str) -> dict[str, object]:
    lhs: dict[str, object] = {}
    for index in indices:
        if index.name in lhs:
            ctx.err(f"index '{index.name}' appears twice on the left-hand side of {what}", index.pos)
        lhs[index.name] = index.count
        _check_count(ctx, index)
    return lhs


def _check_count(ctx: _Ctx, index: ast.Index) -> None:
    if isinstance(index.count, str):
        p = ctx.spec.param(index.count)
        if p is None:
            ctx.err(f"unknown parameter '{index.count}' in index pack '{index.name}^{index.count}'",
                    index.pos)
        elif isinstance(p.value, bool) or not isinstance(p.value, int) or p.value < 1:
            ctx.err(f"parameter '{index.count}' is used as a repetition count and must be a "
                    f"positive integer, not {p.value!r}", index.pos)
    elif isinstance(index.count, int) and index.count < 1:
        ctx.err(f"index pack '{index.name}^{index.count}' needs a count of at least 1", index.pos)


def _check_symmetric(ctx, s, group, dims) -> None:
    lhs_names = [i.name for i in s.indices]
    width = 0
    for index in group:
        if index.name not in lhs_names:
            ctx.err(f"symmetric index '{index.name}' is not an index of '{s.name}'", index.pos)
            return
        width += 1 if index.count is None else 2
    group_dims = {dims.get(i.name) for i in group}
    if width < 2:
        ctx.err("symmetric(...) needs at least two indices", group[0].pos)
    elif len(group_dims) > 1:
        ctx.err(f"symmetric indices of '{s.name}' must share one dim", group[0].pos)


def _term_indices(ctx: _Ctx, term: ast.Term, dims: dict[str, str], where: str, state):
    """Occurrences of each index in a product (groups contribute their free indices)."""
    occurrences: list[tuple[ast.Index, str | None]] = []
    for f in term.factors:
        if isinstance(f, ast.Tensor):
            occurrences.extend(_tensor_indices(ctx, f, where, state))
        elif isinstance(f, ast.ParamRef):
            p = ctx.spec.param(f.name)
            if p is None:
                ctx.err(f"unknown parameter '{f.name}'", f.pos)
            elif isinstance(p.value, bool):
                ctx.err(f"parameter '{f.name}' is a flag and cannot be used as a coefficient", f.pos)
        elif isinstance(f, ast.Group):
            free = None
            for t in f.expr.terms:
                occ = _term_indices(ctx, t, dims, where, state)
                counts = Counter(i.name for i, _ in occ)
                t_free = [(i, d) for i, d in occ if counts[i.name] == 1]
                names = sorted(i.name for i, _ in t_free)
                if free is None:
                    free, free_names = t_free, names
                elif names != free_names:
                    ctx.err(f"terms of this sum have different free indices "
                            f"([{', '.join(free_names)}] and [{', '.join(names)}])", t.pos)
            occurrences.extend(free or [])
    return occurrences


def _tensor_indices(ctx: _Ctx, f: ast.Tensor, where: str, state):
    spec = ctx.spec
    decl_input, decl_state = spec.input(f.name), spec.state(f.name)
    if f.name == BUILTIN_EYE:
        if len(f.indices) != 2 or any(i.count is not None for i in f.indices):
            ctx.err("eye takes exactly two plain indices: eye[i, j]", f.pos)
            return []
        if where != "output":
            ctx.err("eye[...] may only be used in the output and the normalizer", f.pos)
        return [(f.indices[0], "eye"), (f.indices[1], "eye")]
    if decl_input is None and decl_state is None:
        kinds = {"delta": "token input", "cross": "state", "output": "input or state"}
        ctx.err(f"unknown {kinds[where]} '{f.name}'", f.pos)
        return []
    if f.side is not None and f.side not in ("A", "B"):
        ctx.err(f"unknown segment side '@{f.side}': cross-term factors are X@B (the later "
                f"segment) or X@A (the earlier one)", f.pos)
        return []
    if where == "delta":
        if decl_input is None:
            ctx.err(f"a token delta is a product of token inputs; '{f.name}' is a state "
                    f"(put state factors in a 'cross' clause as {f.name}@A or {f.name}@B)", f.pos)
            return []
    elif where == "cross":
        if decl_state is None:
            ctx.err(f"cross terms combine summaries of the two segments; '{f.name}' is a token "
                    f"input (token factors belong in the delta)", f.pos)
            return []
        if f.side is None:
            ctx.err(f"cross-term factor '{f.name}' needs a segment side: {f.name}@A or {f.name}@B",
                    f.pos)
            return []
        if f.side == "A" and decl_state.combine_only:
            ctx.err(f"'{f.name}' is combine_only (not carried in the streaming state), so it can "
                    f"only be read from the later segment as {f.name}@B", f.pos)
            return []
    else:
        if f.side is not None:
            ctx.err(f"'{f.name}@{f.side}': segment sides are only meaningful in cross terms", f.pos)
            return []
        if decl_state is not None and decl_state.combine_only:
            ctx.err(f"'{f.name}' is combine_only and not part of the streaming state, so the "
                    f"output cannot read it", f.pos)
            return []
    if decl_input is not None:
        if len(f.indices) != 1:
            ctx.err(f"input '{f.name}' has one index, got {len(f.indices)}", f.pos)
            return []
        return [(f.indices[0], decl_input.dim)]
    declared = _slots(decl_state.indices)
    used = _slots(f.indices)
    if len(used) != len(declared) or any(u[1] != d[1] for u, d in zip(used, declared)):
        want = "[" + ", ".join(n if c is None else f"{n}^{c}" for n, c in declared) + "]"
        ctx.err(f"'{f.name}' is declared with indices {want}; got {len(f.indices)} index "
                f"slot(s) that do not match", f.pos)
        return []
    slot_dims = ctx.slot_dims.get(f.name, (None,) * len(declared))
    return list(zip(f.indices, slot_dims))


def _check_term(ctx: _Ctx, term: ast.Term, lhs: dict[str, object], dims: dict[str, str],
                *, where: str, state=None, lhs_name: str | None = None) -> None:
    owner = lhs_name or (state.name if state else "")
    occ = _term_indices(ctx, term, dims, where, state)
    if where == "delta" and not any(isinstance(f, ast.Tensor) for f in term.factors):
        ctx.err(f"a token delta term must contain token inputs (a constant delta would count "
                f"padding tokens)", term.pos)
    if where == "cross":
        sides = [f.side for f in _tensors(term.factors) if ctx.spec.state(f.name) is not None]
        if sides and sides.count("B") != 1:
            ctx.err(f"a cross term needs exactly one factor of the later segment (X@B); "
                    f"this one has {sides.count('B')}", term.pos)
        elif sides and "A" not in sides:
            ctx.err("a cross term needs at least one factor of the earlier segment (Y@A)", term.pos)
    counts = Counter(i.name for i, _ in occ)
    local_dims: dict[str, tuple[str, ast.Index]] = {}
    reported = set()
    for index, dim in occ:
        n = counts[index.name]
        if n > 2 and index.name not in reported:
            ctx.err(f"index '{index.name}' appears {n} times in one product; an index is either "
                    f"free (once) or contracted (twice)", index.pos)
            reported.add(index.name)
        elif n == 1 and index.name not in lhs and index.name not in reported:
            ctx.err(f"index '{index.name}' appears once but is not an index of '{owner}': a "
                    f"contraction needs it twice", index.pos)
            reported.add(index.name)
        elif n == 2 and index.name in lhs and index.name not in reported:
            ctx.err(f"index '{index.name}' is an index of '{owner}' but is summed over here "
                    f"(it appears twice)", index.pos)
            reported.add(index.name)
        if dim is None or dim == "eye":
            continue
        seen = local_dims.get(index.name)
        if seen is not None and seen[0] != dim and index.name not in reported:
            ctx.err(f"index '{index.name}' is bound to dim '{seen[0]}' and to dim '{dim}'", index.pos)
            reported.add(index.name)
        local_dims.setdefault(index.name, (dim, index))
        if index.name in lhs:
            if dims.setdefault(index.name, dim) != dim and index.name not in reported:
                ctx.err(f"index '{index.name}' of '{owner}' is bound to dim '{dims[index.name]}' "
                        f"elsewhere and to dim '{dim}' here", index.pos)
                reported.add(index.name)
    for name in lhs:
        if counts[name] == 0:
            ctx.err(f"this term of '{owner}' does not use its index '{name}'", term.pos)
    for index, dim in occ:   # a pack count must agree with the declaration
        if index.name in lhs and index.count != lhs[index.name]:
            ctx.err(f"index '{index.name}' is declared as '{index.name}"
                    f"{'' if lhs[index.name] is None else '^' + str(lhs[index.name])}' on the "
                    f"left-hand side", index.pos)


def _check_outputs(ctx: _Ctx) -> None:
    spec = ctx.spec
    if spec.output is not None:
        lhs = _check_lhs(ctx, spec.output.indices, f"output {spec.output.name}")
        dims: dict[str, str] = {}
        for term in spec.output.expr.terms:
            _check_term(ctx, term, lhs, dims, where="output", lhs_name=spec.output.name)
    if spec.normalizer is not None:
        for term in spec.normalizer.terms:
            _check_term(ctx, term, {}, {}, where="output", lhs_name="normalizer")
