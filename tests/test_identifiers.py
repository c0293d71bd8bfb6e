"""Spec names cannot collide with generated code.

Spec names reach the generated torch and Triton modules only behind fixed
prefixes (``st_S``, ``offs_d``, ``state_S_0``, ``"S"``) or in comments. The
frontend rejects the few names for which a prefixed name is one the templates
use for themselves (``frontend/check.py: RESERVED_NAMES``); everything else --
Python keywords, builtins, ``tl``, ``torch``, ``lam``, ``num`` ... -- is legal.

* injectivity: renaming one spec name to any identifier the generated code uses
  (with or without a family prefix stripped) either is rejected by the frontend
  with a located error, or renames the generated identifiers one-to-one: no two
  variables of a generated function merge;
* a spec whose every name is a keyword, builtin or generated-code name computes
  exactly what hla2 computes, through the torch module and the Triton kernels
  (TRITON_INTERPRET=1);
* nothing in a spec's text (comments, numbers, unicode) reaches generated source.
"""
from __future__ import annotations

import ast as pyast
import io
import os
import re
import tokenize

os.environ["TRITON_INTERPRET"] = "1"   # before triton is imported anywhere

import pytest  # noqa: E402
import torch  # noqa: E402

import hladsl  # noqa: E402
from hladsl.errors import SpecError  # noqa: E402
from hladsl.frontend.check import reserved  # noqa: E402
from hladsl.frontend.specs import SHIPPED_DIR  # noqa: E402
from hladsl.ir.pipeline import chunk_program  # noqa: E402

NAME = re.compile(r"(?<![\w@])[A-Za-z][A-Za-z0-9_]*(?![\w])")


@pytest.fixture(autouse=True)
def _cache_dir(tmp_path_factory, monkeypatch):
    monkeypatch.setenv("HLADSL_CACHE_DIR", str(tmp_path_factory.getbasetemp() / "hladsl-cache"))


def _sources(text: str, path, sizes: dict[str, int]) -> dict[str, str]:
    """Generated torch and Triton sources of a spec text (gated, chunk 16), and its attention
    form's modules where it has one (power): the forward's and the one with its backward."""
    from hladsl.codegen import attention_gen, torch_gen, triton_gen
    from hladsl.ir.attention import attention_form
    path.write_text(text)
    alg = hladsl.compile_spec(str(path))
    program = chunk_program(alg, 16, tuple(sorted(sizes.items())), True)
    out = {"torch": torch_gen.generate(program), "triton": triton_gen.generate(program)}
    if attention_form(program) is not None:
        out["attention"] = attention_gen.attention_source(program)
        out["attention_bwd"] = attention_gen.attention_bwd_source(program)
    return out


def _identifiers(source: str) -> set[str]:
    """Every identifier of a Python source (comments and strings left out)."""
    toks = tokenize.generate_tokens(io.StringIO(source).readline)
    return {t.string for t in toks if t.type == tokenize.NAME}


def _rename(text: str, names: dict[str, str]) -> str:
    """The spec body with whole-word names replaced (comments dropped; a segment
    side after '@' is not a name)."""
    body = "\n".join(line.split("#")[0] for line in text.splitlines())
    return NAME.sub(lambda m: names.get(m.group(0), m.group(0)), body)


IDENT = r"[A-Za-z][A-Za-z0-9_]*"


def _families(name: str, sizes: dict[str, int], roles: dict[str, list[str]], tmp_path):
    """(families, fixed names) of the generated modules of a shipped spec: every spec
    name of each role is renamed to a marker, so each generated identifier holding
    a marker shows its family (``offs_{dim}``, ``in_{input}_ptr``) and the others are
    the templates' own names."""
    markers = {old: f"XQ{role}{n}QX" for role, olds in roles.items()
               for n, old in enumerate(olds)}
    role_of = {m: role for role, olds in roles.items() for m in (markers[o] for o in olds)}
    text = _rename((SHIPPED_DIR / f"{name}.hla").read_text(), markers)
    sizes = {markers.get(d, d): n for d, n in sizes.items()}
    generated = set().union(*(_identifiers(s) for s in _sources(text, tmp_path / "m.hla",
                                                                  sizes).values()))
    families, fixed = set(), set()
    for ident in generated:
        found = re.findall(r"XQ[a-z]+\d+QX", ident)
        if not found:
            fixed.add(ident)
            continue
        assert len(found) == 1, ident
        prefix, suffix = ident.split(found[0])
        families.add((role_of[found[0]], prefix, re.sub(r"\d+", r"\\d+", re.escape(suffix))))
    return families, fixed


