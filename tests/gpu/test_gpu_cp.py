"""Context parallelism on 2 GPUs (NCCL): ``op(..., cp_group=group)`` with each rank
holding half of one sequence equals the fp32 reference of the whole sequence --
output shards, final state, gradients of the shards and of the initial state -- for
every shipped spec, gated, bf16 (per-rank checks in cp_worker.py).

Skipped with fewer than 2 GPUs, and, saying why, while the op takes no ``cp_group``.
"""
from __future__ import annotations

import inspect
import os

import pytest
import torch

from gpu_support import SHIPPED, load

pytestmark = pytest.mark.slow
WORLD = 2


def takes_cp_group(op) -> bool:
    """Whether op(...) knows ``cp_group`` (it may take its options as **kwargs):
    a tiny CPU call with cp_group=None."""
    if "cp_group" in inspect.signature(op.__call__).parameters:
        return True
    x = torch.zeros(1, 1, 1, 16)
    try:
        op(*[x] * len(getattr(op, "inputs", "qkv")), cp_group=None)
    except (TypeError, ValueError) as exc:
        if "cp_group" in str(exc):
            return False
        raise
    return True


def test_context_parallel_on_two_gpus_equals_one(tmp_path):
    if torch.cuda.device_count() < WORLD:
        pytest.skip(f"needs {WORLD} GPUs, found {torch.cuda.device_count()}")
    if not takes_cp_group(load(SHIPPED[0])):
        pytest.skip("op(..., cp_group=...) has not landed on this branch yet")
    if not torch.distributed.is_nccl_available():
        pytest.skip("torch.distributed has no NCCL")
    # NVLink multicast stays off (it can take a shared host's GPUs down)
    os.environ["NCCL_NVLS_ENABLE"] = "0"
    os.environ["NVSHMEM_DISABLE_NVLS"] = "1"
    os.environ["TORCH_SYMM_MEM_DISABLE_MULTICAST"] = "1"
    import torch.multiprocessing as mp

    import cp_worker
    mp.spawn(cp_worker.run, args=(WORLD, str(tmp_path / "rendezvous"), [s.id for s in SHIPPED]),
             nprocs=WORLD, join=True)
