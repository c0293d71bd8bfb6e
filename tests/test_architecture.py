"""The structure the rest of hladsl grows in: layers import one way, the pass
pipeline is listed and verified, operand kinds are closed, one op (and one
custom op) per loaded spec, and the op takes whatever token inputs a spec declares."""
from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import hladsl
from hladsl.emit import PASS_TEXT, emit
from hladsl.frontend.specs import shipped_names
from hladsl.ir.operands import Kind, exhaustive
from hladsl.ir.pipeline import PASS_NAMES

PACKAGE = Path(hladsl.__file__).resolve().parent

# lower rank = earlier layer; a module may import its own layer or earlier ones
LAYERS = {"base": 0, "frontend": 1, "ir": 2, "codegen": 3, "runtime": 4, "surface": 5}
BASE = {"hladsl.errors", "hladsl.version"}


def _layer(module: str) -> str:
    if module in BASE:
        return "base"
    parts = module.split(".")
    if len(parts) > 1 and parts[1] in ("frontend", "ir", "codegen", "runtime"):
        return parts[1]
    return "surface"


def _imports(path: Path) -> set[str]:
    """Every hladsl module imported anywhere in the file (lazy imports included)."""
    tree = ast.parse(path.read_text())
    found = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found |= {a.name for a in node.names if a.name.startswith("hladsl")}
        elif isinstance(node, ast.ImportFrom) and node.module and node.module.startswith("hladsl"):
            found.add(node.module)
            for a in node.names:   # `from hladsl.runtime import launch` imports a module
                if (PACKAGE.parent / (node.module + "." + a.name).replace(".", "/")).with_suffix(
                        ".py").exists():
                    found.add(f"{node.module}.{a.name}")
    return found


def _modules() -> dict[str, Path]:
    out = {}
    for path in PACKAGE.rglob("*.py"):
        rel = path.relative_to(PACKAGE.parent).with_suffix("")
        name = ".".join(rel.parts)
        out[name.removesuffix(".__init__")] = path
    return out


def test_layers_import_one_way():
    bad = []
    for name, path in _modules().items():
        here = LAYERS[_layer(name)]
        for dep in _imports(path):
            if dep == "hladsl" and _layer(name) != "surface":
                bad.append(f"{name} imports the package root")
            elif dep != "hladsl" and LAYERS[_layer(dep)] > here:
                bad.append(f"{name} ({_layer(name)}) imports {dep} ({_layer(dep)})")
    assert not bad, "\n".join(bad)


def test_no_import_cycles():
    modules = _modules()
    graph = {name: {d for d in _imports(path) if d in modules and d != name}
             for name, path in modules.items()}
    # packages import their own __init__ implicitly; only module-to-module edges count
    seen, stack, cycles = set(), [], []

    def visit(node):
        if node in stack:
            cycles.append(stack[stack.index(node):] + [node])
            return
        if node in seen:
            return
        seen.add(node)
        stack.append(node)
        for nxt in graph[node]:
            visit(nxt)
        stack.pop()
    for node in graph:
        visit(node)
    assert not cycles, "\n".join(" -> ".join(c) for c in cycles)


def test_every_folder_says_what_it_owns():
    for sub in ("frontend", "ir", "codegen", "runtime"):
        doc = ast.get_docstring(ast.parse((PACKAGE / sub / "__init__.py").read_text()))
        assert doc and len(doc.split()) >= 20, f"hladsl/{sub}/__init__.py needs a paragraph"


def test_passes_are_listed_and_printable():
    assert PASS_NAMES[:2] == ("lower", "check")
    assert set(PASS_TEXT) == set(PASS_NAMES), "every pass has an after:PASS printer"
    for name in PASS_NAMES:
        text = emit("hla2", f"after:{name}", {}, None)
        assert text.startswith(f"# after pass '{name}'") and len(text.splitlines()) > 2


@pytest.mark.parametrize("name", shipped_names())
def test_verifiers_hold_between_passes(name):
    from hladsl.api import compile_spec
    from hladsl.ir.pipeline import Target
    for gated in (True, False):
        c = compile_spec(name, target=Target(16, (("d", 4), ("dv", 3)), gated), verify=True)
        assert c.program is not None and c.check


def test_verifier_catches_a_broken_plan():
    from dataclasses import replace

    from hladsl.api import compile_spec
    from hladsl.ir.contract import Plan
    from hladsl.ir.pipeline import PassInvariantError, verify_program
    program = compile_spec("hla2").program
    term = program.output[1]
    broken = replace(term, plan=Plan(term.plan.steps[:1], 0, term.plan.steps[0].left))
    with pytest.raises(PassInvariantError):
        verify_program(replace(program, output=(program.output[0], broken) + program.output[2:]))


