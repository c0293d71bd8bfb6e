# Round 45, run 294: the GPU suite (quick) on the round's final kernels and routing, then the attention form's
# GPU tests with their slow (d = 128) cases.
OUT=$OUT/t GPU_TESTS_BUDGET=330 bash benchmarks/gpu_tests.sh -m "gpu and not slow" -n 12 2>&1 | tail -2
TRITON_CACHE_DIR=/tmp/hl/triton HLADSL_CACHE_DIR=/tmp/hl/hladsl timeout 90 python3 -m pytest -q -p no:cacheprovider -n 4 -m gpu -s \
  tests/gpu/test_gpu_attention.py 2>&1 | grep "power\|linear\|passed\|failed" | cut -c1-300
