"""Finding and reading specs: a path to a .hla file, or the name of a shipped spec."""
from __future__ import annotations

from pathlib import Path

from hladsl.errors import SpecError
from hladsl.frontend import ast
from hladsl.frontend.check import check
from hladsl.frontend.parser import parse

SHIPPED_DIR = Path(__file__).resolve().parent.parent / "specs"


def shipped_names() -> list[str]:
    return sorted(p.stem for p in SHIPPED_DIR.glob("*.hla"))


def resolve(name_or_path: str | Path) -> Path:
    path = Path(name_or_path)
    if path.suffix == ".hla" or path.exists():
        if not path.is_file():
            raise SpecError(f"no such spec file: {path}", path=str(path))
        return path
    shipped = SHIPPED_DIR / f"{name_or_path}.hla"
    if shipped.is_file():
        return shipped
    raise SpecError(f"'{name_or_path}' is neither a .hla file nor a shipped spec "
                    f"(shipped: {', '.join(shipped_names())})", path=str(name_or_path))


def load_ast(name_or_path: str | Path, *, checked: bool = True) -> tuple[ast.Spec, str, str]:
    """(spec AST, display path, source text); semantic checks run unless checked=False."""
    path = resolve(name_or_path)
    source = path.read_text()
    display = str(name_or_path) if Path(name_or_path).suffix == ".hla" else str(path)
    spec = parse(source, display)
    if checked:
        try:
            check(spec)
        except SpecError as exc:
            for e in getattr(exc, "errors", [exc]):
                e.located(display, source)
            raise exc.located(display, source)
    return spec, display, source
