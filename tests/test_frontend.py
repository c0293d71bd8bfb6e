"""Frontend tests: error goldens (API and CLI), shipped specs round-trip through the
canonical printer, identifier hygiene, and property tests that the parser and
checker only ever fail with a located SpecError.

Regenerate the error goldens after an intended message change with
``HLADSL_UPDATE_GOLDENS=1 python -m pytest tests/test_frontend.py -k golden``
and read every changed .err file before committing it.
"""
from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from hladsl import cli
from hladsl.errors import SpecError, SpecSyntaxError
from hladsl.frontend.check import check
from hladsl.frontend.parser import MAX_NESTING, parse
from hladsl.frontend.printer import to_text
from hladsl.frontend.specs import SHIPPED_DIR, load_ast, shipped_names

TESTS = Path(__file__).resolve().parent
REPO = TESTS.parent
GOLDEN_DIR = TESTS / "golden" / "errors"
GOLDENS = sorted(GOLDEN_DIR.glob("*.hla"))
SHIPPED = shipped_names()
SHIPPED_TEXT = {name: (SHIPPED_DIR / f"{name}.hla").read_text() for name in SHIPPED}

# A few goldens of each kind (lexer, parser, transformer, checker, several errors)
# also go through a real `python -m hladsl` process; all of them would only repeat
# the API test slowly (`hladsl check` imports torch).
CLI_GOLDENS = ["04_end_of_file", "06_dunder_name", "13_unknown_state", "71_several_errors"]


def rel(path: Path) -> str:
    """A path as the user typed it: relative to the repository root."""
    return path.relative_to(REPO).as_posix()


@pytest.fixture
def at_repo_root(monkeypatch):
    monkeypatch.chdir(REPO)


def hladsl_cli(*args: str) -> subprocess.CompletedProcess:
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(
        p for p in (str(REPO), os.environ.get("PYTHONPATH")) if p))
    return subprocess.run([sys.executable, "-m", "hladsl", *args], cwd=REPO, env=env,
                          capture_output=True, text=True, timeout=120)


def hladsl_main(capsys, *args: str) -> tuple[int, str, str]:
    """The CLI in this process (exit code, stdout, stderr): the same code path as
    the command without paying for a fresh interpreter each time."""
    code = cli.main(list(args))
    out, err = capsys.readouterr()
    return code, out, err


def spec_error(path: str) -> SpecError:
    with pytest.raises(SpecError) as info:
        load_ast(path)
    return info.value


def parse_and_check(text: str):
    """The checked AST, or None if the spec is rejected. Anything but a SpecError
    escapes (and fails the calling test); every error must render and be located."""
    try:
        return check(parse(text, "fuzz.hla"))
    except SpecError as err:
        n_lines = max(1, len(text.splitlines()))
        for e in getattr(err, "errors", [err]):
            assert e.pos is not None, f"unlocated error: {e.message}"
            assert 1 <= e.pos.line <= n_lines and e.pos.column >= 1, e.message
            assert str(e.located("fuzz.hla", text)).startswith(f"fuzz.hla:{e.pos.line}:")
        return None


def assert_round_trips(spec) -> None:
    canonical = to_text(spec)
    again = parse(canonical, "canonical.hla")
    assert again == spec
    assert to_text(again) == canonical
    check(again)


# ---------------------------------------------------------------- error goldens

def test_goldens_are_complete():
    assert len(GOLDENS) >= 26
    hla = {p.stem for p in GOLDENS}
    err = {p.stem for p in GOLDEN_DIR.glob("*.err")}
    assert hla == err, f"goldens without .err: {hla - err}; .err without spec: {err - hla}"
    assert all(re.fullmatch(r"\d\d_[a-z0-9_]+", stem) for stem in hla)
    assert set(CLI_GOLDENS) <= hla


@pytest.mark.parametrize("path", GOLDENS, ids=lambda p: p.stem)
def test_error_golden(path, at_repo_root):
    message = str(spec_error(rel(path)))
    expected_file = path.with_suffix(".err")
    if os.environ.get("HLADSL_UPDATE_GOLDENS"):
        expected_file.write_text(message)
    assert message.startswith(f"{rel(path)}:")
    assert message == expected_file.read_text()


