"""Backward program: the VJP of a chunk program, derived term by term.

Every term of a chunk program is a multilinear contraction of its operands, so
its transpose with respect to one operand is again a tensor network: the
cotangent of the term's result (a ``Kind.COTANGENT`` operand carrying the
term's output indices) and every other operand, contracted to that operand's
indices, times the term's coefficient. Each gradient term below is such a
network with a fresh contraction plan, labelled with what it differentiates:

  TOKEN    d x[T, i]: adds into the gradient tile of input x (every time node
           of a term adds into the same [C, dim] tile)
  POWER    d spow(x)[T, α] (packed): the executor applies the chain rule
           dx[T,i] = Σ_α dspow[T,α] (m(α)) Σ_r [α_r = i] Π_{s≠r} x[T,α_s]
  CARRY    d of a chunk-start state (reverse state pass)
  DERIVED  d of a derived carry W; ``derived`` sends it on to the carries
           through the monomials of W's poly (the same transpose rule)
  LAM      dΛ at a time index T: masks M[b,a] = [a rel b] exp(W(Λ_b − Λ_a))
           and decays exp(W(Λ_end − Λ_a)), exp(W Λ_t) give ± W · N_T, N_T the
           network with every operand kept, contracted to T; one term per time
           index with the weights netted. N_T is planned as a token's gradient
           network at T plus a row dot with that token (shared in the kernels)
  LAM_END  dΛ_end (= dΛ at the chunk's last position): end decays and a state
           term's carry scale exp(carry_weight · Λ_end), network summed to a scalar

Cotangents: ``num`` [T, e] and ``den`` [T] of the outputs, ``end_<state>`` of a
chunk-end state (a state term's gradient carries the forward term's
``carry_weight``: its value is scaled by exp(carry_weight · Λ_end), like the
forward term), ``dr_<derived>`` of a derived carry.
"""
from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass, replace
from enum import Enum
from functools import lru_cache

from hladsl.ir.chunk import ChunkProgram, TermProgram, operand_sizes, poly_sizes
from hladsl.ir.contract import Plan, Step, plan
from hladsl.ir.operands import Kind, Operand, exhaustive


class Target(str, Enum):
    TOKEN = "token"
    POWER = "power"
    CARRY = "carry"
    DERIVED = "derived"
    LAM = "lam"
    LAM_END = "lam_end"

    def __str__(self) -> str:
        return self.value


@dataclass(frozen=True)
class GradTerm:
    target: Target
    name: str                  # input (token, power), state (carry), derived; for Λ the input whose
                               # gradient network it extends by a row dot ('' where none: _rider)
    wrt: Operand | None        # the forward operand differentiated; for Λ the one it extends (or None)
    term: TermProgram          # the network: cotangent + operands -> the target's indices
    indices: tuple[str, ...]   # the target's indices (term.output plus ``broadcast``)
    broadcast: tuple[tuple[str, int], ...] = ()   # (index, size) the network lacks: constant along it

    @property
    def cotangent(self) -> Operand:
        return next(o for o in self.term.operands if o.kind is Kind.COTANGENT)

    def text(self) -> str:
        """``d<target>[idx] += coef · operands``."""
        t = self.term
        scale = f" · exp({t.carry_weight}·Λ_end)" if t.carry_weight else ""
        body = " ".join(o.text() for o in t.operands)
        spread = "".join(f" · 1[{i}]" for i, _ in self.broadcast)
        return f"{_target_text(self)} += {t.coef:+g} · {body}{scale}{spread}"


def _target_text(g: GradTerm) -> str:
    idx = ",".join(g.indices)
    if g.target is Target.LAM:
        return f"dΛ[{idx}]"
    if g.target is Target.LAM_END:
        return "dΛ_end"
    if g.target is Target.POWER:
        return f"d{g.wrt.text()}"
    return f"d{g.name}[{idx}]"


