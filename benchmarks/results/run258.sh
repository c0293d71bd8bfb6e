# Round 38, fifth call: run 257's fault is in run254_trials.py's fp32 call (its bf16 calls pass alone)?
# hla3 stateless with fp32 inputs, CUDA_LAUNCH_BLOCKING=1, the last launch named; memcheck at a small shape.
set -u
export TRITON_CACHE_DIR=/tmp/hl/triton HLADSL_CACHE_DIR=/tmp/hl/hladsl
S=/usr/local/cuda/bin/compute-sanitizer
(timeout 330 $S --tool memcheck --print-limit 3 python3 benchmarks/results/run256_repro.py 1 1024 2 fp32 > /tmp/san.log 2>&1; echo "rc $?" >> /tmp/san.log) &
CUDA_LAUNCH_BLOCKING=1 timeout 300 python3 benchmarks/results/run256_repro.py 2 2048 4 fp32 2>&1 | grep -v -i warn | tail -16
CUDA_LAUNCH_BLOCKING=1 timeout 200 python3 benchmarks/results/run256_repro.py 1 1024 2 fp32 gated 2>&1 | grep -v -i warn | tail -6
wait
grep -v -i "warn" /tmp/san.log | grep -v "^hladsl: compiling" | head -60 | cut -c1-300
