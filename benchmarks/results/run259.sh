# Round 38, sixth call: run 258's fault (hla3 fp32 reverse_kernel at B_dv = 16, 8 warps, 1 stage: an invalid
# shared-memory read by memcheck) against two launch-layer changes, each its own process,
# CUDA_LAUNCH_BLOCKING=1: the fallbacks without 8 warps; fp32-accurate dots as "ieee".
set -u
export TRITON_CACHE_DIR=/tmp/hl/triton HLADSL_CACHE_DIR=/tmp/hl/hladsl CUDA_LAUNCH_BLOCKING=1
R() { timeout 230 python3 benchmarks/results/run256_repro.py 1 1024 2 fp32 "$@" 2>&1 | grep -v -i warn | grep -v "^hladsl: compiling" | head -4 | cut -c1-400; }
(R > /tmp/a.log) & (R warps4 > /tmp/b.log) & (R ieee > /tmp/c.log) &
wait
cat /tmp/a.log /tmp/b.log /tmp/c.log