@dataclass(frozen=True)
class BackwardProgram:
    forward: ChunkProgram
    output: tuple[GradTerm, ...]          # cotangent num [T, e]
    normalizer: tuple[GradTerm, ...]      # cotangent den [T]
    derived: tuple[tuple[str, tuple[GradTerm, ...]], ...]   # derived carry -> carries
    states: tuple[tuple[str, tuple[GradTerm, ...]], ...]    # cotangent end_<state>

    def all_terms(self):
        yield from self.output
        yield from self.normalizer
        for _, ts in self.derived + self.states:
            yield from ts

    def flops(self) -> dict[str, int]:
        """MACs per chunk of the planned networks, before the kernels share subexpressions."""
        return {"reverse": sum(g.term.plan.flops for g in self.all_terms() if g.target in REVERSE),
                "gradient": sum(g.term.plan.flops for g in self.all_terms() if g.target in PARALLEL)}


REVERSE = (Target.CARRY, Target.DERIVED)                         # feed the reverse state pass
PARALLEL = (Target.TOKEN, Target.POWER, Target.LAM, Target.LAM_END)   # the gradient pass


def cotangent_name(role: str, name: str = "") -> str:
    return {"num": "num", "den": "den", "end": f"end_{name}", "derived": f"dr_{name}"}[role]


def output_size(p: ChunkProgram) -> int:
    """The extent of the output's free (value) index."""
    (index,) = p.algebra.output.free
    return operand_sizes(p, p.output[0].operands)[index]


def _network(p: ChunkProgram, operands, output, coef, carry_weight, source, sizes) -> TermProgram:
    """The contraction of ``operands`` to the indices of ``output`` they carry
    (an index of the differentiated operand that nothing else carries was summed
    away alone in the forward: its gradient is broadcast, see GradTerm.broadcast)."""
    covered = {i for o in operands for i in o.indices}
    result = tuple(i for i in output if i in covered)
    pl = plan(tuple(o.indices for o in operands), result,
              tuple(sorted((i, sizes[i]) for i in covered)))
    return TermProgram(float(coef), tuple(operands), result, pl, carry_weight, source)


def _grad(target, name, wrt, net: TermProgram, output, sizes) -> GradTerm:
    missing = tuple((i, sizes[i]) for i in output if i not in net.output)
    return GradTerm(target, name, wrt, net, tuple(output), missing)


# -- transposes of one forward term ----------------------------------------------------------
def _operand_grad(target: Target):
    def grad(p, term, k, ct, sizes):
        o = term.operands[k]
        others = (ct,) + term.operands[:k] + term.operands[k + 1:]
        src = f"∂/∂{o.text()} of {term.coef:+g} · {term.source}"
        net = _network(p, others, o.indices, term.coef, term.carry_weight, src, sizes)
        return [_grad(target, o.name, o, net, o.indices, sizes)]
    return grad


def _via_lam(p, term, k, ct, sizes):
    return []    # masks and decays: collected per time index by _lam_grads


def _no_grad(p, term, k, ct, sizes):
    raise ValueError("a forward term has no cotangent operands")


_TRANSPOSE = exhaustive({
    Kind.TOKEN: _operand_grad(Target.TOKEN), Kind.POWER: _operand_grad(Target.POWER),
    Kind.CARRY: _operand_grad(Target.CARRY), Kind.DERIVED: _operand_grad(Target.DERIVED),
    Kind.MASK: _via_lam, Kind.DECAY: _via_lam, Kind.COTANGENT: _no_grad},
    "the backward transform (transpose rules)")


def _mask_weights(o: Operand, at: dict, end: list) -> None:
    b, a = o.indices
    at[b] += o.weight
    at[a] -= o.weight


def _decay_weights(o: Operand, at: dict, end: list) -> None:
    (a,) = o.indices
    if o.anchor == "end":
        at[a] -= o.weight
        end[0] += o.weight
    else:
        at[a] += o.weight


def _no_weights(o, at, end) -> None:
    pass


_LAM_WEIGHTS = exhaustive({Kind.MASK: _mask_weights, Kind.DECAY: _decay_weights,
                           Kind.TOKEN: _no_weights, Kind.POWER: _no_weights,
                           Kind.CARRY: _no_weights, Kind.DERIVED: _no_weights,
                           Kind.COTANGENT: _no_weights}, "the backward transform (Λ weights)")


