"""ir/scan.py: which state-pass terms read the chunk only through another state's chunk
delta. Checked by running the state pass with every such term replaced by the carried
states times that state's delta (all chunks' deltas computed first, from zero), float64,
against the torch state pass -- for every shipped spec, gated and not -- and the Triton
state pass that uses it (under the interpreter)."""
import os

os.environ["TRITON_INTERPRET"] = "1"   # before triton is imported anywhere

import pytest  # noqa: E402
import torch  # noqa: E402

import hladsl  # noqa: E402
from hladsl.api import compile_spec  # noqa: E402
from hladsl.codegen.torch_gen import torch_module  # noqa: E402
from hladsl.frontend.specs import shipped_names  # noqa: E402
from hladsl.ir.pipeline import chunk_program  # noqa: E402
from hladsl.ir.scan import scan_plan  # noqa: E402
from hladsl.ir.backward import GradTerm, Target  # noqa: E402
from hladsl.runtime import chunk_torch  # noqa: E402
from hladsl.runtime.backward_torch import GradEnv, evaluate  # noqa: E402

C, N_CHUNKS = 8, 4


def _inputs(program, seed=0):
    gen = torch.Generator().manual_seed(seed)
    sizes = dict(program.sizes)
    tokens = {x: 0.5 * torch.randn(1, 2, N_CHUNKS, C, sizes[d], generator=gen, dtype=torch.float64)
              for x, d in program.algebra.inputs.items()}
    lam = None
    if program.gated:
        lam = (-0.3 * torch.rand(1, 2, N_CHUNKS, C, generator=gen, dtype=torch.float64)).cumsum(-1)
    init = {s: 0.3 * torch.randn(1, 2, *program.state_shape(s), generator=gen, dtype=torch.float64)
            for s, _ in program.states}
    return tokens, lam, init


def _scan_state_pass(program, tokens, lam, init):
    """The state pass with every ``scan`` term evaluated as carried states x delta."""
    module = torch_module(program)
    roles = {(t.state, t.index): t for t in scan_plan(program).terms}
    terms_of = dict(program.states)
    every = chunk_torch.Env(tokens, lam, {}, program.chunk, torch.float64)
    deltas = {name: sum(fn(every) for fn, reads, _ in entries if not reads)
              for name, entries in module.STATES.items()}
    for aux in scan_plan(program).aux:   # chunk summaries no state holds: their token networks
        net = GradTerm(Target.CARRY, aux.name, None, aux.term, aux.term.output)
        deltas[aux.name] = evaluate(net, GradEnv(tokens, lam, {}, program.chunk, torch.float64))
    state = dict(init)
    for c in range(N_CHUNKS):
        env = chunk_torch.Env({k: v[:, :, c] for k, v in tokens.items()},
                              None if lam is None else lam[:, :, c], state, program.chunk, torch.float64)
        new = {}
        for name, entries in module.STATES.items():
            total = 0
            for k, (fn, reads, carry_weight) in enumerate(entries):
                role, term = roles[(name, k)], terms_of[name][k]
                if role.role == "scan":
                    carried = [o for o in term.operands if o.kind.value == "carry"]
                    letters = {}
                    for i in [i for o in carried for i in o.indices] + list(role.delta_indices):
                        letters.setdefault(i, chr(ord("a") + len(letters)))
                    spec = ",".join("yz" + "".join(letters[i] for i in o.indices) for o in carried)
                    spec += ",yz" + "".join(letters[i] for i in role.delta_indices)
                    spec += "->yz" + "".join(letters[i] for i in term.output)
                    value = term.coef * torch.einsum(spec, *[state[o.name] for o in carried],
                                                     deltas[role.delta][:, :, c])
                else:
                    value = fn(env)
                if reads and carry_weight and lam is not None:
                    end = lam[:, :, c, -1]
                    value = value * torch.exp(carry_weight * end).reshape(
                        end.shape + (1,) * (value.dim() - end.dim()))
                total = total + value
            new[name] = total
        state = new
    return state


@pytest.mark.parametrize("name", shipped_names())
@pytest.mark.parametrize("gated", [False, True], ids=["plain", "gated"])
def test_scan_terms_are_carried_states_times_a_delta(name, gated):
    alg = hladsl.compile_spec(name)
    program = chunk_program(alg, C, tuple(sorted((d, 4) for d in alg.dims)), gated)
    tokens, lam, init = _inputs(program)
    _, want = chunk_torch.state_pass(program, tokens, lam, init, torch.float64)
    got = _scan_state_pass(program, tokens, lam, init)
    for s in want:
        assert torch.allclose(got[s], want[s], rtol=1e-12, atol=1e-12), s


