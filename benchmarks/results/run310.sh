# Round 48, call 1: the GPU suite on round 47's final tree (its quotient mask "den + eps == 0" in the two cotangent
# kernels had run on CPU only); then the windowed prototype with two row tiles of one slice a program (proto_window.py paired).
set -u
export TRITON_CACHE_DIR=/tmp/hl/triton HLADSL_CACHE_DIR=/tmp/hl/hladsl
OUT=$OUT/t GPU_TESTS_BUDGET=300 bash benchmarks/gpu_tests.sh -m "gpu and not slow" -n 12 2>&1 | tail -1
echo "[suite done at $SECONDS s]"
timeout 240 python3 benchmarks/proto_window.py paired 2>&1 | tail -8
echo "[paired done at $SECONDS s]"
