"""Errors meant for people: every spec problem carries a source position and
renders as ``file:line:col: message``, the offending line and a caret."""
from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Pos:
    """A 1-based source position (line, column) of an AST node."""

    line: int
    column: int
    end_line: int | None = None
    end_column: int | None = None


class SpecError(Exception):
    """Base class of every problem found in a spec file."""

    def __init__(self, message: str, pos: Pos | None = None, *, path: str = "<spec>",
                 source: str | None = None, hint: str | None = None):
        super().__init__(message)
        self.message = message
        self.pos = pos
        self.path = path
        self.source = source
        self.hint = hint

    def located(self, path: str, source: str) -> "SpecError":
        """Attach the file this error belongs to (positions are filled in by the parser)."""
        self.path, self.source = path, source
        return self

    def __str__(self) -> str:
        if self.pos is None:
            head = f"{self.path}: {self.message}"
        else:
            head = f"{self.path}:{self.pos.line}:{self.pos.column}: {self.message}"
        lines = [head]
        if self.pos is not None and self.source is not None:
            src_lines = self.source.split("\n")   # as lark counts lines
            if 1 <= self.pos.line <= len(src_lines):
                text = src_lines[self.pos.line - 1].expandtabs(1)
                lines.append(f"    {text}")
                lines.append("    " + " " * (self.pos.column - 1) + "^")
        if self.hint:
            lines.append(self.hint)
        return "\n".join(lines)


class SpecSyntaxError(SpecError):
    """The text does not follow the grammar."""


class SpecCheckError(SpecError):
    """The spec parses but is inconsistent (names, indices, sides, cycles)."""


class AlgebraError(SpecError):
    """The declared state algebra is not a valid associative, graded algebra."""


class SpecErrors(SpecError):
    """Several problems at once (``hladsl check`` lists all of them)."""

    def __init__(self, errors: list[SpecError]):
        super().__init__(f"{len(errors)} problems", errors[0].pos if errors else None,
                         path=errors[0].path if errors else "<spec>")
        self.errors = errors

    def __str__(self) -> str:
        return "\n".join(str(e) for e in self.errors)


class SettingError(ValueError):
    """A bad ``HLADSL_*`` environment setting (e.g. ``HLADSL_LAUNCH``): the message names the
    variable, the item and what was expected; the CLI prints it without a traceback."""