@pytest.mark.parametrize("name,params,complete,scans", [
    ("linear", {}, True, []), ("hla2", {}, True, [("G", "S")]),
    ("hla2", {"normalize": True}, True, [("G", "S"), ("h", "S")]),
    ("hla3", {}, False, [("G1", "SK"), ("G1", "aux_G1_3"), ("G2", "SQ"), ("G2", "aux_G2_2"),
                         ("G2", "aux_G2_3"), ("G3", "P"), ("G3", "aux_G3_3")]),
    ("ahla", {}, True, [("E", "aux_E_1")]),
    ("hla3_masked", {}, True, [("H", "aux_H_1"), ("H", "aux_H_2"), ("H", "aux_H_3")]),
    ("power", {"p": 2}, True, [])])
def test_scan_plan_of_the_shipped_specs(name, params, complete, scans):
    """HLA2's G (and h) read the chunk through S's delta: its sequential phase needs no
    tokens; AHLA's E and HLA3-masked's H read chunk summaries no state holds (their
    combine-only R, QQ, N, M), held per chunk; two of HLA3's terms through four-index
    combine-only states still walk the tokens (their summaries exceed the largest state)."""
    plan = scan_plan(compile_spec(name, **params).program)
    assert plan.complete is complete
    assert [(t.state, t.delta) for t in plan.terms if t.role == "scan"] == scans
    text = "\n".join(plan.describe())
    assert ("needs no tokens" in text) is complete


def test_emit_chunk_prints_the_scan_plan():
    from hladsl.emit import emit
    text = emit("hla2", "chunk", {}, None)
    assert "1855488 walking the tokens (today), 262144 as a scan over chunk deltas" in text
    assert "G term 1: carried states x delta of S" in text
    # a complete scan runs one stage; its two-stage split is the plain forward's alternative
    assert ("  or, for a forward with nothing to differentiate, where the scan's products reach "
            "runtime.launch.STAGED_SCAN_MACS a chunk and head (or schedule \"staged\"): staged chunk scan: S, C "
            "scanned first; then every chunk's increment of G at once (their terms read only C at the chunk "
            "start), then their carries scanned") in text
    assert "\nstaged chunk scan" not in text
    text = emit("hla3", "chunk", {}, None)
    assert ("staged chunk scan: SK, SQ, P scanned first; then every chunk's increment of G1, G2, G3 at once "
            "(their terms read only SK, SQ, P at the chunk start), then their carries scanned") in text
    text = emit("hla3", "chunk_bwd", {}, None)
    assert ("staged reverse scan: dG1, dG2, dG3 scanned first; then every chunk's increment of dSK, dSQ, dP "
            "at once (12 networks read only dG1, dG2, dG3 at the chunk end), then their carries scanned") in text
    assert "after a state pass in two stages" not in text   # (HLA3's scan has two stages only)
    text = emit("hla3_masked", "chunk_bwd", {}, None)   # one stage, and two after the complete scan's two
    assert "reverse scan: 5 d-state networks every chunk at once" in text
    assert ("after a state pass in two stages, staged reverse scan: dH scanned first; then every chunk's "
            "increment of dS, dP at once (4 networks read only dH at the chunk end), then their carries "
            "scanned") in text


@pytest.mark.parametrize("name,gated,dv,block", [("hla2", True, 8, None), ("hla2", False, 8, None),
                                                  ("hla3", True, 8, None), ("hla3", False, 32, 16),
                                                  ("hla2", True, 32, 16)])