CASES = [("hla2", {"d": 4, "dv": 4}, {"dim": ["d", "dv"], "input": ["q", "k", "v"],
                                       "state": ["S", "C", "m", "G", "h"], "param": ["ridge"],
                                       "output": ["o"], "index": ["i", "j", "e"]}),
         ("power", {"d": 4, "dv": 4}, {"dim": ["d", "dv"], "input": ["q", "k", "v"],
                                        "state": ["U", "z"], "param": ["p"], "index": ["i", "e"]})]


def _reserved(role: str, name: str) -> bool:
    return reserved(role, name) is not None


@pytest.mark.parametrize("name, sizes, roles", CASES, ids=[c[0] for c in CASES])
def test_generated_names_of_different_spec_names_never_meet(name, sizes, roles, tmp_path):
    families, fixed = _families(name, sizes, roles, tmp_path)
    assert {role for role, _, _ in families} >= {"dim", "input", "state"}
    # a template's own name in a family: the name it would need is reserved
    for role, prefix, suffix in families:
        family = re.compile(re.escape(prefix) + f"({IDENT})" + suffix + r"\Z")
        for ident in fixed:
            m = family.match(ident)
            if m:
                assert _reserved(role, m.group(1)), (
                    f"a {role} named '{m.group(1)}' would be {ident}, which the template uses")
    # two families meet: the name one of them needs is reserved
    for role, prefix, suffix in families:
        family = re.compile(re.escape(prefix) + f"({IDENT})" + suffix + r"\Z")
        for role2, prefix2, suffix2 in families:
            if (role2, prefix2, suffix2) == (role, prefix, suffix):
                continue
            for witness in ("a", "b_1"):
                ident = prefix2 + witness + suffix2.replace(r"\d+", "0").replace("\\", "")
                m = family.match(ident)
                if m and (role, m.group(1)) != (role2, witness):
                    assert _reserved(role, m.group(1)) or _reserved(role2, witness), (
                        f"{role} '{m.group(1)}' and {role2} '{witness}' both give {ident}")


@pytest.mark.parametrize("role, name", [("dim", "t"), ("dim", "nh"), ("dim", "d_pow2"),
                                        ("input", "v_ptr")])
def test_reserved_names_are_rejected_with_a_location(role, name, tmp_path):
    text = (SHIPPED_DIR / "linear.hla").read_text()
    path = tmp_path / "r.hla"
    path.write_text(_rename(text, {"dv" if role == "dim" else "v": name}))
    with pytest.raises(SpecError) as info:
        hladsl.compile_spec(str(path))
    err = info.value
    assert err.pos is not None and "reserved" in err.message
    lines = str(err).splitlines()
    assert lines[0].startswith(f"{path}:{err.pos.line}:{err.pos.column}: '{name}' cannot name ")
    assert lines[1].strip().startswith("dims" if role == "dim" else "input")
    assert lines[2].strip() == "^" and lines[1][lines[2].index("^"):].startswith(name)


# ----------------------------------------------------------------------------- a tricky spec

TRICKY = """# every name is a Python keyword or builtin, or a name the generated code uses
# (x0, x1: the torch module's temporaries; offs_t, lam, num, den, tl: the kernels')
mechanism triton {
  dims tl, range
  input q[tl], k[tl], v[range]
  param normalize = true, eps = 1e-6, float = 0.5
  state if[None, lambda] = k[None] k[lambda]  symmetric(None, lambda)
  state torch[None, in] = q[None] v[in]
  state x0[None] = q[None]
  state den[None, in] = 0  cross if@B[None, t] torch@A[t, in]
  state x1[None] = 0  cross if@B[None, t] x0@A[t]
  output offs_t[in] = q[None] ((if[None, t] + float eye[None, t]) torch[t, in] - den[None, in])
  normalizer = q[None] ((if[None, t] + float eye[None, t]) x0[t] - x1[None])
}
"""

def _tokens(seed, T=20, d=4, dv=3):
    gen = torch.Generator().manual_seed(seed)
    q, k = torch.rand(2, 1, T, 1, d, generator=gen, dtype=torch.float64)
    v = torch.randn(1, T, 1, dv, generator=gen, dtype=torch.float64)
    g = -torch.rand(1, T, 1, generator=gen, dtype=torch.float64)
    return q, k, v, g


