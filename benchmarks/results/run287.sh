# Round 44, run 287: power's forward at d = 128 with row tiles (POWER_COLUMNS "auto" -> "rows" there) against the
# one-hot dots (the round-43 default there), separate processes (the mode is read at import); profiles of both;
# then power's GPU cases (d = 64 and 128, the slow ones included) on the row-tile tree.
set -u
export TRITON_CACHE_DIR=/tmp/hl/triton HLADSL_CACHE_DIR=/tmp/hl/hladsl
show() { python3 -c "
import json, sys; r = json.load(open(sys.argv[1]))['rows']
print('\n'.join(f\"{sys.argv[2]}: {x['what']} {x['mode']} d={x['d']} T={x['T']}: {x['ms']:.4g} ms\" for x in r))" $1 $2 2>&1 | tail -8; }
for mode in auto dot; do   # (auto was row tiles at d = 128 then: now HLADSL_POWER_COLUMNS=rows)
  HLADSL_POWER_COLUMNS=$mode timeout 150 python3 benchmarks/profile_kernels.py power:p=2 --gated --mode fwd --d 128 --T 16384 \
    2>&1 | grep -v "compiling\|Warn\|warn" | head -5 | sed "s/^/[$mode] /"
  HLADSL_POWER_COLUMNS=$mode timeout 150 python3 -m hladsl bench --specs power:p=2 --gated --baselines --modes fwd \
    --d 128 --T 16384 65536 --json $OUT/run287_$mode.json --plot '' > $OUT/run287_$mode.txt 2>&1; show $OUT/run287_$mode.json $mode
  echo "$mode done at $SECONDS s"
done
OUT=$OUT/t GPU_TESTS_BUDGET=$(( 560 - SECONDS )) bash benchmarks/gpu_tests.sh -m gpu -n 8 -k "power" 2>&1 | tail -2
echo "done at $SECONDS s"
