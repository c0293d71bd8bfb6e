# Next session (prepared in round 39, not run yet): what run 264 did not reach -- the fp32 GPU tests of hla3 and
# hla3_masked after the gradient-warps rule; round 37's mend check (run254_trials.py: trial compiles == launch
# variants, bf16 then fp32, now that fp32 no longer faults); hla3's stateless varlen case and the hla3 cases
# run 254 did not reach.
set -u
export TRITON_CACHE_DIR=/tmp/hl/triton HLADSL_CACHE_DIR=/tmp/hl/hladsl
# run 263 c: EXACT_DOTS=bf16x3 (gradient kernels at 4 warps: PREC is not tf32) gave a NaN dq; at 8 warps?
(CUDA_LAUNCH_BLOCKING=1 HLADSL_LAUNCH="EXACT_DOTS=bf16x3" timeout 300 python3 benchmarks/results/run262_repro.py ahla 1 2>&1 | grep -E "OK|FAILED" > /tmp/x1.log) &
(CUDA_LAUNCH_BLOCKING=1 HLADSL_LAUNCH="EXACT_DOTS=bf16x3 GRAD_WARPS=8" timeout 300 python3 benchmarks/results/run262_repro.py ahla 1 2>&1 | grep -E "OK|FAILED" > /tmp/x2.log) &
(timeout 400 python3 benchmarks/results/run254_trials.py 2>&1 | grep -v -i warn | grep -v "^hladsl: compiling" | tail -8 > /tmp/trials.log) &
OUT=$OUT/t GPU_TESTS_BUDGET=$((560 - SECONDS)) bash benchmarks/gpu_tests.sh -m "gpu" -n 10 \
  -k "(fp32_inputs and hla3) or (varlen and hla3) or (forward_backward and hla3 and fp16)" 2>&1 | tail -4
wait
echo "== run254_trials.py"; cat /tmp/trials.log; echo "== bf16x3 (4 warps, 8 warps)"; cat /tmp/x1.log /tmp/x2.log
