"""Which state-pass terms a chunk scan could take from chunk summaries.

The state pass walks the chunks one after another, and each chunk's update reads
its token tiles. Much of that work does not need the carry: the token sums of a
chunk are its own summary (the state's *delta*, computed from zero), and a cross
term of the combine, X@B Y@A, reads the later segment -- here the chunk -- only
through X's delta. HLA2's G update, for instance, reads C at the chunk start times
Σ_n k_n k_nᵀ exp(Λ_end − Λ_n), which is S's delta. A chunk-parallel state pass would
compute every chunk's deltas at once (no carry, parallel over chunks) and then walk
the chunks applying only the carry terms, each a product of carried states with a
delta tile (d x d x dv MACs for HLA2's G) instead of chains over the chunk's tokens.

``scan_plan`` classifies every state-pass term:

* ``carry``: the decayed carried state itself;
* ``delta``: token-only, part of the state's own chunk delta (the parallel phase);
* ``scan``: carried states times another state's whole delta (the sequential phase);
* ``walk``: carried states times a token sum that is no state's delta -- HLA3's
  terms through its combine-only states (X1@B SQ@A, ...): they need the tokens in
  the sequential phase, as today.

``--emit chunk`` prints it with the sequential MACs of such a schedule; the Triton state
pass uses it behind ``codegen.triton_gen.STATE_PASS_READS_DELTAS`` (off until measured).
"""
from __future__ import annotations

from dataclasses import dataclass, replace
from itertools import permutations

from hladsl.ir.backward import REVERSE, BackwardProgram, GradTerm
from hladsl.ir.chunk import ChunkProgram, TermProgram
from hladsl.ir.contract import plan
from hladsl.ir.operands import Kind, Operand

_CARRIED = (Kind.CARRY, Kind.DERIVED)   # (state-pass terms read carried states only)


@dataclass(frozen=True)
class ScanTerm:
    state: str
    index: int                 # the term's position in the state's update
    role: str                  # carry | delta | scan | walk
    delta: str = ""            # scan: the state whose delta it reads
    delta_indices: tuple[str, ...] = ()   # scan: the term's indices on the delta's axes
    macs: int = 0              # scan: MACs of carried states x delta, per chunk and head
    walk_macs: int = 0         # the term's MACs in today's state pass (over the chunk's tokens)


@dataclass(frozen=True)
class ScanPlan:
    terms: tuple[ScanTerm, ...]

    @property
    def complete(self) -> bool:
        """Every term is carry, delta or scan: the sequential phase needs no tokens."""
        return all(t.role != "walk" for t in self.terms)

    def describe(self) -> list[str]:
        roles = {}
        for t in self.terms:
            roles.setdefault(t.role, []).append(t)
        head = ("chunk scan: every state-pass term reads the chunk through a state's delta "
                "(a chunk-parallel state pass needs no tokens in its sequential phase)"
                if self.complete else
                "chunk scan: some state-pass terms read token sums that are no state's delta "
                "(a chunk-parallel state pass would still walk them over the tokens)")
        today = sum(t.walk_macs for t in self.terms)
        sequential = sum(t.macs for t in roles.get("scan", [])) + sum(t.walk_macs for t in roles.get("walk", []))
        lines = [head, f"  sequential MACs a chunk and head: {today} walking the tokens (today), "
                       f"{sequential} as a scan over chunk deltas"]
        for t in roles.get("scan", []):
            lines.append(f"  {t.state} term {t.index}: carried states x delta of {t.delta} "
                         f"({t.macs} MACs a chunk)")
        for t in roles.get("walk", []):
            lines.append(f"  {t.state} term {t.index}: walks the tokens")
        return lines


def _signature(o: Operand) -> tuple:
    return (o.kind, o.name, o.rel, o.weight, o.anchor, o.packed, o.power, o.weighted, len(o.indices))


def _match(ours: list[Operand], theirs: list[Operand]) -> dict[str, str] | None:
    """An index renaming (theirs -> ours) under which ``theirs`` is ``ours``, operand
    for operand (the networks are a handful of operands: brute force)."""
    if sorted(map(_signature, ours)) != sorted(map(_signature, theirs)):
        return None
    for order in permutations(theirs):
        if any(_signature(a) != _signature(b) for a, b in zip(ours, order)):
            continue
        forward: dict[str, str] = {}
        backward: dict[str, str] = {}
        ok = True
        for a, b in zip(ours, order):
            for i, j in zip(a.indices, b.indices):
                if forward.setdefault(j, i) != i or backward.setdefault(i, j) != j:
                    ok = False
                    break
            if not ok:
                break
        if ok:
            return forward
    return None


def _delta_terms(program: ChunkProgram) -> dict[str, TermProgram]:
    """Each state whose delta is one token-only term (its only term without carries)."""
    out = {}
    for name, terms in program.states:
        token_only = [t for t in terms if not any(o.kind in _CARRIED for o in t.operands)]
        if len(token_only) == 1 and token_only[0].coef == 1:
            out[name] = token_only[0]
    return out


