"""Mutational fuzzer for spec texts.

Each mutant is a shipped spec (hladsl/specs/*.hla) after one to three token-level
edits of the kind a new user's typos produce: a token deleted, duplicated, swapped
with its neighbour or replaced (by another token of the spec vocabulary, a number,
a keyword or punctuation), a bracket / comma / ``@A`` / ``^p`` dropped or inserted.
It runs through the whole pipeline: ``hladsl.compile_spec`` (parse, check, lower)
and, when that succeeds, ``hladsl.load`` plus one tiny gated float64 CPU forward
(B=1, T=3, H=1, dims of size 4, 3, ...), compared with the op's own serial
recurrence; every other mutant whose normalizer is off runs normalized.

A mutant must succeed or raise a SpecError whose every message starts with
``file:line:col:``. Anything else is a finding:

  crash      any other exception (KeyError, IndexError, RecursionError, lark ...)
  unlocated  a SpecError without a source position
  hang       more than HANG_CPU_S of CPU time (or HANG_WALL_S wall time) on one
             mutant (see Harness)
  mismatch   the chunked forward disagrees with the serial recurrence

    python tests/fuzz_specs.py --n 20000 --seed 1      # from the repository root
"""
from __future__ import annotations

import argparse
import difflib
import multiprocessing
import os
import random
import re
import resource
import sys
import tempfile
import time
import traceback
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
if str(REPO) not in sys.path:   # run as a script from anywhere
    sys.path.insert(0, str(REPO))

import torch  # noqa: E402

import hladsl  # noqa: E402
from hladsl.errors import SpecError  # noqa: E402
from hladsl.frontend.specs import SHIPPED_DIR, shipped_names  # noqa: E402

HANG_CPU_S = 5.0
HANG_WALL_S = 60.0
MEMORY_LIMIT = 3 << 30   # address space of the worker process
FORWARD_DIMS = (4, 3, 2, 5)   # sizes given to the spec's dims, in declaration order

# a token: a comment, a name, a number, or one other character (whitespace is kept
# with the token that follows it)
TOKEN = re.compile(r"(\s*)(#[^\n]*|[A-Za-z_][A-Za-z0-9_]*|\d+(?:\.\d*)?(?:[eE][-+]?\d+)?|\S)")
KEYWORDS = ["mechanism", "dims", "input", "param", "state", "output", "normalizer", "cross",
            "decay", "symmetric", "combine_only", "true", "false", "eye"]
NUMBERS = ["0", "0.0", "1", "2", "3", "-1", "0.5", "1e-6", "1e400", "10", "99", "00", "1.",
           "99999999999999999999"]
PUNCTUATION = ["[", "]", "(", ")", "{", "}", ",", "=", "@", "^", "+", "-", "*", "#", ".", ":",
               ";", "_", "'", "\n"]
INSERTS = ["[", "]", "(", ")", ",", "@A", "@B", "@C", "^p", "^2", "^0", "^", "@", "+", "-", "0",
           "eye[i, j]", "q[i]", "k[j]"]


def shipped_texts() -> dict[str, str]:
    return {name: (SHIPPED_DIR / f"{name}.hla").read_text() for name in shipped_names()}


def tokenize(text: str) -> list[tuple[str, str]]:
    """(leading whitespace, token) pairs; the trailing whitespace is a last pair."""
    out, end = [], 0
    for m in TOKEN.finditer(text):
        out.append((m.group(1), m.group(2)))
        end = m.end()
    out.append((text[end:], ""))
    return out


def detokenize(tokens: list[tuple[str, str]]) -> str:
    return "".join(ws + tok for ws, tok in tokens)


def vocabulary(texts) -> list[str]:
    return sorted({tok for text in texts for _, tok in tokenize(text) if tok and tok[0] != "#"})


