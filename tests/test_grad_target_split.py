"""The gradient kernels' split by target group (launch.grad_target_sets) and of a
target's networks into parts (launch.grad_parts; each part computes the products its
networks read, once: triton_bwd._parted_code): every grouping -- the default, two targets
and one network a program, runs of three, everything in one program -- gives the same
gradients under the Triton interpreter (float32), matching the float64 torch backward."""
import os
import re

os.environ["TRITON_INTERPRET"] = "1"   # before triton is imported anywhere

import pytest
import torch

import hladsl
from hladsl.ir.pipeline import chunk_program
from hladsl.runtime.backward_torch import backward_torch
from hladsl.runtime.launch import grad_target_sets

from tests.test_triton_backward import C, PROBE, _inputs, _rel


def test_grad_target_sets_partition_the_groups():
    for groups in range(1, 7):
        for per in range(1, 8):
            masks = grad_target_sets(groups, per)
            assert sum(masks) == (1 << groups) - 1                  # every group once
            assert all(a & b == 0 for i, a in enumerate(masks) for b in masks[i + 1:])
            assert all(bin(m).count("1") <= per for m in masks)
    assert grad_target_sets(4) == [1, 2, 4, 8]
    with pytest.raises(ValueError, match="targets_per_program"):
        grad_target_sets(3, 0)


def test_grad_loop_tile_narrows_to_the_element_budget():
    from hladsl.runtime.launch import grad_loop_tile
    assert grad_loop_tile(64, 64) == 64 and grad_loop_tile(128, 64) == 32 and grad_loop_tile(256, 64) == 16
    assert grad_loop_tile(64, 16) == 16 and grad_loop_tile(512, 64) == 16   # never below tl.dot's 16


CASES = [("linear", {}, True, "fused"), ("hla2", {}, True, "two_pass"), ("hla2", {}, True, "fused"),
         ("power", {"p": 2}, True, "two_pass"), ("probe", {}, True, "two_pass")]


@pytest.fixture(autouse=True)
def _cache_dir(tmp_path_factory, monkeypatch):
    monkeypatch.setenv("HLADSL_CACHE_DIR", str(tmp_path_factory.getbasetemp() / "hladsl-cache"))


@pytest.mark.parametrize("name,params,gated,schedule", CASES, ids=[c[0] + "-" + c[3] for c in CASES])
def test_every_target_grouping_gives_the_same_gradients(name, params, gated, schedule, tmp_path,
                                                         monkeypatch):
    from hladsl.runtime import launch
    from hladsl.runtime.triton_backward import backward_triton
    # at the test's C = 16 the packed loop tile would stay 64: narrow it to 16 here so
    # that the loop runs over many narrow tiles (as at C = 256 on a GPU)
    monkeypatch.setattr(launch, "GRAD_LOOP_TILE_ELEMENTS", 256)
    if name == "probe":
        (tmp_path / "backward_probe.hla").write_text(PROBE)
        name = str(tmp_path / "backward_probe.hla")
    alg = hladsl.compile_spec(name, **params)
    program = chunk_program(alg, C, (("d", 16 if params else 8), ("dv", 8)), gated)
    tiles, lam, init, grad_o, grad_final = _inputs(program, False, seed=7)
    ref_tiles, ref_lam, ref_init = backward_torch(program, tiles, lam, init, grad_o, grad_final, alg.eps)

    def f32(d):
        return {k: v.float() for k, v in d.items()}
    results = []
    # one network a program .. runs of three (parts sharing some products, not others) .. all in one
    for per, networks in ((None, None), (2, 1), (1, 3), (64, 1000)):
        if networks:   # every group in parts of ``networks``
            monkeypatch.setattr(launch, "GRAD_WHOLE_MAX_MATMULS", -1)
            monkeypatch.setattr(launch, "GRAD_LONG_RUN", 0)
            monkeypatch.setattr(launch, "GRAD_NETWORKS_PER_PROGRAM", networks)
        results.append(backward_triton(program, f32(tiles), lam.float(), f32(init), grad_o.float(),
                                       f32(grad_final), alg.eps, schedule=schedule, targets_per_program=per))
    d_tiles, d_lam, d_init = results[0]
    for x in tiles:
        assert _rel(d_tiles[x], ref_tiles[x]) <= 1e-4, x
    for s in init:
        assert _rel(d_init[s], ref_init[s]) <= 1e-4, s
    assert _rel(d_lam, ref_lam) <= 1e-4
    # the same networks, summed in another order (the parts of a launch follow its
    # largest group): equal up to float32 rounding
    for other_tiles, other_lam, other_init in results[1:]:
        assert all(_rel(other_tiles[x], d_tiles[x].double()) <= 1e-6 for x in tiles)
        assert _rel(other_lam, d_lam.double()) <= 1e-6
        assert all(torch.equal(other_init[s], d_init[s]) for s in init)