def test_state_pass_reading_deltas_matches_the_torch_program(name, gated, dv, block, monkeypatch,
                                                             tmp_path):
    """codegen.triton_gen.STATE_PASS_READS_DELTAS (off by default until measured on the GPU):
    the generated state pass multiplies HLA2's C by S's delta tile (no second walk over
    the chunk's k), and its chunk-start states and outputs equal the torch program's, also
    over two value blocks (HLA3's G3 reads P's delta, which holds the split value dim)."""
    from hladsl.codegen import triton_gen
    from hladsl.runtime.triton_forward import forward_triton
    monkeypatch.setenv("HLADSL_CACHE_DIR", str(tmp_path))
    monkeypatch.setattr(triton_gen, "STATE_PASS_READS_DELTAS", True)
    monkeypatch.setattr(triton_gen, "_MODULES", {})
    alg = hladsl.compile_spec(name)
    program = chunk_program(alg, 16, (("d", 8), ("dv", dv)), gated)
    source = triton_gen.generate(program)
    assert "not its tokens again (ir.scan)" in source
    if name == "hla2":
        assert "_dot(tl.trans(st_C)" not in source.split("def state_pass_kernel(")[1].split("@triton.jit")[0]
    gen = torch.Generator().manual_seed(4)
    sizes = dict(program.sizes)
    tokens = {x: 0.5 * torch.randn(1, 2, 3, 16, sizes[d], generator=gen, dtype=torch.float64)
              for x, d in alg.inputs.items()}
    lam = (-0.3 * torch.rand(1, 2, 3, 16, generator=gen, dtype=torch.float64)).cumsum(-1) if gated else None
    init = {s: 0.3 * torch.randn(1, 2, *program.state_shape(s), generator=gen, dtype=torch.float64)
            for s, _ in program.states}
    starts, final = chunk_torch.state_pass(program, tokens, lam, init, torch.float64)
    want = chunk_torch.outputs(program, "output", tokens, lam, starts, torch.float64)
    o, got_final = forward_triton(program, {k: v.float() for k, v in tokens.items()},
                                  None if lam is None else lam.float(),
                                  {k: v.float() for k, v in init.items()}, alg.eps, schedule="two_pass",
                                  state_block=block)
    assert (o.double() - want).norm() / want.norm() < 1e-5
    for s in final:
        assert (got_final[s].double() - final[s]).norm() / final[s].norm() < 1e-5, s


@pytest.mark.parametrize("name,params,staged", [
    ("hla3", {}, (("SK", "SQ", "P"), ("G1", "G2", "G3"), ("SK", "SQ", "P"))),
    ("hla3", {"normalize": True}, (("SK", "SQ", "P", "m"), ("G1", "G2", "G3", "h1", "h2", "h3"),
                                   ("SK", "SQ", "P", "m"))),
    ("hla2", {}, None), ("ahla", {}, None), ("hla3_masked", {}, None), ("linear", {}, None),
    ("power", {"p": 2}, None)])
def test_staged_scan_of_the_shipped_specs(name, params, staged):
    """Where the one-stage scan walks (HLA3), the states split into lower ones (carry and
    token-only terms) and upper ones whose other terms read lower states only; everything
    else needs no second stage (or, power, has packed states)."""
    from hladsl.ir.scan import staged_scan
    got = staged_scan(compile_spec(name, **params).program)
    assert (None if got is None else (got.lower, got.upper, got.reads)) == staged


@pytest.mark.parametrize("params", [{}, {"normalize": True}], ids=["plain", "norm"])
@pytest.mark.parametrize("gated", [False, True], ids=["plain", "gated"])
def test_staged_scan_is_the_state_pass(params, gated):
    """The two-stage scan in float64 torch: the lower states scanned over their deltas; each
    chunk's increment of every upper state (its terms but the carry, evaluated at the lower
    states' chunk starts with the upper ones at zero); the upper states scanned over those --
    equal to the walking state pass (every chunk start and the final states)."""
    from hladsl.ir.scan import staged_scan
    alg = hladsl.compile_spec("hla3", **params)
    program = chunk_program(alg, C, tuple(sorted((d, 4) for d in alg.dims)), gated)
    staged = staged_scan(program)
    tokens, lam, init = _inputs(program, seed=2)
    want_starts, want_final = chunk_torch.state_pass(program, tokens, lam, init, torch.float64)
    module = torch_module(program)

    def chunk_env(c, state):
        return chunk_torch.Env({k: v[:, :, c] for k, v in tokens.items()},
                               None if lam is None else lam[:, :, c], state, program.chunk, torch.float64)

    def decayed(value, weight, c):
        if not weight or lam is None:
            return value
        end = lam[:, :, c, -1]
        return value * torch.exp(weight * end).reshape(end.shape + (1,) * (value.dim() - end.dim()))

    def step(names, state, c, carry=True, rest=True):
        env, new = chunk_env(c, state), {}
        for name in names:
            total = 0
            for k, (fn, reads, weight) in enumerate(module.STATES[name]):
                own = roles[(name, k)] == "carry"
                if (own and carry) or (not own and rest):
                    total = total + decayed(fn(env), weight if reads else 0, c)
            new[name] = total
        return new

    roles = {(t.state, t.index): t.role for t in scan_plan(program).terms}
    lower, starts = dict((n, init[n]) for n in staged.lower), {}
    for c in range(N_CHUNKS):
        for n in staged.lower:
            starts.setdefault(n, []).append(lower[n])
        lower = step(staged.lower, lower, c)
    zero = {n: torch.zeros_like(init[n]) for n in staged.upper}
    increments = [step(staged.upper, {**{n: starts[n][c] for n in staged.lower}, **zero}, c, carry=False)
                  for c in range(N_CHUNKS)]
    upper = {n: init[n] for n in staged.upper}
    for c in range(N_CHUNKS):
        for n in staged.upper:
            starts.setdefault(n, []).append(upper[n])
        carried = step(staged.upper, upper, c, rest=False)
        upper = {n: carried[n] + increments[c][n] for n in staged.upper}
    final = {**lower, **upper}
    for s in want_final:
        assert torch.allclose(final[s], want_final[s], rtol=1e-12, atol=1e-12), s
        if s in want_starts:
            assert torch.allclose(torch.stack(starts[s], 2), want_starts[s], rtol=1e-12, atol=1e-12), s


