"""A seeded sample of the spec fuzzer (tests/fuzz_specs.py) on every run, and the
crash classes it found, as regressions.

Every mutant of the sample goes through parse, check and lower; those that
compile are loaded and run forward on the CPU (float64, B=1, T=3, H=1) against
the op's serial recurrence. Longer hunts: ``python tests/fuzz_specs.py --n 20000``.
"""
from __future__ import annotations

import re

import pytest
import torch

import hladsl
from hladsl.errors import SpecError
from hladsl.frontend.specs import SHIPPED_DIR

import fuzz_specs

SAMPLE = 2000
SEED = 20261123


def test_seeded_sample_of_mutants(tmp_path, monkeypatch):
    monkeypatch.setenv("HLADSL_CACHE_DIR", str(tmp_path / "cache"))
    counts, findings = fuzz_specs.fuzz(SAMPLE, SEED)
    assert sum(counts.values()) == SAMPLE
    report = "\n\n".join(f"mutant {k} of {origin} ({out.kind}, {out.stage}): {out.detail}\n"
                         + fuzz_specs.changes(origin, text)
                         for k, out, origin, text in findings[:5])
    assert not findings, f"{len(findings)} findings, {dict(counts)}:\n{report}"
    # the sample reaches every stage: most mutants are rejected, some compile and run
    assert counts["spec_error"] > SAMPLE // 2 and counts["ok"] >= 40


def test_the_fuzzer_reports_crashes_and_hangs(tmp_path, monkeypatch):
    """The harness classifies a crash, an unlocated error and a hang (a mutant
    stuck in C code is killed from outside)."""
    import time

    def fake(text, path, *, run_forward, seed=0):
        if text == "crash":
            raise KeyError("x")
        if text == "unlocated":
            raise SpecError("no position")
        if text == "hang":
            time.sleep(1000)   # in C: no signal would interrupt it
        return fuzz_specs.Outcome("ok")

    monkeypatch.setattr(fuzz_specs, "run_one", lambda *a, **k: _classify(fake, *a, **k))
    monkeypatch.setattr(fuzz_specs, "HANG_WALL_S", 2.0)
    harness = fuzz_specs.Harness(str(tmp_path))
    try:
        kinds = [harness.run(k, text, True).kind
                 for k, text in enumerate(["ok", "crash", "unlocated", "hang", "ok"])]
    finally:
        harness.close()
    assert kinds == ["ok", "crash", "unlocated", "hang", "ok"]


def _classify(fn, text, path, *, run_forward, seed=0):
    try:
        return fn(text, path, run_forward=run_forward, seed=seed)
    except SpecError as exc:
        return fuzz_specs.Outcome("unlocated" if exc.pos is None else "spec_error", str(exc))
    except Exception as exc:
        return fuzz_specs.Outcome("crash", f"{type(exc).__name__}: {exc}")


def test_mutations_are_token_edits():
    texts = fuzz_specs.shipped_texts()
    for name, text in texts.items():   # tokenizing loses nothing
        assert fuzz_specs.detokenize(fuzz_specs.tokenize(text)) == text
    import random
    mutator = fuzz_specs.Mutator(random.Random(0), fuzz_specs.vocabulary(texts.values()), texts)
    mutants = [mutator.mutant() for _ in range(300)]
    changed = sum(text != texts[origin] for origin, text in mutants)
    assert changed > 250 and len({origin for origin, _ in mutants}) == len(texts)


# ----------------------------------------------------------------------------- regressions

def _spec(tmp_path, name: str, old: str, new: str):
    text = (SHIPPED_DIR / f"{name}.hla").read_text()
    assert old in text, old
    path = tmp_path / f"{name}_mutant.hla"
    path.write_text(text.replace(old, new))
    return str(path)


def _run(op, seed=0, d=4, dv=3):
    gen = torch.Generator().manual_seed(seed)
    q, k = torch.randn(2, 1, 6, 1, d, generator=gen, dtype=torch.float64)
    v = torch.randn(1, 6, 1, dv, generator=gen, dtype=torch.float64)
    g = -torch.rand(1, 6, 1, generator=gen, dtype=torch.float64)
    o, final = op(q, k, v, g, output_final_state=True)
    o_serial, _ = op.serial(q, k, v, g)
    torch.testing.assert_close(o, o_serial, rtol=1e-10, atol=1e-12)
    return o, final


def test_zero_cross_factor_is_a_zero_term(tmp_path):
    # a literal 0 factor used to drop the term's indices before lowering (KeyError);
    # a zero term is no term: x2 is zero, so h2 only has its other two cross terms
    zero = _spec(tmp_path, "hla3", "cross SQ@B[b, c] m@A[c]  combine_only",
                 "cross SQ@B[b, c] m@A[c] 0  combine_only")
    without = _spec(tmp_path, "hla3", "+ x2@B[b] SK@A[a, b] + Y2@B[a, c] m@A[c]",
                    "+ Y2@B[a, c] m@A[c]")
    # without x2's term h2's combine is no longer associative: loading (which runs the
    # check pass) rejects both specs alike, at h2, instead of crashing on the zero
    for path in (zero, without):
        with pytest.raises(hladsl.AlgebraError, match="combine of 'h2' is not associative"):
            hladsl.load(path, normalize=True)
    assert "x2" not in {s.name for s in hladsl.compile_spec(zero).summaries
                        if s.delta.terms or s.crosses}


