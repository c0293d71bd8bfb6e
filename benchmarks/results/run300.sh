# Round 47, call 1: the GPU suite on 297e1c6 (the normaliser's edges: eps = 0 padding, / z / z, the attention
# form's fp32 o for d den; the form tuned), then the attention tests' slow cases and the new ones with their
# ratios printed (no xdist: it swallows -s).
set -u
export TRITON_CACHE_DIR=/tmp/hl/triton HLADSL_CACHE_DIR=/tmp/hl/hladsl
OUT=$OUT/t GPU_TESTS_BUDGET=300 bash benchmarks/gpu_tests.sh -m "gpu and not slow" -n 12 2>&1 | tail -1
echo "[suite done at $SECONDS s]"
timeout 200 python3 -m pytest -q -p no:cacheprovider -n 0 -s tests/gpu/test_gpu_attention.py \
  tests/gpu/test_gpu_form_tuning.py -k "backward or eps_zero or tuning" 2>&1 \
  | grep "^power\|^linear\|^always\|^never\|passed\|failed\|Error\|assert" | cut -c1-900
echo "[tests done at $SECONDS s]"
