"""Semantic checks on the AST: names, index discipline (einsum rules), dims,
segment sides of cross terms, parameters, and the summary dependency graph.

All problems are collected; ``check(spec)`` raises one SpecCheckError or a
SpecErrors listing them, in source order."""
from __future__ import annotations

import re
from collections import Counter
from dataclasses import dataclass, field


from hladsl.errors import Pos, SpecCheckError, SpecError, SpecErrors
from hladsl.frontend import ast
from hladsl.frontend.graph import Digraph, dependencies_first, find_cycle

BUILTIN_EYE = "eye"                 # Kronecker delta eye[i,j]; both indices of one dim
_STATE_KEYWORDS = ("cross", "decay", "symmetric", "combine_only")   # may follow a state's delta
RESERVED_PARAMS = {"normalize": bool, "eps": float}
# Spec names reach generated code only behind fixed prefixes (st_S, offs_d, in_q,
# state_S_0) or in comments and strings, so Python keywords, builtins and the
# templates' own names (tl, torch, range, lam, num, eps, C ...) are all legal
# names; names cannot start with '_', so no dunder is ever formed. The exceptions
# are the names whose prefixed form the Triton template (codegen/templates/
# chunk_kernels.py.jinja) already uses for something else: the kernel would
# silently read the wrong variable. tests/test_identifiers.py finds every place
# where two name families, or a family and a template name, meet in the
# generated source, and fails if it is not covered here.
RESERVED_NAMES: dict[str, tuple[tuple[str, str], ...]] = {   # kind -> (pattern, why)
    "dim": (("t", "offs_t holds the chunk's time offsets"),
            ("nh", "pid_nh is the program's (sequence, head) id"),
            (r"[A-Za-z][A-Za-z0-9_]*_pow[0-9]+_*", "names like d_pow2 are the packed "
                                                   "symmetric dims")),
    "input": ((r"[A-Za-z][A-Za-z0-9_]*_ptr", "in_x_ptr is input x's pointer"),),
}


def reserved(kind: str, name: str) -> str | None:
    """Why ``name`` cannot name a ``kind`` (dim, input, ...), or None."""
    return next((why for pattern, why in RESERVED_NAMES.get(kind, ())
                 if re.fullmatch(pattern, name)), None)


# An index pack i^p has at most this many indices: deriving the algebra enumerates
# the p! orderings of a pack's identical factors and symmetric slots (p = 5 takes
# seconds at d = 4, p = 6 minutes), and the unpacked state has d^p entries.
MAX_PACK_COUNT = 4


@dataclass
class _Ctx:
    spec: ast.Spec
    errors: list[SpecError] = field(default_factory=list)
    slot_dims: dict[str, tuple[str | None, ...]] = field(default_factory=dict)
    rejected: int = 0   # factors reported and dropped; their terms get no index checks
    bad_counts: set = field(default_factory=set)   # pack counts already reported

    def err(self, message: str, pos: Pos | None) -> None:
        self.errors.append(SpecCheckError(message, pos))

    def reject(self, message: str, pos: Pos | None) -> list:
        """Report a factor that cannot be used; the product it is in is not checked
        further (its indices are unknown, so index errors would only pile up)."""
        self.err(message, pos)
        self.rejected += 1
        return []


def _slots(indices) -> tuple[tuple[str, object], ...]:
    """A declared index list as (name, pack count) slots."""
    return tuple((i.name, i.count) for i in indices)


def dependency_graph(spec: ast.Spec) -> Digraph:
    """Edge X -> Y when Y appears in a cross term of X (for cycles and order; the segments
    read are ``Algebra.graph``'s)."""
    graph = Digraph()
    for s in spec.states:
        graph.add_node(s.name)
        for term in (s.cross.terms if s.cross else ()):
            for f in _tensors(term.factors):
                if spec.state(f.name) is not None:
                    graph.add_edge(s.name, f.name)
    return graph


def declaration_order(spec: ast.Spec, graph: Digraph | None = None) -> list[str]:
    """Summaries ordered so each comes after those its cross terms read, ties
    broken by declaration order (the graph must be acyclic)."""
    graph = dependency_graph(spec) if graph is None else graph
    rank = {s.name: n for n, s in enumerate(spec.states)}
    return dependencies_first(graph, rank.__getitem__)


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
    order = declaration_order(spec, graph) if acyclic else [s.name for s in spec.states]
    for name in order:
        _check_state(ctx, spec.state(name))
    _check_outputs(ctx)
    if ctx.errors:
        ctx.errors.sort(key=lambda e: (e.pos.line, e.pos.column) if e.pos else (0, 0))
        raise ctx.errors[0] if len(ctx.errors) == 1 else SpecErrors(ctx.errors)
    return spec


