# Round 37, first call: the GPU suite on round 36's final tree (8a7ba37: its review's unit fix not yet run on a
# GPU), hla3's varlen cases (never reached), and the gradient kernels' run lengths again now that dΛ rides with
# its inputs (gated runs of 8 lost 5 % in run 246, when dΛ was a group of its own), same process.
set -u
export TRITON_CACHE_DIR=/tmp/hl/triton HLADSL_CACHE_DIR=/tmp/hl/hladsl
mkdir -p /tmp/hl/w $OUT/t
V=("GRAD_NETWORKS_PER_PROGRAM=8" "GRAD_WHOLE_MAX_SPILL=100000")
i=0
for gated in "" "--gated"; do
  for v in "" "${V[@]}"; do
    i=$((i+1))
    HLADSL_LAUNCH="$v" timeout 330 python3 -m hladsl bench --baselines --plot '' --specs hla3 hla3_masked $gated --modes fwd fwd+bwd --T 16384 > /tmp/hl/w/w$i.log 2>&1 &
  done
done
OUT=$OUT/t GPU_TESTS_BUDGET=300 bash benchmarks/gpu_tests.sh -m "gpu and not slow" -n 6 -k "gated" 2>&1 | tail -2
wait
echo "tests + warm-up done at $SECONDS s"; tail -qn 2 /tmp/hl/w/*.log | grep -v "^$" | cut -c1-160
L=(); for v in "${V[@]}"; do L+=(--launch $v); done
for gated in "" "--gated"; do
  timeout $(((585 - SECONDS) / 2)) python3 -m hladsl bench --specs hla3 hla3_masked $gated --baselines fla --modes fwd fwd+bwd --T 16384 \
    "${L[@]}" --json $OUT/run250${gated/--/_}.json --plot '' 2>&1 | grep -v "^\s*$" | tail -16
  echo "done at $SECONDS s"
done
