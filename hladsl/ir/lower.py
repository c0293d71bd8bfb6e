"""AST -> state algebra: bind parameters, expand index packs and groups into
sums of monomials, infer dims and decay weights, check grading, and drop
summaries no output needs."""
from __future__ import annotations

import sys
from fractions import Fraction


from hladsl.errors import AlgebraError, SpecError
from hladsl.frontend import ast
from hladsl.frontend.check import BUILTIN_EYE, MAX_PACK_COUNT, declaration_order
from hladsl.frontend.graph import Digraph, descendants
from hladsl.frontend.printer import sum_text
from hladsl.ir.algebra import Algebra, Summary
from hladsl.ir.expr import Factor, Monomial, Poly, eliminate_eye


def bind_params(spec: ast.Spec, overrides: dict) -> dict[str, object]:
    params = {p.name: p.value for p in spec.params}
    for key, value in overrides.items():
        if key not in params:
            known = ", ".join(params) or "none"
            raise SpecError(f"unknown parameter '{key}' for {spec.name} (parameters: {known})")
        default = params[key]
        if isinstance(default, bool):
            if not isinstance(value, bool):
                raise SpecError(f"parameter '{key}' must be true or false, got {value!r}")
        elif isinstance(value, bool) or not isinstance(value, (int, float)):
            raise SpecError(f"parameter '{key}' must be a number, got {value!r}")
        elif isinstance(default, int) and _is_count(spec, key) and (
                not float(value).is_integer() or not 1 <= value <= MAX_PACK_COUNT):
            raise SpecError(f"parameter '{key}' is a repetition count and must be an integer "
                            f"from 1 to {MAX_PACK_COUNT}, got {value!r}")
        params[key] = int(value) if _is_count(spec, key) else value
    return params


def _is_count(spec: ast.Spec, name: str) -> bool:
    def walk(sum_):
        for t in sum_.terms if sum_ else ():
            for f in t.factors:
                if isinstance(f, ast.Tensor) and any(i.count == name for i in f.indices):
                    return True
                if isinstance(f, ast.Group) and walk(f.expr):
                    return True
        return False
    return any(any(i.count == name for i in s.indices) or walk(s.delta) or walk(s.cross)
               for s in spec.states) or walk(spec.output.expr if spec.output else None)


class _Lowerer:
    def __init__(self, spec: ast.Spec, params: dict):
        self.spec, self.params = spec, params
        self.slot_dims: dict[str, tuple[str, ...]] = {}

    def count(self, index: ast.Index) -> int:
        if index.count is None:
            return 1
        return int(self.params[index.count]) if isinstance(index.count, str) else index.count

    def expand(self, index: ast.Index) -> list[str]:
        if index.count is None:
            return [index.name]
        return [f"{index.name}#{n + 1}" for n in range(self.count(index))]

    def expand_all(self, indices) -> tuple[str, ...]:
        return tuple(i for index in indices for i in self.expand(index))

    def symmetric_slots(self, decl: ast.StateDecl) -> tuple[tuple[int, ...], ...]:
        names = self.expand_all(decl.indices)
        groups = []
        for group in decl.symmetric:
            wanted = [i for index in group for i in self.expand(index)]
            groups.append(tuple(names.index(i) for i in wanted))
        return tuple(g for g in groups if len(g) > 1)

    def tensor(self, t: ast.Tensor, where_input: str) -> list[Factor]:
        if t.name == BUILTIN_EYE:
            return [Factor("eye", BUILTIN_EYE, "", (t.indices[0].name, t.indices[1].name))]
        if self.spec.input(t.name) is not None:
            return [Factor("input", t.name, where_input, (i,)) for i in self.expand(t.indices[0])]
        decl = self.spec.state(t.name)
        return [Factor("state", t.name, t.side or "", self.expand_all(t.indices),
                       self.symmetric_slots(decl))]

    def sum(self, expr: ast.Sum, where_input: str) -> list[Monomial]:
        """The monomials of ``expr``, zero ones included (a literal 0 factor keeps
        its term's factors, so dims are inferred from everything written)."""
        return [m for _, monos in self.by_term(expr, where_input) for m in monos]

    def by_term(self, expr: ast.Sum, where_input: str) -> list[tuple[ast.Term, list[Monomial]]]:
        """Each written term with the monomials it expands to."""
        out = []
        for term in expr.terms:
            partial = [Monomial(Fraction(term.sign), ())]
            for f in term.factors:
                if isinstance(f, ast.Number):
                    partial = [p.scaled(_frac(f.value)) for p in partial]
                elif isinstance(f, ast.ParamRef):
                    partial = [p.scaled(_frac(self.params[f.name])) for p in partial]
                elif isinstance(f, ast.Group):
                    inner = self.sum(f.expr, where_input)
                    partial = [p.times(q) for p in partial for q in inner]
                else:
                    m = Monomial(Fraction(1), tuple(self.tensor(f, where_input)))
                    partial = [p.times(m) for p in partial]
            if any(abs(p.coef) > _FLOAT_MAX for p in partial):   # generated code holds floats
                raise SpecError("the coefficient of this term is out of range (above 1.8e308)",
                                term.pos)
            out.append((term, partial))
        return out

    def factor_dims(self, f: Factor) -> list[tuple[str, str]]:
        """(index, dim) of each slot of a lowered factor (none for eye)."""
        if f.kind == "input":
            return [(f.indices[0], self.spec.input(f.name).dim)]
        if f.kind == "state":
            return list(zip(f.indices, self.slot_dims[f.name]))
        return []

    def infer_dims(self, name: str, indices: tuple[str, ...], terms: list[Monomial]) -> tuple[str, ...]:
        dims: dict[str, str] = {}
        for t in terms:
            for f in t.factors:
                for i, dim in self.factor_dims(f):
                    dims.setdefault(i, dim)
        return tuple(dims[i] for i in indices)


