# Round 44, run 283: the first two parts of the run round 43 prepared as run282.sh (removed: this replaces it; the GPU suite on the final tree of round 43; the gated stateless
# d = 128 cases under the bf16-starts rule), then where hla3_masked's training goes now (profiles, ungated and gated).
set -u
export TRITON_CACHE_DIR=/tmp/hl/triton HLADSL_CACHE_DIR=/tmp/hl/hladsl
OUT=$OUT/t GPU_TESTS_BUDGET=250 bash benchmarks/gpu_tests.sh -m "gpu and not slow" -n 12 2>&1 | tail -2
echo "suite done at $SECONDS s"
OUT=$OUT/t2 GPU_TESTS_BUDGET=110 bash benchmarks/gpu_tests.sh -m gpu -n 8 \
  -k "test_forward_backward_matches_fp32_reference and -gated- and nostate and d128" 2>&1 | tail -2
echo "d = 128 gated cases done at $SECONDS s"
for g in "" "--gated"; do
  timeout $(( 570 - SECONDS )) python3 benchmarks/profile_kernels.py hla3_masked $g --T 16384 --mode fwd+bwd --launches \
    > $OUT/run283_prof_hla3_masked$g.txt 2>&1; tail -40 $OUT/run283_prof_hla3_masked$g.txt
  echo "profile $g done at $SECONDS s"
done