def _lam_grads(p, term: TermProgram, ct: Operand, sizes) -> list[GradTerm]:
    """dΛ of one term: Σ over its masks and decays of ± W · N_T, netted per time index
    T, where N_T is the whole network (cotangent included) contracted to T; the
    end-anchored part W_end · Σ_T N_T as one scalar."""
    at: dict[str, int] = defaultdict(int)
    end = [term.carry_weight]
    for o in term.operands:
        _LAM_WEIGHTS[o.kind](o, at, end)
    out = []
    for t, w in at.items():
        if w:
            src = f"∂/∂Λ_{t} (weight {w:+d}) of {term.coef:+g} · {term.source}"
            net = _whole(p, term, ct, t, (t,), term.coef * w, src, sizes)
            out.append(_grad(Target.LAM, *_rider(term, t), net, (t,), sizes))
    if end[0]:
        src = f"∂/∂Λ_end (weight {end[0]:+d}) of {term.coef:+g} · {term.source}"
        times = [o.indices[0] for o in term.operands if o.kind in _ROW_DOT]
        t = times[0] if times else None
        net = _whole(p, term, ct, t, (), term.coef * end[0], src, sizes)
        out.append(_grad(Target.LAM_END, *_rider(term, t), net, (), sizes))
    return out


def _row_dot_operand(term: TermProgram, t: str | None) -> int | None:
    """The position of the token (or power) operand of ``term`` at time ``t``, the first
    where several sit there; None where none does."""
    return next((k for k, o in enumerate(term.operands) if o.kind in _ROW_DOT and o.indices[0] == t),
                None)


def _rider(term: TermProgram, t: str | None) -> tuple[str, Operand | None]:
    """(input, operand): the token operand whose gradient network a dΛ network at time ``t``
    extends by one row dot (``_whole``; computed beside that gradient, it costs one row dot
    more), and its input; ('', None) where none sits at ``t`` (a network of its own)."""
    k = _row_dot_operand(term, t)
    return ("", None) if k is None else (term.operands[k].name, term.operands[k])


_ROW_DOT = (Kind.TOKEN, Kind.POWER)


def _whole(p, term: TermProgram, ct: Operand, t: str | None, output, coef, src, sizes) -> TermProgram:
    """The whole network of ``term`` and its cotangent contracted to ``output`` (T or
    nothing). When a token (or power) operand x sits at time T, N_T is Σ_i x[T,i] ·
    (x's gradient network)[T,i]: the network is planned as exactly that gradient
    network plus one row dot, so the kernels reuse the gradient they compute anyway."""
    k = _row_dot_operand(term, t)
    if k is None:
        return _network(p, (ct,) + term.operands, output, coef, term.carry_weight, src, sizes)
    x = term.operands[k]
    others = (ct,) + term.operands[:k] + term.operands[k + 1:]
    grad = _network(p, others, x.indices, coef, term.carry_weight, src, sizes)
    n = len(others)

    def shifted(i):     # the operand x joins as input n: step results move up by one
        return i if i < n else i + 1
    steps = tuple(replace(s, left=shifted(s.left), right=shifted(s.right)) for s in grad.plan.steps)
    row = Step(shifted(grad.plan.result), n, (t,), sizes[t] * sizes[x.indices[1]])
    pl = Plan(steps + (row,), grad.plan.flops + row.flops, n + 1 + len(steps))
    return TermProgram(float(coef), others + (x,), tuple(output), pl, term.carry_weight, src)


def _term_grads(p: ChunkProgram, term: TermProgram, ct_name: str) -> tuple[GradTerm, ...]:
    ct = Operand(Kind.COTANGENT, ct_name, term.output)
    sizes = operand_sizes(p, term.operands)
    out = []
    for k, o in enumerate(term.operands):
        out += _TRANSPOSE[o.kind](p, term, k, ct, sizes)
    if p.gated:
        out += _lam_grads(p, term, ct, sizes)
    return tuple(out)


