# Next session (prepared in round 38, not run yet): which launch change stops hla3's fp32 reverse-pass fault
# (run 258), each its own process, CUDA_LAUNCH_BLOCKING=1, B = 1, T = 1024, H = 2, ungated and gated; then the
# fp32 GPU tests (tests/gpu/test_gpu_fp32.py) on this tree.
set -u
export TRITON_CACHE_DIR=/tmp/hl/triton HLADSL_CACHE_DIR=/tmp/hl/hladsl CUDA_LAUNCH_BLOCKING=1
R() { timeout 400 python3 benchmarks/results/run256_repro.py 1 1024 2 fp32 "$@" 2>&1 | grep -v -i warn | grep -v "^hladsl: compiling" | head -4 | cut -c1-400; }
(R > /tmp/a.log) &                                                              # as is (fails)
(HLADSL_LAUNCH="WALKER_ELEMENTS_PER_4_WARPS=1000000" R > /tmp/b.log) &         # 4 warps at every width
(HLADSL_LAUNCH="NARROWEST_SPLIT=32" R > /tmp/c.log) &                          # no value blocks of 16
(R gated > /tmp/d.log) &                                                        # the gated call
(R ieee > /tmp/e.log) &                                                         # fp32-accurate dots as "ieee"
wait
for f in a b c d e; do echo "== $f"; cat /tmp/$f.log; done
unset CUDA_LAUNCH_BLOCKING
OUT=$OUT/t GPU_TESTS_BUDGET=$((590 - SECONDS)) bash benchmarks/gpu_tests.sh -m gpu -n 6 -k fp32_inputs 2>&1 | tail -2
