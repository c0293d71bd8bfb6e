# Round 42, run 274: the stored-dtype rules (bf16 backward starts where every reader rounds them so, bf16
# d-states where no d initial state is formed) -- the GPU suite, then hla3 / hla3_masked fwd + bwd beside fla.
set -u
export TRITON_CACHE_DIR=/tmp/hl/triton HLADSL_CACHE_DIR=/tmp/hl/hladsl
OUT=$OUT/t GPU_TESTS_BUDGET=290 bash benchmarks/gpu_tests.sh -m "gpu and not slow" -n 12 2>&1 | tail -4
echo "suite done at $SECONDS s"
timeout $((555 - SECONDS)) python3 -m hladsl bench --specs hla3 hla3_masked --baselines fla --modes fwd fwd+bwd --T 16384 \
  --json $OUT/run274.json --plot '' 2>&1 | grep -v "^\s*$" | grep -v compiling | tail -14
echo "done at $SECONDS s"
