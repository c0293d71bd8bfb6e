"""Context parallelism (hladsl.runtime.context_parallel): gloo on CPU, 2 and 4 processes.

Every shipped spec, gated, with an initial state, batched and with cu_seqlens
crossing shard boundaries (a sequence over three shards, one starting exactly at
a boundary, an empty one), both strategies forced, both final-state modes: the
sharded outputs, final state and every gradient (q, k, v, g, initial state) must
equal the single-process op to 1e-10 relative in float64. Cases are batched into
one process launch per world size (spawning is the slow part); rank 0 computes the
reference and compares what every rank sends it.
"""
from __future__ import annotations

import os
import socket
import traceback

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

import hladsl
from hladsl.runtime.context_parallel import cp_call, cp_plan_text
from hladsl.ir.combine import combine
from hladsl.ir.evaluate import einsum_poly
from hladsl.ir.segment import gathered, segment_algebra
from hladsl.ir.pipeline import algebra_compilation
from hladsl.runtime.op import Op
from hladsl.runtime.packing import unpack

F64 = torch.float64
TOL = 1e-10
SPECS = [("linear", {}), ("hla2", {}), ("ahla", {}), ("hla3", {}), ("hla3_masked", {}),
         ("power", {})]
D, DV, H, B = 3, 2, 2, 2
# shard lengths (unequal on purpose) and global cu_seqlens per world size: a sequence
# over several shards, one starting exactly at a shard boundary, an empty one
LAYOUTS = {
    2: ([7, 10], [0, 4, 12, 12, 17]),
    4: ([5, 9, 3, 6], [0, 3, 3, 16, 17, 23]),
}


def _cases():
    cases = []
    for n, (spec, params) in enumerate(SPECS):
        for strategy, varlen, mode in (("gather", False, "last"), ("relay", False, "broadcast"),
                                       ("gather", True, "broadcast"), ("relay", True, "last")):
            cases.append(dict(spec=spec, params=params, strategy=strategy, varlen=varlen,
                              gated=True, init=True, mode=mode, seed=10 * n + len(cases)))
    cases.append(dict(spec="hla2", params={"normalize": True}, strategy="auto", varlen=False,
                      gated=False, init=False, mode=None, seed=1))
    cases.append(dict(spec="ahla", params={"normalize": True}, strategy="gather", varlen=True,
                      gated=False, init=False, mode="last", seed=2))
    cases.append(dict(spec="hla3_masked", params={}, strategy="relay", varlen=True,
                      gated=True, init=False, mode="broadcast", seed=3))
    cases.append(dict(spec="power", params={"p": 3}, strategy="gather", varlen=True,
                      gated=True, init=True, mode="last", seed=4))
    cases.append(dict(spec="hla2", params={"ridge": 0.3}, strategy="relay", varlen=False,
                      gated=True, init=True, mode="last", seed=5))
    # only the initial state differentiated (frozen tokens): every rank still joins the backward
    cases.append(dict(spec="hla3", params={}, strategy="gather", varlen=False, gated=True, init=True,
                      mode="last", seed=6, frozen=True))
    return cases


# ------------------------------------------------------------------------- the worker

def _data(case, world):
    lengths, cu = LAYOUTS[world]
    T = sum(lengths)
    gen = torch.Generator().manual_seed(case["seed"])
    batch = 1 if case["varlen"] else B
    n_seq = len(cu) - 1 if case["varlen"] else B

    def rnd(*shape):
        return torch.randn(*shape, generator=gen, dtype=F64)
    data = {"q": rnd(batch, T, H, D), "k": rnd(batch, T, H, D), "v": rnd(batch, T, H, DV)}
    data["g"] = -0.4 * torch.rand(batch, T, H, generator=gen, dtype=F64) if case["gated"] else None
    data["cu"] = torch.tensor(cu, dtype=torch.long) if case["varlen"] else None
    data["wo"] = rnd(batch, T, H, DV)
    op = _op(case)
    shapes = op.state_shapes(D, DV)
    data["init"] = ({n: 0.3 * rnd(n_seq, H, *s) for n, s in shapes.items()} if case["init"]
                    else None)
    data["wf"] = {n: rnd(n_seq, H, *s) for n, s in shapes.items()}
    return data, lengths