@pytest.mark.parametrize("name,params,split", [
    ("hla3", {}, (("G1", "G2", "G3"), ("SK", "SQ", "P"))),
    ("hla3", {"normalize": True}, (("G1", "G2", "G3", "h1", "h2", "h3"), ("SK", "SQ", "P", "m"))),
    ("hla2", {}, (("S", "G"), ("C",))), ("ahla", {}, (("E",), ("P",))),
    ("hla3_masked", {}, (("H",), ("S", "P"))), ("hla3_masked", {"normalize": True}, (("H", "z"), ("S", "P", "m"))),
    ("linear", {}, None), ("power", {"p": 2}, None)])
def test_staged_reverse_of_the_shipped_specs(name, params, split):
    """The reverse pass's two stages transpose the forward's (HLA3's own, the others' complete
    scan split in two): the forward's upper states' d-states only decay and collect parallel
    networks (lower in reverse), and the d-states of the lower states they read take the cross
    networks (upper in reverse: the forward's ``reads``). Where nothing crosses (linear) or a
    state is packed (power): none."""
    from hladsl.ir.backward import backward_program
    from hladsl.ir.scan import staged_reverse, staged_scan
    program = compile_spec(name, **params).program
    got = staged_reverse(backward_program(program))
    assert (None if got is None else (got.lower, got.upper)) == split
    if got is not None:
        forward = staged_scan(program) or staged_scan(program, complete=True)
        # the transpose: the reverse's upper d-states are the forward's reads, and what they
        # read the forward's upper states (HLA2's lower dS reads nothing across)
        assert got.upper == forward.reads and got.reads == forward.upper and set(got.reads) <= set(got.lower)
        assert all(g.cotangent.name[len("end_"):] in got.lower for g in got.cross)
        # the kernels' networks (codegen.triton_bwd._reverse_scan): the first stage's part, each
        # upper d-state's increment (d W0 from d num before the networks reading it), the scans
        from hladsl.ir.backward import Target
        first = got.networks(got.lower)
        parts = [got.networks([n]) for n in got.upper]
        targets = [g for p in [first] + parts for g in p if g.target is Target.CARRY]
        assert sorted(map(id, targets)) == sorted(map(id, [g for g in got.parallel + got.cross
                                                           if g.target is Target.CARRY]))
        for p in [first] + parts:
            derived = [g for g in p if g.target is Target.DERIVED]
            assert p[:len(derived)] == tuple(derived) and (bool(derived) == any(
                g.cotangent.name.startswith("dr_") for g in p))
        assert got.carries(got.lower) + got.carries(got.upper) == tuple(
            g for n in got.lower + got.upper for g in got.carry if g.name == n)


@pytest.mark.parametrize("name,params", [("hla3", {}), ("hla3", {"normalize": True}), ("hla3_masked", {}),
                                         ("hla3_masked", {"normalize": True}), ("ahla", {}), ("hla2", {})],
                         ids=["hla3", "hla3-norm", "hla3_masked", "hla3_masked-norm", "ahla", "hla2"])
