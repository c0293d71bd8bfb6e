"""Text -> AST. The grammar lives in grammar.lark (LALR, positions propagated);
syntax errors become SpecSyntaxError with what the parser expected."""
from __future__ import annotations

import difflib
import math
import re
import sys
from functools import lru_cache
from pathlib import Path

import lark
from lark import Transformer, v_args

from hladsl.errors import Pos, SpecError, SpecSyntaxError
from hladsl.frontend import ast

# Human names for grammar terminals, used in "expected ..." messages.
_TERMINAL_NAMES = {
    "NAME": "a name", "INT": "an integer", "NUMBER": "a number", "SIGNED_NUMBER": "a number",
    "LBRACE": "'{'", "RBRACE": "'}'", "LSQB": "'['", "RSQB": "']'", "LPAR": "'('",
    "RPAR": "')'", "COMMA": "','", "EQUAL": "'='", "AT": "'@'", "CIRCUMFLEX": "'^'",
    "ADDOP": "'+' or '-'", "MINUS": "'-'", "$END": "end of file",
}


_KEYWORDS: dict[str, str] = {}   # terminal name -> keyword ("STATE" -> "state")


def _whole_word_keyword(terminal: lark.lexer.TerminalDef) -> None:
    """A keyword ends at a word boundary: 'states S[i]' is a misspelt keyword, not
    'state' followed by the name 's'. Where a name is acceptable too, the keyword
    wins (as lark's own keyword handling does)."""
    pattern = terminal.pattern
    if pattern.type == "str" and pattern.value.replace("_", "").isalpha():
        _KEYWORDS[terminal.name] = pattern.value
        terminal.pattern = lark.lexer.PatternRE(re.escape(pattern.value) + r"(?![A-Za-z0-9_])")
        terminal.priority = 1


@lru_cache(maxsize=1)
def _parser() -> lark.Lark:
    grammar = (Path(__file__).parent / "grammar.lark").read_text()
    return lark.Lark(grammar, parser="lalr", propagate_positions=True, maybe_placeholders=False,
                     edit_terminals=_whole_word_keyword)


def _pos(meta_or_token) -> Pos:
    return Pos(meta_or_token.line, meta_or_token.column,
               getattr(meta_or_token, "end_line", None), getattr(meta_or_token, "end_column", None))


def _describe(terminal: str) -> str:
    if terminal in _TERMINAL_NAMES:
        return _TERMINAL_NAMES[terminal]
    if terminal in _KEYWORDS:
        return f"'{_KEYWORDS[terminal]}'"
    pattern = _parser().get_terminal(terminal).pattern
    return f"'{pattern.value}'" if pattern.type == "str" else terminal.lower()


def _expected(names) -> str:
    return ", ".join(sorted({_describe(n) for n in names}))


def _acceptable(exc, fallback) -> set[str]:
    """The terminals the parser can really take here. LALR lookahead sets merge
    contexts (``exc.expected`` lists ')' inside an index list, for instance), so ask
    the parser state itself, which tries each terminal."""
    try:
        return set(exc.interactive_parser.accepts()) or set(fallback or ())
    except (AttributeError, lark.exceptions.LarkError):   # fall back to the coarse set
        return set(fallback or ())


# Parenthesised groups may nest this deep; deeper ones are rejected before the
# (recursive) AST builder, checker and printer see them.
MAX_NESTING = 32


