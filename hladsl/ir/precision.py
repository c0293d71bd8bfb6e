"""The precision plan of a chunk program: which products must stay fp32-accurate.

Tokens arrive in bf16/fp16 and are exact in that dtype; carried states are fp32.
A product that reads a carried state may round the state to the tensor cores'
dtype (one bf16 dot, relative error ~2^-9 of each product) as long as nothing
downstream subtracts large, nearly equal values. Where a sum has carry-reading
terms of opposite sign (HLA2's derived W = C S - G, HLA3's SK SQ P - G1 - G2 - G3)
the result is a small difference of large terms and bf16 rounding of either side
destroys it. So:

1. a *cancelling sum* (a derived carry, the output, the normaliser or a state's
   update) has carry-reading terms of both signs: its products reading carried
   states are fp32-accurate;
2. a state read by a cancelling sum is *sensitive*; so is, transitively, every state
   read by a sensitive state's update: the products of a sensitive state's update
   that read carried states are fp32-accurate too (else the state would enter the
   cancelling sum with bf16 errors);
3. a cancelling derived carry of degree three or more (a product of three carried
   states, HLA3's SK SQ P) reads states summed over the whole sequence, and bf16
   tensor-core products leave each such state ~1e-4 relative error at T = 65536
   (measured on the H100: HLA3's P 7.6e-5 with bf16 token products, 8e-7 with fp32 ones)
   that the degree-three cancellation amplifies past the output's bar (o 1.8e-2; 2.1e-3
   with fp32). So the states such a sum reads, and transitively those their updates
   read, multiply even their token products fp32-accurately (*exact_tokens*). A
   degree-two sum (HLA2's C S - G: o 2.4e-3 there) amplifies far less and keeps them bf16;
4. every other product runs on the tensor cores in the input dtype.

How an fp32-accurate product runs (``codegen.steps``, the template's ``_dot``): two token
tiles as loaded (bf16) multiply in bf16, exactly (their products fit the fp32
accumulator); a token tile against an fp32 tile takes the fp32 side as three bf16 pieces
(hi + mid + lo, its 24 bits), three bf16 dots; two fp32 tiles one tf32x3 dot (three tf32
passes at half the bf16 rate; ``launch.exact_precision``). Measured (H100, HLA3, bf16,
B = 2, H = 16, d = 64): the forward 8.35 -> 3.84 ms at T = 16384 with o at T = 65536
unchanged (2.47e-3 ungated against fp64); bf16x3 (a 16-bit split) for the fp32 pairs too
gives 3.35 ms but o 4.36e-3 (8.6e-3 with it in the output kernel), so it is not the rule.

The backward inherits rules 1 and 2: a gradient network is exact iff the forward sum
whose cotangent it consumes is; rule 3 applies to the state updates (forward, and the
backward's recomputed chunk-start states), and to the backward as a whole:

5. with a cancelling sum of degree three or more (``exact_tokens`` not empty) every
   backward product that reads a carried state or a d-state is fp32-accurate
   (``exact_backward``), as it is for fp16 inputs anyway (``launch.state_dot_dtype``).
   Its cotangent reaches every factor (d(SK SQ P) = dW (SQ P)^T, ...), so the d-states
   are large and cancel in each token's gradient the way the states cancel in W.
   Measured on the H100 (HLA3 ungated, bf16, T = 1000, d = 64, no initial state):
   with bf16 state products in the gradient kernel dq, dk, dv reach 1.6e-2 against the
   fp32 reference, 1.65e-3 with every backward product fp32 (C = 32, round 6).
"""
from __future__ import annotations

from dataclasses import dataclass

from hladsl.ir.chunk import ChunkProgram, TermProgram
from hladsl.ir.operands import Kind

_READS = (Kind.CARRY, Kind.DERIVED)


@dataclass(frozen=True)
class PrecisionPlan:
    exact_output: bool                 # the output / normaliser sum cancels
    exact_derived: frozenset[str]      # derived carries whose terms cancel
    exact_states: frozenset[str]       # states whose update's carry-reading products stay fp32
    exact_tokens: frozenset[str]       # states whose update's token products stay fp32 too (rule 3)
    reasons: tuple[str, ...]           # one line per exact sum, for --emit chunk

    @property
    def exact_backward(self) -> bool:
        """Rule 5: every backward product reading a state or d-state is fp32-accurate."""
        return bool(self.exact_tokens)

    def describe(self) -> list[str]:
        if not self.reasons:
            return ["precision: every product runs on the tensor cores in the input dtype "
                    "(no sum has carry-reading terms of opposite sign)"]
        return (["precision: products reading carried states are fp32-accurate in:"]
                + [f"  {r}" for r in self.reasons]
                + ["  (two token tiles as loaded: in the input dtype, exact; one: the fp32 side as three "
                   "bf16 pieces; none: tf32x3)",
                   "  every other product runs on the tensor cores in the input dtype"])


_FACTORS = (Kind.TOKEN, Kind.POWER, Kind.CARRY, Kind.DERIVED)


def _carries_read(terms) -> set[str]:
    """Carried states a product reads (a lone decayed carry, S_end = exp(Λ) S, is none)."""
    return {o.name for t in terms if sum(o.kind in _FACTORS for o in t.operands) > 1
            for o in t.operands if o.kind is Kind.CARRY}


