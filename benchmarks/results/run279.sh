# Round 43, run 279: the GPU suite on the forward's register-gathered power columns (d <= 64) and power's long
# chunk at d = 128; power's new d = 128 "auto" cases (slow-marked); then power p = 2 fwd + bwd at d = 64 with the
# forward gathering against dots everywhere, and d = 128 fwd at the new rule against C = 64 (gated and not).
set -u
export TRITON_CACHE_DIR=/tmp/hl/triton HLADSL_CACHE_DIR=/tmp/hl/hladsl
OUT=$OUT/t GPU_TESTS_BUDGET=280 bash benchmarks/gpu_tests.sh -m "gpu and not slow" -n 12 2>&1 | tail -3
echo "suite done at $SECONDS s"
OUT=$OUT/t2 GPU_TESTS_BUDGET=100 bash benchmarks/gpu_tests.sh -m gpu -n 4 -k "power2 and d128" 2>&1 | tail -3
echo "power d128 cases done at $SECONDS s"
show() { python3 -c "
import json, sys; r = json.load(open(sys.argv[1]))['rows']
print('\n'.join(f\"{sys.argv[2]} {x['what']} {x['mode']} d={x['d']} T={x['T']}: {x['ms']:.4g} ms\" for x in r))" $1 $2 2>&1 | tail -16; }
for mode in auto dot; do
  HLADSL_POWER_COLUMNS=$mode timeout 70 python3 -m hladsl bench --specs power --gated --baselines \
    --modes fwd fwd+bwd --T 16384 --d 64 --json $OUT/run279_$mode.json --plot '' > $OUT/run279_$mode.txt 2>&1
  show $OUT/run279_$mode.json $mode
done
timeout $((570 - SECONDS)) python3 -m hladsl bench --specs power --baselines --modes fwd --T 16384 --d 128 \
  --launch FORWARD_CHUNK=64 --json $OUT/run279_d128.json --plot '' > $OUT/run279_d128.txt 2>&1
show $OUT/run279_d128.json ungated
echo "done at $SECONDS s"
