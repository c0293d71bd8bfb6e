"""``hladsl compile --emit KIND``: one function per thing a spec compiles to."""
from __future__ import annotations

from hladsl.errors import SpecError


def _ast(spec, params, out_dir):
    from hladsl.frontend.printer import to_text
    from hladsl.frontend.specs import load_ast
    if params:
        raise SpecError("-p has no effect on --emit ast (the AST is printed before parameters "
                        "are bound)")
    return to_text(load_ast(spec)[0])


EMITTERS = {"ast": _ast}


def emit(spec: str, kind: str | None, params: dict, out_dir: str | None) -> str:
    kind = kind or "triton"
    if kind not in EMITTERS:
        raise SpecError(f"--emit {kind} is not available in this build")
    return EMITTERS[kind](spec, params, out_dir)
