# Round 48, call 4: the GPU suite on the tree with the launch rule counting the column dots; then the windowed
# prototype's output kernel with its tiles from loop counters (proto_window.py sliced).
set -u
export TRITON_CACHE_DIR=/tmp/hl/triton HLADSL_CACHE_DIR=/tmp/hl/hladsl
OUT=$OUT/t GPU_TESTS_BUDGET=300 bash benchmarks/gpu_tests.sh -m "gpu and not slow" -n 12 2>&1 | tail -1
echo "[suite done at $SECONDS s]"
timeout 200 python3 benchmarks/proto_window.py sliced 2>&1 | grep -v Warning | tail -8
echo "[sliced done at $SECONDS s]"
