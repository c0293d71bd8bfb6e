"""Distributivity for gradient networks: Σ_n X · Y_n = X · (Σ_n Y_n).

A target group's networks are planned one by one (``ir.backward``), and the kernel
reuses the products they share (``_TransposingBlock``). What that misses: networks
whose *last* products share an operand, each adding its own X · Y_n into the same
accumulator -- d q = (dnum vᵀ ∘ M) · (k ∘ r) + (dnum vᵀ ∘ M) · (SK qᵀ)ᵀ + ... in
HLA3. Their Y_n are summed first (elementwise adds) and X multiplies once.

Two passes over a group (``codegen.triton_bwd._grad_groups``): the first lowers it as
is and records each network's last product (``LastProduct``); ``families`` picks the
networks whose last product nothing else reads (a product another network reuses
stays) and groups them, greedily, by a shared operand -- the same tile, its indices
in the same roles (a summed index at the same axis, an output index at the same
axis of the result). The second pass lowers the group again with ``Factoring``: a
family's sum tile is zeroed where its first network runs, each network adds its
Y_n (arranged to the sum's axes, with its coefficient), and the last one multiplies.
Those two lines belong to every network of the family, so a part of the group
(``_parted_code``) holding some of them multiplies the sum of its own.

Only plain token-gradient networks take part: not exact ones (an fp32-accurate product
keeps each side as it is), nor those with a carry scale, a broadcast or a power chain.
"""
from __future__ import annotations

import re
from collections import Counter
from dataclasses import dataclass, field

from hladsl.codegen.steps import Tile

_TEMP = re.compile(r"\bt\d+\b")


@dataclass(frozen=True)
class LastProduct:
    """A network's last product X · Y as the first pass lowered it, to ``output``."""
    a: Tile
    b: Tile
    output: tuple[str, ...]
    section: str
    temps: tuple[str, ...]    # its result and the temp the accumulator added (the same, or an arrangement)

    def key(self, side: int) -> tuple:
        """What a family sharing operand ``side`` (0: a, 1: b) must agree on."""
        shared = (self.a, self.b)[side]
        return (self.section, shared.var, tuple(_roles(shared, self.output)))


def _roles(shared: Tile, output) -> list[str]:
    """Each index of the shared operand by role: an output axis, or a summed index at its axis."""
    return [f"o{output.index(i)}" if i in output else f"s{k}" for k, i in enumerate(shared.indices)]


def last_product(a: Tile, b: Tile, output) -> bool:
    """Whether a · b -> ``output`` is one plain matmul (what a shared factor saves)."""
    A, B, O = set(a.indices), set(b.indices), set(output)
    return (len(a.indices) == len(b.indices) == len(output) == 2 and A <= B | O and B <= A | O
            and bool((A & B) - O) and not A & B & O and bool(A & O) and bool(B & O))


def families(lasts: list[LastProduct | None], lines: list[str]) -> dict[int, tuple[int, int]]:
    """Network -> (family, the side it shares) over the group's networks (``lasts``, None where
    a network's last product is not a plain matmul), for families of two or more; ``lines``:
    the first pass's code, to find the last products nothing else reads."""
    uses = Counter(t for line in lines if not line.lstrip().startswith("#") for t in _TEMP.findall(line))
    free = {n: p for n, p in enumerate(lasts) if p is not None and all(uses[t] == 2 for t in p.temps)}
    out: dict[int, tuple[int, int]] = {}
    while True:
        counts = Counter(p.key(s) for p in free.values() for s in (0, 1))
        if not counts:
            break
        key, size = counts.most_common(1)[0]
        if size < 2:
            break
        family = len({f for f, _ in out.values()})
        for n, p in list(free.items()):
            side = next((s for s in (0, 1) if p.key(s) == key), None)
            if side is not None:
                out[n] = (family, side)
                del free[n]
    return out


def family_order(count: int, members: dict[int, tuple[int, int]]) -> list[int]:
    """The group's networks in the order the second pass lowers them: each family's networks
    in a row where its first one was, the rest as they were -- a sum and its shared operand
    then live across the family alone, and runs of networks (parts) hold whole families."""
    order, placed = [], set()
    for n in range(count):
        if n in members and members[n][0] not in placed:
            fam = members[n][0]
            placed.add(fam)
            order += [m for m in range(count) if members.get(m, (None,))[0] == fam]
        elif n not in members:
            order.append(n)
    return order