_OPS: dict = {}


def _op(case):
    key = (case["spec"], tuple(sorted(case["params"].items())))
    if key not in _OPS:
        _OPS[key] = hladsl.load(case["spec"], **case["params"])
        _OPS[key].chunk_size = 16   # several chunks over the reference's whole sequence
    return _OPS[key]


def _leaves(data, lo, hi, frozen=False):
    out = {n: data[n][:, lo:hi].clone().requires_grad_(not frozen) for n in ("q", "k", "v")}
    out["g"] = None if data["g"] is None else data["g"][:, lo:hi].clone().requires_grad_(not frozen)
    return out


def _grads(leaves, init):
    out = {n: (None if x is None else x.grad) for n, x in leaves.items()}
    out["init"] = None if init is None else {n: x.grad for n, x in init.items()}
    return out


def _reference(case, data):
    op = _op(case)
    x = _leaves(data, 0, data["q"].shape[1], case.get("frozen", False))
    init = None if data["init"] is None else {n: t.clone().requires_grad_()
                                              for n, t in data["init"].items()}
    o, final = op(x["q"], x["k"], x["v"], x["g"], scale=0.7, initial_state=init,
                  output_final_state=True, cu_seqlens=data["cu"])
    loss = (o * data["wo"]).sum()
    if case["mode"] is not None:
        loss = loss + sum((final[n] * data["wf"][n]).sum() for n in final)
    loss.backward()
    return o.detach(), {n: t.detach() for n, t in final.items()}, _grads(x, init)


def _sharded(case, data, lengths, rank, world, group=None):
    op = _op(case)
    lo = sum(lengths[:rank])
    hi = lo + lengths[rank]
    x = _leaves(data, lo, hi, case.get("frozen", False))
    init = None
    if data["init"] is not None and rank == 0:
        init = {n: t.clone().requires_grad_() for n, t in data["init"].items()}
    o, final = op(x["q"], x["k"], x["v"], g=x["g"], scale=0.7, initial_state=init,
                  output_final_state=case["mode"] or False, cu_seqlens=data["cu"],
                  cp_group=group or dist.group.WORLD, cp_strategy=case["strategy"])
    loss = (o * data["wo"][:, lo:hi]).sum()
    if final is not None:   # "broadcast": every rank holds it; count it once in total
        share = 1.0 / world if case["mode"] == "broadcast" else 1.0
        loss = loss + share * sum((final[n] * data["wf"][n]).sum() for n in final)
    loss.backward()
    return (o.detach(), None if final is None else {n: t.detach() for n, t in final.items()},
            _grads(x, init))


def _rel(a, b):
    return ((a - b).norm() / b.norm().clamp_min(1e-300)).item()


def _compare(case, ref, got, world):
    """got: per rank (o, final, grads). Returns {quantity: relative error}."""
    o_ref, final_ref, g_ref = ref
    errs = {"o": _rel(torch.cat([r[0] for r in got], 1), o_ref)}
    for n in ("q", "k", "v", "g"):
        if g_ref[n] is not None:
            errs["d" + n] = _rel(torch.cat([r[2][n] for r in got], 1), g_ref[n])
        elif any(r[2][n] is not None for r in got):   # frozen tokens got a gradient
            errs["d" + n + " (frozen)"] = 1.0
    if g_ref["init"] is not None:
        for n, t in g_ref["init"].items():
            errs[f"dinit.{n}"] = _rel(got[0][2]["init"][n], t)
    if case["mode"] is not None:
        holders = range(world) if case["mode"] == "broadcast" else [world - 1]
        for r in range(world):
            if (got[r][1] is not None) != (r in holders):
                errs[f"final held on rank {r}"] = 1.0
        for r in holders:
            for n, t in final_ref.items():
                errs[f"final.{n}@{r}"] = _rel(got[r][1][n], t)
    return errs