_ARTICLE = {"dim": "a dim", "input": "an input", "param": "a parameter", "state": "a state",
            "output": "the output"}


def _check_names(ctx: _Ctx) -> None:
    spec, seen = ctx.spec, {}
    entries = [(n, "dim", p) for n, p in zip(spec.dims, spec.dim_pos or [None] * len(spec.dims))]
    entries += [(i.name, "input", i.pos) for i in spec.inputs]
    entries += [(p.name, "param", p.pos) for p in spec.params]
    entries += [(s.name, "state", s.pos) for s in spec.states]
    if spec.output is not None:
        entries.append((spec.output.name, "output", spec.output.pos))
    for name, kind, pos in entries:
        why = reserved(kind, name)
        if why is not None:
            ctx.err(f"'{name}' cannot name {_ARTICLE[kind]}: it is reserved in the generated "
                    f"kernels ({why})", pos)
        elif name == BUILTIN_EYE:
            ctx.err(f"'{BUILTIN_EYE}' is the built-in identity tensor and cannot be declared", pos)
        elif name in seen:
            first_kind, first_pos = seen[name]
            where = f" on line {first_pos.line}" if first_pos is not None else ""
            ctx.err(f"'{name}' is already declared as {_ARTICLE[first_kind]}{where}", pos)
        else:
            seen[name] = (kind, pos)
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
            ctx.err(f"parameter '{p.name}' must be true or false, not {_literal(p.value)}", p.pos)
        elif want is float and isinstance(p.value, bool):
            ctx.err(f"parameter '{p.name}' must be a number, not {_literal(p.value)}", p.pos)
    has_flag = spec.param("normalize") is not None
    if spec.normalizer is not None:
        missing = [f"'{name}'" for name in RESERVED_PARAMS if spec.param(name) is None]
        if missing:
            ctx.err(f"a normalizer needs the parameter{'s' * (len(missing) > 1)} "
                    f"{' and '.join(missing)} (e.g. param normalize = false, eps = 1e-6)",
                    spec.normalizer_pos)
    elif has_flag:
        ctx.err("parameter 'normalize' needs a 'normalizer = ...' declaration", spec.param("normalize").pos)


def _check_cycles(ctx: _Ctx, graph: Digraph) -> bool:
    cycle = find_cycle(graph)
    if cycle is None:
        return True
    names = [u for u, _ in cycle] + [cycle[0][0]]
    first = ctx.spec.state(names[0])
    ctx.err("summaries depend on each other in a cycle, so the combine is ill-defined: "
            + " -> ".join(names), first.pos)
    return False


def _check_state(ctx: _Ctx, s: ast.StateDecl) -> None:
    lhs = _check_lhs(ctx, s.indices, f"state '{s.name}'")
    dims: dict[str, str] = {}
    if s.delta.is_zero and s.cross is None:
        ctx.err(f"state '{s.name}' has a zero token delta and no cross terms: it is always zero", s.pos)
    if lhs is None:   # a repeated left-hand index: the terms cannot be checked against it
        return
    first = s.delta.terms[0].factors[0] if s.delta.terms and s.delta.terms[0].factors else None
    if (isinstance(first, ast.ParamRef) and first.name in _STATE_KEYWORDS
            and ctx.spec.param(first.name) is None):   # "S[i] = cross ...": read as a parameter
        ctx.err(f"state '{s.name}' has no token delta before '{first.name}' (write "
                f"'{s.name}[...] = 0 {first.name} ...' if no token contributes)", first.pos)
        return
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


def _check_lhs(ctx: _Ctx, indices, what: str) -> dict[str, object] | None:
    """The left-hand indices as name -> pack count; None if one is repeated."""
    lhs: dict[str, object] = {}
    repeated = False
    for index in indices:
        if index.name in lhs:
            ctx.err(f"index '{index.name}' appears twice on the left-hand side of {what}", index.pos)
            repeated = True
        lhs[index.name] = index.count
        _check_count(ctx, index)
    return None if repeated else lhs


