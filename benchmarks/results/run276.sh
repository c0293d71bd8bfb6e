# Round 43, run 276: where power p = 2's gated forward goes at d = 64 and d = 128 (T = 16k), per kernel,
# then its do_bench time at both widths beside retention (d = 64), same process.
set -u
export TRITON_CACHE_DIR=/tmp/hl/triton HLADSL_CACHE_DIR=/tmp/hl/hladsl
for d in 64 128; do
  timeout 200 python3 benchmarks/profile_kernels.py power:p=2 --gated --mode fwd --T 16384 --d $d \
    --launches --json $OUT/run276_prof_d$d.json 2>&1 | grep -v compiling | tee $OUT/run276_prof_d$d.txt | head -45
  echo "profile d=$d done at $SECONDS s"
done
timeout $((560 - SECONDS)) python3 -m hladsl bench --specs power --gated --baselines retention --modes fwd --T 16384 \
  --d 64 128 --launch FORWARD_CHUNK=128 --json $OUT/run276_bench.json --plot '' > $OUT/run276_bench.txt 2>&1
python3 - <<'PY'
import json, os
try:
    rows = json.load(open(os.environ["OUT"] + "/run276_bench.json"))
    print(json.dumps(rows)[:3000])
except Exception as e:
    print("no json", e)
PY
echo "done at $SECONDS s"