@dataclass
class Mutator:
    rng: random.Random
    vocab: list[str]
    texts: dict[str, str]
    specs: list[str] = field(init=False)

    def __post_init__(self):
        self.specs = sorted(self.texts)
        self.names_vocab = [t for t in self.vocab if t[0].isalpha()]

    def replacement(self) -> str:
        pool = self.rng.choice([self.vocab, NUMBERS, KEYWORDS, PUNCTUATION])
        return self.rng.choice(pool)

    def mutate_once(self, tokens: list[tuple[str, str]]) -> list[tuple[str, str]]:
        rng = self.rng
        code = [n for n, (_, tok) in enumerate(tokens) if tok and tok[0] != "#"]
        if not code:
            return tokens
        n = rng.choice(code)
        ws, tok = tokens[n]
        kind = rng.choice(["delete", "duplicate", "swap", "replace", "insert", "drop_bracket",
                           "drop_line", "rename", "rename", "renumber"])
        tokens = list(tokens)
        if kind == "delete":
            tokens[n] = (ws, "")
        elif kind == "duplicate":
            tokens.insert(n + 1, (rng.choice(["", " "]), tok))
        elif kind == "swap":
            later = [m for m in code if m > n]
            if later:
                m = later[0] if rng.random() < 0.7 else rng.choice(later)
                tokens[n], tokens[m] = (ws, tokens[m][1]), (tokens[m][0], tok)
        elif kind == "replace":
            tokens[n] = (ws, self.replacement())
        elif kind == "rename":   # a name for another name (most often one of the same spec)
            names = [m for m in code if tokens[m][1][0].isalpha()] or [n]
            pool = [tokens[m][1] for m in names] if rng.random() < 0.7 else self.names_vocab
            m = rng.choice(names)
            tokens[m] = (tokens[m][0], rng.choice(pool))
        elif kind == "renumber":   # a number for a number, or a number before a factor
            numbers = [m for m in code if tokens[m][1][0].isdigit()]
            if numbers and rng.random() < 0.5:
                m = rng.choice(numbers)
                tokens[m] = (tokens[m][0], rng.choice(NUMBERS))
            else:
                factors = [m for m in code if tokens[m][1][0].isalpha()
                           and m + 1 < len(tokens) and tokens[m + 1][1] in ("[", "@")]
                m = rng.choice(factors or code)
                tokens.insert(m, (tokens[m][0], rng.choice(NUMBERS)))
                tokens[m + 1] = (" ", tokens[m + 1][1])
        elif kind == "insert":
            new = rng.choice(INSERTS) if rng.random() < 0.6 else self.replacement()
            tokens.insert(n + rng.randint(0, 1), (rng.choice(["", " "]), new))
        elif kind == "drop_bracket":
            brackets = [m for m in code if tokens[m][1] in ("[", "]", "(", ")", ",", "@", "^")]
            if brackets:
                m = rng.choice(brackets)
                tokens[m] = (tokens[m][0], "")
        else:   # drop_line: the whole line token n is on
            before, full = detokenize(tokens[:n]), detokenize(tokens)
            line_start = before.rfind("\n") + 1
            line_end = full.find("\n", line_start)
            return tokenize(full[:line_start] + (full[line_end + 1:] if line_end >= 0 else ""))
        return tokens

    def mutant(self) -> tuple[str, str]:
        """(shipped spec it came from, mutated text)."""
        name = self.rng.choice(self.specs)
        tokens = tokenize(self.texts[name])
        for _ in range(self.rng.choice([1, 1, 1, 1, 2, 2, 3])):
            tokens = self.mutate_once(tokens)
        return name, detokenize(tokens)


# ------------------------------------------------------------------ running one mutant

@dataclass
class Outcome:
    kind: str          # ok | spec_error | crash | unlocated | hang | mismatch
    detail: str = ""   # for findings: the exception class and message, or the error
    stage: str = ""    # compile | load | forward


def _located(err: SpecError, path: str) -> str | None:
    """None if every error is located (``path:line:col:``), else the first that is not."""
    for e in getattr(err, "errors", [err]):
        if e.pos is None or not str(e).startswith(f"{e.path}:{e.pos.line}:{e.pos.column}: "):
            return str(e).splitlines()[0]
        if e.path != path:
            return f"(wrong path {e.path!r}) {str(e).splitlines()[0]}"
    return None


