"""The public entry points: spec name or path -> compilation -> op.

This is the only place that turns a path into an AST for the compiler (the IR
takes ASTs) and puts ``file:line:col`` on errors raised past the frontend."""
from __future__ import annotations

from hladsl.errors import SpecError
from hladsl.frontend.specs import load_ast
from hladsl.ir.lower import bind_params
from hladsl.ir.pipeline import Compilation, Target, algebra_passes, compile_spec as run_pipeline

_OPS: dict = {}


def compile_spec(name_or_path, *, until: str | None = None, target: Target | None = None,
                 verify: bool = False, **params) -> Compilation:
    """Parse, check and compile a spec through the pipeline (``until`` a pass name)."""
    spec, display, source = load_ast(name_or_path)
    try:
        bound = bind_params(spec, params)
        return run_pipeline(spec, bound, source, target, until, verify)
    except SpecError as exc:
        exc.path = display
        raise exc.located(display, source)


def algebra(name_or_path, **params):
    """The state algebra of a spec (``ir.algebra.Algebra``)."""
    return compile_spec(name_or_path, until="lower", **params).algebra


def load(name_or_path, *, backend: str = "auto", chunk_size: int | None = None, **params):
    """The torch op of a shipped spec name or a .hla path, memoised: the same spec
    text, parameters and options give the same op object (and one custom op)."""
    from hladsl.runtime.op import Op
    spec, display, source = load_ast(name_or_path)
    try:
        bound = bind_params(spec, params)
        key = (source, tuple(sorted(bound.items())), backend, chunk_size)
        op = _OPS.get(key)
        if op is None:
            op = _OPS[key] = Op(algebra_passes(spec, bound, source), backend, chunk_size)
        return op
    except SpecError as exc:
        exc.path = display
        raise exc.located(display, source)
