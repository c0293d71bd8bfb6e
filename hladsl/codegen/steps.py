"""Lowering of contraction steps to straight-line Triton code.

A value in a generated kernel is a register tile whose axes carry index names
(``Tile``). One plan ``Step`` contracts two tiles into a tile with the step's
result indices; ``Block.contract`` picks the Triton form:

* matmul   -- no index shared by both sides survives, each side keeps at least
  one index and at least one index is summed: ``_dot`` on the two tiles
  (transposed, or permuted and reshaped into 2-D index groups as needed);
* broadcast -- everything else (Hadamard products, row scalings, row-wise dots,
  outer products, 3-D intermediates): align both tiles on the union of their
  indices with ``[:, None]`` slots, multiply, ``tl.sum`` the contracted axes.

A block has three sections, emitted in order around a loop over the tiles of
one index (the output kernel's loop over a packed symmetric dim): ``pre``
(loop-invariant), ``loop`` (one tile), ``post`` (after the loop). A temp is
reused only where it is visible: its own section, or ``pre``.

Only generated names (``t<n>``) and the caller's validated variable names reach
the code; index names appear in comments only (``comment`` strips anything that
could end a comment line).
"""
from __future__ import annotations

import os
import re
import unicodedata
from dataclasses import dataclass

# An exact product (ir.precision) of a token tile as loaded and an fp32 tile: the fp32 side as
# three bf16 pieces against the bf16 tokens (_dot's TOKENS), else one tf32x3 / bf16x3 dot
# (HLADSL_SPLIT_AGAINST_TOKENS=0: for A/B runs).
SPLIT_AGAINST_TOKENS = os.environ.get("HLADSL_SPLIT_AGAINST_TOKENS", "1") != "0"
_TEMP = re.compile(r"\bt\d+\b")
_STATE = re.compile(r"\b(st|dr|nx|ct_end|ct_dr)_\w+")   # states and their gradients stay fp32
# ... of which the loaded chunk starts and chunk-end d-states (``st_X``, ``ct_end_X``) may be stored
# in bf16 (``runtime.launch.starts_dtype``, ``d_states_dtype``): an elementwise product reading one
# casts it to fp32 first, so two such operands never multiply in bf16
_STORED_STATE = re.compile(r"(st|ct_end)_\w+")


def comment(text: str) -> str:
    """``text`` made safe for a one-line comment: no line breaks or control characters."""
    return "".join(ch if ch == " " or unicodedata.category(ch)[0] not in "CZ" else " "
                   for ch in text)


@dataclass(frozen=True)
class Tile:
    var: str
    indices: tuple[str, ...]

    def label(self) -> str:
        return f"{self.var}[{','.join(self.indices)}]"