def _delta_match(program: ChunkProgram, carried: list[Operand], tokens: list[Operand], output,
                 deltas: dict[str, TermProgram]):
    """(state, the term's indices on its delta's axes, the plan of carried x delta) where the
    token side of a term is exactly one state's chunk delta, contracted with the carried side
    only through that delta's free indices; else None."""
    interface = {i for o in carried for i in o.indices} | set(output)
    for other, d in deltas.items():
        renaming = _match(tokens, list(d.operands))
        if renaming is None:
            continue
        exposed = {renaming[j] for j in d.output}
        summed = {i for o in tokens for i in o.indices} - exposed
        if exposed != {i for o in tokens for i in o.indices} & interface or summed & interface:
            continue
        delta_indices = tuple(renaming[j] for j in d.output)
        sizes = dict(program.sizes) | {pd.name: pd.size for pd in program.packed}
        index_sizes = {i: sizes[dim] for o in carried if o.kind in (Kind.CARRY, Kind.COTANGENT)
                       for i, dim in zip(o.indices, program.state_dims(_state_of(o)))}
        index_sizes.update((i, sizes[dim]) for i, dim in zip(delta_indices, program.state_dims(other)))
        pl = plan(tuple(o.indices for o in carried) + (delta_indices,), tuple(output),
                  tuple(sorted(index_sizes.items())))
        return other, delta_indices, pl
    return None


def _state_of(o: Operand) -> str:
    """The state a carried operand holds (a chunk-end cotangent: its state's)."""
    return o.name[len("end_"):] if o.kind is Kind.COTANGENT else o.name


def _classify(program: ChunkProgram, name: str, k: int, t: TermProgram,
              deltas: dict[str, TermProgram]) -> ScanTerm:
    carried = [o for o in t.operands if o.kind in _CARRIED]
    tokens = [o for o in t.operands if o.kind not in _CARRIED]
    cost = t.plan.flops
    if not tokens:
        return ScanTerm(name, k, "carry", walk_macs=cost)
    if not carried:
        return ScanTerm(name, k, "delta", walk_macs=cost)
    found = _delta_match(program, carried, tokens, t.output, deltas)
    if found is None:
        return ScanTerm(name, k, "walk", walk_macs=cost)
    other, delta_indices, pl = found
    return ScanTerm(name, k, "scan", other, delta_indices, pl.flops, cost)


def scan_plan(program: ChunkProgram) -> ScanPlan:
    deltas = _delta_terms(program)
    return ScanPlan(tuple(_classify(program, name, k, t, deltas)
                          for name, terms in program.states for k, t in enumerate(terms)))


@dataclass(frozen=True)
class ReverseScan:
    """The reverse state pass split as ``scan_plan`` splits the forward one. Each d-state
    update of the backward program (``ir.backward``: gradient networks targeting a carry or a
    derived carry) either reads no chunk-end cotangent -- the output's and the derived
    carries' networks read d num / d den, the chunk's tokens and the chunk-start states the
    forward computed: ``parallel``, every chunk at once -- or reads the chunk-end cotangent
    alone (``carry``: the decayed d-state) or times the chunk's tokens, which for the VJP of a
    forward ``scan`` term are exactly another state's chunk delta: ``scan`` holds those
    networks rewritten as cotangent x that delta (a CARRY operand named after the state, read
    from the forward's per-chunk deltas). HLA2: dC += exp(Λ_end) ΔSᵀ dG_end."""
    parallel: tuple[GradTerm, ...]
    carry: tuple[GradTerm, ...]
    scan: tuple[GradTerm, ...]
    deltas: tuple[str, ...]       # forward states whose chunk deltas ``scan`` reads


def reverse_scan(bwd: BackwardProgram) -> ReverseScan | None:
    """The split of ``bwd``'s reverse pass, or None where a d-state update walks the
    tokens otherwise (reads start states beside the cotangent, or a token sum that is no
    state's delta)."""
    program = bwd.forward
    deltas = _delta_terms(program)
    parallel, carry, scan = [], [], []
    for g in bwd.all_terms():
        if g.target not in REVERSE:
            continue
        ct = g.cotangent
        if not ct.name.startswith("end_"):
            parallel.append(g)
            continue
        others = [o for o in g.term.operands if o.kind is not Kind.COTANGENT]
        if not others:
            carry.append(g)
            continue
        if any(o.kind in _CARRIED for o in others):
            return None
        found = _delta_match(program, [ct], others, g.term.output, deltas)
        if found is None:
            return None
        other, delta_indices, pl = found
        t = g.term
        term = TermProgram(t.coef, (ct, Operand(Kind.CARRY, other, delta_indices)), t.output, pl,
                           t.carry_weight, f"{t.source}, its tokens = the chunk delta of {other}")
        scan.append(replace(g, term=term))
    return ReverseScan(tuple(parallel), tuple(carry), tuple(scan),
                       tuple(dict.fromkeys(o.name for g in scan for o in g.term.operands
                                           if o.kind is Kind.CARRY)))
