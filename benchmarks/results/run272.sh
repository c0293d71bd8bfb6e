# Round 41: the GPU suite on the final tree (GRAD_SIDE_PARTS reverted; GRAD_MAXNREG added, off by default)
export TRITON_CACHE_DIR=/tmp/hl/triton HLADSL_CACHE_DIR=/tmp/hl/hladsl
OUT=$OUT/t GPU_TESTS_BUDGET=330 bash benchmarks/gpu_tests.sh -m "gpu and not slow" -n 12 2>&1 | tail -4