@v_args(meta=True)
class _ToAst(Transformer):
    def start(self, meta, children):
        return children[0]

    def mechanism(self, meta, children):
        name, *items = children
        dims, dim_pos, inputs, params, states = [], [], [], [], []
        output = normalizer = normalizer_pos = None
        for kind, value, pos in items:
            if kind == "dims":
                dims.extend(n for n, _ in value)
                dim_pos.extend(p for _, p in value)
            elif kind == "inputs":
                inputs.extend(value)
            elif kind == "params":
                params.extend(value)
            elif kind == "state":
                states.append(value)
            elif kind == "output":
                if output is not None:
                    raise SpecSyntaxError(f"a mechanism has one output; this is a second one "
                                          f"(the first is on line {output.pos.line})", pos)
                output = value
            elif kind == "normalizer":
                if normalizer is not None:
                    raise SpecSyntaxError(f"a mechanism has one normalizer; this is a second one "
                                          f"(the first is on line {normalizer_pos.line})", pos)
                normalizer, normalizer_pos = value, pos
        return ast.Spec(str(name), tuple(dims), tuple(inputs), tuple(params), tuple(states),
                        output, normalizer, pos=_pos(meta), dim_pos=tuple(dim_pos),
                        normalizer_pos=normalizer_pos)

    def dims_decl(self, meta, names):
        return ("dims", [(str(n), _pos(n)) for n in names], _pos(meta))

    def input_decl(self, meta, specs):
        return ("inputs", specs, _pos(meta))

    def input_spec(self, meta, children):
        name, dim = children
        return ast.InputDecl(str(name), str(dim), pos=_pos(name))

    def param_decl(self, meta, specs):
        return ("params", specs, _pos(meta))

    def param_spec(self, meta, children):
        name, value = children
        return ast.ParamDecl(str(name), value, pos=_pos(name))

    def number_literal(self, meta, children):
        return _number(children[0])

    def true_literal(self, meta, children):
        return True

    def false_literal(self, meta, children):
        return False

    def state_decl(self, meta, children):
        name, indices, delta, *rest = children
        cross, decay, symmetric, combine_only = None, None, [], False
        seen = set()
        for kind, value, pos in rest:
            if kind in seen and kind != "symmetric":
                raise SpecSyntaxError(f"'{kind}' is given twice for state '{name}'", pos)
            seen.add(kind)
            if kind == "cross":
                cross = value
            elif kind == "decay":
                decay = value
            elif kind == "symmetric":
                symmetric.append(value)
            else:
                combine_only = True
        decl = ast.StateDecl(str(name), indices, delta, cross, decay, tuple(symmetric),
                             combine_only, pos=_pos(name))
        return ("state", decl, _pos(meta))

    def cross_clause(self, meta, children):
        return ("cross", children[0], _pos(meta))

    def decay_modifier(self, meta, children):
        return ("decay", _int(children[0]), _pos(meta))

    def symmetric_modifier(self, meta, children):
        return ("symmetric", tuple(children), _pos(meta))

    def combine_only_modifier(self, meta, children):
        return ("combine_only", True, _pos(meta))

    def output_decl(self, meta, children):
        name, indices, expr = children
        return ("output", ast.OutputDecl(str(name), indices, expr, pos=_pos(name)), _pos(meta))

    def normalizer_decl(self, meta, children):
        return ("normalizer", children[0], _pos(meta))

    def index_list(self, meta, children):
        return tuple(children)

    def single_index(self, meta, children):
        return ast.Index(str(children[0]), None, pos=_pos(children[0]))

    def pack_index(self, meta, children):
        name, count = children
        count = _int(count) if count.type == "INT" else str(count)
        return ast.Index(str(name), count, pos=_pos(name))

    def sum(self, meta, children):
        terms = [children[0]]
        for op, term in zip(children[1::2], children[2::2]):
            terms.append(ast.Term(1 if op == "+" else -1, term.factors, pos=term.pos))
        return ast.Sum(tuple(terms), pos=_pos(meta))

    def first_term(self, meta, children):
        sign = -1 if len(children) == 2 else 1
        return ast.Term(sign, children[-1].factors, pos=_pos(meta))

    def term(self, meta, children):
        return children[0]

    def product(self, meta, children):
        return ast.Term(1, tuple(children), pos=_pos(meta))

    def tensor(self, meta, children):
        name, indices = children
        return ast.Tensor(str(name), indices, None, pos=_pos(name))

    def sided_tensor(self, meta, children):
        name, side, indices = children
        return ast.Tensor(str(name), indices, str(side), pos=_pos(name))

    def scalar_param(self, meta, children):
        return ast.ParamRef(str(children[0]), pos=_pos(children[0]))

    def number(self, meta, children):
        return ast.Number(_number(children[0]), pos=_pos(children[0]))

    def group(self, meta, children):
        return ast.Group(children[0], pos=_pos(meta))