class Block:
    """Straight-line code of one kernel region; ``sizes`` maps an index name to
    the constexpr expression of its (padded, power-of-two) tile extent."""

    # names whose values are d num / d den (the backward's block sets them; none forward)
    OUTPUT_COTANGENT: re.Pattern | None = None

    def __init__(self, sizes: dict[str, str] | None = None):
        self.sizes = sizes or {}
        self.sections: dict[str, list[str]] = {"pre": [], "loop": [], "post": []}
        self.section = "pre"
        self._temps = 0
        self._known: dict[str, tuple[str, str]] = {}   # expression -> (temp, section) (CSE)
        self._from_dot: set[str] = set()     # temps computed from a matmul result
        self._stateful: set[str] = set()     # temps that read a carried state or derived carry
        self.chained = False                 # a matmul reads (a function of) a matmul result
        self.exact = False                   # matmuls reading carried states stay fp32 (ir.precision)
        # and matmuls reading d num / d den too (ir.precision.quotient_cancelling)
        self.exact_cotangents = False
        self.exact_tokens = False            # every matmul stays fp32 (ir.precision rule 3)
        self._from_output_cotangent: set[str] = set()   # temps that read d num or d den
        # token tiles as the kernel loads them: an fp32 tile -> the same tile in the input
        # dtype (dots read it as is: bf16 straight from the load into the tensor cores), and a
        # tile -> the expression loading (or computing) it transposed, instead of a register
        # transpose, whose layout change goes through shared memory every chunk
        self.raw: dict[str, str] = {}
        self.transposed: dict[str, str] = {}
        self.tokens_as_loaded: set[str] = set()   # input-dtype tiles of token inputs (exact in DOT)
        self._elementwise: dict[str, tuple] = {}   # a 2-D product temp -> (factors, its indices)

    # -- plumbing ---------------------------------------------------------------------------
    @property
    def lines(self) -> list[str]:
        return self.sections[self.section]

    def note(self, text: str) -> None:
        self.lines.append("# " + comment(text))

    def assign(self, var: str, expr: str) -> None:
        self.lines.append(f"{var} = {expr}")

    def define(self, expr: str, why: str = "") -> str:
        """A temp holding ``expr``: an earlier one with the same expression (the
        inputs of a kernel region are never reassigned), else a new one."""
        if expr in self.raw:      # a loaded tile is never copied into a temp
            return expr
        known = self._known.get(expr)
        if known is not None and known[1] in ("pre", self.section):
            if why:
                self.note(f"{why}   = {known[0]}, computed above")
            return known[0]
        if why:
            self.note(why)
        self._temps += 1
        var = f"t{self._temps}"
        self._known[expr] = (var, self.section)
        self.assign(var, expr)
        temps = _TEMP.findall(expr)
        if _STATE.search(expr) or any(t in self._stateful for t in temps):
            self._stateful.add(var)
        if self.reads_output_cotangent(expr):
            self._from_output_cotangent.add(var)
        reads_dot = any(t in self._from_dot for t in _TEMP.findall(expr))
        self.chained |= reads_dot and "_dot(" in expr
        if reads_dot or "_dot(" in expr:
            self._from_dot.add(var)
        return var

    def reads_state(self, var: str) -> bool:
        return bool(_STATE.match(var)) or var in self._stateful

    def reads_output_cotangent(self, expr: str) -> bool:
        """Does ``expr`` (a tile name or an expression) read d num / d den, directly or
        through a temp computed from them?"""
        if self.OUTPUT_COTANGENT is None:
            return False
        return bool(self.OUTPUT_COTANGENT.search(expr)) or any(
            t in self._from_output_cotangent for t in _TEMP.findall(expr))

    def text(self, section: str = "pre") -> str:
        return "\n".join(self.sections[section])

    # -- tile algebra -----------------------------------------------------------------------
    def arrange(self, t: Tile, order) -> str:
        """Expression for ``t`` with its axes in ``order`` (same index set)."""
        order = tuple(order)
        if t.indices == order:
            return t.var
        perm = tuple(t.indices.index(i) for i in order)
        if len(perm) == 2 and t.var in self.transposed:
            return self._load_transposed(t.var)
        if len(perm) == 2 and t.var in self._elementwise:
            # an elementwise product is recomputed from its factors arranged so (a transposed
            # token tile is a load; a register transpose of the product is a layout change)
            a, b, idx = self._elementwise[t.var]
            named = dict(zip(idx, t.indices))    # CSE may hand it out under other index names
            a, b = (Tile(f.var, tuple(named[i] for i in f.indices)) for f in (a, b))
            return self.define(self._broadcast(a, b, order)[0])
        if len(perm) == 2:
            return f"tl.trans({t.var})"
        return f"tl.permute({t.var}, {perm})"

    def _load_transposed(self, var: str) -> str:
        """``var`` transposed, loaded (or computed) so, once per kernel region, before any
        loop over tiles; a loaded tile keeps its input-dtype twin for dots."""
        section, self.section = self.section, "pre"
        if var not in self.raw:
            out = self.define(self.transposed[var], f"{var}ᵀ, computed transposed")
        else:
            raw = self.define(self.transposed[var], f"{var}ᵀ, loaded transposed in the input dtype")
            out = self.define(f"{raw}.to(tl.float32)")
            self.raw[out] = raw
            if self.raw[var] in self.tokens_as_loaded:
                self.tokens_as_loaded.add(raw)
        self.section = section
        return out

    def _group(self, idx) -> str:
        return " * ".join(self.sizes[i] for i in idx)

    def reduce(self, t: Tile, out) -> Tile:
        """Sum away the indices of ``t`` not in ``out``, then order the axes as ``out``."""
        out = tuple(out)
        extra = [i for i in t.indices if i not in out]
        if not extra and t.indices == out:
            return t
        expr, idx = t.var, list(t.indices)
        for i in sorted(extra, key=idx.index, reverse=True):
            expr = f"tl.sum({expr}, axis={idx.index(i)})"
            idx.remove(i)
        why = f"[{','.join(idx)}] = sum over {','.join(extra)} of {t.label()}" if extra else ""
        return self._ordered(Tile(self.define(expr, why), tuple(idx)), out)

    def _ordered(self, t: Tile, out) -> Tile:
        if t.indices == tuple(out):
            return t
        return Tile(self.define(self.arrange(t, out)), tuple(out))

    def contract(self, a: Tile, b: Tile, out) -> Tile:
        """The tile ``out`` = Σ a · b over the indices not in ``out``."""
        out = tuple(out)
        a = self._presum(a, b, out)
        b = self._presum(b, a, out)
        summed = [i for i in a.indices if i in b.indices and i not in out]
        batch = [i for i in a.indices if i in b.indices and i in out]
        free_a = [i for i in out if i in a.indices and i not in b.indices]
        free_b = [i for i in out if i in b.indices and i not in a.indices]
        head = f"[{','.join(out)}] = {a.label()} · {b.label()}"
        if summed and not batch and free_a and free_b:
            why = f"{head}   (matmul over {','.join(summed)})"
            expr, idx = self._matmul(a, b, summed, free_a, free_b, out)
        else:
            why = f"{head}   ({'sum over ' + ','.join(summed) if summed else 'elementwise'})"
            expr, idx = self._broadcast(a, b, out)
            if not summed and len(out) == 2:
                var = self.define(expr, why)
                self._elementwise.setdefault(var, (a, b, idx))
                return Tile(var, idx)
        return self._ordered(Tile(self.define(expr, why), idx), out)

    def _presum(self, t: Tile, other: Tile, out) -> Tile:
        """Indices only ``t`` has and the result drops are summed before the product."""
        keep = tuple(i for i in t.indices if i in out or i in other.indices)
        return t if keep == t.indices else self.reduce(t, keep)

    def _matmul(self, a, b, summed, free_a, free_b, out):
        # orient so that the result comes out in ``out`` order whenever possible
        if set(out[:len(free_a)]) != set(free_a) and set(out[:len(free_b)]) == set(free_b):
            a, b, free_a, free_b = b, a, free_b, free_a
        left = self.arrange(a, free_a + summed)
        right = self.arrange(b, summed + free_b)
        left, right = self.raw.get(left, left), self.raw.get(right, right)
        tokens = (left in self.tokens_as_loaded) + (right in self.tokens_as_loaded)
        if len(free_a) > 1 or len(summed) > 1:
            left = f"tl.reshape({left}, ({self._group(free_a)}, {self._group(summed)}))"
        if len(free_b) > 1 or len(summed) > 1:
            right = f"tl.reshape({right}, ({self._group(summed)}, {self._group(free_b)}))"
        # the precision plan (ir.precision): in a sum whose carry terms cancel (HLA3's
        # SK SQ P - G1 - G2 - G3) and in the states feeding it, products reading carried
        # states stay fp32-accurate; other products reading them go to the tensor cores
        # as SDOT (bf16; fp32 for fp16 inputs, whose range a state can exceed), token
        # products as DOT
        reads = self.reads_state(a.var) or self.reads_state(b.var)
        # (and in a d-state summing a quotient's two cotangent paths, products reading d num /
        # d den stay fp32-accurate too: ir.precision.quotient_cancelling)
        exact_ct = self.exact_cotangents and any(
            self.reads_output_cotangent(x) for x in (a.var, b.var, left, right))
        exact = (self.exact and reads) or exact_ct or self.exact_tokens
        dtype = "tl.float32" if exact else ("SDOT" if reads else "DOT")
        # an exact product of two token tiles as loaded is exact on the tensor cores in their
        # dtype (products of bf16 values are exact in the fp32 accumulator); with one, the
        # other side goes as three bf16 pieces (_dot's TOKENS)
        if exact and tokens == 2:
            dtype = "DOT"
        split = ", DOT" if exact and tokens == 1 and SPLIT_AGAINST_TOKENS else ""
        expr = f"_dot({left}, {right}, {dtype}, PREC{split})"
        idx = tuple(free_a + free_b)
        if len(free_a) > 1 or len(free_b) > 1:
            expr = f"tl.reshape({expr}, ({', '.join(self.sizes[i] for i in idx)}))"
        return expr, idx

    def _broadcast(self, a, b, out):
        union = list(out) + [i for i in a.indices + b.indices if i not in out]
        union = list(dict.fromkeys(union))
        parts = []
        for t in (a, b):
            own = [i for i in union if i in t.indices]
            expr = self.arrange(t, own)
            if _STORED_STATE.match(t.var):   # may be stored bf16: the product in fp32
                expr += ".to(tl.float32)"
            if len(own) < len(union):
                expr += "[" + ", ".join(":" if i in t.indices else "None" for i in union) + "]"
            parts.append(expr)
        expr = " * ".join(parts)
        for axis in range(len(union) - 1, len(out) - 1, -1):
            expr = f"tl.sum({expr}, axis={axis})"
        return expr, tuple(out)
