# Round 38, first call: round 37's review mends on a GPU (run254_trials.py: the trials compile the
# variants the launch runs; a second call compiles nothing); hla3's GPU cases not reached before
# (varlen, fp16 ungated with a state as written, scan, backend="triton"); hla3 / hla3_masked timed
# beside fla on the final round-37 tree.
set -u
export TRITON_CACHE_DIR=/tmp/hl/triton HLADSL_CACHE_DIR=/tmp/hl/hladsl
mkdir -p /tmp/hl/w $OUT/t
for gated in "" "--gated"; do
  timeout 330 python3 -m hladsl bench --baselines fla --plot '' --specs hla3 hla3_masked $gated --modes fwd fwd+bwd --T 16384 > /tmp/hl/w/w$gated.log 2>&1 &
done
(timeout 330 python3 benchmarks/results/run254_trials.py > /tmp/hl/w/trials.log 2>&1; echo "rc $?" >> /tmp/hl/w/trials.log) &
K="(varlen_matches_each_sequence_alone and hla3 and not hla3_masked) or hla3-fp16-ungated-plain-two_pass-state-d64 or hla3-bf16-ungated-plain-scan-nostate-d64 or (triton_backend_and_named_inputs_equal_auto and hla3 and not hla3_masked)"
OUT=$OUT/t GPU_TESTS_BUDGET=330 bash benchmarks/gpu_tests.sh -m gpu -n 6 -k "$K" 2>&1 | tail -2
python3 - <<'PY'
import json, os
d = json.load(open(os.environ["OUT"] + "/t/gpu-summary.json"))
for f in d.get("failures", [])[:5]:
    print(str(f)[:600])
PY
wait
echo "--- trials"; tail -12 /tmp/hl/w/trials.log
echo "tests + warm-up done at $SECONDS s"
for gated in "" "--gated"; do
  timeout $(((585 - SECONDS) / 2)) python3 -m hladsl bench --specs hla3 hla3_masked $gated --baselines fla --modes fwd fwd+bwd --T 16384 \
    --json $OUT/run254${gated/--/_}.json --plot '' 2>&1 | grep -E "^(fwd|---)" | cut -c1-120
  echo "done at $SECONDS s"
done