@pytest.mark.parametrize("gated", [False, True], ids=["plain", "gated"])
def test_staged_reverse_is_the_reverse_pass(name, params, gated):
    """The two-stage reverse pass in float64 torch: the lower d-states scanned over their
    parallel networks, storing every chunk end; each chunk's increment of every upper d-state
    (its parallel and cross networks, reading the stored lower ends, the upper ends NaN);
    the upper d-states scanned over those -- the initial-state gradients of
    ``backward_torch`` (which walks every d-state together), and every chunk's ends of the walk."""
    from hladsl.ir.backward import backward_program, cotangent_name
    from hladsl.ir.scan import staged_reverse
    from hladsl.runtime.backward_torch import _output_cotangents, backward_torch
    alg = hladsl.compile_spec(name, **params)
    program = chunk_program(alg, C, tuple(sorted((d, 4) for d in alg.dims)), gated)
    bwd = backward_program(program)
    staged = staged_reverse(bwd)
    tokens, lam, init = _inputs(program, seed=3)
    if params:   # a positive normaliser
        tokens = {k: v.abs() + 0.1 for k, v in tokens.items()}
        init = {k: v.abs() for k, v in init.items()}
    gen = torch.Generator().manual_seed(4)
    names = [n for n, _ in program.states]
    d_final = {s: torch.randn(1, 2, *program.state_shape(s), generator=gen, dtype=torch.float64) for s in names}
    grad_o = torch.randn(1, 2, N_CHUNKS, C, 4, generator=gen, dtype=torch.float64)
    _, _, want_d_init = backward_torch(program, tokens, lam, init, grad_o, d_final, alg.eps)
    starts, _ = chunk_torch.state_pass(program, tokens, lam, init, torch.float64)
    output_cts = _output_cotangents(program, tokens, lam, starts, grad_o, alg.eps, torch.float64)

    def chunk_env(c, ends):
        return GradEnv({k: v[:, :, c] for k, v in tokens.items()}, None if lam is None else lam[:, :, c],
                       {k: v[:, :, c] for k, v in starts.items()}, C, torch.float64,
                       cotangents={**{k: v[:, :, c] for k, v in output_cts.items()},
                                   **{cotangent_name("end", n): x for n, x in ends.items()}})

    def networks(nets, c, ends):
        """{d-state: sum of ``nets`` into it} at chunk c (derived carries' cotangents first)."""
        env, out = chunk_env(c, ends), {}
        for g in nets:
            if g.target is Target.DERIVED:
                key = cotangent_name("derived", g.name)
                env.cotangents[key] = env.cotangents.get(key, 0) + evaluate(g, env)
        for g in nets:
            if g.target is Target.CARRY:
                out[g.name] = out.get(g.name, 0) + evaluate(g, env)
        return out

    def scan(group, increments):
        d_end, ends = {n: d_final[n] for n in group}, {n: [None] * N_CHUNKS for n in group}
        for c in reversed(range(N_CHUNKS)):
            for n in group:
                ends[n][c] = d_end[n]
            decayed = networks([g for g in staged.carry if g.name in group], c, d_end)
            d_end = {n: decayed[n] + increments[c].get(n, 0) for n in group}
        return d_end, ends

    lower_parallel = [g for g in staged.parallel if g.target is Target.DERIVED or g.name in staged.lower]
    d_lower, lower_ends = scan(staged.lower, [networks(lower_parallel, c, {}) for c in range(N_CHUNKS)])
    nan = {n: torch.full_like(d_final[n], float("nan")) for n in staged.upper}
    upper_nets = list(staged.parallel) + list(staged.cross)
    increments = [{n: x for n, x in networks(upper_nets, c, {**{n: lower_ends[n][c] for n in staged.lower},
                                                                **nan}).items() if n in staged.upper}
                  for c in range(N_CHUNKS)]
    d_upper, upper_ends = scan(staged.upper, increments)
    d_init, ends = {**d_lower, **d_upper}, {**lower_ends, **upper_ends}
    for n in names:
        assert torch.allclose(d_init[n], want_d_init[n], rtol=1e-12, atol=1e-12), n
    walk = dict(d_final)   # every d-state walked together, as backward_torch does
    for c in reversed(range(N_CHUNKS)):
        for n in names:
            assert torch.allclose(ends[n][c], walk[n], rtol=1e-12, atol=1e-12), (n, c)
        every = networks([g for g in bwd.all_terms() if g.target in (Target.CARRY, Target.DERIVED)], c, walk)
        walk = {n: every.get(n, torch.zeros_like(walk[n])) for n in names}
