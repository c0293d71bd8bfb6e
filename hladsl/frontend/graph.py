"""Directed graphs of summary dependencies: the four algorithms the compiler needs.

A spec has a handful of summaries, so plain dicts do. (networkx, which did this before,
cost about 0.1 s of every process's start -- two thirds of importing hladsl -- and issue
13's bar is the time from a cold process to the first call.)
"""
from __future__ import annotations

import heapq
from collections.abc import Callable, Hashable, Iterable


class Digraph:
    """Nodes and edges in insertion order; an edge keeps its attributes (re-adding it
    updates them)."""

    def __init__(self, edges: Iterable[tuple[Hashable, Hashable]] = ()):
        self.succ: dict[Hashable, dict[Hashable, dict]] = {}
        for u, v in edges:
            self.add_edge(u, v)

    def add_node(self, n: Hashable) -> None:
        self.succ.setdefault(n, {})

    def add_nodes_from(self, nodes: Iterable[Hashable]) -> None:
        for n in nodes:
            self.add_node(n)

    def add_edge(self, u: Hashable, v: Hashable, **attrs) -> None:
        self.add_node(u)
        self.add_node(v)
        self.succ[u].setdefault(v, {}).update(attrs)

    def edges(self, data: str | None = None) -> list[tuple]:
        """(u, v) pairs, or (u, v, attribute ``data`` or None)."""
        if data is None:
            return [(u, v) for u, vs in self.succ.items() for v in vs]
        return [(u, v, a.get(data)) for u, vs in self.succ.items() for v, a in vs.items()]


def descendants(g: Digraph, source: Hashable) -> set:
    """Every node reachable from ``source`` by one edge or more."""
    seen: set = set()
    stack = list(g.succ.get(source, ()))
    while stack:
        n = stack.pop()
        if n not in seen:
            seen.add(n)
            stack.extend(g.succ[n])
    return seen


def find_cycle(g: Digraph) -> list[tuple] | None:
    """The edges of the first cycle a depth-first search meets (nodes and edges taken in
    insertion order), or None when the graph is acyclic."""
    state: dict = {}                       # node -> "open" while on the path, "done" after
    for root in g.succ:
        if root in state:
            continue
        path = [root]
        state[root] = "open"
        branches = [iter(g.succ[root])]
        while branches:
            nxt = next(branches[-1], None)
            if nxt is None:
                state[path.pop()] = "done"
                branches.pop()
            elif state.get(nxt) == "open":
                loop = path[path.index(nxt):]
                return list(zip(loop, loop[1:] + [nxt]))
            elif nxt not in state:
                state[nxt] = "open"
                path.append(nxt)
                branches.append(iter(g.succ[nxt]))
    return None


def dependencies_first(g: Digraph, key: Callable[[Hashable], object]) -> list:
    """Every node after all those its edges point to (the graph must be acyclic), ties
    broken by the smallest ``key``."""
    waiting = {n: len(vs) for n, vs in g.succ.items()}
    readers: dict = {n: [] for n in g.succ}
    for u, v in g.edges():
        readers[v].append(u)
    ready = [(key(n), i, n) for i, n in enumerate(g.succ) if waiting[n] == 0]
    heapq.heapify(ready)
    order = []
    index = {n: i for i, n in enumerate(g.succ)}
    while ready:
        _, _, n = heapq.heappop(ready)
        order.append(n)
        for r in readers[n]:
            waiting[r] -= 1
            if waiting[r] == 0:
                heapq.heappush(ready, (key(r), index[r], r))
    if len(order) != len(g.succ):
        raise ValueError("the dependency graph has a cycle")
    return order
