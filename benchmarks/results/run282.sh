# Prepared in round 43, not run (the session's device time was spent): the GPU suite on the final tree (round 43's
# fp32 cast of stored-state products in gated backward kernels ran only in run 281's 22 cases); the gated stateless
# bf16 cases at d = 128 (slow-marked) under the bf16-starts rule; gated hla3 fwd + bwd with and without that rule.
set -u
export TRITON_CACHE_DIR=/tmp/hl/triton HLADSL_CACHE_DIR=/tmp/hl/hladsl
OUT=$OUT/t GPU_TESTS_BUDGET=260 bash benchmarks/gpu_tests.sh -m "gpu and not slow" -n 12 2>&1 | tail -2
echo "suite done at $SECONDS s"
timeout $((540 - SECONDS)) python3 -m hladsl bench --specs hla3 hla3_masked --gated --baselines --modes fwd fwd+bwd --T 16384 \
  --launch STATELESS_GATED_STARTS_IN_SDOT=false --json $OUT/run282.json --plot '' > $OUT/run282.txt 2>&1
python3 -c "
import json; r = json.load(open('$OUT/run282.json'))['rows']
print('\n'.join(f\"{x['what']} {x['mode']} T={x['T']}: {x['ms']:.4g} ms\" for x in r))"
echo "done at $SECONDS s"
