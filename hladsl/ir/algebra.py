"""The state algebra of one mechanism with its parameters bound: summaries,
their token deltas, cross terms and decay weights, and the outputs. Produced by
``lower.lower`` (run by ``ir.pipeline``); everything else in hladsl is derived from it."""
from __future__ import annotations

from dataclasses import dataclass, field
from functools import cached_property

from hladsl.frontend.graph import Digraph, descendants

from hladsl.ir.expr import Factor, Monomial, Poly


@dataclass(frozen=True)
class Summary:
    name: str
    indices: tuple[str, ...]            # expanded index names (packs become i#1, i#2, ...)
    dims: tuple[str, ...]               # dim name per slot
    weight: int                         # decay weight (grade) w
    delta: Poly                         # token delta: token inputs at time 't'
    crosses: tuple[Monomial, ...]       # each: one factor @B, one or more @A
    symmetric: tuple[tuple[int, ...], ...] = ()
    combine_only: bool = False
    pos: object = field(default=None, compare=False, repr=False)   # declaration, for errors

    def factor(self, where: str, indices: tuple[str, ...] | None = None) -> Factor:
        return Factor("state", self.name, where, indices or self.indices, self.symmetric)


@dataclass(frozen=True, eq=False)   # identity hash: used as a cache key
class Algebra:
    name: str
    dims: tuple[str, ...]
    inputs: dict[str, str]              # input name -> dim
    params: dict[str, object]
    summaries: tuple[Summary, ...]      # dependency order: a summary after what it reads
    output: Poly                        # free indices: output indices; reads the inclusive state
    normalizer: Poly | None             # scalar; None when normalisation is off
    output_name: str = "o"
    source: str = field(default="", compare=False)

    def summary(self, name: str) -> Summary:
        for s in self.summaries:
            if s.name == name:
                return s
        raise KeyError(name)

    @property
    def normalize(self) -> bool:
        return self.normalizer is not None

    @property
    def eps(self) -> float:
        return float(self.params.get("eps", 0.0))

    def graph(self) -> Digraph:
        """X -> Y (attribute sides: the segments, "A" / "B", at which X's cross terms read Y;
        one cross term may read Y at A and another at B); outputs as node '<out>'."""
        sides: dict[tuple[str, str], set[str]] = {}
        for s in self.summaries:
            for c in s.crosses:
                for f in c.factors:
                    sides.setdefault((s.name, f.name), set()).add(f.where)
        for poly in (self.output, self.normalizer):
            for t in (poly.terms if poly else ()):
                for f in t.factors:
                    if f.kind == "state":
                        sides.setdefault(("<out>", f.name), set()).add("A")
        g = Digraph()
        g.add_nodes_from([s.name for s in self.summaries] + ["<out>"])
        for (u, v), where in sides.items():
            g.add_edge(u, v, sides=frozenset(where))
        return g

    def a_side_graph(self) -> Digraph:
        """``graph``'s edges that read segment A (what must be carried to form a combine)."""
        g = Digraph([(u, v) for u, v, sides in self.graph().edges(data="sides") if "A" in sides])
        g.add_node("<out>")
        return g

    @cached_property
    def queries(self) -> tuple[str, ...]:
        """Inputs read at the output's own token (the query side): a call's ``scale``
        multiplies them (the kernels as they load them)."""
        return tuple(dict.fromkeys(f.name for m in self.output.terms for f in m.factors
                                   if f.kind == "input"))

    @cached_property
    def streaming(self) -> tuple[Summary, ...]:
        """Summaries carried from segment to segment: what the outputs read,
        closed under A-side reads. The rest are combine-only: a later segment's
        value is formed from its tokens when needed."""
        keep = descendants(self.a_side_graph(), "<out>")
        return tuple(s for s in self.summaries if s.name in keep)
