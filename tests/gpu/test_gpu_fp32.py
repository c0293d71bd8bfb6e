"""fp32 inputs on CUDA run the generated kernels too (every GPU test before round 38 fed
bf16 / fp16 and computed its fp32 reference with the torch path): forward and backward of
every shipped spec, gated and not, against the float64 torch path, each call in a process
of its own (fp32_worker.py: an illegal memory access poisons the process). Found here:
hla3's stateless reverse pass narrowed to value blocks of 16 at 8 warps (runs 257-261) and
gated ahla's gradient kernel at 4 warps (runs 261-263) read or wrote shared memory out of
bounds inside tf32 dots; the launch layer now avoids both (``launch.wgmma_safe``,
``launch.grad_warps``)."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from gpu_support import SHIPPED

pytestmark = pytest.mark.slow
TOL = 1e-3   # RMS ratio; fp32 tiles, exact products as tf32x3 (~21 bits), T = 1024, against float64


def _cases():
    for spec in SHIPPED:
        for gated in (False, True):
            yield pytest.param(spec.id, gated, id=f"{spec.id}-{'gated' if gated else 'ungated'}")


@pytest.mark.parametrize("spec_id,gated", list(_cases()))
def test_fp32_inputs_train_on_the_kernels(spec_id, gated, record_property):
    here = Path(__file__).resolve().parent
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(here), os.environ.get("PYTHONPATH", "")])}
    done = subprocess.run([sys.executable, str(here / "fp32_worker.py"), spec_id, str(int(gated))],
                          capture_output=True, text=True, timeout=450, env=env)   # (the runner stops a test at 480 s)
    assert done.returncode == 0, done.stderr[-2000:]
    errors = json.loads(done.stdout.strip().splitlines()[-1])
    for name, err in errors.items():
        record_property(f"rms_{name}", f"{err:.3e}")
    assert all(err < TOL for err in errors.values()), errors