def _executed(code: str, part: int, parts: int) -> list[str]:
    """The lines of a gradient group's code that part ``part`` of ``parts`` runs (its
    constexpr tests evaluated as Triton folds them)."""
    run, taken = [], True
    for line in code.splitlines():
        if not line.strip():
            continue
        if line.startswith("if ") and line.rstrip().split("  #")[0].endswith(":"):
            taken = bool(eval(line[3:].split("  #")[0].rstrip()[:-1], {"PARTS": parts, "PART": part}))
        elif line.startswith("    "):
            if taken:
                run.append(line[4:])
        else:
            taken = True
            run.append(line)
    return [x for x in run if x.strip() and not x.lstrip().startswith("#")]


@pytest.mark.parametrize("name,params", [("hla2", {}), ("hla3", {}), ("hla3_masked", {"normalize": True}),
                                         ("ahla", {}), ("linear", {})])
def test_each_part_defines_what_it_reads_and_adds_its_networks_once(name, params):
    """For every PARTS a program may be launched with, each part's code defines every temp
    and loads every state tile it loads itself before reading it (a product shared with a
    network of another part is computed again there), adds each of the group's networks in
    exactly one part, and the parts together
    compute no more products than the networks each on its own would."""
    from hladsl.codegen.triton_bwd import backward_context
    program = chunk_program(hladsl.compile_spec(name, **params), 64, (("d", 64), ("dv", 64)), True)
    ctx = backward_context(program)
    # state tiles the kernel loads where a part first reads them (triton_bwd._lazy_loads)
    lazy = {f"st_{s['name']}" for s in ctx["grad_reads"] if s["lazy"]} | \
        {f"ct_end_{s['name']}" for s in ctx["grad_cts"] if s["lazy"]}
    assert lazy
    for g in ctx["grad_groups"]:
        code = g["code"]["pre"]
        assert not g["code"]["loop"]
        alone = 0
        # (PARTS past the group's networks: a launch's PARTS follows its largest group)
        for parts in range(1, g["networks"] + 3):
            adds, dots = [], 0
            for part in range(parts):
                defined = {v for v in lazy if re.search(rf"\b{v} = ", g["derived"])}
                for line in _executed(code, part, parts):
                    target, _, value = line.partition(" = ")
                    for t in re.findall(r"\b(?:t\d+|st_\w+|ct_end_\w+)\b", value if value else line):
                        assert t in defined or not (t.startswith("t") or t in lazy), (g["input"], parts, part, line)
                    if re.fullmatch(r"t\d+|st_\w+|ct_end_\w+", target):
                        defined.add(target)
                    adds += [line] if re.match(r"(dx_\w+|dlam|dlam_end) [+-]= ", line) else []
                    dots += line.count("_dot(")
            every = [x for x in _executed(code, 0, 1) if re.match(r"(dx_\w+|dlam|dlam_end) [+-]= ", x)]
            assert sorted(adds) == sorted(every)
            assert len(adds) >= g["networks"]
            if parts == 1:
                assert dots == g["matmuls"]
            alone = dots if parts == g["networks"] else alone
        assert g["matmuls"] <= alone


