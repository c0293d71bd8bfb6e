"""Segment summaries for context parallelism.

Splitting one sequence over ranks needs, per rank, the summary of its shard as
the *B* side of ``carry ⊕ shard``: the combine of each streaming summary reads
its own B-side value and possibly combine-only ones (AHLA's R, HLA3's X1...).
``gathered(alg)`` is that set.

Generic rule for a segment's value of a combine-only summary: it is a summary
like any other, only not carried by the op. ``segment_algebra(alg)`` is the
same algebra with those summaries carried too (its ``streaming`` closes them
under A-side reads), so its chunk program's state pass from a zero state ends
with the whole segment tuple — the chain normal form of every summary
(``summary_chains``), chunked, with no new derivation. For HLA3 this carries
4-index states, which is why context parallelism then prefers the relay.
"""
from __future__ import annotations

from dataclasses import dataclass, fields

from hladsl.frontend.graph import descendants

from hladsl.ir.algebra import Algebra, Summary
from hladsl.ir.combine import combine


def gathered(alg: Algebra) -> tuple[Summary, ...]:
    """Streaming summaries plus every summary their combine reads on the B side,
    in declaration order."""
    names = {s.name for s in alg.streaming}
    for s in alg.streaming:
        for term in combine(alg, s).terms:
            names.update(f.name for f in term.factors if f.kind == "state" and f.where == "B")
    return tuple(s for s in alg.summaries if s.name in names)


@dataclass(frozen=True, eq=False)
class SegmentAlgebra(Algebra):
    """``base`` with the summaries ``carried`` (and what they read on the A side)
    streaming as well."""
    carried: tuple[str, ...] = ()

    @property
    def streaming(self) -> tuple[Summary, ...]:
        a_side = self.a_side_graph()
        roots = ["<out>", *self.carried]
        a_side.add_nodes_from(roots)
        keep = set(self.carried).union(*(descendants(a_side, r) for r in roots))
        return tuple(s for s in self.summaries if s.name in keep)


_SEGMENT: dict[int, tuple[Algebra, Algebra]] = {}


def segment_algebra(alg: Algebra) -> Algebra:
    """``alg`` itself when every gathered summary streams; otherwise the
    algebra that also carries the gathered combine-only ones (memoised per
    algebra: chunk programs are cached by algebra identity)."""
    extra = tuple(s.name for s in gathered(alg) if s not in alg.streaming)
    if not extra:
        return alg
    hit = _SEGMENT.get(id(alg))
    if hit is None or hit[0] is not alg:
        values = {f.name: getattr(alg, f.name) for f in fields(alg)}
        hit = _SEGMENT[id(alg)] = (alg, SegmentAlgebra(**values, carried=extra))
    return hit[1]
