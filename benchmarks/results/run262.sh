# Round 39: run 261 left one fp32 fault (ahla gated, after its grad kernels); which launch, and which
# launch change stops it -- each call its own process, CUDA_LAUNCH_BLOCKING=1.
set -u
export TRITON_CACHE_DIR=/tmp/hl/triton HLADSL_CACHE_DIR=/tmp/hl/hladsl CUDA_LAUNCH_BLOCKING=1
R() { timeout 280 python3 benchmarks/results/run262_repro.py "$@" 2>&1 | grep -v -i warn | grep -v "^hladsl: compiling" | head -16 | cut -c1-600; }
(R ahla 1 > /tmp/a.log) &                                                        # as is
(HLADSL_LAUNCH="GRAD_WARPS=4" R ahla 1 > /tmp/b.log) &                           # gradient kernels at 4 warps
(HLADSL_LAUNCH="WALKER_ELEMENTS_PER_4_WARPS=1000000" R ahla 1 > /tmp/c.log) &    # walkers at 4 warps
(HLADSL_LAUNCH="TF32_SPLIT_MIN_TILE=256" R ahla 1 > /tmp/d.log) &                # no tf32 launch at 8 warps
(R ahla 0 > /tmp/e.log) &                                                        # ungated (passed in run 261)
wait
for f in a b c d e; do echo "== $f"; cat /tmp/$f.log; done