_FLOAT_MAX = Fraction(sys.float_info.max)


def _nonzero(terms: list[Monomial]) -> list[Monomial]:
    return [t for t in terms if t.coef != 0]


def _frac(value) -> Fraction:
    return Fraction(str(value)) if isinstance(value, float) else Fraction(value)


def lower(spec: ast.Spec, params: dict, source: str = "") -> Algebra:
    low = _Lowerer(spec, params)
    order = declaration_order(spec)
    weights: dict[str, int] = {}
    summaries: dict[str, Summary] = {}
    for name in order:
        decl = spec.state(name)
        indices = low.expand_all(decl.indices)
        delta = [] if decl.delta.is_zero else low.sum(decl.delta, "t")
        cross_terms = low.by_term(decl.cross, "t") if decl.cross is not None else []
        crosses = [m for _, monos in cross_terms for m in monos]
        low.slot_dims[name] = low.infer_dims(name, indices, delta + crosses)
        weights[name] = _weight(decl, cross_terms, weights)
        delta, crosses = _nonzero(delta), _nonzero(crosses)
        summaries[name] = Summary(name, indices, low.slot_dims[name], weights[name],
                                  Poly(indices, tuple(delta)), tuple(crosses),
                                  low.symmetric_slots(decl), decl.combine_only, decl.pos)
        _check_declared_symmetry(summaries[name])
    normalize = bool(params.get("normalize", False))
    out_indices = low.expand_all(spec.output.indices)
    output = _without_eye(low, Poly(out_indices, tuple(low.sum(spec.output.expr, "t"))),
                          spec.output.pos, f"the output '{spec.output.name}'")
    normalizer = (_without_eye(low, Poly((), tuple(low.sum(spec.normalizer, "t"))),
                               spec.normalizer_pos, "the normalizer")
                  if normalize else None)
    needed = _needed(summaries, output, normalizer)
    kept = tuple(summaries[n] for n in order if n in needed)
    return Algebra(spec.name, spec.dims, {i.name: i.dim for i in spec.inputs}, params, kept,
                   output, normalizer, spec.output.name, source)


def _without_eye(low: _Lowerer, poly: Poly, pos, what: str) -> Poly:
    """``poly`` with eye factors contracted away, collected; it must not vanish
    (a zero output has no program: o would be 0, or num / eps)."""
    _check_eye_dims(low, poly, pos, what)
    terms = []
    for t in poly.terms:
        reduced = eliminate_eye(t, poly.free)
        if reduced is None:
            raise SpecError("eye[i, j] with both indices free has nothing to contract with", pos)
        terms.append(reduced)
    out = Poly(poly.free, tuple(terms)).canonical()
    if not out.terms:
        raise SpecError(f"{what} is identically zero: its terms have a zero factor or cancel", pos)
    return out