def _expect_errors(rank, world):
    """Bad input on one rank: every rank raises a ValueError (nobody hangs)."""
    op = _op(dict(spec="linear", params={}))
    messages = []
    for bad in ("shape", "gate"):
        q = torch.randn(1, 4, H, D, dtype=F64)
        k, v = q.clone(), torch.randn(1, 4, H, DV, dtype=F64)
        g = None
        if bad == "shape" and rank == world - 1:
            k = torch.randn(1, 4, H, D + 1, dtype=F64)
        if bad == "gate":
            g = torch.zeros(1, 4, H, dtype=F64) + (1.0 if rank == 0 else 0.0)
        try:
            cp_call(op, {"q": q, "k": k, "v": v}, g, None, None, False, None, None, "relay")
            messages.append(None)
        except ValueError as exc:
            messages.append(str(exc))
    return messages


SUBGROUP_CASE = dict(spec="hla2", params={}, strategy="relay", varlen=True, gated=True, init=True,
                     mode="broadcast", seed=7)


def _subgroup_case(rank):
    """Context parallelism over a subgroup of non-adjacent ranks (global 1 and 3):
    group ranks, not global ones, order the shards and address the messages."""
    sub = dist.new_group([1, 3])
    case = SUBGROUP_CASE
    data, lengths = _data(case, 2)
    got = None
    if rank in (1, 3):
        mine = dist.get_rank(sub)
        got = (mine, _sharded(case, data, lengths, mine, 2, sub))
    every = [None] * 4 if rank == 0 else None
    dist.gather_object(got, every, dst=0)
    if rank != 0:
        return None
    ordered = [r for _, r in sorted(x for x in every if x is not None)]
    return case, _compare(case, _reference(case, data), ordered, 2)


def _worker(rank, world, port, cases, path):
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                            world_size=world)
    report = []
    try:
        for case in cases:
            data, lengths = _data(case, world)
            got = _sharded(case, data, lengths, rank, world)
            every = [None] * world if rank == 0 else None
            dist.gather_object(got, every, dst=0)
            if rank == 0:
                report.append((case, _compare(case, _reference(case, data), every, world)))
        if world == 4:
            report.append(_subgroup_case(rank))
        errors = _expect_errors(rank, world)
        every = [None] * world if rank == 0 else None
        dist.gather_object(errors, every, dst=0)
        if rank == 0:
            report.append(("errors", every))
            torch.save(report, path)
        # every rank past its last collective before any tears the group down: a rank
        # leaving early made another's destroy_process_group abort (gloo, now and then)
        dist.barrier()
    except Exception:
        traceback.print_exc()
        raise
    finally:
        dist.destroy_process_group()
    # Now and then (about 1 run in 10 here) a rank aborted during interpreter teardown,
    # after every result was checked and saved ("terminate called without an active
    # exception": a C++ thread of gloo's or autograd's still joinable at exit). Leave
    # without that teardown; a failure above still raises and fails the test.
    os._exit(0)


def _free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.mark.parametrize("world", [2, 4])
def test_cp_matches_single_process(world, tmp_path):
    path = str(tmp_path / "report.pt")
    cases = _cases()
    mp.spawn(_worker, args=(world, _free_port(), cases, path), nprocs=world, join=True)
    report = torch.load(path, weights_only=False)
    failures = []
    for case, result in report[:-1]:
        for quantity, err in result.items():
            if not err <= TOL:
                failures.append(f"{case['spec']} {case['params']} {case['strategy']} "
                                f"varlen={case['varlen']} mode={case['mode']}: {quantity} {err:.2e}")
    worst = max((e, q) for _, r in report[:-1] for q, e in r.items())
    print(f"world {world}: {len(report) - 1} cases, worst relative error {worst[0]:.1e} ({worst[1]})")
    assert len(report) == len(cases) + 1 + (world == 4)
    assert not failures, "\n".join(failures)
    _, messages = report[-1]
    for r, per_rank in enumerate(messages):
        assert all(m is not None for m in per_rank), f"rank {r} accepted bad input"
    # the rank with the bad tensor names it; the others name that rank
    assert "k" in messages[world - 1][0] and f"[{world - 1}]" in messages[0][0]
    assert "g" in messages[0][1] and "[0]" in messages[world - 1][1]


