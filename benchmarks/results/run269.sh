# Prepared in round 40, run in round 41 (the GRAD_SIDE_PARTS switch it times was declined then and is not in the
# tree: run it on 3333ca8): hla3's and hla3_masked's gradient parts side by
# side (launch.GRAD_SIDE_PARTS, off by default) against a launch a part -- gradients against each other and
# fwd + bwd time in the same process, gated and not; then the GPU tests of the side path's specs with it on.
set -u
export TRITON_CACHE_DIR=/tmp/hl/triton HLADSL_CACHE_DIR=/tmp/hl/hladsl
for spec in hla3 hla3_masked; do
  for gated in "" gated; do
    timeout 140 python3 benchmarks/results/run269_side.py $spec $gated 2>&1 | grep -v compiling | tail -4
  done
done
if [ $SECONDS -lt 450 ]; then HLADSL_LAUNCH="GRAD_SIDE_PARTS=true" OUT=$OUT/t GPU_TESTS_BUDGET=$((580 - SECONDS)) bash benchmarks/gpu_tests.sh -m "gpu and not slow" -n 8 -k "hla3 or hla2 or linear" 2>&1 | tail -2; fi
