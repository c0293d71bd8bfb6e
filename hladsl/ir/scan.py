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
* ``walk``: carried states times a token sum too large to hold per chunk -- HLA3's
  terms through its four-index combine-only states (X1@B SQ@A, ...): they need the
  tokens in the sequential phase, as today.

A scan term's chunk summary is another state's delta where one matches (HLA2's G reads
S's); otherwise an ``AuxDelta``, the term's token side summed over the chunk to the
indices it shares with the carried side (AHLA's Σ k qᵀ, its combine-only R; HLA3-masked's
QQ, N and M), computed beside the deltas, if it is no larger than the largest state.

``--emit chunk`` prints it with the sequential MACs of such a schedule. The chunk-parallel
state pass (``codegen.triton_gen._chunk_scan``, schedule "scan") is built from it; the walking
state pass reads deltas so only behind ``codegen.triton_gen.STATE_PASS_READS_DELTAS`` (off).
``reverse_scan`` splits the backward's reverse pass the same way. ``staged_scan`` runs the
chunk-parallel pass in two stages where the plan walks (HLA3): the walking terms read lower
states' stored chunk starts and become per-chunk increments; asked (``complete``), it splits
a complete scan so too, taking its scan terms' products out of the sequential walk (HLA2's
G += ΔS (ρ C) becomes every chunk's increment at once).
"""
from __future__ import annotations

import math
from dataclasses import dataclass, replace
from itertools import permutations

from hladsl.ir.backward import REVERSE, BackwardProgram, GradTerm, Target, cotangent_name
from hladsl.ir.chunk import ChunkProgram, TermProgram
from hladsl.ir.contract import plan
from hladsl.ir.operands import Kind, Operand

_CARRIED = (Kind.CARRY, Kind.DERIVED)   # (state-pass terms read carried states only)


@dataclass(frozen=True)
class AuxDelta:
    """A chunk summary no state holds: the token side of a scan term whose tokens are no
    state's delta (AHLA's Σ_n k_n q_nᵀ, its combine-only R), summed over the chunk to the
    indices it shares with the carried side. The chunk-parallel pass computes it beside the
    states' deltas and stores it per chunk."""
    name: str                  # aux_<state>_<term position> (the state's name is an identifier)
    state: str                 # whose update reads it (its products take that state's precision)
    dims: tuple[str, ...]      # the dims of its axes
    term: TermProgram          # tokens, masks, decays -> its axes (coef 1, no carry weight)


@dataclass(frozen=True)
class ScanTerm:
    state: str
    index: int                 # the term's position in the state's update
    role: str                  # carry | delta | scan | walk
    delta: str = ""            # scan: the state (or AuxDelta) whose chunk summary it reads
    delta_indices: tuple[str, ...] = ()   # scan: the term's indices on the delta's axes
    macs: int = 0              # scan: MACs of carried states x delta, per chunk and head
    walk_macs: int = 0         # the term's MACs in today's state pass (over the chunk's tokens)
    aux: AuxDelta | None = None   # scan: the chunk summary it reads, where no state holds it


