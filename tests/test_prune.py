"""codegen.prune: dead generated names leave the rendered kernels; nothing else does."""
import ast

import pytest

import hladsl
from hladsl.codegen.prune import prune_dead
from hladsl.codegen.triton_bwd import triton_bwd_source
from hladsl.codegen.triton_gen import generate
from hladsl.ir.pipeline import chunk_program

SOURCE = '''
def kernel(x_ptr, C: tl.constexpr):
    raw_x = tl.load(
        x_ptr)
    in_x = raw_x.to(tl.float32)
    # [i] = in_x · in_x   (elementwise)
    t1 = in_x * in_x
    # [i] = t1 · t1   (elementwise)
    t2 = t1 * t1
    user = 3
    for i in range(C):
        t3 = t1 + i
    tl.store(x_ptr, t1)
'''


def test_dead_generated_names_go_with_their_comment_and_nothing_else():
    out = prune_dead(SOURCE)
    assert "t2 =" not in out and "[i] = t1 · t1" not in out     # dead, with its comment
    assert "t1 = in_x * in_x" in out and "[i] = in_x · in_x" in out
    assert "user = 3" in out             # not a generated name
    assert "t3 = t1 + i" in out          # a block keeps its last statement
    assert "raw_x = tl.load(" in out and "in_x = raw_x" in out
    ast.parse(out)


@pytest.mark.parametrize("name", ["linear", "hla2", "ahla", "hla3_masked", "power"])
def test_generated_kernels_assign_no_generated_name_that_nothing_reads(name):
    program = chunk_program(hladsl.compile_spec(name), 64, (("d", 64), ("dv", 64)), True)
    for source in (generate(program), triton_bwd_source(program)):
        assert prune_dead(source) == source
        ast.parse(source)