def _check_count(ctx: _Ctx, index: ast.Index) -> None:
    """A pack count is a positive integer or names one; each bad count is reported once."""
    if index.count in ctx.bad_counts:
        return
    if isinstance(index.count, str):
        p = ctx.spec.param(index.count)
        if p is None:
            ctx.err(f"unknown parameter '{index.count}' in index pack '{index.name}^{index.count}' "
                    f"(declared: {_names(ctx.spec.params)})", index.pos)
            ctx.bad_counts.add(index.count)
        elif isinstance(p.value, bool) or not isinstance(p.value, int) or p.value < 1:
            ctx.err(f"parameter '{index.count}' is used as a repetition count and must be a "
                    f"positive integer, not {_literal(p.value)}", index.pos)
            ctx.bad_counts.add(index.count)
        elif p.value > MAX_PACK_COUNT:
            ctx.err(f"parameter '{index.count}' = {p.value} is used as a repetition count; packs "
                    f"hold at most {MAX_PACK_COUNT} indices", index.pos)
            ctx.bad_counts.add(index.count)
    elif isinstance(index.count, int) and index.count < 1:
        ctx.err(f"index pack '{index.name}^{index.count}' needs a count of at least 1", index.pos)
        ctx.bad_counts.add(index.count)
    elif isinstance(index.count, int) and index.count > MAX_PACK_COUNT:
        ctx.err(f"index pack '{index.name}^{index.count}' is too large: packs hold at most "
                f"{MAX_PACK_COUNT} indices", index.pos)
        ctx.bad_counts.add(index.count)


def _literal(value) -> str:
    return ("true" if value else "false") if isinstance(value, bool) else repr(value)


def _check_symmetric(ctx, s, group, dims) -> None:
    lhs = {i.name: i for i in s.indices}
    width, names = 0, set()
    for index in group:
        if index.name not in lhs:
            ctx.err(f"symmetric index '{index.name}' is not an index of '{s.name}'", index.pos)
            return
        if index.name in names:
            ctx.err(f"index '{index.name}' appears twice in symmetric(...)", index.pos)
            return
        if index.count != lhs[index.name].count:
            ctx.err(f"symmetric index '{_index_text(index)}' does not match "
                    f"'{_index_text(lhs[index.name])}' of '{s.name}'", index.pos)
            return
        names.add(index.name)
        width += 1 if index.count is None else 2
    group_dims = {dims.get(i.name) for i in group}
    if width < 2:
        ctx.err("symmetric(...) needs at least two indices", group[0].pos)
    elif len(group_dims) > 1:
        over = ", ".join(f"'{i.name}' over '{dims.get(i.name)}'" for i in group)
        ctx.err(f"symmetric indices of '{s.name}' must share one dim ({over})", group[0].pos)


def _index_text(index: ast.Index) -> str:
    return index.name if index.count is None else f"{index.name}^{index.count}"


def _term_indices(ctx: _Ctx, term: ast.Term, dims: dict[str, str], where: str, state):
    """Occurrences of each index in a product (groups contribute their free indices)."""
    occurrences: list[tuple[ast.Index, str | None]] = []
    for f in term.factors:
        if isinstance(f, ast.Tensor):
            occurrences.extend(_tensor_indices(ctx, f, where, state))
        elif isinstance(f, ast.ParamRef):
            p, tensor = ctx.spec.param(f.name), _tensor_kind(ctx.spec, f.name)
            if p is None and tensor is not None:
                ctx.reject(f"'{f.name}' is {tensor}, not a parameter: write it with its "
                           f"indices, as in {f.name}[...]", f.pos)
            elif p is None:
                ctx.err(f"unknown parameter '{f.name}' (declared: {_names(ctx.spec.params)})", f.pos)
            elif isinstance(p.value, bool):
                ctx.err(f"parameter '{f.name}' is a flag and cannot be used as a coefficient", f.pos)
        elif isinstance(f, ast.Group):
            free = None
            for t in f.expr.terms:
                rejected = ctx.rejected
                occ = _term_indices(ctx, t, dims, where, state)
                if ctx.rejected != rejected:
                    continue
                _check_inner_contractions(ctx, occ)
                counts = Counter(i.name for i, _ in occ)
                t_free = [(i, d) for i, d in occ if counts[i.name] == 1]
                names = sorted(i.name for i, _ in t_free)
                if free is None:
                    free, free_names = t_free, names
                elif names != free_names:
                    ctx.err(f"terms of this sum have different free indices "
                            f"([{', '.join(free_names)}] and [{', '.join(names)}])", t.pos)
                else:
                    free = _merge_free_dims(ctx, free, t_free)
            occurrences.extend(free or [])
    return occurrences