def _number(token) -> int | float:
    text = str(token)
    try:
        value = int(text)
    except ValueError:   # a float, or more digits than int() takes
        value = float(text)
    # every number becomes a float coefficient in generated code
    if abs(value) > sys.float_info.max or not math.isfinite(value):
        raise SpecSyntaxError(f"number '{_short(text)}' is out of range", _pos(token))
    return value


def _int(token) -> int:
    try:
        return int(str(token))
    except ValueError:   # more digits than Python converts
        raise SpecSyntaxError(f"integer '{_short(str(token))}' is too large", _pos(token)) from None


def _short(text: str, width: int = 24) -> str:
    return text if len(text) <= width else text[:width - 3] + "..."


def parse(source: str, path: str = "<spec>") -> ast.Spec:
    """Parse spec text into an AST, or raise a located SpecSyntaxError."""
    try:
        tree = _parser().parse(source)
        _check_nesting(source)
        return _ToAst().transform(tree)
    except lark.exceptions.VisitError as exc:
        err = exc.orig_exc
        if isinstance(err, SpecError):
            raise err.located(path, source) from None
        raise
    except SpecError as err:
        raise err.located(path, source) from None
    except lark.exceptions.UnexpectedToken as exc:
        acceptable = _acceptable(exc, exc.expected)
        if exc.token.type == "$END":
            pos = _end_pos(exc.token, source)
            msg = f"unexpected end of file; expected {_expected(acceptable)}"
        else:
            pos = Pos(exc.line, exc.column)
            msg = (f"unexpected {_token_text(exc.token)}; expected {_expected(acceptable)}"
                   + _did_you_mean(exc.token, acceptable))
        raise SpecSyntaxError(msg, pos, path=path, source=source) from None
    except lark.exceptions.UnexpectedCharacters as exc:
        char = source[exc.pos_in_stream] if exc.pos_in_stream < len(source) else ""
        msg = f"unexpected character {char!r}"
        allowed = _acceptable(exc, exc.allowed)
        if allowed:
            msg += f"; expected {_expected(allowed)}"
        if "NAME" in allowed and (char == "_" or char.isalnum()):
            msg += " (a name is an ASCII letter followed by letters, digits or '_')"
        elif char == "*" and "ADDOP" in allowed:   # right after a factor
            msg += " (a product is written by juxtaposition, as in k[i] v[e])"
        raise SpecSyntaxError(msg, Pos(exc.line, exc.column), path=path, source=source) from None
    except lark.exceptions.UnexpectedEOF as exc:
        lines = source.splitlines() or [""]
        msg = f"unexpected end of file; expected {_expected(exc.expected)}"
        raise SpecSyntaxError(msg, Pos(len(lines), len(lines[-1]) + 1), path=path,
                              source=source) from None


def _end_pos(token, source: str) -> Pos:
    """Where a missing token belongs: right after the last token (lark's $END token
    borrows its position), else after the last line."""
    if getattr(token, "end_line", None) is not None:
        return Pos(token.end_line, token.end_column)
    lines = source.splitlines() or [""]
    return Pos(len(lines), len(lines[-1]) + 1)


def _check_nesting(source: str) -> None:
    """Reject parentheses nested deeper than MAX_NESTING (the text has parsed, so
    every '(' outside a comment is a grammar token)."""
    depth, line, column, in_comment = 0, 1, 0, False
    for char in source:
        column += 1
        if char == "\n":
            line, column, in_comment = line + 1, 0, False
        elif in_comment:
            continue
        elif char == "#":
            in_comment = True
        elif char == "(":
            depth += 1
            if depth > MAX_NESTING:
                raise SpecSyntaxError(f"parentheses nested more than {MAX_NESTING} deep",
                                      Pos(line, column))
        elif char == ")":
            depth -= 1


def _did_you_mean(token, acceptable) -> str:
    """' (did you mean 'state'?)' for a name that is a misspelt acceptable keyword."""
    if token.type != "NAME":
        return ""
    keywords = [_KEYWORDS[t] for t in acceptable if t in _KEYWORDS]
    close = difflib.get_close_matches(str(token), keywords, n=1, cutoff=0.75)
    return f" (did you mean '{close[0]}'?)" if close else ""


def _token_text(token) -> str:
    if token.type == "NAME":
        return f"name '{token}'"
    return f"'{token}'"