@dataclass(frozen=True)
class ScanPlan:
    terms: tuple[ScanTerm, ...]

    @property
    def aux(self) -> tuple[AuxDelta, ...]:
        return tuple(t.aux for t in self.terms if t.aux is not None)

    @property
    def scan_macs(self) -> int:
        """The sequential phase's MACs a chunk and head: carried states x chunk summaries."""
        return sum(t.macs for t in self.terms if t.role == "scan")

    @property
    def complete(self) -> bool:
        """Every term is carry, delta or scan: the sequential phase needs no tokens."""
        return all(t.role != "walk" for t in self.terms)

    def describe(self) -> list[str]:
        roles = {}
        for t in self.terms:
            roles.setdefault(t.role, []).append(t)
        head = ("chunk scan: every state-pass term reads the chunk through a chunk summary, a "
                "state's delta or one no state holds (a chunk-parallel state pass needs no tokens "
                "in its sequential phase)"
                if self.complete else
                "chunk scan: some state-pass terms read token sums that are no state's delta "
                "(a chunk-parallel state pass would still walk them over the tokens)")
        today = sum(t.walk_macs for t in self.terms)
        sequential = self.scan_macs + sum(t.walk_macs for t in roles.get("walk", []))
        lines = [head, f"  sequential MACs a chunk and head: {today} walking the tokens (today), "
                       f"{sequential} as a scan over chunk deltas"]
        for t in roles.get("scan", []):
            what = (f"a chunk summary [{','.join(t.aux.dims)}] no state holds ({t.aux.name})"
                    if t.aux else f"delta of {t.delta}")
            lines.append(f"  {t.state} term {t.index}: carried states x {what} ({t.macs} MACs a chunk)")
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
                 deltas: dict[str, TermProgram], aux: dict[str, AuxDelta] | None = None):
    """(state, the term's indices on its delta's axes, the plan of carried x delta) where the
    token side of a term is exactly one state's chunk delta (or one of ``aux``, by name),
    contracted with the carried side only through that delta's free indices; else None."""
    aux = aux or {}
    deltas = {**deltas, **{name: a.term for name, a in aux.items()}}
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
        sizes = _feature_sizes(program)
        index_sizes = {i: sizes[dim] for o in carried if o.kind in (Kind.CARRY, Kind.COTANGENT)
                       for i, dim in zip(o.indices, program.state_dims(_state_of(o)))}
        axes = aux[other].dims if other in aux else program.state_dims(other)
        index_sizes.update((i, sizes[dim]) for i, dim in zip(delta_indices, axes))
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
    if found is not None:
        other, delta_indices, pl = found
        return ScanTerm(name, k, "scan", other, delta_indices, pl.flops, cost)
    aux = _aux_delta(program, name, k, carried, tokens, t.output)
    if aux is None:
        return ScanTerm(name, k, "walk", walk_macs=cost)
    sizes = _feature_sizes(program)
    index_sizes = {i: sizes[dim] for o in carried if o.kind is Kind.CARRY
                   for i, dim in zip(o.indices, program.state_dims(o.name))}
    index_sizes.update((i, sizes[dim]) for i, dim in zip(aux.term.output, aux.dims))
    pl = plan(tuple(o.indices for o in carried) + (aux.term.output,), t.output,
              tuple(sorted(index_sizes.items())))
    return ScanTerm(name, k, "scan", aux.name, aux.term.output, pl.flops, cost, aux)


def _feature_sizes(program: ChunkProgram) -> dict[str, int]:
    return dict(program.sizes) | {pd.name: pd.size for pd in program.packed}


def _aux_delta(program: ChunkProgram, state: str, k: int, carried: list[Operand],
               tokens: list[Operand], output) -> AuxDelta | None:
    """The token side of a term summed over the chunk to the feature indices it shares with
    the carried side or the result, where that summary is no larger than the program's
    largest state (it is held in registers and stored per chunk); None for token powers."""
    if any(o.kind is Kind.POWER for o in tokens) or not all(o.kind is Kind.CARRY for o in carried):
        return None
    dims = {}
    for o in tokens:
        if o.kind is Kind.TOKEN:
            dims[o.indices[1]] = program.algebra.inputs[o.name]
    outside = {i for o in carried for i in o.indices} | set(output)
    axes = tuple(i for i in dict.fromkeys(list(output) + [i for o in carried for i in o.indices])
                 if i in dims)
    if not axes or any(i in outside and i not in dims for o in tokens for i in o.indices):
        return None
    sizes = _feature_sizes(program)
    largest = max(math.prod(program.state_shape(s)) for s, _ in program.states)
    if math.prod(sizes[dims[i]] for i in axes) > largest:
        return None
    index_sizes = {i: program.chunk for o in tokens for i in o.indices if i not in dims}
    index_sizes.update((i, sizes[d]) for i, d in dims.items())
    pl = plan(tuple(o.indices for o in tokens), axes, tuple(sorted(index_sizes.items())))
    term = TermProgram(1.0, tuple(tokens), axes, pl, 0, f"the chunk summary of {state} term {k}'s tokens")
    return AuxDelta(f"aux_{state}_{k}", state, tuple(dims[i] for i in axes), term)


def scan_plan(program: ChunkProgram) -> ScanPlan:
    deltas = _delta_terms(program)
    return ScanPlan(tuple(_classify(program, name, k, t, deltas)
                          for name, terms in program.states for k, t in enumerate(terms)))


def has_chunk_scan(program: ChunkProgram, plan: ScanPlan | None = None) -> bool:
    """Does ``program`` get the one-stage chunk-parallel state pass? Every state-pass term is a
    carry, a delta or a scan term (``ScanPlan.complete``) and no state is packed (the scan
    kernel reads and writes states as whole tiles). Else ``staged_scan`` may give two stages."""
    return (plan or scan_plan(program)).complete and not program.packed


