"""Context parallelism on 2 GPUs (NCCL): ``op(..., cp_group=group)`` with each rank
holding half of one sequence equals the fp32 reference of the whole sequence --
output shards, final state, gradients of the shards and of the initial state -- for
every shipped spec, gated, bf16 (per-rank checks in cp_worker.py).

Skipped with fewer than 2 GPUs, and, saying why, while the op takes no ``cp_group``.
"""
from __future__ import annotations

import os

import pytest
import torch

from gpu_support import SHIPPED

pytestmark = pytest.mark.slow
WORLD = 2


def test_context_parallel_on_two_gpus_equals_one(tmp_path):
    if torch.cuda.device_count() < WORLD:
        pytest.skip(f"needs {WORLD} GPUs, found {torch.cuda.device_count()}")
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
