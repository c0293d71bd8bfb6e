"""The spec AST: frozen dataclasses, positions excluded from equality so a spec
and its canonical re-print compare equal.

Stable contract for later stages (see docs in README "Spec language"):

Spec
  name, dims: tuple[str], inputs: tuple[InputDecl], params: tuple[ParamDecl],
  states: tuple[StateDecl], output: OutputDecl | None, normalizer: Sum | None
StateDecl
  name, indices: tuple[Index], delta: Sum (token inputs only; empty = 0),
  cross: Sum | None (products of one ``X@B`` and one or more ``Y@A`` factors),
  decay: int | None (weight override), symmetric: tuple[tuple[Index, ...]],
  combine_only: bool
Expressions
  Sum(terms: tuple[Term]); Term(sign: +1/-1, factors: tuple[Factor]);
  Factor = Tensor(name, indices, side: 'A' | 'B' | None) | Number | ParamRef | Group(Sum)
Index(name, count): count None for a plain index, an int or a parameter name
  for a pack ``i^p`` (p indices over the same dim; on a 1-index input it means
  the p-fold tensor power).
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Union

from hladsl.errors import Pos

_POS = dict(default=None, compare=False, repr=False)


@dataclass(frozen=True)
class Index:
    name: str
    count: int | str | None = None
    pos: Pos | None = field(**_POS)


@dataclass(frozen=True)
class Tensor:
    name: str
    indices: tuple[Index, ...]
    side: str | None = None
    pos: Pos | None = field(**_POS)


@dataclass(frozen=True)
class Number:
    value: int | float
    pos: Pos | None = field(**_POS)


@dataclass(frozen=True)
class ParamRef:
    name: str
    pos: Pos | None = field(**_POS)


@dataclass(frozen=True)
class Group:
    expr: "Sum"
    pos: Pos | None = field(**_POS)


Factor = Union[Tensor, Number, ParamRef, Group]


@dataclass(frozen=True)
class Term:
    sign: int
    factors: tuple[Factor, ...]
    pos: Pos | None = field(**_POS)


@dataclass(frozen=True)
class Sum:
    terms: tuple[Term, ...]
    pos: Pos | None = field(**_POS)

    @property
    def is_zero(self) -> bool:
        """True for the literal ``0`` (an empty token delta)."""
        return all(len(t.factors) == 1 and isinstance(t.factors[0], Number)
                   and t.factors[0].value == 0 for t in self.terms)


@dataclass(frozen=True)
class InputDecl:
    name: str
    dim: str
    pos: Pos | None = field(**_POS)


@dataclass(frozen=True)
class ParamDecl:
    name: str
    value: bool | int | float
    pos: Pos | None = field(**_POS)


@dataclass(frozen=True)
class StateDecl:
    name: str
    indices: tuple[Index, ...]
    delta: Sum
    cross: Sum | None = None
    decay: int | None = None
    symmetric: tuple[tuple[Index, ...], ...] = ()
    combine_only: bool = False
    pos: Pos | None = field(**_POS)


@dataclass(frozen=True)
class OutputDecl:
    name: str
    indices: tuple[Index, ...]
    expr: Sum
    pos: Pos | None = field(**_POS)


@dataclass(frozen=True)
class Spec:
    name: str
    dims: tuple[str, ...]
    inputs: tuple[InputDecl, ...]
    params: tuple[ParamDecl, ...]
    states: tuple[StateDecl, ...]
    output: OutputDecl | None
    normalizer: Sum | None
    pos: Pos | None = field(**_POS)
    dim_pos: tuple[Pos, ...] = field(default=(), compare=False, repr=False)
    normalizer_pos: Pos | None = field(**_POS)

    def param(self, name: str) -> ParamDecl | None:
        return next((p for p in self.params if p.name == name), None)

    def state(self, name: str) -> StateDecl | None:
        return next((s for s in self.states if s.name == name), None)

    def input(self, name: str) -> InputDecl | None:
        return next((i for i in self.inputs if i.name == name), None)
