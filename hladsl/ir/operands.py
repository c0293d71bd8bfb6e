"""Operands of a chunk-program term: one closed set of kinds.

Every consumer of operands (the torch and Triton lowerings, the packing pass,
the backward transform, size inference) handles them through a table keyed by
``Kind`` built with ``exhaustive``, so a kind added here and forgotten there
fails at import, where it is unhandled, instead of being silently skipped.
"""
from __future__ import annotations

from dataclasses import dataclass
from enum import Enum


class Kind(str, Enum):
    TOKEN = "token"          # an input tile X[T_n, i]   (time index 'T<node>' of size C)
    POWER = "power"          # spow(x)[T, α]: p copies of one token tile, packed symmetric
    CARRY = "carry"          # a carried state P[...] at the chunk start (anchor 'end': at its end)
    DERIVED = "derived"      # a per-chunk sum of carried-state contractions (HLA2's W_P)
    MASK = "mask"            # M[T_b, T_a] = [a rel b] · exp(W (Λ_b − Λ_a))
    DECAY = "decay"          # exp(W (Λ_end − Λ_a)) ('end') or exp(W Λ_t) ('start')
    COTANGENT = "cotangent"  # backward only: the gradient flowing into a term's result

    def __str__(self) -> str:
        return self.value


def exhaustive(table: dict, consumer: str, kinds=None) -> dict:
    """``table`` (Kind -> handler) after checking it covers ``kinds`` (default: all)."""
    wanted = set(Kind) if kinds is None else set(kinds)
    missing = wanted - set(table)
    if missing:
        raise NotImplementedError(f"{consumer} does not handle operand kind(s) "
                                  f"{', '.join(sorted(k.value for k in missing))}")
    return table


@dataclass(frozen=True)
class Operand:
    kind: Kind
    name: str                      # input / state / derived name; '' otherwise
    indices: tuple[str, ...]
    rel: str = ""                  # masks: '<' or '<='
    weight: int = 0                # masks and decays: the decay weight W
    anchor: str = ""               # decays: 'end' (to chunk end) or 'start' (carry to t); carry: 'end'
                                   # (the state at the chunk's end: ir.recursion.chunk_terms)
    packed: str = ""               # power: the packed dim of its second index
    power: int = 0                 # power: p
    weighted: bool = False         # power: times the multiplicity m(α) (a consumed group)

    def __post_init__(self):
        object.__setattr__(self, "kind", Kind(self.kind))

    def text(self) -> str:
        return _TEXT[self.kind](self)


def _power_text(o: Operand) -> str:
    return f"{'m·' if o.weighted else ''}spow{o.power}({o.name})[{','.join(o.indices)}]"


def _mask_text(o: Operand) -> str:
    b, a = o.indices
    return f"M[{b},{a}] = [{a} {o.rel} {b}]" + (f"·exp({o.weight}(Λ_{b}−Λ_{a}))" if o.weight else "")


def _decay_text(o: Operand) -> str:
    (a,) = o.indices
    return f"exp({o.weight}(Λ_end−Λ_{a}))" if o.anchor == "end" else f"exp({o.weight}·Λ_{a})"


def _named_text(o: Operand) -> str:
    return f"{o.name}[{','.join(o.indices)}]"


def _carry_text(o: Operand) -> str:
    return f"{o.name}{'@end' if o.anchor == 'end' else ''}[{','.join(o.indices)}]"


def _cotangent_text(o: Operand) -> str:
    return f"d{o.name}[{','.join(o.indices)}]"


_TEXT = exhaustive({Kind.TOKEN: _named_text, Kind.POWER: _power_text, Kind.CARRY: _carry_text,
                    Kind.DERIVED: _named_text, Kind.MASK: _mask_text, Kind.DECAY: _decay_text,
                    Kind.COTANGENT: _cotangent_text}, "Operand.text")
