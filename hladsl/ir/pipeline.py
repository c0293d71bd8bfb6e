"""The compiler's passes, in order: one flat, named list anyone can run up to
and print between (``hladsl compile SPEC --emit after:PASS``).

Every pass is a function from one immutable ``Compilation`` to the next (it
fills one more field) and has a verifier that checks the invariants of what it
produced; ``compile_spec(..., verify=True)`` (the tests) runs each verifier
between passes. Passes before ``chains`` depend on the spec alone; ``chunk`` and
what follows also on a ``Target`` (chunk size, dim sizes, gated or not), so the
runtime runs them once per shape class through ``program_for``.

    lower            AST + parameters -> state algebra (ir.lower)
    check            associativity (symbolic and float64), symmetry, combine VJP
    serial           X_t = X_{t-1} ⊕ token_t, rank-1 factors as matvecs
    combine          X(AB) from X(A), X(B) with decay powers
    vjp              reverse-mode rules of the combine
    chains           output and state-pass terms in chain normal form
    chunk            the chunk program: contraction plans on [C, ·] tiles
    pack_symmetric   symmetric states held packed where every use allows it
    backward         the VJP of the chunk program: gradient tensor networks per
                     operand and the reverse state pass (ir.backward)
"""
from __future__ import annotations

from dataclasses import dataclass, field, replace
from functools import lru_cache
from typing import Callable

from hladsl.frontend import ast
from hladsl.ir.algebra import Algebra
from hladsl.ir.backward import BackwardProgram, backward_program
from hladsl.ir.chains import output_chains, summary_chains
from hladsl.ir.checks import verify as check_algebra
from hladsl.ir.chunk import ChunkProgram, Chains, build_chunk_program
from hladsl.ir.combine import combine, serial, vjp
from hladsl.ir.expr import Poly
from hladsl.ir.lower import lower
from hladsl.ir.operands import Kind
from hladsl.ir.symmetric import pack_symmetric

DEFAULT_SIZE = 64


@dataclass(frozen=True)
class Target:
    """What the chunk-level passes are specialised to."""
    chunk: int = 64
    sizes: tuple[tuple[str, int], ...] = ()     # dim -> size; a dim not given is DEFAULT_SIZE
    gated: bool = True

    def dim_sizes(self, alg: Algebra) -> tuple[tuple[str, int], ...]:
        given = dict(self.sizes)
        return tuple(sorted((d, given.get(d, DEFAULT_SIZE)) for d in alg.dims))


@dataclass(frozen=True, eq=False)
class Compilation:
    spec: ast.Spec
    params: tuple[tuple[str, object], ...]
    source: str = field(default="", repr=False)
    target: Target = Target()
    algebra: Algebra | None = None
    check: tuple[str, ...] | None = None                       # report lines
    serial: tuple[tuple[str, Poly], ...] | None = None         # streaming summary -> X_t
    combine: tuple[tuple[str, Poly], ...] | None = None        # summary -> X(AB)
    vjp: tuple[tuple[tuple[str, str], Poly], ...] | None = None
    chains: Chains | None = None
    chunk: ChunkProgram | None = None                          # every state unpacked
    program: ChunkProgram | None = None                        # the program kernels run
    backward: BackwardProgram | None = None                    # its VJP


@dataclass(frozen=True)
class Pass:
    name: str
    run: Callable[[Compilation], Compilation]
    verify: Callable[[Compilation], None]
    target_specific: bool = False


# -- passes ---------------------------------------------------------------------------

def _lower(c: Compilation) -> Compilation:
    return replace(c, algebra=lower(c.spec, dict(c.params), c.source))


def _check(c: Compilation) -> Compilation:
    return replace(c, check=tuple(check_algebra(c.algebra)))


def _serial(c: Compilation) -> Compilation:
    return replace(c, serial=tuple((x.name, serial(c.algebra, x)) for x in c.algebra.streaming))


def _combine(c: Compilation) -> Compilation:
    return replace(c, combine=tuple((x.name, combine(c.algebra, x)) for x in c.algebra.summaries))


def _vjp(c: Compilation) -> Compilation:
    return replace(c, vjp=tuple(sorted(vjp(c.algebra).items())))


def _chains(c: Compilation) -> Compilation:
    alg = c.algebra
    chains = Chains(
        output=tuple(output_chains(alg)),
        normalizer=tuple(output_chains(alg, alg.normalizer)) if alg.normalizer is not None else None,
        states=tuple((x.name, tuple(summary_chains(alg, x))) for x in alg.streaming))
    return replace(c, chains=chains)