def test_operand_kinds_are_closed():
    with pytest.raises(NotImplementedError, match="does not handle operand kind"):
        exhaustive({Kind.TOKEN: None}, "a consumer")
    assert Kind("carry") is Kind.CARRY


def test_load_is_memoised_and_registers_once():
    a = hladsl.load("hla2")
    assert hladsl.load("hla2") is a
    assert hladsl.load(str(PACKAGE / "specs" / "hla2.hla")) is a   # same text, same op
    assert hladsl.load("hla2", normalize=True) is not a
    script = ("import torch, hladsl\n"
              "before = {n for n in dir(torch.ops.hladsl)}\n"
              "ops = [hladsl.load('linear') for _ in range(5)]\n"
              "assert all(o is ops[0] for o in ops)\n"
              "after = {n for n in dir(torch.ops.hladsl)}\n"
              "print(len(after - before))\n")
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "2", "one forward and one backward custom op for five loads"


FOUR_INPUTS = """
mechanism two_memories {
  dims d, dv
  input q[d], k[d], u[d], v[dv]
  state S[i, e] = k[i] v[e]
  state U[i, e] = u[i] v[e]
  output o[e] = q[i] (S[i, e] + U[i, e])
}
"""


def test_spec_with_four_token_inputs(tmp_path):
    path = tmp_path / "two_memories.hla"
    path.write_text(FOUR_INPUTS)
    op = hladsl.load(str(path))
    assert op.inputs == ("q", "k", "u", "v")
    gen = torch.Generator().manual_seed(0)
    q, k, u = (torch.randn(2, 37, 3, 5, generator=gen, dtype=torch.float64) for _ in range(3))
    v = torch.randn(2, 37, 3, 4, generator=gen, dtype=torch.float64)
    g = -torch.rand(2, 37, 3, generator=gen, dtype=torch.float64)
    o_pos, s_pos = op(q, k, u, v, g, output_final_state=True)
    o_kw, _ = op(v=v, u=u, q=q, k=k, g=g)
    linear = hladsl.load("linear")
    want = linear(q, k, v, g)[0] + linear(q, u, v, g)[0]
    torch.testing.assert_close(o_pos, want, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(o_kw, want, rtol=1e-12, atol=1e-12)
    assert set(s_pos) == {"S", "U"}
    with pytest.raises(ValueError, match="missing token input.*u"):
        op(q=q, k=k, v=v)
    with pytest.raises(ValueError, match="u has last dimension"):
        op(q, k, u[..., :3], v)
    with pytest.raises(ValueError, match="unexpected argument 'w'"):
        op(q, k, u, v, w=v)


def test_a_negative_scale_is_not_the_default():
    op = hladsl.load("linear")
    gen = torch.Generator().manual_seed(1)
    q, k, v = (torch.randn(1, 9, 2, 4, generator=gen, dtype=torch.float64) for _ in range(3))
    neg, _ = op(q, k, v, scale=-0.3)
    pos, _ = op(q, k, v, scale=0.3)
    torch.testing.assert_close(neg, -pos)      # linear in q: the sign carries through
    step_o, _ = op.step(q, k, v, scale=-0.3)
    torch.testing.assert_close(step_o, neg)
    with pytest.raises(ValueError, match="scale must be a finite number"):
        op(q, k, v, scale=float("nan"))


def test_backward_fake_matches_real_strides():
    """The compiled graph trusts the fake's strides: gradients come back contiguous."""
    op = hladsl.load("linear")
    q, k, v = (torch.randn(1, 4, 6, 3, dtype=torch.float64).transpose(1, 2).requires_grad_()
               for _ in range(3))
    o, _ = op(q, k, v)
    grads = torch.autograd.grad(o.sum(), (q, k, v))
    assert all(g.is_contiguous() for g in grads)
    with torch._subclasses.FakeTensorMode():
        x = torch.empty(1, 4, 6, 3).transpose(1, 2)
        # (the registered name: op_name at load; a memoised op's chunk_size may have changed since)
        fake = getattr(torch.ops.hladsl, op.identity + "_backward")(
            [x, x, x], None, 0.5, [], None, "auto", torch.empty(1, 6, 4, 3), [torch.empty(1, 4, 3, 3)])
    assert all(f.is_contiguous() for f in fake)
