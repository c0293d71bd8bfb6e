# Round 44, run 289: the GPU suite on the final tree of the round (row tiles opt-in; the default kernels hash as
# round 43's), with a budget that reaches every quick case.
set -u
export TRITON_CACHE_DIR=/tmp/hl/triton HLADSL_CACHE_DIR=/tmp/hl/hladsl
OUT=$OUT/t GPU_TESTS_BUDGET=340 bash benchmarks/gpu_tests.sh -m "gpu and not slow" -n 12 2>&1 | tail -2
echo "suite done at $SECONDS s"
