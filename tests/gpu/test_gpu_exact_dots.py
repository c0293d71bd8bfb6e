"""The exact products' dots on the tensor cores (the chunk template's ``_dot``, see
tests/test_exact_dots.py for which products take which): a bf16 token tile against an
fp32 tile as three bf16 dots of the fp32 side's pieces is fp32-accurate; two bf16 tiles
in bf16 are exact up to the fp32 accumulation; against float64."""
from __future__ import annotations

import pytest
import torch
import triton
import triton.language as tl

import hladsl
from gpu_support import DEVICE
from hladsl.ir.pipeline import chunk_program

pytestmark = pytest.mark.gpu
M = 64
_dot = None   # the generated module's (a jit function calls module globals)


@triton.jit
def _product(a_ptr, b_ptr, out_ptr, DOT: tl.constexpr, PREC: tl.constexpr, TOKENS: tl.constexpr,
             M: tl.constexpr):
    rows, cols = tl.arange(0, M)[:, None], tl.arange(0, M)[None, :]
    a = tl.load(a_ptr + rows * M + cols)
    b = tl.load(b_ptr + rows * M + cols)
    tl.store(out_ptr + rows * M + cols, _dot(a, b, DOT, PREC, TOKENS))


@pytest.fixture(scope="module", autouse=True)
def _generated_dot():
    global _dot
    from hladsl.codegen.triton_gen import kernels
    program = chunk_program(hladsl.compile_spec("hla3"), 64, (("d", 64), ("dv", 64)), True)
    _dot = kernels(program)[0]._dot


def _run(a, b, dot, prec, tokens):
    out = torch.empty(M, M, device=DEVICE, dtype=torch.float32)
    _product[(1,)](a, b, out, DOT=dot, PREC=prec, TOKENS=tokens, M=M)
    return out.double()


def _error(ref, out):
    return ((out - ref).norm() / ref.norm()).item()


def test_token_times_fp32_as_three_bf16_dots_is_fp32_accurate():
    gen = torch.Generator(device=DEVICE).manual_seed(0)
    tok = torch.randn(M, M, device=DEVICE, generator=gen).to(torch.bfloat16)
    state = torch.randn(M, M, device=DEVICE, generator=gen) * 1e3
    ref_left = tok.double() @ state.double()
    ref_right = state.double() @ tok.double()
    split_left = _error(ref_left, _run(tok, state, tl.float32, "tf32x3", tl.bfloat16))
    split_right = _error(ref_right, _run(state, tok, tl.float32, "tf32x3", tl.bfloat16))
    tf32x3 = _error(ref_left, _run(tok, state, tl.float32, "tf32x3", tl.float32))
    bf16x3 = _error(ref_left, _run(tok, state, tl.float32, "bf16x3", tl.float32))
    print(f"split {split_left:.2e} / {split_right:.2e}, tf32x3 {tf32x3:.2e}, bf16x3 {bf16x3:.2e}")
    assert split_left < 1e-6 and split_right < 1e-6          # fp32's unit roundoff is 6e-8
    assert split_left <= 2 * tf32x3 + 1e-7                    # no worse than tf32x3
    assert bf16x3 > 10 * split_left                           # the 16-bit split it replaces


def test_two_token_tiles_in_bf16_are_exact_up_to_fp32_accumulation():
    gen = torch.Generator(device=DEVICE).manual_seed(1)
    a, b = (torch.randn(M, M, device=DEVICE, generator=gen).to(torch.bfloat16) for _ in range(2))
    ref = a.double() @ b.double()
    assert _error(ref, _run(a, b, tl.bfloat16, "tf32x3", tl.float32)) < 1e-6