def _chunk(c: Compilation) -> Compilation:
    t = c.target
    return replace(c, chunk=build_chunk_program(c.algebra, c.chains, t.chunk,
                                                t.dim_sizes(c.algebra), t.gated))


def _pack(c: Compilation) -> Compilation:
    return replace(c, program=pack_symmetric(c.chunk))


def _backward(c: Compilation) -> Compilation:
    return replace(c, backward=backward_program(c.program))


# -- verifiers ------------------------------------------------------------------------

class PassInvariantError(AssertionError):
    """A pass produced a value that breaks its invariants: a compiler bug."""


def _require(ok: bool, what: str) -> None:
    if not ok:
        raise PassInvariantError(what)


def _verify_algebra(c: Compilation) -> None:
    alg = c.algebra
    names = {x.name for x in alg.summaries}
    for x in alg.summaries:
        _require(len(x.indices) == len(x.dims), f"{x.name}: one dim per index")
        _require(set(x.delta.free) == set(x.indices) or not x.delta.terms,
                 f"{x.name}: its delta's free indices are its own")
        for m in x.crosses:
            _require(all(f.name in names for f in m.factors if f.kind == "state"),
                     f"{x.name}: a cross term reads an unknown summary")
            _require(sum(f.where == "B" for f in m.factors) == 1,
                     f"{x.name}: a cross term reads exactly one summary @B")
    _require({x.name for x in alg.streaming} <= names, "streaming summaries are summaries")
    _require(all(d in alg.dims for d in alg.inputs.values()), "every input has a declared dim")


def _verify_check(c: Compilation) -> None:
    _require(bool(c.check), "the check pass reports what it checked")


def _verify_serial(c: Compilation) -> None:
    for name, poly in c.serial:
        x = c.algebra.summary(name)
        _require(tuple(poly.free) == tuple(x.indices), f"serial {name}: free indices")
        for m in poly.terms:
            _require(all(f.where in ("prev", "t") for f in m.factors if f.kind in ("state", "input")),
                     f"serial {name}: reads only the previous state and the token")


def _verify_combine(c: Compilation) -> None:
    for name, poly in c.combine:
        x = c.algebra.summary(name)
        _require(tuple(poly.free) == tuple(x.indices), f"combine {name}: free indices")
        _require(all(f.where in ("A", "B") for m in poly.terms for f in m.factors),
                 f"combine {name}: reads segments A and B only")


def _verify_vjp(c: Compilation) -> None:
    for (name, side), poly in c.vjp:
        _require(side in ("A", "B"), f"vjp d{name}: side {side}")
        if name != "log_rho":
            _require(tuple(poly.free) == tuple(c.algebra.summary(name).indices),
                     f"vjp d{name}@{side}: free indices are the summary's")


def _verify_chains(c: Compilation) -> None:
    ch = c.chains
    _require([n for n, _ in ch.states] == [x.name for x in c.algebra.streaming],
             "one state-pass chain list per streaming summary, in order")
    for term in ch.output + (ch.normalizer or ()) + tuple(t for _, ts in ch.states for t in ts):
        _require(len(term.parents) == term.nodes == len(term.rels), "one parent and rel per node")
        _require(all(-1 <= p < term.nodes for p in term.parents), "parents are nodes or the anchor")


def verify_program(program: ChunkProgram) -> None:
    """Every term's plan contracts exactly its operands to its output, with
    consistent index sizes; states and layouts match the algebra."""
    alg = program.algebra
    _require([n for n, _ in program.states] == [x.name for x in alg.streaming],
             "one state pass per streaming summary")
    _require({n for n, _ in program.layouts} == {x.name for x in alg.streaming},
             "one layout per streaming summary")
    derived = {d.name for d in program.derived}
    for t in program.output + program.normalizer + tuple(x for _, ts in program.states for x in ts):
        for o in t.operands:
            _require(isinstance(o.kind, Kind) and o.kind is not Kind.COTANGENT,
                     f"{t.source}: forward operand kinds only")
            _require(o.kind is not Kind.DERIVED or o.name in derived,
                     f"{t.source}: derived carry {o.name} is defined")
        ids = [o.indices for o in t.operands]
        used = set()
        for s in t.plan.steps:
            _require(s.left < len(ids) and s.right < len(ids), f"{t.source}: step reads a value")
            _require(not ({s.left, s.right} & used), f"{t.source}: each value used once")
            used |= {s.left, s.right}
            _require(set(s.indices) <= set(ids[s.left]) | set(ids[s.right]),
                     f"{t.source}: a step's indices come from its inputs")
            ids.append(s.indices)
        _require(len(used) == len(ids) - 1 or not t.plan.steps, f"{t.source}: every operand is used")
        _require(set(ids[t.plan.result]) >= set(t.output) or not t.plan.steps,
                 f"{t.source}: the result carries the output indices")