@pytest.mark.parametrize("zero", ["0.0k[i^p] v[e]", "0 k[i^p] v[e]", "k[i^p] (0 v[e])"])
def test_zero_token_delta_keeps_its_dims(tmp_path, zero):
    path = _spec(tmp_path, "power", "state U[i^p, e] = k[i^p] v[e]", f"state U[i^p, e] = {zero}")
    alg = hladsl.compile_spec(path)
    (u,) = [s for s in alg.summaries if s.name == "U"]
    assert u.dims == ("d", "d", "dv") and not u.delta.terms
    o, final = _run(hladsl.load(path))
    assert torch.count_nonzero(o) == 0 and torch.count_nonzero(final["U"]) == 0


@pytest.mark.parametrize("old, new", [
    ("output o[e] = q[i^p] U[i^p, e]", "output o[e] = q[i^p] 0 U[i^p, e]"),
    ("output o[e] = q[i^p] U[i^p, e]", "output o[e] = q[i^p] U[i^p, e] - q[i^p] U[i^p, e]"),
    ("output o[e] = q[i^p] U[i^p, e]", "output o[e] = q[i^p] (U[i^p, e] - U[i^p, e])"),
], ids=["zero factor", "cancelling terms", "cancelling group"])
def test_identically_zero_output_is_a_located_error(tmp_path, old, new):
    path = _spec(tmp_path, "power", old, new)
    with pytest.raises(SpecError, match="the output 'o' is identically zero") as info:
        hladsl.compile_spec(path)
    assert str(info.value).startswith(f"{path}:14:")


def test_identically_zero_normalizer_is_a_located_error(tmp_path):
    path = _spec(tmp_path, "linear", "normalizer = q[i] z[i]", "normalizer = 0 q[i] z[i]")
    hladsl.compile_spec(path)   # not used unless normalize = true
    with pytest.raises(SpecError, match="the normalizer is identically zero") as info:
        hladsl.compile_spec(path, normalize=True)
    assert re.match(rf"{re.escape(path)}:\d+:\d+: ", str(info.value))


@pytest.mark.parametrize("p", [5, 22])
def test_large_packs_are_errors_not_hangs(tmp_path, p):
    path = _spec(tmp_path, "power", "param p = 2", f"param p = {p}")
    with pytest.raises(SpecError, match="at most 4 indices") as info:
        hladsl.compile_spec(path)
    assert str(info.value).startswith(f"{path}:")
    with pytest.raises(SpecError, match="from 1 to 4"):
        hladsl.load("power", p=p)


def test_zero_cross_term_is_still_graded(tmp_path):
    # a written term is checked as written, zero or not: its decay weight must match
    path = _spec(tmp_path, "hla2", "cross S@B[i, j] C@A[j, e]",
                 "cross S@B[i, j] C@A[j, e] + 0 S@B[i, j] S@A[j, k] C@A[k, e]")
    with pytest.raises(hladsl.AlgebraError, match="decay weight 3") as info:
        hladsl.compile_spec(path)
    assert str(info.value).startswith(f"{path}:")


@pytest.mark.parametrize("name, old, new", [
    ("hla3", "state SK[a, b] = k[a] k[b]", "state SK[a, b] = q[a] k[b]"),
    ("hla3", "state Y1[a, c] = 0  cross SK@B[a, b] SQ@A[b, c]  combine_only",
     "state Y1[a, c] = 0  cross SK@B[a, b] SQ@A[b, c]  combine_only  symmetric(a, c)"),
], ids=["delta", "cross"])
def test_false_symmetry_declarations_are_located_errors(tmp_path, name, old, new):
    # the chunk program reads symmetric summaries packed: a false declaration gave
    # silently wrong outputs (fuzzer, seed 2: chunked and serial differed by 0.87)
    path = _spec(tmp_path, name, old, new)
    with pytest.raises(hladsl.AlgebraError, match="is declared symmetric in") as info:
        hladsl.compile_spec(path)
    assert re.match(rf"{re.escape(path)}:\d+:\d+: ", str(info.value))


@pytest.mark.parametrize("old, new", [
    ("- G3[a, e])", "- eye[a, e])"),                       # a over d becomes the output's e (dv)
    ("SQ[b, c] P[c, e] - G1", "SQ[b, c] P[c, f] eye[f, g] P[g, e] - G1"),   # dv and d
], ids=["output index", "inside a term"])
def test_eye_joins_indices_of_one_dim(tmp_path, old, new):
    # found by the fuzzer (normalized runs): the chunk program mixed d and dv tiles
    path = _spec(tmp_path, "hla3", old, new)
    from hladsl.emit import check_report
    for compile_ in (hladsl.compile_spec, check_report):   # the op, and `hladsl check`
        with pytest.raises(SpecError, match=r"eye\[") as info:
            compile_(path)
        assert re.match(rf"{re.escape(path)}:\d+:\d+: ", str(info.value))