def test_tricky_names_compute_hla2_through_the_torch_module(tmp_path):
    path = tmp_path / "tricky.hla"
    path.write_text(TRICKY)
    op, ref = hladsl.load(str(path)), hladsl.load("hla2", normalize=True, ridge=0.5)
    q, k, v, g = _tokens(0)
    o, final = op(q, k, v, g, output_final_state=True)
    o_ref, final_ref = ref(q, k, v, g, output_final_state=True)
    torch.testing.assert_close(o, o_ref, rtol=1e-12, atol=1e-12)
    assert list(final) == ["if", "torch", "x0", "den", "x1"]
    for mine, theirs in zip(final, ["S", "C", "m", "G", "h"]):
        torch.testing.assert_close(final[mine], final_ref[theirs], rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("options", [{"schedule": "two_pass"},
                                     {"schedule": "fused", "state_block": 16}],
                         ids=["two_pass", "fused"])
def test_tricky_names_compute_hla2_through_the_triton_kernels(tmp_path, options):
    from hladsl.runtime.triton_forward import forward_triton
    from hladsl.runtime import chunk_torch
    path = tmp_path / "tricky.hla"
    path.write_text(TRICKY)
    mine, ref = hladsl.compile_spec(str(path)), hladsl.compile_spec("hla2", normalize=True,
                                                                    ridge=0.5)
    q, k, v, g = _tokens(1, T=32, d=6, dv=20)
    tiles = {n: x.reshape(1, 2, 16, 1, -1).permute(0, 3, 1, 2, 4) for n, x in
             (("q", q * 6 ** -0.5), ("k", k), ("v", v))}
    lam = g.reshape(1, 2, 16, 1).permute(0, 3, 1, 2).cumsum(-1)
    ref_program = chunk_program(ref, 16, (("d", 6), ("dv", 20)), True)
    init = {s.name: torch.zeros((1, 1) + ref_program.state_shape(s.name), dtype=torch.float64)
            for s in ref.streaming}
    starts, final_ref = chunk_torch.state_pass(ref_program, tiles, lam, init, torch.float64)
    num = chunk_torch.outputs(ref_program, "output", tiles, lam, starts, torch.float64)
    den = chunk_torch.outputs(ref_program, "normalizer", tiles, lam, starts, torch.float64)
    o_ref = num / (den.unsqueeze(-1) + ref.eps)
    program = chunk_program(mine, 16, (("range", 20), ("tl", 6)), True)
    renamed = dict(zip(["S", "C", "m", "G", "h"], ["if", "torch", "x0", "den", "x1"]))
    o, final = forward_triton(program, {n: x.float() for n, x in tiles.items()}, lam.float(),
                              {renamed[n]: x.float() for n, x in init.items()}, mine.eps,
                              **options)
    torch.testing.assert_close(o.double(), o_ref, rtol=1e-4, atol=1e-5)
    for theirs, name in renamed.items():
        torch.testing.assert_close(final[name].double(), final_ref[theirs], rtol=1e-4, atol=1e-5)


# ----------------------------------------------------------------------------- injection

INJECTIONS = [
    "# \"\"\" ''' ); import os; os.system('echo pwned') \\\n",   # quotes, a continuation
    "# \u2028 \u2029 \x85 \x0c \u202e unicode line breaks and overrides\n",
    "# {{ name }} {% raw %} jinja in a comment\n",
]


@pytest.mark.parametrize("comment", INJECTIONS, ids=["quotes", "unicode", "jinja"])
def test_comments_never_reach_generated_source(comment, tmp_path):
    text = (SHIPPED_DIR / "hla2.hla").read_text()
    text = text.replace("  state S", comment + "  state S", 1)
    sources = _sources(text, tmp_path / "c.hla", {"d": 4, "dv": 4})
    plain = _sources((SHIPPED_DIR / "hla2.hla").read_text(), tmp_path / "p.hla", {"d": 4, "dv": 4})
    assert sources == plain


@pytest.mark.parametrize("number", ["1e400", "1" + "0" * 400, "9" * 5000 + ".5"])
def test_huge_numbers_are_rejected(number, tmp_path):
    text = (SHIPPED_DIR / "hla2.hla").read_text().replace("ridge = 0.0", f"ridge = {number}")
    path = tmp_path / "n.hla"
    path.write_text(text)
    with pytest.raises(SpecError, match="out of range|too large") as info:
        hladsl.compile_spec(str(path))
    line = text[:text.index(number)].count("\n") + 1
    assert str(info.value).startswith(f"{path}:{line}:")


def test_coefficients_render_as_python_literals(tmp_path):
    # tiny, huge-but-finite and many-digit coefficients become float literals
    text = (SHIPPED_DIR / "linear.hla").read_text().replace(
        "q[i] S[i, e]", "1e-300 q[i] S[i, e] + 1e300 q[i] S[i, e] + 0.1234567890123456789 q[i] S[i, e]")
    sources = _sources(text, tmp_path / "k.hla", {"d": 4, "dv": 4})
    for source in sources.values():
        pyast.parse(source)
        assert "Fraction" not in source and "inf" not in _identifiers(source)


def test_unicode_names_are_rejected_with_a_location(tmp_path):
    text = (SHIPPED_DIR / "linear.hla").read_text().replace("state z[i]", "state zé[i]")
    path = tmp_path / "u.hla"
    path.write_text(text)
    with pytest.raises(SpecError) as info:
        hladsl.compile_spec(str(path))
    line = text[:text.index("zé")].count("\n") + 1
    assert str(info.value).startswith(f"{path}:{line}:")