@dataclass
class _Sum:
    var: str
    key: tuple
    axes: tuple[str, ...]       # the sum's axes by role (``_roles`` names)
    left: int                   # networks still to add
    acc: str                    # the accumulator the product adds into
    output: tuple[str, ...]     # the product's result, the shared operand and the sum's axes in
    shared: Tile | None = None  # the index names of the last network that added (the product
    axis_names: tuple[str, ...] = ()   # reads them so)


@dataclass
class Factoring:
    """The second pass's state: which network is in which family, and the open sums."""
    members: dict[int, tuple[int, int]]
    sums: dict[int, _Sum] = field(default_factory=dict)
    shared_lines: list[tuple[str, int, int, int]] = field(default_factory=list)  # (section, start, end, family)

    def family(self, fam: int) -> frozenset[int]:
        return frozenset(m for m, (f, _) in self.members.items() if f == fam)

    def add(self, low, n: int, a: Tile, b: Tile, output, coef: float, acc: str) -> bool:
        """Network ``n``'s last product a · b (times ``coef``) into its family's sum, and
        where it is the family's last, the one product into ``acc``. False (nothing emitted)
        where the operands are not the ones the first pass shared."""
        block = low.block
        fam, side = self.members[n]
        shared, other = (a, b) if side == 0 else (b, a)
        roles = dict(zip(shared.indices, _roles(shared, output)))
        roles.update((i, f"o{output.index(i)}") for i in output)
        key = LastProduct(a, b, tuple(output), block.section, ()).key(side)
        s = self.sums.get(fam)
        if s is None:
            order = _operand_order(shared, other, output)
            low.sums += 1
            s = self.sums[fam] = _Sum(f"fsum{low.sums}", key, tuple(roles[i] for i in order),
                                      sum(f == fam for f, _ in self.members.values()), acc, tuple(output))
            named = {r: i for i, r in roles.items()}
            shape = ", ".join(block.sizes[named[r]] for r in s.axes)
            self._shared(block, fam, lambda: block.lines.append(
                f"{s.var} = tl.zeros(({shape},), dtype=tl.float32)  # Σ of the family's second factors"))
        matched = s.key == key
        if matched:
            named = {r: i for i, r in roles.items()}
            value = block.arrange(other, tuple(named[r] for r in s.axes))
            mag = abs(float(coef))
            block.lines.append(f"{s.var} {'-' if coef < 0 else '+'}= {value if mag == 1.0 else f'{mag!r} * {value}'}")
            for v in (other.var, value):   # what the sum reads decides its product's dtype
                if block.reads_state(v):
                    block._stateful.add(s.var)
                if block.reads_output_cotangent(v):
                    block._from_output_cotangent.add(s.var)
            s.shared, s.axis_names, s.output = shared, tuple(named[r] for r in s.axes), tuple(output)
        s.left -= 1
        if s.left == 0:
            def multiply():
                block.note(f"the family's one product: {s.shared.label()} · {s.var}")
                r = block.contract(s.shared, Tile(s.var, s.axis_names), s.output)
                block.lines.append(f"{s.acc} += {block.reduce(r, s.output).var}")
            self._shared(block, fam, multiply)
        return matched

    def _shared(self, block, fam: int, emit) -> None:
        start = len(block.lines)
        emit()
        self.shared_lines.append((block.section, start, len(block.lines), fam))


def _operand_order(a: Tile, b: Tile, output) -> tuple[str, ...]:
    """The axes ``Block._matmul`` arranges b in for a · b -> ``output`` (no transpose of the sum)."""
    summed = [i for i in a.indices if i in b.indices and i not in output]
    free_a = [i for i in output if i in a.indices and i not in b.indices]
    free_b = [i for i in output if i in b.indices and i not in a.indices]
    if set(output[:len(free_a)]) != set(free_a) and set(output[:len(free_b)]) == set(free_b):
        return tuple(free_b + summed)   # b goes on the left
    return tuple(summed + free_b)
