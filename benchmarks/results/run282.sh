# Prepared in round 43, not run (the session's device time was spent): the GPU suite on the final tree (round 43's
# fp32 cast of stored-state products ran only in run 281's 22 cases, the split-dim column fix nowhere: it leaves the
# shipped specs' kernels as they were); the gated stateless bf16 cases at d = 128 (slow-marked) under the bf16-starts
# rule; gated hla3 and hla3_masked fwd + bwd with and without that rule.
set -u
export TRITON_CACHE_DIR=/tmp/hl/triton HLADSL_CACHE_DIR=/tmp/hl/hladsl
OUT=$OUT/t GPU_TESTS_BUDGET=250 bash benchmarks/gpu_tests.sh -m "gpu and not slow" -n 12 2>&1 | tail -2
echo "suite done at $SECONDS s"
OUT=$OUT/t2 GPU_TESTS_BUDGET=120 bash benchmarks/gpu_tests.sh -m gpu -n 8 \
  -k "test_forward_backward_matches_fp32_reference and -gated- and nostate and d128" 2>&1 | tail -2
echo "d = 128 gated cases done at $SECONDS s"
timeout $((560 - SECONDS)) python3 -m hladsl bench --specs hla3 hla3_masked --gated --baselines --modes fwd fwd+bwd --T 16384 \
  --launch STATELESS_GATED_STARTS_IN_SDOT=false --json $OUT/run282.json --plot '' > $OUT/run282.txt 2>&1
python3 -c "
import json; r = json.load(open('$OUT/run282.json'))['rows']
print('\n'.join(f\"{x['what']} {x['mode']} T={x['T']}: {x['ms']:.4g} ms\" for x in r))"
echo "done at $SECONDS s"
