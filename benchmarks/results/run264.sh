# Round 39: the fp32 GPU tests after the gradient-warps rule (launch.grad_warps' tf32_tiles), all 14 at once
# (the device time ran out at 235 s: 11 passed, the three hla3 / hla3_masked cases not reached).
export TRITON_CACHE_DIR=/tmp/hl/triton HLADSL_CACHE_DIR=/tmp/hl/hladsl
OUT=$OUT/t GPU_TESTS_BUDGET=235 bash benchmarks/gpu_tests.sh -m gpu -n 14 -k fp32_inputs 2>&1 | tail -3
