"""The GPU suite: every test here is marked ``gpu`` and skips cleanly without CUDA,
so the CPU CI collects it in well under a second and runs none of it.

Markers (registered here, not in pyproject.toml):
  gpu   every test in tests/gpu (added by the collection hook below)
  slow  the long-sequence, d = 128 and largest-compile cases; the runner's quick
        pass (benchmarks/gpu_tests.sh --quick) deselects them
Run: ``benchmarks/gpu_tests.sh`` (pytest -m gpu -n 8 --dist loadgroup, JUnit XML
and a JSON summary). Tests that share generated kernels carry one
``xdist_group``, so one worker compiles them once (Triton caches start empty on
a fresh machine and compiles are CPU-bound).
"""
import sys
from pathlib import Path

import pytest

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))   # gpu_support, without making tests/ a package


def pytest_configure(config):
    config.addinivalue_line("markers", "gpu: needs a CUDA device (tests/gpu); skipped without one")
    config.addinivalue_line("markers", "slow: long GPU cases (long sequences, d = 128, the "
                                       "largest compiles); deselect with -m 'gpu and not slow'")
    # pytest-xdist registers this itself; the CPU CI runs without xdist
    config.addinivalue_line("markers", "xdist_group(name): run on the worker of this group "
                                       "(with --dist loadgroup)")


def _cuda_available() -> bool:
    try:
        import torch
    except ImportError:
        return False
    return torch.cuda.is_available()


@pytest.hookimpl(tryfirst=True)   # before -m selection reads the markers
def pytest_collection_modifyitems(config, items):
    mine = [item for item in items if HERE in Path(str(item.path)).resolve().parents]
    if not mine:
        return
    skip = None if _cuda_available() else pytest.mark.skip(reason="needs CUDA (GPU suite)")
    for item in mine:
        item.add_marker(pytest.mark.gpu)
        spec = getattr(getattr(item, "callspec", None), "params", {}).get("spec")
        if getattr(spec, "heavy", False):   # its generated backward compiles for minutes
            item.add_marker(pytest.mark.slow)
        if skip is not None:
            item.add_marker(skip)
