"""hladsl.frontend.graph against brute force on random small graphs."""
import itertools
import random

import pytest

from hladsl.frontend.graph import Digraph, dependencies_first, descendants, find_cycle


def _random_graph(rng, n, p, acyclic):
    g = Digraph()
    g.add_nodes_from(range(n))
    for u, v in itertools.product(range(n), repeat=2):
        if (u > v or not acyclic) and rng.random() < p:
            g.add_edge(u, v)
    return g


def _reach(g):
    """Transitive closure by repeated squaring of the adjacency sets."""
    reach = {u: set(vs) for u, vs in g.succ.items()}
    changed = True
    while changed:
        changed = False
        for u in reach:
            new = set().union(*(reach[v] for v in reach[u])) - reach[u]
            if new:
                reach[u] |= new
                changed = True
    return reach


@pytest.mark.parametrize("seed", range(40))
def test_against_brute_force(seed):
    rng = random.Random(seed)
    n = rng.randint(1, 7)
    g = _random_graph(rng, n, rng.choice([0.15, 0.3, 0.5]), acyclic=seed % 2 == 0)
    reach = _reach(g)
    for u in g.succ:
        assert descendants(g, u) == reach[u]
    cyclic = any(u in reach[u] for u in reach)
    cycle = find_cycle(g)
    assert (cycle is not None) == cyclic
    if cycle:   # consecutive edges of the graph, closing on the first node
        assert all(v in g.succ[u] for u, v in cycle)
        assert all(a[1] == b[0] for a, b in zip(cycle, cycle[1:] + cycle[:1]))
    else:
        key = {u: rng.random() for u in g.succ}
        order = dependencies_first(g, key.__getitem__)
        assert sorted(order) == sorted(g.succ)
        where = {u: i for i, u in enumerate(order)}
        assert all(where[v] < where[u] for u, v in g.edges())
        # ties broken by the smallest key: each node is the smallest-keyed one ready then
        done = set()
        for u in order:
            ready = [w for w in g.succ if w not in done and set(g.succ[w]) <= done]
            assert key[u] == min(key[w] for w in ready)
            done.add(u)


def test_edges_keep_their_attributes():
    g = Digraph()
    g.add_edge("G", "S", side="B")
    g.add_edge("G", "C", side="A")
    g.add_edge("G", "S", side="A")     # re-added: updated, not doubled
    assert g.edges(data="side") == [("G", "S", "A"), ("G", "C", "A")]
    assert find_cycle(Digraph([("G", "G")])) == [("G", "G")]