@pytest.mark.parametrize("stem", CLI_GOLDENS)
def test_error_golden_cli(stem):
    path = GOLDEN_DIR / f"{stem}.hla"
    result = hladsl_cli("check", rel(path))
    assert result.returncode == 1
    assert "Traceback" not in result.stderr
    assert result.stderr == path.with_suffix(".err").read_text() + "\n"
    assert result.stdout == ""


def test_an_internal_error_is_one_line_not_a_traceback(monkeypatch, capsys):
    """A failure inside hladsl (not the spec's fault) exits 3 with one line that says so (the
    first of its message's); HLADSL_TRACEBACK=1 lets the exception through for whoever debugs it."""
    def broken(*args, **kwargs):
        raise RuntimeError("ptxas failed\nline two of a compiler's log")
    monkeypatch.setattr(cli, "emit", broken)
    for unset in (None, "0"):
        if unset is None:
            monkeypatch.delenv("HLADSL_TRACEBACK", raising=False)
        else:
            monkeypatch.setenv("HLADSL_TRACEBACK", unset)
        assert cli.main(["compile", "hla2", "--emit", "carried"]) == 3
        err = capsys.readouterr().err
        assert err.startswith("hladsl: internal error (RuntimeError: ptxas failed): a bug in hladsl")
        assert err.count("\n") == 1
    monkeypatch.setenv("HLADSL_TRACEBACK", "1")
    with pytest.raises(RuntimeError):
        cli.main(["compile", "hla2", "--emit", "carried"])


def test_what_cannot_be_generated_and_bad_sizes_exit_1(monkeypatch, capsys):
    """A ValueError of code generation (a spec the kernels do not support) is the input's
    limit, not a bug: exit 1, one line; so are --size and --chunk that are not positive."""
    def unsupported(*args, **kwargs):
        raise ValueError("Triton chunk kernels need a power-of-two chunk size")
    assert cli.main(["compile", "hla2", "--emit", "cost", "--size", "d=0"]) == 1
    assert capsys.readouterr().err == "hladsl: --size d: expected a positive integer, got '0'\n"
    with pytest.raises(SystemExit) as exit_:
        cli.main(["compile", "hla2", "--emit", "cost", "--chunk", "-4"])
    assert exit_.value.code == 2 and "expected a positive integer, got '-4'" in capsys.readouterr().err
    monkeypatch.setattr(cli, "emit", unsupported)
    assert cli.main(["compile", "hla2", "--emit", "triton"]) == 1
    assert capsys.readouterr().err == "hladsl: cannot generate this: Triton chunk kernels need a power-of-two chunk size\n"

    def guard(*args, **kwargs):   # (ir.operands' exhaustiveness guard: a compiler bug, not the spec's limit)
        raise NotImplementedError("a consumer does not handle operand kind(s) x")
    monkeypatch.setattr(cli, "emit", guard)
    monkeypatch.delenv("HLADSL_TRACEBACK", raising=False)
    assert cli.main(["compile", "hla2", "--emit", "triton"]) == 3
    assert capsys.readouterr().err.startswith("hladsl: internal error (NotImplementedError:")


# ---------------------------------------------------------------- shipped specs

@pytest.mark.parametrize("name", SHIPPED)
def test_shipped_spec_round_trips(name):
    spec = check(parse(SHIPPED_TEXT[name], f"{name}.hla"))
    assert spec.name == name
    assert_round_trips(spec)
    assert load_ast(name)[0] == spec


@pytest.mark.parametrize("name", SHIPPED)
def test_shipped_spec_cli_emit_ast(name):
    result = hladsl_cli("compile", name, "--emit", "ast")
    assert result.returncode == 0, result.stderr
    assert result.stdout == to_text(parse(SHIPPED_TEXT[name]))


@pytest.mark.parametrize("name", SHIPPED)
def test_shipped_spec_cli_check(name, capsys):
    code, out, err = hladsl_main(capsys, "check", name)
    assert (code, err) == (0, "")
    assert "OK" in out


def test_cli_check_process():
    result = hladsl_cli("check", SHIPPED[0])
    assert result.returncode == 0, result.stderr
    assert "OK" in result.stdout


@pytest.mark.parametrize("flag", ["--version", "--help"])
def test_cli_info(flag):
    result = hladsl_cli(flag)
    assert result.returncode == 0, result.stderr
    assert "hladsl" in result.stdout


