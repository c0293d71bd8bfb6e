# Round 45, run 293: the GPU suite (quick) with the attention form in (before its "auto"-schedule guard:
# 3 tests that name a schedule failed, fixed in op.forward_impl; run 294 is the suite on the final tree).
OUT=$OUT/t GPU_TESTS_BUDGET=350 bash benchmarks/gpu_tests.sh -m "gpu and not slow" -n 12 2>&1 | tail -3