@dataclass(frozen=True)
class StagedScan:
    """The chunk-parallel state pass in two stages, where a scan plan walks the tokens (or,
    asked, where it is complete: its scan terms become increments too): the
    *lower* states (carry and token-only terms alone) are scanned first, as any chunk scan;
    every other term of the *upper* states reads carried lower states only, so once the
    lower states' chunk starts are stored those terms -- walking ones included -- are a
    chunk's own increment, computed for every chunk at once; the upper states then scan their
    carries and increments. HLA3: SK, SQ, P (and m) first, then G1, G2, G3 (h1, h2, h3), whose
    terms through the four-index combine-only states stop walking the chunks one by one."""
    lower: tuple[str, ...]
    upper: tuple[str, ...]
    reads: tuple[str, ...]     # the lower states the upper increments read at each chunk start

    def describe(self) -> list[str]:
        return [f"staged chunk scan: {', '.join(self.lower)} scanned first; then every chunk's "
                f"increment of {', '.join(self.upper)} at once (their terms read only "
                f"{', '.join(self.reads)} at the chunk start), then their carries scanned"]


def staged_scan(program: ChunkProgram, plan: ScanPlan | None = None,
                complete: bool = False) -> StagedScan | None:
    """The two-stage chunk scan of ``program``, or None: where the one-stage scan is complete
    (it needs no second stage; ``complete`` stages such a scan too, where a scan term would
    multiply carried states by a delta in the sequential walk), a state is packed (whole
    tiles, as ``has_chunk_scan``), or the states do not split so -- a carry term reads
    another state, or a term of an upper state reads an upper state or a derived carry."""
    plan = plan or scan_plan(program)
    if (plan.complete and not complete) or program.packed:
        return None
    roles = {}
    for t in plan.terms:
        roles.setdefault(t.state, set()).add(t.role)
    upper = {name for name, r in roles.items() if r & {"scan", "walk"}}
    if not upper:
        return None
    reads = {}
    for name, terms in program.states:
        for t in terms:
            carried = [o for o in t.operands if o.kind in _CARRIED]
            if any(o.kind is not Kind.CARRY for o in carried):
                return None
            tokens = len(carried) < len(t.operands)
            if not tokens:   # a carry term: the state's own decayed carry
                if {o.name for o in carried} != {name}:
                    return None
            elif carried and (name not in upper or any(o.name in upper for o in carried)):
                return None
            else:
                reads.update(dict.fromkeys(o.name for o in carried))
    order = [name for name, _ in program.states]
    return StagedScan(tuple(n for n in order if n not in upper), tuple(n for n in order if n in upper),
                      tuple(n for n in order if n in reads))


def split_complete_scan(program: ChunkProgram, plan: ScanPlan | None = None) -> StagedScan | None:
    """The two-stage alternative of a complete one-stage scan (schedule "staged"), or None:
    where the scan is not complete (its own split, if any, is ``staged_scan``'s), a state is
    packed, or no state has a term to split off."""
    plan = plan or scan_plan(program)
    return staged_scan(program, plan, complete=True) if plan.complete else None


@dataclass(frozen=True)
class ReverseScan:
    """The reverse state pass split as ``scan_plan`` splits the forward one. Each d-state
    update of the backward program (``ir.backward``: gradient networks targeting a carry or a
    derived carry) either reads no chunk-end cotangent -- the output's and the derived
    carries' networks read d num / d den, the chunk's tokens and the chunk-start states the
    forward computed: ``parallel``, every chunk at once -- or reads the chunk-end cotangent
    alone (``carry``: the decayed d-state) or times the chunk's tokens, which for the VJP of a
    forward ``scan`` term are exactly another state's chunk delta (or an ``AuxDelta``):
    ``scan`` holds those networks rewritten as cotangent (x the chunk-start states the term
    reads) x that delta (a CARRY operand named after it, read from the forward's per-chunk
    deltas). HLA2: dC += exp(Λ_end) ΔSᵀ dG_end; HLA3-masked: dS += dH_end Pᵀ (Σ q qᵀ)."""
    parallel: tuple[GradTerm, ...]
    carry: tuple[GradTerm, ...]
    scan: tuple[GradTerm, ...]
    deltas: tuple[str, ...]       # forward states (or AuxDelta) whose chunk deltas ``scan`` reads
    starts: tuple[str, ...] = ()  # forward states whose chunk-start values ``scan`` reads too


def reverse_scan(bwd: BackwardProgram) -> ReverseScan | None:
    """The split of ``bwd``'s reverse pass, or None where a d-state update walks the
    tokens otherwise (reads start states beside the cotangent, or a token sum that is no
    state's delta)."""
    program = bwd.forward
    deltas = _delta_terms(program)
    aux = {a.name: a for a in scan_plan(program).aux}   # the forward's, stored per chunk too
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
        starts = [o for o in others if o.kind in _CARRIED]
        tokens = [o for o in others if o.kind not in _CARRIED]
        if not tokens or any(o.kind is not Kind.CARRY for o in starts):
            return None
        found = _delta_match(program, [ct] + starts, tokens, g.term.output, deltas, aux)
        if found is None or any(o.name == found[0] for o in starts):
            return None     # (a start state and a delta of one name would share its tile)
        other, delta_indices, pl = found
        t = g.term
        term = TermProgram(t.coef, (ct, *starts, Operand(Kind.CARRY, other, delta_indices)), t.output,
                           pl, t.carry_weight, f"{t.source}, its tokens = the chunk delta of {other}")
        scan.append(replace(g, term=term))
    deltas_read = tuple(dict.fromkeys(g.term.operands[-1].name for g in scan))
    starts_read = tuple(dict.fromkeys(o.name for g in scan for o in g.term.operands[1:-1]))
    if set(deltas_read) & set(starts_read):
        return None         # one tile name per chunk-wise operand (see above)
    return ReverseScan(tuple(parallel), tuple(carry), tuple(scan), deltas_read, starts_read)