def test_part_test_is_membership():
    """triton_bwd._part_test(nets, count) evaluated (as Triton folds it) is true for every
    part holding a network of ``nets`` and, while PARTS <= count, for no other part; past
    count, true only for parts holding no network at all besides those (wasted work there,
    no network added twice)."""
    import itertools
    from hladsl.codegen.triton_bwd import _part_test
    for count in range(1, 8):
        for size in range(1, count + 1):
            for nets in itertools.combinations(range(count), size):
                test = _part_test(nets, count)
                for parts in range(1, count + 4):
                    for part in range(parts):
                        want = any(n * parts // count == part for n in nets)
                        got = bool(eval(test, {"PARTS": parts, "PART": part}))
                        empty = not any(n * parts // count == part for n in range(count))
                        assert got == want or (parts > count and got and empty), (nets, count, parts, part)


@pytest.mark.parametrize("name,gated,candidates", [
    ("linear", True, [(1,), (1,), (1,), (1,)]),
    ("hla2", True, [(1, 2), (1, 2), (1,), (1,)]),   # runs of 8 of 7, 8 networks: the whole group
    ("hla3_masked", True, [(1, 3, 6), (1, 2, 4), (1, 2), (1,)]),   # dΛ rides with dq, dk: 3 networks
                                                  # of its own, no matmuls (before round 36 52 matmuls of 32 networks)
    ("hla3", True, [(9,), (11,), (1, 2, 4), (1, 2)]),
    ("hla3", False, [(9,), (11,), (1, 2, 4)]),   # dq, dk past GRAD_WHOLE_MAX_MATMULS: runs of 4, untried
])
def test_groups_may_run_whole_up_to_the_matmul_limit_then_in_runs_of_8_then_of_4(name, gated, candidates):
    """The part counts a backward plan offers each gradient launch (launch.grad_parts), fewest
    first: up to GRAD_WHOLE_MAX_MATMULS whole, then runs of GRAD_LONG_RUN, then of
    GRAD_NETWORKS_PER_PROGRAM networks (a count met twice offered once); past it the last alone."""
    from hladsl.codegen.triton_bwd import backward_kernels
    from hladsl.runtime.triton_backward import _BackwardPlan
    program = chunk_program(hladsl.compile_spec(name), 64, (("d", 64), ("dv", 64)), gated)
    _, ctx = backward_kernels(program)
    first = torch.zeros(2, 16, 4, 64, 64, dtype=torch.bfloat16)
    plan = _BackwardPlan(program, ctx, first, None, 4, None, "two_pass", None, None)
    assert [c for _, _, c in plan.grad_launches] == candidates
    assert [t for t, _, _ in plan.grad_launches] == [1 << n for n in range(len(candidates))]
    for _, held, offered in plan.grad_launches:
        units = max(g["networks"] for g in held)
        small = sum(g["matmuls"] for g in held) <= 48
        assert offered[-1] == -(-units // 4) and (offered[0] == 1) == small and (len(offered) == 1 or small)


def test_the_launcher_takes_the_fewest_parts_whose_kernels_do_not_spill(monkeypatch):
    """``launch.grad_fitting_parts``: each candidate's parts are compiled in order up to the
    first that spills (``grad_spills``), each as it would launch (its arguments in that many
    parts, PART, PARTS, and LAM: part 0's ``lam_first``, later parts add where it is not 0);
    the last candidate runs untried; the choice is remembered per launch variant; nothing is
    known (the first candidate) where no variant key exists (the interpreter)."""
    from hladsl.runtime import launch
    tried = []
    monkeypatch.setattr(launch, "compiled_variant_key", lambda kernel, args: ("variant", args["x"], args["LAM"]))

    def take(spilling, lam_first=1):
        tried.clear()
        monkeypatch.setattr(launch, "_GRAD_PARTS", {})
        monkeypatch.setattr(launch, "grad_spills", lambda kernel, grid, args: tried.append(
            (args["PARTS"], args["PART"], args["LAM"], args["x"])) or (args["PARTS"], args["PART"]) in spilling)
        return launch.grad_fitting_parts(None, (1,), lambda parts: {"x": 7 * parts}, (1, 3, 6), lam_first)
    assert take(set()) == 1 and tried == [(1, 0, 1, 7)]
    assert take({(1, 0)}) == 3 and tried == [(1, 0, 1, 7), (3, 0, 1, 21), (3, 1, 2, 21), (3, 2, 2, 21)]
    assert take({(1, 0), (3, 1)}) == 6 and tried == [(1, 0, 1, 7), (3, 0, 1, 21), (3, 1, 2, 21)]
    assert take({(1, 0)}, lam_first=0) == 3 and [t[2] for t in tried] == [0, 0, 0, 0]
    assert take({(1, 0)}, lam_first=2) == 3 and [t[2] for t in tried] == [2, 2, 2, 2]
    tried.clear()   # remembered: a second call tries nothing
    assert launch.grad_fitting_parts(None, (1,), lambda parts: {"x": 7 * parts}, (1, 3, 6), 2) == 3 and not tried
    # ... per launch variant: part 0's LAM is in it (here nothing spills for lam_first 1)
    monkeypatch.setattr(launch, "grad_spills", lambda kernel, grid, args: tried.append(args["LAM"]) and False)
    assert launch.grad_fitting_parts(None, (1,), lambda parts: {"x": 7 * parts}, (1, 3, 6), 1) == 1 and tried == [1]
    tried.clear()
    assert launch.grad_fitting_parts(None, (1,), dict, (4,), 0) == 4 and not tried   # one candidate: no trial
    monkeypatch.setattr(launch, "compiled_variant_key", lambda kernel, args: None)
    assert launch.grad_fitting_parts(None, (1,), lambda parts: {"x": 1}, (1, 3, 6), 1) == 1 and not tried


def _variant(kernel, args) -> tuple:
    """A stand-in for direct.variant_key on CPU: the constexprs and options, and each tensor's dtype."""
    from hladsl.runtime import launch
    return launch._fallback_key(kernel, args), tuple(sorted(
        (k, v.dtype) for k, v in args.items() if isinstance(v, torch.Tensor)))


def _gated_hla2(seed: int):
    """A small gated hla2 program and its float32 inputs (the launcher tests' case)."""
    program = chunk_program(hladsl.compile_spec("hla2"), C, (("d", 8), ("dv", 8)), True)
    tiles, lam, init, grad_o, grad_final = _inputs(program, False, seed=seed)
    tiles, init, grad_final = ({k: v.float() for k, v in d.items()} for d in (tiles, init, grad_final))
    return program, tiles, lam, init, grad_o, grad_final


def test_a_group_whose_whole_kernel_would_spill_runs_in_runs_from_the_first_call(monkeypatch):
    """A group under the matmul limit runs whole unless its whole kernel, compiled before its
    first launch, keeps more than GRAD_WHOLE_MAX_SPILL bytes in local memory
    (``launch.grad_spills``; here the compiler is told to report ``spilled`` bytes --
    sm_90 reported 2 KB for hla2's gated dΛ group): then every call, the first too, runs it in runs,
    with the same gradients as whole up to float32 rounding. The trial compile gets the whole
    launch's own arguments, once per variant."""
    from hladsl.runtime import launch
    from hladsl.runtime.triton_backward import backward_triton
    program, tiles, lam, init, grad_o, grad_final = _gated_hla2(seed=3)
    launched, trials = [], []
    real = launch.launch

    def recording(kernel, grid, args, may, tiling=None):
        if kernel.fn.__name__ == "grad_kernel":
            launched.append((kernel, args))
        return real(kernel, grid, args, may, tiling)
    monkeypatch.setattr(launch, "launch", recording)
    monkeypatch.setattr(launch, "compiled_variant_key", _variant)
    results, seen = [], []
    for n, spilled in enumerate((0, 2048, 2048)):   # no spill; spills, then the same again (remembered)
        if n < 2:
            monkeypatch.setattr(launch, "_SPILLS", {})
            monkeypatch.setattr(launch, "_GRAD_PARTS", {})
        monkeypatch.setattr(launch, "local_bytes",
                            lambda kernel, grid, args, b=spilled: trials.append(_variant(kernel, args)) or b)
        launched.clear()
        before = len(trials)
        results.append(backward_triton(program, tiles, lam.float(), init, grad_o.float(), grad_final, 1e-6))
        seen.append(([a["PARTS"] for _, a in launched if a["PART"] == 0], len(trials) - before,
                     [_variant(k, a) for k, a in launched]))
    (whole, tried_first, whole_variants), (parted, tried_second, _), (again, tried_third, _) = seen
    # groups of 7, 8, 4, 3 network units (dΛ's riders join dq's and dk's): dq, dk would run
    # in runs of 4; dv and dΛ are one run anyway
    assert whole == [1, 1, 1, 1] and tried_first == 2    # each whole variant tried once ...
    assert trials[:2] == [whole_variants[i] for i in (0, 1)]   # ... with the arguments it runs with
    assert parted == again == [2, 2, 1, 1]
    assert tried_second == 2 and tried_third == 0        # remembered per variant
    (a_tiles, a_lam, a_init) = results[0]
    for b_tiles, b_lam, b_init in results[1:]:
        assert all(_rel(b_tiles[x], a_tiles[x].double()) <= 1e-6 for x in tiles)
        assert _rel(b_lam, a_lam.double()) <= 1e-6
        assert all(torch.equal(a_init[s], b_init[s]) for s in init)


def test_a_dry_run_remembers_no_choice(monkeypatch):
    """``progress.counted``'s dry run knows no verdict it has not compiled (``grad_spills``:
    False), so its choice (whole) is not remembered: the real first call then tries the
    candidates and runs in parts where the whole kernel spills."""
    from hladsl.runtime import launch, progress
    monkeypatch.setattr(launch, "_GRAD_PARTS", {})
    monkeypatch.setattr(launch, "_SPILLS", {})
    monkeypatch.setattr(launch, "compiled_variant_key", lambda kernel, args: (args["PARTS"], args["PART"]))
    monkeypatch.setattr(launch, "local_bytes", lambda kernel, grid, args: 2048 if args["PARTS"] == 1 else 0)
    token = progress._dry.set([])
    try:
        assert launch.grad_fitting_parts(None, (1,), lambda parts: {}, (1, 2, 4), 1) == 1
    finally:
        progress._dry.reset(token)
    assert launch._GRAD_PARTS == {} and launch._SPILLS == {}
    assert launch.grad_fitting_parts(None, (1,), lambda parts: {}, (1, 2, 4), 1) == 2
    assert list(launch._GRAD_PARTS.values()) == [2]


def test_a_candidate_in_parts_is_tried_as_the_variants_it_launches(monkeypatch):
    """bf16 gradients: a launch in parts sums them in fp32 buffers (``dsum_``), whole it has
    none -- so a candidate in parts is compiled for its trial with those buffers, the variant
    it then launches (a trial without them compiled a variant never launched, and the launch
    compiled again). Runs of 4 and 2 here (hla2's dq, dk: 7 and 8 units -> candidates 1, 2, 4),
    whole kernels spilling."""
    from hladsl.runtime import launch
    from hladsl.runtime.triton_backward import backward_triton
    program, tiles, lam, init, grad_o, grad_final = _gated_hla2(seed=5)
    launched, trials = [], []
    real = launch.launch

    def recording(kernel, grid, args, may, tiling=None):
        if kernel.fn.__name__ == "grad_kernel":
            launched.append((args["TARGETS"], args["PARTS"], _variant(kernel, args)))
        return real(kernel, grid, args, may, tiling)
    monkeypatch.setattr(launch, "launch", recording)
    monkeypatch.setattr(launch, "compiled_variant_key", _variant)
    monkeypatch.setattr(launch, "_SPILLS", {})
    monkeypatch.setattr(launch, "_GRAD_PARTS", {})
    monkeypatch.setattr(launch, "GRAD_LONG_RUN", 4)
    monkeypatch.setattr(launch, "GRAD_NETWORKS_PER_PROGRAM", 2)
    monkeypatch.setattr(launch, "local_bytes", lambda kernel, grid, args: trials.append(_variant(kernel, args))
                        or (2048 if args["PARTS"] == 1 else 0))
    backward_triton(program, tiles, lam.float(), init, grad_o.float(), grad_final, 1e-6,
                    grad_dtype=torch.bfloat16)
    tried = [v for targets, parts, v in launched if targets in (1, 2)]
    assert [parts for targets, parts, _ in launched if targets in (1, 2)] == [2, 2, 2, 2]
    assert all(v in trials for v in tried) and len(trials) == 2 * 3 + 2   # dq, dk: whole + 2 parts; dv, dΛ whole
    assert any(t == torch.float32 for _, _, v in launched for name, t in v[1] if name.startswith("dsum_"))


def test_spill_verdicts_in_a_dry_run_compile_nothing(monkeypatch):
    """``progress.counted``'s dry run counts a first call's compiles: ``grad_spills``
    answers from what it knows and compiles nothing; under the interpreter it knows nothing
    (False, nothing stored)."""
    from hladsl.runtime import launch, progress

    def no_compile(*args):
        raise AssertionError("compiled in a dry run")
    monkeypatch.setattr(launch, "_SPILLS", {("known",): 4096})
    monkeypatch.setattr(launch, "local_bytes", no_compile)
    token = progress._dry.set([])
    try:
        monkeypatch.setattr(launch, "compiled_variant_key", lambda kernel, args: ("known",))
        assert launch.grad_spills(None, (1,), {})
        monkeypatch.setattr(launch, "compiled_variant_key", lambda kernel, args: ("new",))
        assert not launch.grad_spills(None, (1,), {})
    finally:
        progress._dry.reset(token)
    monkeypatch.undo()
    monkeypatch.setattr(launch, "_SPILLS", {})
    monkeypatch.setattr(launch, "local_bytes", no_compile)

    def interpreted():   # a stand-in kernel: not a GPU JITFunction
        pass
    assert not launch.grad_spills(interpreted, (1,), {}) and launch._SPILLS == {}


@pytest.mark.parametrize("name,carried", [("hla2", False), ("hla3", False), ("hla3", True), ("hla3_masked", False)])
def test_a_dlam_network_shares_the_unit_of_the_gradient_network_it_extends(name, carried):
    """A dΛ network riding with an input's gradient (``ir.backward._rider``) is that gradient's
    network plus a row dot: it sits in that input's group, in the same part-split unit as that
    network (``triton_bwd._network_units``), so no part computes its products for it alone --
    also where a term reads the input twice (k k), whose other gradient network lies between."""
    from hladsl.codegen.triton_bwd import _group, _group_key, _network_units
    from hladsl.ir.backward import PARALLEL, Target, backward_program
    from hladsl.runtime.op import carried_compilation
    alg = hladsl.compile_spec(name)
    if carried:
        alg = carried_compilation(alg)[0].algebra
    program = chunk_program(alg, 64, tuple((d, 64) for d in alg.dims), True)
    every = [g for g in backward_program(program).all_terms() if g.target in PARALLEL]
    riders = 0
    for key, grads in _group(every, _group_key).items():
        units = _network_units(grads)
        for g, unit in zip(grads, units):
            if g.target in (Target.LAM, Target.LAM_END) and g.name:
                riders += 1
                assert key == ("x", g.name)
                extended = [u for h, u in zip(grads, units) if h.target not in (Target.LAM, Target.LAM_END)
                            and h.wrt == g.wrt and h.term.operands == g.term.operands[:-1]]
                assert unit in extended, (key, g.term.source)
        assert sorted(set(units)) == list(range(len(set(units))))   # units numbered densely
    assert riders


def test_a_register_cap_reaches_every_gradient_launch(monkeypatch):
    """``launch.GRAD_MAXNREG`` (an A/B knob, run 271) is a launch option of every gradient
    kernel launch and of nothing else (the launch options only: the interpreter ignores the
    cap, so the equal gradients say only that nothing else changed)."""
    from hladsl.runtime import launch
    from hladsl.runtime.triton_backward import backward_triton
    program, tiles, lam, init, grad_o, grad_final = _gated_hla2(seed=7)
    results, real = [], launch.launch
    for cap in (None, 168):
        caps = set()

        def recording(kernel, grid, args, may, tiling=None):
            caps.add((kernel.fn.__name__ == "grad_kernel", args.get("maxnreg")))
            return real(kernel, grid, args, may, tiling)
        monkeypatch.setattr(launch, "launch", recording)
        with launch.switched(GRAD_MAXNREG=cap):
            results.append(backward_triton(program, tiles, lam.float(), init, grad_o.float(), grad_final, 1e-6))
        assert {grad for grad, _ in caps} == {True, False}   # the reverse pass launches too
        assert caps == {(True, cap), (False, None)}
    (a_tiles, a_lam, _), (b_tiles, b_lam, _) = results
    assert all(torch.equal(a_tiles[x], b_tiles[x]) for x in tiles) and torch.equal(a_lam, b_lam)