def test_cli_missing_file(capsys):
    code, out, err = hladsl_main(capsys, "check", "no/such/spec.hla")
    assert (code, out) == (1, "")
    assert err == "no/such/spec.hla: no such spec file: no/such/spec.hla\n"


# ---------------------------------------------------------------- identifiers

TEMPLATE = """mechanism {mechanism} {{
  dims d, dv
  input q[d], {input}[d], v[dv]
  param normalize = false, eps = 1e-6, {param} = 0.5
  state {state}[i, e] = {input}[i] v[e]
  state z[i] = {input}[i]
  output o[e] = {param} q[i] {state}[i, e]
  normalizer = q[i] z[i]
}}
"""
ROLES = ["mechanism", "input", "param", "state"]
GOOD_NAMES = dict(mechanism="m", input="k", param="r", state="S")
BAD_NAMES = ["__import__", "_x", "a.b", "os.system", 'q"', '"q"', "x-y", "é", "café", "ß",
             "1x", "9", "x y", "a[0]", "x;y", "x__import__()"]


def with_name(role: str, name: str) -> str:
    return TEMPLATE.format(**{**GOOD_NAMES, role: name})


def test_identifier_template_is_valid():
    assert parse_and_check(with_name("state", "S")) is not None
    for role in ROLES:   # plain names with digits and underscores are fine everywhere
        assert parse_and_check(with_name(role, "x_1Y")) is not None


@pytest.mark.parametrize("role", ROLES)
@pytest.mark.parametrize("name", BAD_NAMES)
def test_non_plain_identifiers_are_rejected(role, name):
    text = with_name(role, name)
    with pytest.raises(SpecSyntaxError) as info:
        parse(text, "names.hla")
    # the error points into the first occurrence of the name
    first = text.index(name)
    line = text.count("\n", 0, first) + 1
    column = first - (text.rfind("\n", 0, first) + 1) + 1
    assert info.value.pos.line == line
    assert column <= info.value.pos.column <= column + len(name)


# Python keywords, builtins and names the generated code uses are plain names: spec
# names only reach generated code behind fixed prefixes (tests/test_identifiers.py)
CODE_NAMES = ["if", "lambda", "None", "True", "import", "self", "tl", "triton", "torch", "range",
              "float", "lam", "num", "den", "C", "env", "offs_t", "pid_nh", "st_S", "a__b__"]


@pytest.mark.parametrize("role", ROLES)
@pytest.mark.parametrize("name", CODE_NAMES)
def test_python_and_generated_code_names_are_legal(role, name):
    spec = parse_and_check(with_name(role, name))
    assert spec is not None
    assert_round_trips(spec)


# ---------------------------------------------------------------- parser limits

def minimal_spec(output: str = "q[i] S[i, e]", extra: str = "") -> str:
    return ("mechanism m {\n  dims d, dv\n  input q[d], k[d], v[dv]\n"
            f"  state S[i, e] = k[i] v[e]{extra}\n  output o[e] = {output}\n}}\n")


def test_nesting_limit():
    ok = minimal_spec("(" * MAX_NESTING + "q[i] S[i, e]" + ")" * MAX_NESTING)
    assert_round_trips(parse_and_check(ok))
    for depth in (MAX_NESTING + 1, 5000):   # no RecursionError, however deep
        text = minimal_spec("(" * depth + "q[i] S[i, e]" + ")" * depth)
        with pytest.raises(SpecSyntaxError, match="nested more than"):
            parse(text)


@pytest.mark.parametrize("extra, output", [
    ("  decay " + "9" * 5000, "q[i] S[i, e]"),                  # more digits than int() takes
    ("", "q[i^" + "9" * 5000 + "] S[i, e]"),
    ("", "9" * 5000 + " q[i] S[i, e]"),
    ("", "1" + "0" * 400 + ".0 q[i] S[i, e]"),                   # a float overflows to inf
    ("", "1e999 q[i] S[i, e]"),
], ids=["decay", "pack", "int", "float", "exponent"])
def test_out_of_range_numbers(extra, output):
    with pytest.raises(SpecSyntaxError, match="too large|out of range"):
        parse(minimal_spec(output, extra))