def _cancels(coefs_of_carry_terms) -> bool:
    signs = {c > 0 for c in coefs_of_carry_terms if c != 0}
    return len(signs) == 2


def _term_cancels(terms: tuple[TermProgram, ...]) -> bool:
    return _cancels(t.coef for t in terms if any(o.kind in _READS for o in t.operands))


def precision_plan(program: ChunkProgram) -> PrecisionPlan:
    reasons = []
    sensitive: set[str] = set()
    exact_derived = set()
    deep: set[str] = set()        # states read by a cancelling sum of degree >= 3
    for d in program.derived:     # every term of a derived carry reads carried states
        if _cancels(float(m.coef) for m in d.poly.terms):
            exact_derived.add(d.name)
            read = sorted({f.name for m in d.poly.terms for f in m.factors})
            sensitive.update(read)
            reasons.append(f"derived {d.name} (its terms cancel: {d.poly.text()})")
            if max(len(m.factors) for m in d.poly.terms) >= DEEP_CANCELLATION:
                deep.update(read)
    out_terms = program.output + program.normalizer
    exact_output = _term_cancels(program.output) or _term_cancels(program.normalizer)
    if exact_output:
        sensitive |= _carries_read(out_terms)
        reasons.append("the output (carry-reading terms of opposite sign)")
    updates = dict(program.states)
    exact_states = {name for name, terms in updates.items() if _term_cancels(terms)}
    sensitive |= {n for name in exact_states for n in _carries_read(updates[name])}
    for name in sorted(exact_states):
        reasons.append(f"the update of {name} (carry-reading terms of opposite sign)")
    frontier = sorted(sensitive)
    while frontier:               # a sensitive state's update must not round what it reads
        name = frontier.pop()
        read = _carries_read(updates.get(name, ()))
        if read and name not in exact_states:
            exact_states.add(name)
            reasons.append(f"the update of {name} ({name} enters a cancelling sum; it reads "
                           f"{', '.join(sorted(read))})")
        for n in sorted(read - sensitive):
            sensitive.add(n)
            frontier.append(n)
    updates_read = {name: _all_carries(terms) for name, terms in updates.items()}
    frontier = sorted(deep)
    while frontier:               # what a deep state's update reads accumulates its errors too
        for n in sorted(updates_read.get(frontier.pop(), set()) - deep):
            deep.add(n)
            frontier.append(n)
    if deep:
        reasons.append(f"token products of {', '.join(sorted(deep))} (read by a cancelling product "
                       f"of {DEEP_CANCELLATION} or more states: their bf16 errors would be amplified)")
    return PrecisionPlan(exact_output, frozenset(exact_derived), frozenset(exact_states),
                         frozenset(deep), tuple(reasons))


DEEP_CANCELLATION = 3   # rule 3: the degree from which a cancelling sum's states stay fp32


def _all_carries(terms) -> set[str]:
    """Carried states the terms read, in products or alone."""
    return {o.name for t in terms for o in t.operands if o.kind is Kind.CARRY}


def quotient_cancelling(bwd) -> tuple[frozenset[tuple[str, str]], tuple[str, ...]]:
    """The reverse-pass targets of a normalised program whose cotangent is a quotient
    rule's near-cancelling sum, and one line of why for each d-state.

    With o = num / den the cotangents are dnum = do / den and dden = -Σ do num / den²:
    a d-state reached from both (a state read by the output and by the normaliser, like
    HLA2's S) sums the two paths, which nearly cancel; rounding either side's products
    to bf16 leaves a small difference of rounded terms (measured: HLA2's d initial S at
    5.4e-3, HLA3-masked's at 2.9e-2, against 1.6e-3 for states reached from one path).
    Those d-states, and the derived carries' cotangents feeding them, keep their
    cotangent products fp32-accurate. ``bwd``: an ``ir.backward.BackwardProgram``.
    Returns ({(target kind, name)}, reasons). The paths followed are d num, d den and the
    derived carries' cotangents within a chunk; a state reached from one of them only
    through another state's chunk-end cotangent (d end_X) is not marked."""
    from hladsl.ir.backward import REVERSE, Target
    feeds: dict[tuple[str, str], set[str]] = {}
    for g in bwd.all_terms():
        if g.target in REVERSE:
            feeds.setdefault((g.target.value, g.name), set()).add(g.cotangent.name)

    def reached(key, seen=frozenset()) -> tuple[set[str], set[tuple[str, str]]]:
        """(which of num / den reach ``key``, the derived targets on the way)."""
        roles, via = set(), set()
        for ct in feeds.get(key, ()):
            if ct in ("num", "den"):
                roles.add(ct)
            elif ct.startswith("dr_"):
                inner = (Target.DERIVED.value, ct[3:])
                if inner not in seen:
                    r, v = reached(inner, seen | {key})
                    roles |= r
                    via |= v | ({inner} if r else set())
        return roles, via

    marked, reasons = set(), []
    for key in sorted(feeds):
        if key[0] != Target.CARRY.value:
            continue
        roles, via = reached(key)
        if roles == {"num", "den"}:
            marked |= {key} | via
            reasons.append(f"d{key[1]} (reached from the output's and the normaliser's cotangents: "
                           f"the quotient rule's terms nearly cancel)")
    return frozenset(marked), tuple(reasons)