def _check_eye_dims(low: _Lowerer, poly: Poly, pos, what: str) -> None:
    """eye[i, j] joins two indices of one dim (the checker leaves eye's dims open:
    they are those of the factors its indices meet), and a free index keeps one
    dim in every term."""
    free_dims: dict[str, str] = {}
    for t in poly.terms:
        joined: dict[str, str] = {}   # union-find over the indices eyes join

        def root(i: str) -> str:
            while joined.get(i, i) != i:
                i = joined[i]
            return i
        for f in t.factors:
            if f.kind == "eye" and root(f.indices[0]) != root(f.indices[1]):
                joined[root(f.indices[0])] = root(f.indices[1])
        dims: dict[str, set[str]] = {}
        for f in t.factors:
            for i, dim in low.factor_dims(f):
                dims.setdefault(root(i), set()).add(dim)
        for found in dims.values():
            if len(found) > 1:
                raise SpecError(f"eye[...] in {what} joins indices of different dims "
                                f"({' and '.join(sorted(found))}): both indices of eye range "
                                f"over one dim", pos)
        for i in poly.free:
            (dim,) = dims.get(root(i), {None})
            if dim is not None and free_dims.setdefault(i, dim) != dim:
                raise SpecError(f"index '{i}' of {what} ranges over dim '{free_dims[i]}' in one "
                                f"term and over '{dim}' in another (through eye[...])", pos)


def _check_declared_symmetry(summary: Summary) -> None:
    """A symmetric(...) group must hold for the delta and every cross term: the
    chunk program stores and reads the summary packed, so a false declaration
    would silently change the result. Checked symbolically, one adjacent swap of
    the group's slots at a time (they generate every permutation)."""
    body = Poly(summary.indices, summary.delta.terms + summary.crosses)
    for group in summary.symmetric:
        for left, right in zip(group, group[1:]):
            a, b = summary.indices[left], summary.indices[right]
            swapped = body.map_terms(lambda t: t.relabel({a: b, b: a}))
            if (body + swapped.scaled(-1)).canonical().terms:   # as ir.checks words it
                raise AlgebraError(f"'{summary.name}' is declared symmetric in ({a}, {b}) but its "
                                   f"delta or cross terms are not: {body.canonical().text()}",
                                   summary.pos)


def _weight(decl: ast.StateDecl, cross_terms, weights: dict[str, int]) -> int:
    """Decay weight: the override, else 1 for a summary with a token delta, else
    the weight of its first cross term. Every cross term must match (grading),
    zero ones included (they are checked as written)."""
    def cross_weight(m: Monomial) -> int:
        return sum(weights[f.name] for f in m.factors if f.kind == "state")

    if decl.decay is not None:
        w = decl.decay
    elif not decl.delta.is_zero:
        w = 1
    else:
        w = cross_weight(cross_terms[0][1][0])
    for term, monos in cross_terms:
        for m in monos:
            cw = cross_weight(m)
            if cw == w:
                continue
            parts = ", ".join(f"{f.name}: {weights[f.name]}" for f in m.factors if f.kind == "state")
            how = (f"declared 'decay {w}'" if decl.decay is not None else
                   f"its {'token delta' if not decl.delta.is_zero else 'first cross term'} "
                   f"gives weight {w}")
            raise AlgebraError(
                f"cross term '{sum_text(ast.Sum((term,)))}' of '{decl.name}' has decay weight {cw} "
                f"({parts}) but '{decl.name}' decays with weight {w} ({how}). The combine "
                f"{decl.name}(AB) = rho_B^{w} {decl.name}(A) + {decl.name}(B) + ... is associative "
                f"only if every cross term has the summary's weight; "
                f"{'use decay ' + str(cw) if cw >= 0 else 'fix the weights'}.",
                term.pos)
    return w


def _needed(summaries: dict[str, Summary], output: Poly, normalizer: Poly | None) -> set[str]:
    graph = Digraph()
    graph.add_node("<out>")
    for s in summaries.values():
        for c in s.crosses:
            for f in c.factors:
                graph.add_edge(s.name, f.name)
    for poly in (output, normalizer):
        for t in (poly.terms if poly else ()):
            for f in t.factors:
                if f.kind == "state":
                    graph.add_edge("<out>", f.name)
    return descendants(graph, "<out>")
