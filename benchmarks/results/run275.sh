# Round 42, run 275: hla3's and hla3_masked's stateless bf16 GPU cases (marked slow: the rules' d-states in bf16
# change their gradients), then their gated fwd + bwd.
set -u
export TRITON_CACHE_DIR=/tmp/hl/triton HLADSL_CACHE_DIR=/tmp/hl/hladsl
OUT=$OUT/t GPU_TESTS_BUDGET=170 bash benchmarks/gpu_tests.sh -m gpu -n 12 \
  -k "test_forward_backward_matches_fp32_reference and nostate and bf16 and d64 and hla3" 2>&1 | tail -2
echo "cases done at $SECONDS s"
timeout $((330 - SECONDS)) python3 -m hladsl bench --specs hla3_masked hla3 --gated --baselines fla --modes fwd fwd+bwd --T 16384 \
  --json $OUT/run275.json --plot '' 2>&1 | grep -v "^\s*$" | grep -v compiling | tail -8
echo "done at $SECONDS s"
