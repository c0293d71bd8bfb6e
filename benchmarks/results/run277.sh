# Round 43, run 277: power's packed factor columns picked by tl.gather in registers (POWER_COLUMNS
# "gather") against one-hot dots ("dot", the default): the same bits (fwd + bwd, d = 64, 128), then
# gated fwd at T = 16k, d = 64, 128 and fwd + bwd at d = 64, each mode a process of its own.
set -u
export TRITON_CACHE_DIR=/tmp/hl/triton HLADSL_CACHE_DIR=/tmp/hl/hladsl
for mode in gather dot; do
  HLADSL_POWER_COLUMNS=$mode timeout 150 python3 benchmarks/results/run277_power_io.py $mode 2>&1 | grep -v compiling | tail -3
done
python3 benchmarks/results/run277_power_io.py compare gather dot
echo "io done at $SECONDS s"
for mode in gather dot; do
  HLADSL_POWER_COLUMNS=$mode timeout $(( (560 - SECONDS) / 2 )) python3 -m hladsl bench --specs power --gated --baselines \
    --modes fwd --T 16384 --d 64 128 --launch FORWARD_CHUNK=128 --json $OUT/run277_$mode.json --plot '' > $OUT/run277_$mode.txt 2>&1
  python3 -c "
import json; r = json.load(open('$OUT/run277_$mode.json'))['rows']
print('\n'.join(f\"$mode {x['what']} {x['mode']} d={x['d']} T={x['T']}: {x['ms']:.4g} ms\" for x in r))" 2>&1 | tail -12
  echo "$mode done at $SECONDS s"
done