def _check_inner_contractions(ctx: _Ctx, occ) -> None:
    """Indices summed inside one product of a parenthesised sum (its free ones are
    checked where the sum is used): at most twice, one dim, the same pack."""
    counts = Counter(i.name for i, _ in occ)
    first: dict[str, tuple[ast.Index, str | None]] = {}
    for index, dim in occ:
        n = counts[index.name]
        if n == 1 or index.name in first and first[index.name] is None:
            continue
        if n > 2:
            ctx.err(f"index '{index.name}' appears {n} times in one product; an index is either "
                    f"free (once) or contracted (twice)", index.pos)
            first[index.name] = None   # reported
            continue
        if index.name not in first:
            first[index.name] = (index, dim)
            errors = len(ctx.errors)
            _check_count(ctx, index)
            if len(ctx.errors) != errors:
                first[index.name] = None
            continue
        other, other_dim = first[index.name]
        if dim not in (None, "eye") and other_dim not in (None, "eye") and dim != other_dim:
            ctx.err(f"index '{index.name}' is bound to dim '{other_dim}' and to dim '{dim}'",
                    index.pos)
        elif index.count != other.count:
            ctx.err(f"index '{_index_text(index)}' is contracted with '{_index_text(other)}'; "
                    f"both sides of a contraction need the same pack", index.pos)


def _merge_free_dims(ctx: _Ctx, free, t_free):
    """The free indices of a sum seen so far, with the dims of one more term: a
    free index has one dim in every term (a sum of [d] and [dv] tensors is not a
    tensor); a dim unknown so far is taken from this term."""
    dims = {i.name: d for i, d in t_free}
    merged = []
    for index, dim in free:
        other = dims[index.name]
        if dim in (None, "eye"):
            dim = other
        elif other not in (None, "eye") and other != dim:
            where = next(i for i, _ in t_free if i.name == index.name)
            ctx.err(f"index '{index.name}' is bound to dim '{dim}' in one term of this sum and "
                    f"to dim '{other}' in another", where.pos)
        merged.append((index, dim))
    return merged


def _tensor_kind(spec: ast.Spec, name: str) -> str | None:
    if name == BUILTIN_EYE:
        return "the identity tensor"
    if spec.input(name) is not None:
        return "an input"
    return "a state" if spec.state(name) is not None else None


def _tensor_indices(ctx: _Ctx, f: ast.Tensor, where: str, state):
    spec = ctx.spec
    decl_input, decl_state = spec.input(f.name), spec.state(f.name)
    if f.side is not None and where != "cross":
        return ctx.reject(f"'{f.name}@{f.side}': segment sides are only meaningful in cross "
                          f"terms", f.pos)
    if f.name == BUILTIN_EYE:
        if where != "output":
            return ctx.reject("eye[...] may only be used in the output and the normalizer", f.pos)
        if len(f.indices) != 2 or any(i.count is not None for i in f.indices):
            return ctx.reject("eye takes exactly two plain indices: eye[i, j]", f.pos)
        return [(f.indices[0], "eye"), (f.indices[1], "eye")]
    if decl_input is None and decl_state is None:
        if spec.param(f.name) is not None:
            return ctx.reject(f"'{f.name}' is a parameter and takes no indices", f.pos)
        kinds = {"delta": ("token input", spec.inputs), "cross": ("state", spec.states),
                 "output": ("input or state", spec.inputs + spec.states)}
        kind, decls = kinds[where]
        return ctx.reject(f"unknown {kind} '{f.name}' (declared: {_names(decls)})", f.pos)
    if f.side is not None and f.side not in ("A", "B"):
        return ctx.reject(f"unknown segment side '@{f.side}': cross-term factors are X@B (the "
                          f"later segment) or X@A (the earlier one)", f.pos)
    if where == "delta":
        if decl_input is None:
            return ctx.reject(f"a token delta is a product of token inputs; '{f.name}' is a state "
                              f"(put state factors in a 'cross' clause as {f.name}@A or "
                              f"{f.name}@B)", f.pos)
    elif where == "cross":
        if decl_state is None:
            return ctx.reject(f"cross terms combine summaries of the two segments; '{f.name}' is a "
                              f"token input (token factors belong in the delta)", f.pos)
        if f.side is None:
            return ctx.reject(f"cross-term factor '{f.name}' needs a segment side: {f.name}@A or "
                              f"{f.name}@B", f.pos)
        if f.side == "A" and decl_state.combine_only:
            return ctx.reject(f"'{f.name}' is combine_only (not carried in the streaming state), so "
                              f"it can only be read from the later segment as {f.name}@B", f.pos)
    elif decl_state is not None and decl_state.combine_only:
        return ctx.reject(f"'{f.name}' is combine_only and not part of the streaming state, so the "
                          f"output cannot read it", f.pos)
    if decl_input is not None:
        if len(f.indices) != 1:
            return ctx.reject(f"input '{f.name}' has one index (declared as "
                              f"{f.name}[{decl_input.dim}]); {f.name}{_indices_text(f.indices)} "
                              f"has {len(f.indices)}", f.pos)
        # an undeclared dim is reported once, at the input; it binds nothing here
        return [(f.indices[0], decl_input.dim if decl_input.dim in spec.dims else None)]
    declared = _slots(decl_state.indices)
    used = _slots(f.indices)
    if len(used) != len(declared):
        return ctx.reject(f"'{f.name}' has {_n_indices(len(declared))} (declared as "
                          f"{f.name}{_indices_text(decl_state.indices)}); "
                          f"{f.name}{_indices_text(f.indices)} has {len(used)}", f.pos)
    if any(u[1] != d[1] for u, d in zip(used, declared)):
        return ctx.reject(f"index packs must be written as declared: '{f.name}' is declared as "
                          f"{f.name}{_indices_text(decl_state.indices)}, used as "
                          f"{f.name}{_indices_text(f.indices)}", f.pos)
    slot_dims = ctx.slot_dims.get(f.name, (None,) * len(declared))
    return list(zip(f.indices, slot_dims))


