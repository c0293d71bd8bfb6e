# Round 43, run 281: the gated backward's chunk starts in bf16 where dΛ's inner products are their only
# other reads (launch.GATED_STARTS_IN_SDOT, opt-in), against fp32 starts, same process: gated hla3_masked and
# hla3 fwd + bwd at T = 16k; then the gated stateless bf16 GPU cases with the switch on (HLADSL_LAUNCH).
set -u
export TRITON_CACHE_DIR=/tmp/hl/triton HLADSL_CACHE_DIR=/tmp/hl/hladsl
show() { python3 -c "
import json, sys; r = json.load(open(sys.argv[1]))['rows']
print('\n'.join(f\"{x['what']} {x['mode']} d={x['d']} T={x['T']}: {x['ms']:.4g} ms\" for x in r))" $1 2>&1 | tail -8; }
for spec in hla3_masked hla3; do
  timeout $(( SECONDS < 100 ? 110 : 230 - SECONDS )) python3 -m hladsl bench --specs $spec --gated --baselines \
    --modes fwd+bwd --T 16384 --launch GATED_STARTS_IN_SDOT=true --json $OUT/run281_$spec.json --plot '' \
    > $OUT/run281_$spec.txt 2>&1; show $OUT/run281_$spec.json
  echo "$spec done at $SECONDS s"
done
HLADSL_LAUNCH="GATED_STARTS_IN_SDOT=true" OUT=$OUT/t GPU_TESTS_BUDGET=$(( 330 - SECONDS )) bash benchmarks/gpu_tests.sh -m gpu -n 8 \
  -k "test_forward_backward_matches_fp32_reference and gated and nostate and bf16 and d64 and plain and not norm" 2>&1 | tail -2
echo "done at $SECONDS s"
