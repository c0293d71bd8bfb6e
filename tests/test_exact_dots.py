"""The precision plan's exact products at the least tensor-core cost (codegen.steps
``_matmul``, the chunk template's ``_dot``): two token tiles as loaded multiply in their
own dtype (products of bf16 values are exact in the fp32 accumulator); one token tile
against an fp32 tile takes the fp32 side as three bf16 pieces (``_bf16_pieces``); two
fp32 tiles stay one fp32 dot at PREC. The dots themselves are checked on the GPU
(tests/gpu/test_gpu_exact_dots.py): the interpreter's bf16 dots are off."""
import os

os.environ["TRITON_INTERPRET"] = "1"   # before triton is imported anywhere

import re  # noqa: E402

import pytest  # noqa: E402
import torch  # noqa: E402

import hladsl  # noqa: E402
from hladsl.ir.pipeline import chunk_program  # noqa: E402

_DOT = re.compile(r"_dot\(([^,]+(?:\([^)]*\))?), ([^,]+(?:\([^)]*\))?), ([^,]+), PREC(, DOT)?\)")


def _regions(source: str, kernel: str) -> list[str]:
    """A kernel's code, one piece per launch part (``if PART == n``: temps are numbered per part)."""
    body = source.split(f"def {kernel}(")[1].split("@triton.jit")[0]
    return re.split(r"\n\s+if PART == \d+:", body)


def _dots(region: str) -> list[tuple[str, str, str, bool]]:
    return [(a, b, dt, bool(tok)) for a, b, dt, tok in _DOT.findall(region)]


def _token_tiles(region: str) -> set[str]:
    """raw_<x> and the temps a region loads transposed in the input dtype."""
    loaded = re.findall(r"# in_\wᵀ, loaded transposed in the input dtype\n\s+(t\d+) = ", region)
    return {"raw_k", "raw_q", "raw_v"} | set(loaded)


def test_hla3_exact_products_by_what_their_sides_are():
    from hladsl.codegen.triton_gen import generate
    program = chunk_program(hladsl.compile_spec("hla3"), 64, (("d", 64), ("dv", 64)), True)
    source = generate(program)
    for kernel in ("delta_kernel", "stage_kernel", "state_pass_kernel"):
        kinds = set()
        for region in _regions(source, kernel):
            tokens = _token_tiles(region)
            for a, b, dtype, split in _dots(region):
                sides = (a in tokens) + (b in tokens)
                if sides == 2:       # exact on the tensor cores in the token dtype
                    assert dtype == "DOT" and not split, (kernel, a, b)
                elif sides == 1:     # the fp32 side in three bf16 pieces
                    assert dtype == "tl.float32" and split, (kernel, a, b)
                else:                # one fp32 dot at PREC
                    assert dtype == "tl.float32" and not split, (kernel, a, b)
                kinds.add(sides)
        assert 1 in kinds, kernel    # each multiplies tokens with fp32 tiles
        if kernel == "stage_kernel":
            assert kinds == {0, 1, 2}


@pytest.mark.parametrize("name,params", [("hla3", {}), ("hla3", {"normalize": True}), ("hla2", {}),
                                         ("hla2", {"normalize": True}), ("hla3_masked", {}), ("ahla", {}),
                                         ("linear", {}), ("power", {"p": 2})])
def test_every_exact_product_forward_and_backward_takes_the_dot_its_sides_allow(name, params):
    """In every kernel, forward and backward: an fp32 product never has two token tiles as
    loaded (they go in their dtype), is split exactly when one side is a token tile, and
    nothing else is split. (An exact product of two token tiles reads DOT like a plain one:
    the per-kernel test above tells them apart where every product is exact.)"""
    from hladsl.api import compile_spec
    from hladsl.codegen.triton_bwd import triton_bwd_source
    from hladsl.codegen.triton_gen import generate
    program = compile_spec(name, **params).program
    for source in (generate(program), triton_bwd_source(program)):
        for kernel in re.findall(r"def (\w+_kernel)\(", source):
            for region in _regions(source, kernel):
                tokens = _token_tiles(region)
                for a, b, dtype, split in _dots(region):
                    sides = (a in tokens) + (b in tokens)
                    assert split == (dtype == "tl.float32" and sides == 1), (kernel, a, b, dtype)
                    assert not (dtype == "tl.float32" and sides == 2), (kernel, a, b)


def test_products_outside_the_plan_keep_their_dtypes():
    """HLA2's exact products read carried states (no token rule 3): no token pair goes to
    DOT through the exact path, and linear has no exact product at all."""
    from hladsl.codegen.triton_gen import generate
    for name in ("hla2", "linear"):
        program = chunk_program(hladsl.compile_spec(name), 64, (("d", 64), ("dv", 64)), True)
        source = generate(program)
        out = _dots(_regions(source, "output_kernel")[0])
        assert out and all(dt in ("DOT", "SDOT", "tl.float32") for _, _, dt, _ in out)
        if name == "linear":
            assert all(dt != "tl.float32" and not split for _, _, dt, split in out)


_pieces = None   # the generated module's _bf16_pieces (a jit function calls module globals)


def test_bf16_pieces_sum_exactly_to_their_fp32_value():
    import triton
    import triton.language as tl
    from hladsl.codegen.triton_gen import kernels
    global _pieces
    program = chunk_program(hladsl.compile_spec("hla3"), 64, (("d", 16), ("dv", 16)), True)
    _pieces = kernels(program)[0]._bf16_pieces

    @triton.jit
    def split(x_ptr, hi_ptr, mid_ptr, lo_ptr, N: tl.constexpr):
        offs = tl.arange(0, N)
        hi, mid, lo = _pieces(tl.load(x_ptr + offs))
        tl.store(hi_ptr + offs, hi)
        tl.store(mid_ptr + offs, mid)
        tl.store(lo_ptr + offs, lo)

    gen = torch.Generator().manual_seed(0)
    x = torch.randn(1024, generator=gen) * torch.logspace(-30, 30, 1024)
    x[:4] = torch.tensor([0.0, 1.0, -3.0, 1 + 2 ** -23])
    hi, mid, lo = (torch.empty(1024, dtype=torch.bfloat16) for _ in range(3))
    split[(1,)](x, hi, mid, lo, N=1024)
    total = hi.double() + mid.double() + lo.double()
    assert torch.equal(total, x.double())
    assert (hi.double() - x.double()).abs().le(x.double().abs() * 2 ** -7).all()   # hi leads