def _names(decls, limit: int = 12) -> str:
    names = list(dict.fromkeys(d.name for d in decls))
    more = ", ..." if len(names) > limit else ""
    return ", ".join(names[:limit]) + more if names else "none"


def _n_indices(n: int) -> str:
    return "1 index" if n == 1 else f"{n} indices"


def _indices_text(indices) -> str:
    return "[" + ", ".join(_index_text(i) for i in indices) + "]"


def _check_term(ctx: _Ctx, term: ast.Term, lhs: dict[str, object], dims: dict[str, str],
                *, where: str, state=None, lhs_name: str | None = None) -> None:
    owner = lhs_name or (state.name if state else "")
    rejected = ctx.rejected
    occ = _term_indices(ctx, term, dims, where, state)
    if ctx.rejected != rejected:
        return
    if where == "delta" and next(_tensors(term.factors), None) is None:
        ctx.err("a token delta term must contain token inputs (a constant delta would count "
                "padding tokens)", term.pos)
        return
    if where == "cross":
        sides = [f.side for f in _tensors(term.factors)]
        if sides.count("B") != 1:
            ctx.err(f"a cross term needs exactly one factor of the later segment (X@B); "
                    f"this one has {sides.count('B')}", term.pos)
            return
        if "A" not in sides:
            ctx.err("a cross term needs at least one factor of the earlier segment (Y@A)", term.pos)
            return
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
    contracted: dict[str, ast.Index] = {}
    for index, dim in occ:   # pack counts: as declared, or equal on both sides of a contraction
        if index.name in reported:
            continue
        if index.name in lhs:
            if index.count != lhs[index.name]:
                declared = ast.Index(index.name, lhs[index.name])
                ctx.err(f"index '{_index_text(index)}' does not match '{_index_text(declared)}' on "
                        f"the left-hand side of '{owner}'", index.pos)
                reported.add(index.name)
        elif index.name not in contracted:
            contracted[index.name] = index
            errors = len(ctx.errors)
            _check_count(ctx, index)
            if len(ctx.errors) != errors:
                reported.add(index.name)
        elif index.count != contracted[index.name].count:
            ctx.err(f"index '{_index_text(index)}' is contracted with "
                    f"'{_index_text(contracted[index.name])}'; both sides of a contraction need "
                    f"the same pack", index.pos)
            reported.add(index.name)


def _check_outputs(ctx: _Ctx) -> None:
    spec = ctx.spec
    if spec.output is not None:
        lhs = _check_lhs(ctx, spec.output.indices, f"output '{spec.output.name}'")
        dims: dict[str, str] = {}
        for term in (spec.output.expr.terms if lhs is not None else ()):
            _check_term(ctx, term, lhs, dims, where="output", lhs_name=spec.output.name)
    if spec.normalizer is not None:
        for term in spec.normalizer.terms:
            _check_term(ctx, term, {}, {}, where="output", lhs_name="normalizer")