# ----------------------------------------------------------- single-process pieces

@pytest.mark.parametrize("spec", [s for s, _ in SPECS])
def test_segment_tuple_is_the_fold_of_token_deltas(spec):
    """The segment algebra's state pass from zero equals T_1 ⊕ T_2 ⊕ ... folded with
    the derived combine (every gathered summary, combine-only ones included)."""
    torch.manual_seed(0)
    alg = hladsl.compile_spec(spec)
    seg_alg = segment_algebra(alg)
    op = Op(algebra_compilation(seg_alg)) if seg_alg is not alg else hladsl.load(spec)
    T, dims = 21, {"d": D, "dv": DV}
    q, k = torch.randn(2, T, H, D, dtype=F64), torch.randn(2, T, H, D, dtype=F64)
    v, g = torch.randn(2, T, H, DV, dtype=F64), -0.3 * torch.rand(2, T, H, dtype=F64)
    _, seg = op(q, k, v, g, scale=1.0, output_final_state=True)
    names = [s.name for s in seg_alg.streaming]
    assert {s.name for s in gathered(alg)} <= set(names)
    acc = {s.name: torch.zeros((2, H) + tuple(dims[d] for d in s.dims), dtype=F64)
           for s in seg_alg.streaming}
    for t in range(T):
        tok = {"q": q[:, t], "k": k[:, t], "v": v[:, t]}
        delta = {s.name: (einsum_poly(s.delta, lambda f: tok[f.name]) if s.delta.terms
                          else torch.zeros_like(acc[s.name])) for s in seg_alg.streaming}
        rho = torch.exp(g[:, t])
        acc = {s.name: einsum_poly(combine(alg, s), lambda f: acc[f.name] if f.where == "A"
                                   else delta[f.name], lambda side: rho)
               for s in seg_alg.streaming}
    for name in names:
        full = unpack(alg.summary(name), seg[name], dims)
        assert _rel(full, acc[name]) < TOL, name


def test_plan_text_picks_by_bytes():
    small = cp_plan_text(hladsl.compile_spec("hla2"), {"d": 64, "dv": 64}, 2, heads=16)
    big = cp_plan_text(hladsl.compile_spec("hla3"), {"d": 64, "dv": 64}, 2, heads=16)
    assert "auto -> gather" in small and "auto -> relay" in big
    assert "X1" in big and "combine-only" in big and "X1" not in small
    assert "[2080x64]" not in small and "[2080]" in small   # S packed: d(d+1)/2 entries


def test_group_of_one_is_the_op(tmp_path):
    """A group of one rank: both strategies give the op's result; bad arguments
    raise ValueError naming them."""
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{_free_port()}", rank=0,
                            world_size=1)
    try:
        case = dict(spec="ahla", params={}, strategy="gather", varlen=True, gated=True, init=True,
                    mode="last", seed=5)
        data, _ = _data(case, 2)
        ref = _reference(case, data)
        for strategy in ("gather", "relay"):
            got = _sharded(dict(case, strategy=strategy), data, [data["q"].shape[1]], 0, 1)
            errs = _compare(case, ref, [got], 1)
            assert max(errs.values()) < TOL, errs
        op = _op(case)
        x = {n: data[n] for n in ("q", "k", "v")}
        with pytest.raises(ValueError, match="cp_strategy"):
            cp_call(op, x, strategy="ring")
        with pytest.raises(ValueError, match="output_final_state"):
            cp_call(op, x, output_final_state="first")
        with pytest.raises(ValueError, match="cu_seqlens"):
            cp_call(op, x, cu_seqlens=torch.tensor([0, 5, 3]))
        with pytest.raises(ValueError, match="initial_state"):
            cp_call(op, x, initial_state={"P": torch.zeros(1)}, cu_seqlens=data["cu"])
    finally:
        dist.destroy_process_group()