def test_keywords_end_at_a_word_boundary():
    with pytest.raises(SpecSyntaxError, match="did you mean 'state'"):
        parse("mechanism m {\n  states S[i] = k[i]\n}")
    with pytest.raises(SpecSyntaxError, match="unexpected name 'dimsd'"):
        parse(minimal_spec().replace("dims d,", "dimsd,"))   # once read as "dims d,"
    # where no keyword is acceptable, a keyword-like word is a plain name
    spec = parse_and_check(minimal_spec("q[i] S[i, e]").replace("k[", "cross["))
    assert spec.inputs[1].name == "cross"
    assert_round_trips(spec)


# ---------------------------------------------------------------- properties

# HLADSL_FUZZ_EXAMPLES=20000 for a longer hunt
FUZZ = settings(max_examples=int(os.environ.get("HLADSL_FUZZ_EXAMPLES", 300)), deadline=None,
                suppress_health_check=[HealthCheck.too_slow, HealthCheck.filter_too_much])

# everything the grammar uses, plus characters it does not
ALPHABET = st.characters(codec="ascii", min_codepoint=32, max_codepoint=126) | st.sampled_from(
    "\n\t{}[](),=@^+-#._\"'" + "é\x00\r")


@FUZZ
@given(st.text(ALPHABET, max_size=200))
def test_random_text_fails_only_with_spec_errors(text):
    parse_and_check(text)


@FUZZ
@given(st.text(ALPHABET, max_size=120))
def test_random_mechanism_body_fails_only_with_spec_errors(body):
    parse_and_check("mechanism m {\n" + body + "\n}\n")


def _tokens(text: str) -> list[str]:
    return re.findall(r"[A-Za-z_][A-Za-z0-9_]*|\d+(?:\.\d*)?(?:e-?\d+)?|\S", text)


VOCABULARY = sorted({t for text in SHIPPED_TEXT.values() for t in _tokens(text)}
                    | {"eye", "true", "false", "0", "1.5", "-", "@A", "@B", "@C", "^p", "^2",
                       "decay", "combine_only", "symmetric", "(", ")", "\n", "#"})


@FUZZ
@given(st.lists(st.sampled_from(VOCABULARY), max_size=60))
def test_token_soup_fails_only_with_spec_errors(tokens):
    spec = parse_and_check("mechanism m {\n" + " ".join(tokens) + "\n}\n")
    if spec is not None:
        assert_round_trips(spec)


EDIT_CHARS = list("{}[](),=@^+-#._\"'*/0129aAeiBqkz\n")


@st.composite
def mutated_specs(draw) -> str:
    """A shipped spec after a few random edits, each deleting, inserting or
    replacing one token or one character."""
    text = SHIPPED_TEXT[draw(st.sampled_from(SHIPPED))]
    for _ in range(draw(st.integers(1, 4))):
        if draw(st.booleans()):
            spans = [m.span() for m in re.finditer(r"[A-Za-z0-9_.]+|\S", text)]
            start, end = draw(st.sampled_from(spans))
            new = draw(st.sampled_from(VOCABULARY))
            pad = draw(st.sampled_from(["", " "]))
        else:
            start = draw(st.integers(0, len(text)))
            end, new, pad = start + 1, draw(st.sampled_from(EDIT_CHARS)), ""
        start, end, new = draw(st.sampled_from([(start, end, ""),            # delete
                                                 (start, start, new + pad),  # insert before
                                                 (start, end, new)]))        # replace
        text = text[:start] + new + text[end:]
    return text


@FUZZ
@given(mutated_specs())
def test_mutated_shipped_specs(text):
    spec = parse_and_check(text)
    if spec is not None:
        assert_round_trips(spec)


DECLARATIONS = sorted({line.split("#")[0].strip() for text in SHIPPED_TEXT.values()
                       for line in text.splitlines()[1:-1]} - {""})


@FUZZ
@given(st.lists(st.sampled_from(DECLARATIONS), min_size=1, max_size=12), mutated_specs())
def test_spliced_shipped_declarations(lines, mutated):
    """Declarations of different shipped specs mixed (mostly well-formed text that
    the checker must reject cleanly), with a mutated spec's body appended."""
    body = mutated[mutated.find("{") + 1:] if "{" in mutated else "}"
    spec = parse_and_check("mechanism mix {\n" + "\n".join(lines) + "\n" + body)
    if spec is not None:
        assert_round_trips(spec)