def _tokens_for(alg, gen) -> dict[str, torch.Tensor]:
    sizes = {d: FORWARD_DIMS[n % len(FORWARD_DIMS)] for n, d in enumerate(alg.dims)}
    return {name: torch.randn(1, 3, 1, sizes[alg.inputs[name]] if name in alg.inputs else 4,
                              generator=gen, dtype=torch.float64) for name in ("q", "k", "v")}


def forward(op, seed: int) -> str | None:
    """One tiny gated forward; a description of the disagreement with the serial
    recurrence, or None. Normalized ops get positive tokens (denominators away
    from zero)."""
    gen = torch.Generator().manual_seed(seed)
    x = _tokens_for(op.algebra, gen)
    if op.algebra.normalizer is not None:
        x = {name: t.abs() for name, t in x.items()}
    g = -torch.rand(1, 3, 1, generator=gen, dtype=torch.float64)
    o, final = op(x["q"], x["k"], x["v"], g=g, output_final_state=True)
    o_serial, final_serial = op.serial(x["q"], x["k"], x["v"], g=g)
    pairs = [("o", o, o_serial)] + [(n, final[n], final_serial[n]) for n in final]
    for name, a, b in pairs:
        if not torch.allclose(a, b, rtol=1e-9, atol=1e-9, equal_nan=True):
            return f"{name}: chunked and serial differ by {(a - b).abs().max().item():.3g}"
    return None


def run_one(text: str, path: Path, *, run_forward: bool, seed: int = 0) -> Outcome:
    """The outcome of one mutant in this process (no time limit: see Harness)."""
    path.write_text(text)
    stage = "compile"
    try:
        alg = hladsl.compile_spec(str(path))
        # every other mutant with a normalizer switched off runs normalized
        params = {"normalize": True} if seed % 2 and alg.params.get("normalize") is False else {}
        if params:
            hladsl.compile_spec(str(path), **params)
        if not run_forward:
            return Outcome("ok")
        stage = "load"
        op = hladsl.load(str(path), **params)
        stage = "forward"
        problem = forward(op, seed)
        return Outcome("mismatch", problem, stage) if problem else Outcome("ok")
    except SpecError as exc:
        bad = _located(exc, str(path))
        return Outcome("unlocated", bad, stage) if bad else Outcome("spec_error")
    except RecursionError as exc:   # before Exception: it is one
        return Outcome("crash", f"RecursionError: {exc}", stage)
    except Exception as exc:
        frame = traceback.extract_tb(exc.__traceback__)[-1]
        where = f"{Path(frame.filename).name}:{frame.lineno} {frame.name}"
        return Outcome("crash", f"{type(exc).__name__}: {exc} [{where}]"[:500], stage)


def _worker(conn, workdir: str) -> None:
    """Runs mutants sent by the Harness until it sends None; memory-capped so a
    blow-up is a MemoryError (reported as a crash), not a dead machine."""
    resource.setrlimit(resource.RLIMIT_AS, (MEMORY_LIMIT, MEMORY_LIMIT))
    torch.set_num_threads(1)
    path = Path(workdir) / "mutant.hla"
    while True:
        job = conn.recv()
        if job is None:
            return
        k, text, run_forward = job
        conn.send(run_one(text, path, run_forward=run_forward, seed=k))