@dataclass(frozen=True)
class StagedReverse:
    """The reverse pass in two stages, the transpose of ``StagedScan``
    (docs/design/staged_reverse_pass.md; kernels: ``codegen.triton_bwd._reverse_scan``). In reverse
    the chunk-end d-state (cotangent ``end_Y``) is what is carried; the forward's chunk-start states
    are per-chunk constants like the tokens. So each d-state network is ``parallel`` (no chunk-end
    cotangent: d num, d den, a derived carry's), ``carry`` (``end_X`` alone, into dX: the decayed
    d-state) or ``cross`` (``end_Y`` times tokens and / or start states, into dX). *Lower* d-states
    get only parallel and carry networks and scan first, storing their chunk ends; every chunk's
    increment of the *upper* ones (cross targets) then reads those ends only, every chunk at once;
    then the upper carries scan. HLA3: dG1, dG2, dG3 first, then dSK, dSQ, dP -- the forward's
    ``StagedScan.reads``."""
    lower: tuple[str, ...]
    upper: tuple[str, ...]
    reads: tuple[str, ...]        # lower d-states whose chunk ends the upper increments read
    starts: tuple[str, ...]       # forward states whose chunk starts the cross networks read
    parallel: tuple[GradTerm, ...]
    carry: tuple[GradTerm, ...]
    cross: tuple[GradTerm, ...]

    def networks(self, names) -> tuple[GradTerm, ...]:
        """A stage's per-chunk part of the d-states ``names``: their parallel and cross
        networks, after the derived carries' networks whose d they read (d W0 from d num)."""
        nets = tuple(g for g in self.parallel + self.cross if g.target is Target.CARRY and g.name in names)
        read = {g.cotangent.name for g in nets}
        return tuple(g for g in self.parallel if g.target is Target.DERIVED
                     and cotangent_name("derived", g.name) in read) + nets

    def carries(self, names) -> tuple[GradTerm, ...]:
        """The carry networks of the d-states ``names`` (a stage's scan)."""
        return tuple(g for g in self.carry if g.name in names)

    def describe(self) -> list[str]:
        lower, upper, reads = (", ".join(f"d{n}" for n in names) for names in (self.lower, self.upper, self.reads))
        return [f"staged reverse scan: {lower} scanned first; then every "
                f"chunk's increment of {upper} at once ({len(self.cross)} networks read only {reads} at the "
                f"chunk end), then their carries scanned"]


def staged_reverse(bwd: BackwardProgram) -> StagedReverse | None:
    """The two-stage split of ``bwd``'s reverse pass, or None: where a state is packed,
    nothing crosses, or the d-states do not split so -- a carry network into another
    d-state, a cross network reading an upper d-state's end or a derived carry. It reads
    no forward delta, so it serves a program whose one-stage ``reverse_scan`` exists too
    wherever that one's deltas are not at hand (after a state pass in two stages)."""
    program = bwd.forward
    if program.packed:
        return None
    parallel, carry, cross = [], [], []
    for g in bwd.all_terms():
        if g.target not in REVERSE:
            continue
        if not g.cotangent.name.startswith("end_"):
            parallel.append(g)
        elif all(o.kind is Kind.COTANGENT for o in g.term.operands):
            if g.cotangent.name != f"end_{g.name}":
                return None
            carry.append(g)
        else:
            cross.append(g)
    upper = {g.name for g in cross}
    read = {g.cotangent.name[len("end_"):] for g in cross}
    others = [o for g in cross for o in g.term.operands if o.kind is not Kind.COTANGENT]
    if not cross or read & upper or any(o.kind is Kind.DERIVED for o in others):
        return None
    order = [name for name, _ in program.states]
    return StagedReverse(tuple(n for n in order if n not in upper), tuple(n for n in order if n in upper),
                         tuple(n for n in order if n in read),
                         tuple(n for n in order if n in {o.name for o in others if o.kind is Kind.CARRY}),
                         tuple(parallel), tuple(carry), tuple(cross))
