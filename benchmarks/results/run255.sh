# Round 38, second call: shared last factors (codegen.shared_factors: a family of gradient networks whose
# last products share an operand multiplies once) against the committed tree (.whl/old = git archive of
# round 37's final tree, hladsl only), same call, hla3 and hla3_masked gated and not; with the factored
# groups whole where they spill up to 2 KB (GRAD_WHOLE_MAX_SPILL=2048) as a third row. GPU numerics of
# the specs whose kernels changed (hla3 carried and as written, hla3_masked, ahla); run254_trials.py.
set -u
export TRITON_CACHE_DIR=/tmp/hl/triton HLADSL_CACHE_DIR=/tmp/hl/hladsl
mkdir -p /tmp/hl/w $OUT/t
NEW=$PYTHONPATH; OLD=/tmp/site:$PWD/.whl/old:$PWD/tests/gpu
B() { timeout 400 python3 -m hladsl bench --baselines fla --plot '' --specs hla3 hla3_masked --modes fwd fwd+bwd --T 16384 "$@"; }
(B --launch GRAD_WHOLE_MAX_SPILL=2048 > /tmp/hl/w/new.log 2>&1) &
(B --gated --launch GRAD_WHOLE_MAX_SPILL=2048 > /tmp/hl/w/newg.log 2>&1) &
(PYTHONPATH=$OLD B > /tmp/hl/w/old.log 2>&1) &
(PYTHONPATH=$OLD B --gated > /tmp/hl/w/oldg.log 2>&1) &
(timeout 300 python3 benchmarks/results/run254_trials.py > /tmp/hl/w/trials.log 2>&1; echo "rc $?" >> /tmp/hl/w/trials.log) &
K="test_forward_backward_matches_fp32_reference and (((hla3 or ahla) and d64 and bf16 and plain and two_pass and nostate) or hla3-bf16-gated-plain-two_pass-state-d64)"
OUT=$OUT/t GPU_TESTS_BUDGET=280 bash benchmarks/gpu_tests.sh -m gpu -n 5 -k "$K" 2>&1 | tail -2
python3 - <<'PY'
import json, os
d = json.load(open(os.environ["OUT"] + "/t/gpu-summary.json"))
for f in d.get("failures", [])[:5]:
    print(str(f)[:600])
PY
wait
echo "--- trials"; tail -8 /tmp/hl/w/trials.log
echo "tests + warm-up done at $SECONDS s"
for gated in "" "--gated"; do
  for v in new old; do
    P=$NEW; [ $v = old ] && P=$OLD
    extra=(); [ $v = new ] && extra=(--launch GRAD_WHOLE_MAX_SPILL=2048)
    PYTHONPATH=$P timeout $(( (590 - SECONDS) / 3 )) python3 -m hladsl bench --specs hla3 hla3_masked $gated --baselines fla \
      --modes fwd fwd+bwd --T 16384 "${extra[@]}" --json $OUT/run255_$v${gated/--/_}.json --plot '' 2>&1 | grep -E "^(fwd|---)" | cut -c1-120
    echo "$v $gated done at $SECONDS s"
  done
done
