# Round 43, run 278: power p = 2's forward at d = 128 (gated, T = 16k): where the register gather's time goes,
# value blocks of 64 in the state pass, the long chunk, packed tiles of 32; then the "auto" column rule
# (gather from tiles <= 64 wide) against one-hot dots at d = 64, fwd and fwd + bwd, and p = 3.
set -u
export TRITON_CACHE_DIR=/tmp/hl/triton HLADSL_CACHE_DIR=/tmp/hl/hladsl
HLADSL_POWER_COLUMNS=gather timeout 100 python3 benchmarks/profile_kernels.py power:p=2 --gated --mode fwd --T 16384 --d 128 \
  --launches 2>&1 | grep -v compiling | grep -A4 "== power" | tee $OUT/run278_prof_gather.txt
echo "profile done at $SECONDS s"
show() { python3 -c "
import json, sys; r = json.load(open(sys.argv[1]))['rows']
print('\n'.join(f\"{sys.argv[2]} {x['what']} {x['mode']} d={x['d']} T={x['T']}: {x['ms']:.4g} ms\" for x in r))" $1 $2 2>&1 | tail -16; }
timeout 200 python3 -m hladsl bench --specs power --gated --baselines --modes fwd --T 16384 --d 128 \
  --launch STATE_BLOCK=64 --launch FORWARD_CHUNK=128 --launch PACKED_BLOCK=32 --launch PACKED_BLOCK=32 STATE_BLOCK=64 \
  --launch PACKED_BLOCK=128 --json $OUT/run278_d128.json --plot '' > $OUT/run278_d128.txt 2>&1
show $OUT/run278_d128.json d128
echo "d128 done at $SECONDS s"
for mode in auto dot; do
  HLADSL_POWER_COLUMNS=$mode timeout 90 python3 -m hladsl bench --specs power --gated --baselines \
    --modes fwd fwd+bwd --T 16384 --d 64 --json $OUT/run278_$mode.json --plot '' > $OUT/run278_$mode.txt 2>&1
  show $OUT/run278_$mode.json $mode
  HLADSL_POWER_COLUMNS=$mode timeout 90 python3 -m hladsl bench --specs power:p=3 --gated --baselines \
    --modes fwd --T 4096 --d 64 --json $OUT/run278_p3_$mode.json --plot '' > $OUT/run278_p3_$mode.txt 2>&1
  show $OUT/run278_p3_$mode.json $mode
  echo "$mode done at $SECONDS s"
done
