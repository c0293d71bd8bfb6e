"""Contraction order: which pair of tensors to multiply next.

Exact dynamic programming over connected subsets (the networks here are small:
a handful of token tiles, masks and states), minimising FLOPs while keeping
every intermediate no larger than the largest input or output, so a rank-1
factor is applied as a matvec (k (kᵀ C), never (k kᵀ) C) and no d³
intermediate is ever formed when a cheaper order exists."""
from __future__ import annotations

from dataclasses import dataclass
from functools import lru_cache
from math import prod


@dataclass(frozen=True)
class Step:
    left: int            # operand ids; inputs are 0..n-1, step k produces id n+k
    right: int
    indices: tuple[str, ...]  # indices of the result
    flops: int


@dataclass(frozen=True)
class Plan:
    steps: tuple[Step, ...]
    flops: int
    result: int          # operand id of the final tensor


def plan(operands: tuple[tuple[str, ...], ...], output: tuple[str, ...],
         sizes: tuple[tuple[str, int], ...]) -> Plan:
    """Best pairwise order to contract ``operands`` (index tuples) to ``output``."""
    return _plan(tuple(operands), tuple(output), tuple(sorted(sizes)))


@lru_cache(maxsize=4096)
def _plan(operands, output, sizes) -> Plan:
    size_of = dict(sizes)
    n = len(operands)
    if n == 1:
        return Plan((), 0, 0)
    full = (1 << n) - 1
    index_sets = [frozenset(o) for o in operands]
    cap = max([prod(size_of[i] for i in o) for o in operands] + [prod(size_of[i] for i in output)])

    def result_indices(mask: int) -> frozenset:
        inside = frozenset().union(*(index_sets[k] for k in range(n) if mask >> k & 1))
        outside = frozenset(output).union(*(index_sets[k] for k in range(n) if not mask >> k & 1))
        return inside & outside

    res = {}
    best: dict[int, tuple[float, int, tuple]] = {}
    for k in range(n):
        best[1 << k] = (0, 0, ())
        res[1 << k] = index_sets[k]
    by_size = sorted(range(1, full + 1), key=lambda m: bin(m).count("1"))
    for mask in by_size:
        if mask in best:
            continue
        r = result_indices(mask)
        res[mask] = r
        size = prod(size_of[i] for i in r)
        penalty = 1 if size <= cap else 1e6
        choice = None
        sub = (mask - 1) & mask
        while sub:
            other = mask ^ sub
            if sub < other and sub in best and other in best:
                joined = res[sub] | res[other]
                connected = bool(res[sub] & res[other])
                flops = prod(size_of[i] for i in joined)
                cost = best[sub][0] + best[other][0] + flops * penalty * (1 if connected else 10)
                if choice is None or cost < choice[0]:
                    choice = (cost, flops, (sub, other))
            sub = (sub - 1) & mask
        if choice is not None:
            best[mask] = choice
    steps: list[Step] = []
    ids: dict[int, int] = {1 << k: k for k in range(n)}

    def build(mask: int) -> int:
        if mask in ids:
            return ids[mask]
        a, b = best[mask][2]
        left, right = build(a), build(b)
        indices = tuple(sorted(res[mask], key=_order_key(operands, output)))
        if mask == full:
            indices = tuple(output)
        steps.append(Step(left, right, indices, best[mask][1]))
        ids[mask] = n + len(steps) - 1
        return ids[mask]

    result = build(full)
    return Plan(tuple(steps), sum(s.flops for s in steps), result)


def _order_key(operands, output):
    order = {}
    for i in list(output) + [i for o in operands for i in o]:
        order.setdefault(i, len(order))
    return order.__getitem__
