"""The one Jinja environment every generator renders with: templates from
``templates/``, StrictUndefined (a missing context key is an error, never an
empty string), whitespace control for readable generated code."""
from __future__ import annotations

from functools import lru_cache
from pathlib import Path

from jinja2 import Environment, FileSystemLoader, StrictUndefined

TEMPLATE_DIR = Path(__file__).resolve().parent / "templates"


@lru_cache(maxsize=1)
def environment() -> Environment:
    return Environment(loader=FileSystemLoader(str(TEMPLATE_DIR)), undefined=StrictUndefined,
                       keep_trailing_newline=True, trim_blocks=True, lstrip_blocks=True)


def render_template(template: str, /, **context) -> str:
    return environment().get_template(template).render(**context)


def template_text(*names: str) -> str:
    """The text of templates (part of the cache key of what they render)."""
    return "".join((TEMPLATE_DIR / n).read_text() for n in names)