def _verify_chunk(c: Compilation) -> None:
    verify_program(c.chunk)
    _require(not c.chunk.packed, "the chunk pass holds every state unpacked")


def _verify_pack(c: Compilation) -> None:
    verify_program(c.program)
    packed = {pd.name for pd in c.program.packed}
    for name, dims in c.program.layouts:
        x = c.algebra.summary(name)
        _require(len(dims) == len(x.dims) - sum(len(g) - 1 for g in x.symmetric)
                 if set(dims) & packed else tuple(dims) == tuple(x.dims),
                 f"{name}: a packed layout folds each symmetric group into one packed dim")


def _verify_backward(c: Compilation) -> None:
    b = c.backward
    _require(b.forward is c.program, "the backward differentiates the program kernels run")
    for g in b.all_terms():
        ops = g.term.operands
        _require(sum(o.kind is Kind.COTANGENT for o in ops) == 1,
                 f"{g.term.source}: one cotangent per gradient network")
        _require(set(g.term.output) <= {i for o in ops for i in o.indices},
                 f"{g.term.source}: the gradient's indices come from its network")
    read = {o.name for t in c.program.output + c.program.normalizer
            for o in t.operands if o.kind is Kind.CARRY}
    got = {g.name for g in b.all_terms() if g.target.value == "carry"}
    _require(read <= got, "every carried state the outputs read gets a gradient")


PASSES: tuple[Pass, ...] = (
    Pass("lower", _lower, _verify_algebra),
    Pass("check", _check, _verify_check),
    Pass("serial", _serial, _verify_serial),
    Pass("combine", _combine, _verify_combine),
    Pass("vjp", _vjp, _verify_vjp),
    Pass("chains", _chains, _verify_chains),
    Pass("chunk", _chunk, _verify_chunk, target_specific=True),
    Pass("pack_symmetric", _pack, _verify_pack, target_specific=True),
    Pass("backward", _backward, _verify_backward, target_specific=True),
)
PASS_NAMES = tuple(p.name for p in PASSES)


def run_passes(c: Compilation, until: str | None = None, verify: bool = False,
               passes: tuple[Pass, ...] = PASSES) -> Compilation:
    """Run ``passes`` in order (through ``until``, inclusive)."""
    if until is not None and until not in PASS_NAMES:
        raise ValueError(f"no pass named {until!r}; passes: {', '.join(PASS_NAMES)}")
    for p in passes:
        c = p.run(c)
        if verify:
            p.verify(c)
        if p.name == until:
            break
    return c


def compile_spec(spec: ast.Spec, params: dict, source: str = "", target: Target | None = None,
                 until: str | None = None, verify: bool = False) -> Compilation:
    """A checked AST with bound parameters through the passes (all by default)."""
    c = Compilation(spec, tuple(sorted(params.items())), source, target or Target())
    return run_passes(c, until, verify)


def algebra_passes(spec: ast.Spec, params: dict, source: str = "") -> Compilation:
    """The target-independent passes: what ``hladsl.load`` runs once per spec."""
    return run_passes(Compilation(spec, tuple(sorted(params.items())), source),
                      passes=tuple(p for p in PASSES if not p.target_specific))


@lru_cache(maxsize=128)
def program_for(c: Compilation, chunk: int, dim_sizes: tuple[tuple[str, int], ...],
                gated: bool) -> ChunkProgram:
    """The chunk program kernels run for one shape class (cached per compilation)."""
    done = replace(c, target=Target(chunk, dim_sizes, gated))
    return run_passes(done, until="pack_symmetric",
                      passes=tuple(p for p in PASSES if p.target_specific)).program


def chunk_program(alg: Algebra, chunk: int, dim_sizes: tuple[tuple[str, int], ...],
                  gated: bool = True) -> ChunkProgram:
    """The final chunk program of an algebra (tests, benchmarks)."""
    return program_for(algebra_compilation(alg), chunk, tuple(sorted(dim_sizes)), gated)


@lru_cache(maxsize=64)
def algebra_compilation(alg: Algebra) -> Compilation:
    """The target-independent passes after ``lower`` on an algebra built elsewhere
    (context parallelism's segment algebra carries extra summaries); cached per algebra."""
    c = Compilation(None, tuple(sorted(alg.params.items())), alg.source, algebra=alg)
    return run_passes(c, passes=tuple(p for p in PASSES if not p.target_specific
                                      and p.name != "lower"))
