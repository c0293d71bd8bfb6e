# Round 48, call 7: the power GPU tests with the row tiles forced (HLADSL_POWER_COLUMNS=rows: every power forward's state
# and output passes, and the backward's recomputed state pass, on the spill-free row tiles), not slow.
set -u
export TRITON_CACHE_DIR=/tmp/hl/triton HLADSL_CACHE_DIR=/tmp/hl/hladsl
HLADSL_POWER_COLUMNS=rows OUT=$OUT/t GPU_TESTS_BUDGET=240 bash benchmarks/gpu_tests.sh -m "gpu and not slow" -n 12 -k power 2>&1 | tail -1
echo "[rows suite done at $SECONDS s]"
