# Round 39: the tf32 warpgroup guard (launch.wgmma_safe) against run 260's faults, each call its own
# process with CUDA_LAUNCH_BLOCKING=1 (ahla gated with the guard off and on, hla3 ungated with it on),
# then the fp32 GPU tests on this tree.
set -u
export TRITON_CACHE_DIR=/tmp/hl/triton HLADSL_CACHE_DIR=/tmp/hl/hladsl CUDA_LAUNCH_BLOCKING=1
R() { timeout 300 python3 benchmarks/results/run261_repro.py "$@" 2>&1 | grep -v -i warn | grep -v "^hladsl: compiling" | head -14 | cut -c1-500; }
(HLADSL_LAUNCH="TF32_SPLIT_MIN_TILE=0" R ahla 1 > /tmp/a.log) &
(R ahla 1 > /tmp/b.log) &
(R hla3 0 > /tmp/c.log) &
wait
for f in a b c; do echo "== $f"; cat /tmp/$f.log; done
unset CUDA_LAUNCH_BLOCKING
OUT=$OUT/t GPU_TESTS_BUDGET=$((585 - SECONDS)) bash benchmarks/gpu_tests.sh -m gpu -n 8 -k fp32_inputs 2>&1 | tail -3
