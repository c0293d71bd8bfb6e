"""The per-rank body of test_gpu_cp (a plain module, so that spawned processes can
import it): each rank runs its shard of one long sequence with ``cp_group`` and
checks its shard of the output, the final state (last rank), the gradients of its
shard and of the initial state (first rank) against the fp32 torch reference of
the whole sequence, which every rank computes for itself."""
from __future__ import annotations

import sys
import traceback

import torch
import torch.distributed as dist

from gpu_support import (BY_ID, TOL, Inputs, Ratios, gates, generator, grads, initial_state, load,
                         loss, tokens)

B, T, H = 1, 2048, 4      # 1024 tokens per rank: 16 chunks each
BF16 = torch.bfloat16


def check_spec(spec, rank: int, world: int) -> None:
    d = spec.d
    gen = generator(61)            # the same draws on every rank
    full = Inputs(tokens(spec, B, T, H, d, d, BF16, False, gen), gates(B, T, H, gen),
                  initial_state(spec, False, B, H, d, d, True, gen))
    w_o = torch.randn(B, T, H, d, device="cuda", generator=gen).to(BF16).float()
    shard = slice(rank * T // world, (rank + 1) * T // world)

    theirs = full.leaves(torch.float32)
    o_ref, state_ref = theirs.call(load(spec, "torch"))
    w_s = {n: torch.randn(x.shape, device="cuda", generator=gen) for n, x in state_ref.items()}
    want = grads(loss(o_ref, state_ref, w_o, w_s), theirs.named())

    # the initial state is read (and its gradient arrives) on the first rank only
    mine = Inputs({n: x[:, shard] for n, x in full.tokens.items()}, full.g[:, shard],
                  full.init if rank == 0 else None).leaves()
    o, state = mine.call(load(spec), cp_group=dist.group.WORLD)
    # every rank runs its backward (collectives) before any check can stop it. With
    # loss.backward(): torch.autograd.grad(loss, inputs) deadlocked hladsl.distributed
    # (cp branch, gloo dry run): it prunes the carry-in's backward, and its
    # reduce-scatter, on a rank whose requested inputs do not need it
    loss(o, state, w_o[:, shard], w_s).backward()
    got = {name: x.grad for name, x in mine.named().items()}

    last = rank == world - 1
    assert (state is not None) == last, "the final state belongs on the last rank only"
    ratios = Ratios()
    ratios.add("o", o_ref[:, shard], o, TOL[BF16])
    if last:
        ratios.states("final_state", state_ref, state, TOL[BF16])
    for name in mine.tokens:
        ratios.add(f"d{name}", want[name][:, shard], got[name], TOL[BF16])
    ratios.add("dg", want["g"][:, shard], got["g"], TOL[BF16])
    if rank == 0:
        for n in full.init:
            ratios.add(f"dinitial_state[{n}]", want[f"initial_state[{n}]"],
                       got[f"initial_state[{n}]"], TOL[BF16])
    ratios.check()


def run(rank: int, world: int, init_file: str, spec_ids: list[str]) -> None:
    torch.cuda.set_device(rank)
    dist.init_process_group("nccl", init_method=f"file://{init_file}", rank=rank,
                            world_size=world)
    failures = []
    try:
        for spec_id in spec_ids:
            try:
                check_spec(BY_ID[spec_id], rank, world)
            except Exception:   # go on: every rank must reach the same collectives
                failures.append(f"{spec_id}: {traceback.format_exc()}")
                print(f"rank {rank}: {failures[-1]}", file=sys.stderr, flush=True)   # if it hangs
            dist.barrier()
    finally:
        dist.destroy_process_group()
    if failures:
        raise AssertionError(f"rank {rank}:\n" + "\n".join(failures))
