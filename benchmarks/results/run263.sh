# Round 39: run 262 found ahla gated fp32's fault in its grad_kernel (TARGETS 4, whole, 4 warps, C = 64,
# tf32x3); memcheck of that call, and which launch change stops it -- each its own process.
set -u
export TRITON_CACHE_DIR=/tmp/hl/triton HLADSL_CACHE_DIR=/tmp/hl/hladsl CUDA_LAUNCH_BLOCKING=1
R() { timeout 250 python3 benchmarks/results/run262_repro.py "$@" 2>&1 | grep -v -i warn | grep -v "^hladsl: compiling" | head -6 | cut -c1-400; }
(HLADSL_LAUNCH="GRAD_WARPS=8" R ahla 1 > /tmp/a.log) &                 # gradient kernels at 8 warps
(HLADSL_LAUNCH="GRAD_WHOLE_MAX_MATMULS=0" R ahla 1 > /tmp/b.log) &     # no whole groups
(HLADSL_LAUNCH="EXACT_DOTS=bf16x3" R ahla 1 > /tmp/c.log) &            # bf16 dots, no tf32
(HLADSL_LAUNCH="BACKWARD_CHUNK=128" R ahla 1 > /tmp/d.log) &           # the long chunk
(timeout 280 /usr/local/cuda/bin/compute-sanitizer --tool memcheck --print-limit 2 python3 benchmarks/results/run262_repro.py ahla 1 2>&1 | grep -v -i warn | grep -v "^hladsl: compiling" | grep -E "Invalid|at |by thread|Address|FAILED|OK|ERROR SUMMARY" | head -12 | cut -c1-300 > /tmp/e.log) &
wait
for f in a b c d e; do echo "== $f"; cat /tmp/$f.log; done
