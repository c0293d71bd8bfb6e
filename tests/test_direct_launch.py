"""``runtime.direct`` without a GPU: a fake jitted kernel stands for Triton's (its
``kernel[grid](**args)`` returns a fake compiled kernel that records launches). The
key must separate every variant Triton would compile apart (constexpr values, tensor
dtype and 16-byte alignment, int classes, launch options) and nothing else; a hit must
launch the remembered binary with every parameter in order, defaults filled in.
(The real launches are compared bitwise with Triton's own in tests/gpu/test_gpu_direct.py.)
"""
from __future__ import annotations

import types

import pytest
import torch
import triton   # here, under tests/conftest.py's TRITON_INTERPRET=1 (its first import decides)

from hladsl.runtime import direct


class FakeCompiled:
    function, packed_metadata = "fn", "meta"

    def __init__(self):
        self.runs = []

    def launch_metadata(self, grid, stream, *values):
        return None

    def run(self, g0, g1, g2, stream, function, packed, meta, enter, exit_, *values):
        self.runs.append(((g0, g1, g2), stream, values))


class FakeKernel:
    """Parameters x_ptr, n, BLOCK: constexpr, flag=True (a default)."""

    def __init__(self):
        self.params = [types.SimpleNamespace(name=n, is_constexpr=c, has_default=d is not None,
                                             default=d)
                       for n, c, d in (("x_ptr", False, None), ("n", False, None),
                                       ("BLOCK", True, None), ("flag", False, True))]
        self.compiles = []

    def __getitem__(self, grid):
        def launch(**args):
            compiled = FakeCompiled()
            self.compiles.append((grid, args, compiled))
            return compiled
        return launch


@pytest.fixture
def cuda_free(monkeypatch):
    """direct's device / stream lookups answered without CUDA; a clean cache."""
    monkeypatch.setattr(direct, "launches_on_gpu", lambda kernel: isinstance(kernel, FakeKernel))
    monkeypatch.setattr(direct, "ENABLED", True)
    monkeypatch.setattr(direct, "_COMPILED", {})
    monkeypatch.setattr(direct, "_PARAMS", {})
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    monkeypatch.setattr(torch._C, "_cuda_getCurrentRawStream", lambda device: 1234, raising=False)
    monkeypatch.setattr(triton.knobs.runtime, "launch_enter_hook", None)


def test_a_variant_compiles_once_then_launches_directly(cuda_free):
    kernel = FakeKernel()
    x = torch.zeros(64)
    direct.call(kernel, (3,), {"x_ptr": x, "n": 64, "BLOCK": 16, "num_warps": 4})
    assert len(kernel.compiles) == 1
    compiled = kernel.compiles[0][2]
    assert direct.cached(kernel, (5, 2), {"x_ptr": x, "n": 128, "BLOCK": 16, "num_warps": 4})
    assert len(kernel.compiles) == 1
    (grid, stream, values), = compiled.runs
    assert grid == (5, 2, 1) and stream == 1234
    assert values[0] is x and values[1:] == (128, 16, True)   # parameter order, default filled in


def test_a_bound_variant_launches_with_new_tensors_only(cuda_free):
    """direct.bind (decode's bound launches): after call has compiled a variant, the
    bound launch passes every parameter in order with the new tensors in their slots,
    keeps none of the first call's tensors, and a variant never compiled is not bound."""
    kernel = FakeKernel()
    x, y = torch.zeros(64), torch.ones(64)
    args = {"x_ptr": x, "n": 64, "BLOCK": 16, "num_warps": 4}
    assert direct.bind(kernel, (3,), args, ["x_ptr"]) is None
    direct.call(kernel, (3,), args)
    bound = direct.bind(kernel, (3,), args, ["x_ptr"])
    assert bound is not None and all(v is not x for v in bound.values)
    bound.launch([y])
    compiled = kernel.compiles[0][2]
    (grid, stream, values), = compiled.runs
    assert grid == (3, 1, 1) and stream == 1234
    assert values[0] is y and values[1:] == (64, 16, True)


@pytest.mark.parametrize("change", [
    {"BLOCK": 32},                       # a constexpr value
    {"n": 1},                            # ints equal to 1 are specialised
    {"n": 24},                           # divisibility by 16
    {"n": 1 << 40},                      # 64-bit ints
    {"num_warps": 8},                    # launch options
    {"maxnreg": 64},
    {"enable_fp_fusion": False},
    {"flag": False},                     # bools by value (finer than Triton: safe)
    {"x_ptr": "dtype"},                  # another tensor dtype
    {"x_ptr": "misaligned"},             # a pointer not 16-byte aligned
])
def test_the_key_separates_what_triton_compiles_apart(cuda_free, change):
    kernel = FakeKernel()
    base = {"x_ptr": torch.zeros(64), "n": 64, "BLOCK": 16, "num_warps": 4}
    direct.call(kernel, (1,), base)
    other = dict(base, **change)
    if change.get("x_ptr") == "dtype":
        other["x_ptr"] = torch.zeros(64, dtype=torch.float64)
    elif change.get("x_ptr") == "misaligned":
        other["x_ptr"] = torch.zeros(65)[1:]
    assert not direct.cached(kernel, (1,), other)


def test_the_key_ignores_values_triton_does_not_specialise_on(cuda_free):
    kernel = FakeKernel()
    direct.call(kernel, (1,), {"x_ptr": torch.zeros(64), "n": 64, "BLOCK": 16})
    assert direct.cached(kernel, (1,), {"x_ptr": torch.ones(32), "n": 4096, "BLOCK": 16})


def test_fallback_options_are_remembered_under_the_callers_arguments(cuda_free):
    """launch's fallbacks add options (one stage) the caller did not ask for: the binary
    that fit is found again from the caller's arguments."""
    kernel = FakeKernel()
    asked = {"x_ptr": torch.zeros(64), "n": 64, "BLOCK": 16}
    direct.call(kernel, (1,), {**asked, "num_stages": 1}, key_args=asked)
    assert kernel.compiles[0][1]["num_stages"] == 1
    assert direct.cached(kernel, (1,), asked)
    assert len(kernel.compiles) == 1


def test_off_and_interpreter_launch_through_the_kernel(cuda_free, monkeypatch):
    kernel = FakeKernel()
    args = {"x_ptr": torch.zeros(64), "n": 64, "BLOCK": 16}
    monkeypatch.setattr(direct, "ENABLED", False)
    direct.call(kernel, (1,), args)
    direct.call(kernel, (1,), args)
    assert len(kernel.compiles) == 2 and not direct._COMPILED
    monkeypatch.setattr(direct, "ENABLED", True)
    monkeypatch.setattr(direct, "launches_on_gpu", lambda kernel: False)   # the interpreter's
    direct.call(kernel, (1,), args)
    assert not direct.cached(kernel, (1,), args) and not direct._COMPILED


@triton.jit
def _nothing(x):
    pass


def test_only_gpu_jit_functions_launch_directly():
    """Fakes (benchmarks' stubs, tests' kernels) and the interpreter's kernels never do."""
    assert not direct.launches_on_gpu(FakeKernel())
    assert not direct.launches_on_gpu(_nothing)     # under TRITON_INTERPRET=1 (conftest)