def _derived_grads(p: ChunkProgram, d) -> tuple[GradTerm, ...]:
    """dW -> the carries in W's poly: each monomial transposed w.r.t. each factor."""
    sizes = poly_sizes(p, d.poly)
    ct = Operand(Kind.COTANGENT, cotangent_name("derived", d.name), d.poly.free)
    out = []
    for m in d.poly.terms:
        carries = [Operand(Kind.CARRY, f.name, f.indices) for f in m.factors]
        for k, o in enumerate(carries):
            others = [ct] + carries[:k] + carries[k + 1:]
            src = f"∂/∂{o.text()} of {d.name}[{','.join(d.poly.free)}] = {d.poly.text()}"
            net = _network(p, others, o.indices, float(m.coef), 0, src, sizes)
            out.append(_grad(Target.CARRY, o.name, o, net, o.indices, sizes))
    return tuple(out)


@lru_cache(maxsize=64)
def backward_program(program: ChunkProgram) -> BackwardProgram:
    """The VJP of ``program`` (see the module docstring)."""
    def grads(terms, ct_name):
        return tuple(g for t in terms for g in _term_grads(program, t, ct_name))
    return BackwardProgram(
        forward=program,
        output=grads(program.output, cotangent_name("num")),
        normalizer=grads(program.normalizer, cotangent_name("den")),
        derived=tuple((d.name, _derived_grads(program, d)) for d in program.derived),
        states=tuple((name, grads(ts, cotangent_name("end", name))) for name, ts in program.states))


def backward_text(bwd: BackwardProgram) -> str:
    """Every gradient term with the forward equation it came from, by pass."""
    p = bwd.forward
    lines = [f"# {p.algebra.name}: backward chunk program, C = {p.chunk}, "
             + ", ".join(f"{d} = {n}" for d, n in p.sizes) + ("; gated" if p.gated else "; ungated")]
    if p.normalizer:
        lines.append("# o = num / (den + eps):  dnum = do / (den + eps),  "
                     "dden[T] = -Σ_e do[T,e] num[T,e] / (den[T] + eps)^2")
    lines.append("# reverse state pass, chunks last to first: dend_last = d final; "
                 "dstart_c = (carry terms below at chunk c); dend_(c-1) = dstart_c; "
                 "d initial = dstart_0")
    lines.append("# gradient pass, parallel over chunks: token and Λ terms below "
                 "(carries = chunk-start states); dg = reverse in-chunk cumsum of dΛ")

    def block(title, terms, targets):
        chosen = [g for g in terms if g.target in targets]
        if chosen:
            lines.append(title)
            for g in chosen:
                lines.append(f"  {g.text()}")
                lines.append(f"      <- {g.term.source}")
                lines.extend(_plan_lines(g.term))

    for pass_name, targets in (("reverse state pass", REVERSE), ("gradient pass", PARALLEL)):
        lines.append("")
        lines.append(f"== {pass_name} ==")
        block("from the output terms (cotangent dnum):", bwd.output, targets)
        block("from the normalizer terms (cotangent dden):", bwd.normalizer, targets)
        if pass_name == "reverse state pass":
            for name, ts in bwd.derived:
                block(f"derived carry {name} -> carries (cotangent d{name}):", ts, targets)
        for name, ts in bwd.states:
            block(f"from the state terms of {name} (cotangent dend_{name}):", ts, targets)
    flops = bwd.flops()
    lines.append(f"# per chunk and head: {flops['reverse']} reverse-pass MACs, {flops['gradient']} "
                 f"gradient MACs (before shared subexpressions)")
    return "\n".join(lines) + "\n"


def _plan_lines(t: TermProgram) -> list[str]:
    names = [o.text() for o in t.operands]
    out = []
    for s in t.plan.steps:
        names.append(f"%{len(names)}")
        out.append(f"        {names[-1]}[{','.join(s.indices)}] = {names[s.left]} · {names[s.right]}")
    return out
