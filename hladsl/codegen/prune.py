"""Dead generated names out of a rendered kernel module.

The lowering offers every tile in the forms a product may want (a token tile in fp32
and in its input dtype, loaded transposed; an elementwise product re-formed in
another axis order), and CSE hands earlier forms out. What no statement reads is
dropped here, so the emitted source holds only what runs (Triton would drop the dead
values too; the interpreter and a reader would not).

Only generated names are removed (``t<n>`` temps, ``in_<x>`` / ``raw_<x>`` token tiles
and the attention form's key-chunk ``ink_`` / ``rawk_`` / ``basek_`` ones, ``base_<x>``
offsets, ``mask_`` / ``decay_`` definitions, ``ct_`` cotangent tiles, ``offs_`` ranges,
the ``zero64`` of 64-bit chunk offsets), with the one comment line that describes a
temp, and never the last statement of a block.
"""
from __future__ import annotations

import ast
import re

_GENERATED = re.compile(r"(t\d+|in_\w+|ink_\w+|raw_\w+|rawk_\w+|base_\w+|basek_\w+|mask_\w+|decay_\w+|ct_\w+"
                        r"|offs_\w+|zero64)$")
_DESCRIBES = re.compile(r"^\s*# (?!----)")     # a step's comment (not a section header)


def prune_dead(source: str) -> str:
    """``source`` without assignments to generated names that nothing reads."""
    lines = source.split("\n")
    while True:
        dead = _dead_lines(ast.parse("\n".join(lines)))
        if not dead:
            return "\n".join(lines)
        drop = set()
        for first, last in dead:
            drop.update(range(first - 1, last))
            above = first - 2
            if (above >= 0 and _DESCRIBES.match(lines[above])
                    and (above == 0 or lines[above - 1].strip() != "")):
                drop.add(above)
        lines = [line for n, line in enumerate(lines) if n not in drop]


def _dead_lines(module: ast.Module) -> list[tuple[int, int]]:
    """(first, last) line numbers of the dead assignments of every function."""
    dead = []
    for fn in (n for n in module.body if isinstance(n, ast.FunctionDef)):
        loads = {n.id for n in ast.walk(fn) if isinstance(n, ast.Name) and isinstance(n.ctx, ast.Load)}
        for block in (n for n in ast.walk(fn) if hasattr(n, "body") and isinstance(n.body, list)):
            for body in (block.body, getattr(block, "orelse", [])):
                removable = [s for s in body if _dead(s, loads)]
                if len(removable) == len(body):
                    removable = removable[:-1]      # a block keeps a statement
                dead.extend((s.lineno, s.end_lineno) for s in removable)
    return dead


def _dead(statement, loads: set[str]) -> bool:
    if not isinstance(statement, ast.Assign) or len(statement.targets) != 1:
        return False
    target = statement.targets[0]
    return (isinstance(target, ast.Name) and bool(_GENERATED.match(target.id))
            and target.id not in loads)
