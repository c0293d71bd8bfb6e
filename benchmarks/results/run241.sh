# Round 34, run 241: the GPU cases run 240's quick suite failed on (test expectations), the d = 128
# cases (grad_warps), then d = 128 fwd + bwd with the wide-dim rule against 4 warps as written.
set -u
OUT=$OUT GPU_TESTS_BUDGET=250 bash benchmarks/gpu_tests.sh -m gpu -n 15 \
  -k "(two_kv and nostate) or direct or (d128 and (hla2 or linear or ahla or power2))" 2>&1 | tail -3
python3 -m hladsl bench --specs linear hla2 ahla --baselines fla --modes fwd+bwd --T 16384 --d 128 \
  --launch WIDE_GRAD_WARPS=4 CARRY_DERIVED=false --launch CARRY_DERIVED=false --json $OUT/run241_d128.json --plot '' 2>&1 | grep -v "^\s*$" | tail -20
