# Round 43, run 280: power p = 2 ungated forward at d = 64 (the d = 128 ratio's denominator), then round 42's
# backward gated: hla3_masked and hla3, fwd and fwd + bwd at T = 16k (a JSON each).
set -u
export TRITON_CACHE_DIR=/tmp/hl/triton HLADSL_CACHE_DIR=/tmp/hl/hladsl
show() { python3 -c "
import json, sys; r = json.load(open(sys.argv[1]))['rows']
print('\n'.join(f\"{x['what']} {x['mode']} d={x['d']} T={x['T']}: {x['ms']:.4g} ms\" for x in r))" $1 2>&1 | tail -8; }
timeout 40 python3 -m hladsl bench --specs power --baselines --modes fwd --T 16384 --d 64 \
  --json $OUT/run280_power.json --plot '' > /dev/null 2>&1; show $OUT/run280_power.json
for spec in hla3_masked hla3; do
  timeout $(( (330 - SECONDS) )) python3 -m hladsl bench --specs $spec --gated --baselines --modes fwd fwd+bwd --T 16384 \
    --json $OUT/run280_$spec.json --plot '' > $OUT/run280_$spec.txt 2>&1; show $OUT/run280_$spec.json
  echo "$spec done at $SECONDS s"
done