def _cpu_seconds(pid: int) -> float:
    """User + system CPU time of a process (Linux /proc)."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


class Harness:
    """Mutants run in a forked worker process watched from here: a mutant that
    spends more than HANG_CPU_S of CPU time (or HANG_WALL_S of wall time) is a
    hang, and the worker is replaced. CPU time, because the fuzzer runs niced on
    a shared machine where wall time says little; watched from outside, because
    a runaway computation inside C code (a huge itertools product, an einsum)
    never returns to the interpreter to take a signal."""

    def __init__(self, workdir: str):
        self.workdir = workdir
        self.proc = self.conn = None

    def _start(self) -> None:
        ctx = multiprocessing.get_context("fork")
        self.conn, child = ctx.Pipe()
        self.proc = ctx.Process(target=_worker, args=(child, self.workdir), daemon=True)
        self.proc.start()
        child.close()

    def _stop(self) -> None:
        if self.proc is not None and self.proc.is_alive():
            self.proc.kill()
        if self.proc is not None:
            self.proc.join()
        self.proc = None

    def run(self, k: int, text: str, run_forward: bool) -> Outcome:
        if self.proc is None:
            self._start()
        self.conn.send((k, text, run_forward))
        cpu0, wall0 = _cpu_seconds(self.proc.pid), time.monotonic()
        while not self.conn.poll(0.1):
            if not self.proc.is_alive():
                code = self.proc.exitcode
                self._stop()
                return Outcome("crash", f"the worker died (exit code {code})")
            cpu, wall = _cpu_seconds(self.proc.pid) - cpu0, time.monotonic() - wall0
            if cpu > HANG_CPU_S or wall > HANG_WALL_S:
                self._stop()
                return Outcome("hang", f"over {HANG_CPU_S:g} s CPU" if cpu > HANG_CPU_S
                               else f"over {HANG_WALL_S:g} s wall time")
        return self.conn.recv()

    def close(self) -> None:
        if self.proc is not None and self.proc.is_alive():
            self.conn.send(None)
            self.proc.join(5)
        self._stop()


def mutants(n: int, seed: int):
    """The first n mutants of a seed: (index, shipped spec it came from, text)."""
    rng = random.Random(seed)
    texts = shipped_texts()
    mutator = Mutator(rng, vocabulary(texts.values()), texts)
    for k in range(n):
        origin, text = mutator.mutant()
        yield k, origin, text


def fuzz(n: int, seed: int, forward_every: int = 1, progress: bool = False):
    """Counts by outcome, and the findings as (index, outcome, source spec, text)."""
    counts: Counter = Counter()
    findings: list[tuple[int, Outcome, str, str]] = []
    with tempfile.TemporaryDirectory(prefix="hladsl-fuzz-") as tmp:
        os.environ.setdefault("HLADSL_CACHE_DIR", os.path.join(tmp, "cache"))
        harness = Harness(tmp)
        start = time.time()
        try:
            for k, origin, text in mutants(n, seed):
                out = harness.run(k, text, k % forward_every == 0)
                counts[out.kind] += 1
                if out.kind not in ("ok", "spec_error"):
                    findings.append((k, out, origin, text))
                if progress and (k + 1) % 1000 == 0:
                    print(f"  {k + 1}/{n} {dict(counts)} {time.time() - start:.0f}s", flush=True)
        finally:
            harness.close()
    return counts, findings


def changes(origin: str, text: str) -> str:
    """The lines a mutant changed in its shipped spec, as a diff."""
    before = (SHIPPED_DIR / f"{origin}.hla").read_text().splitlines()
    diff = difflib.unified_diff(before, text.splitlines(), lineterm="", n=0)
    return "\n".join(line for line in diff if not line.startswith(("---", "+++")))


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--n", type=int, default=2000, help="number of mutants")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--forward-every", type=int, default=1,
                    help="run load + forward on every k-th mutant (1: all)")
    ap.add_argument("--show", type=int, default=5, help="findings of each class to print")
    args = ap.parse_args(argv)
    start = time.time()
    counts, findings = fuzz(args.n, args.seed, args.forward_every, progress=True)
    print(f"{args.n} mutants (seed {args.seed}) in {time.time() - start:.0f} s: "
          + ", ".join(f"{kind} {counts[kind]}" for kind in
                      ("ok", "spec_error", "crash", "unlocated", "hang", "mismatch")))
    classes: dict[str, list] = {}
    for k, out, origin, text in findings:
        key = f"{out.kind} [{out.stage}] " + re.sub(r"'[^']*'|\d+", "_", out.detail)[:90]
        classes.setdefault(key, []).append((k, out, origin, text))
    for key, items in sorted(classes.items(), key=lambda kv: -len(kv[1])):
        print(f"\n== {len(items)} x {key}")
        for k, out, origin, text in items[:args.show]:
            print(f"-- mutant {k}, from {origin}: {out.detail}")
            print(changes(origin, text))
    return 1 if findings else 0


if __name__ == "__main__":
    sys.exit(main())
