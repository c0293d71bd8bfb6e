# Round 36: HLA3's gradient kernels (18 launches, 66 % of its fwd + bwd in run 245): whole groups
# that spill, 8 warps, runs of 8 networks -- against the rule's runs of 4, same process.
set -u
export TRITON_CACHE_DIR=/tmp/hl/triton HLADSL_CACHE_DIR=/tmp/hl/hladsl
mkdir -p /tmp/hl/w
V=("GRAD_WHOLE_MAX_SPILL=100000" "GRAD_WARPS=8" "GRAD_WARPS=8 GRAD_WHOLE_MAX_SPILL=100000" "GRAD_NETWORKS_PER_PROGRAM=8" "GRAD_NETWORKS_PER_PROGRAM=8 GRAD_WARPS=8")
i=0
for gated in "" "--gated"; do
  for v in "" "${V[@]}"; do
    i=$((i+1))
    HLADSL_LAUNCH="$v" timeout 330 python3 -m hladsl bench --baselines --plot '' --specs hla3 hla3_masked $gated --modes fwd+bwd --T 16384 --json /tmp/hl/w/w$i.json > /tmp/hl/w/w$i.log 2>&1 &
  done
done
wait
echo "warm-up done at $SECONDS s"; tail -qn 2 /tmp/hl/w/*.log | grep -v "^$" | cut -c1-160
L=(); for v in "${V[@]}"; do L+=(--launch $v); done
for gated in "" "--gated"; do
  timeout $(((560 - SECONDS) / 2)) python3 -m hladsl bench --specs hla3 hla3_masked $gated --baselines fla --modes fwd fwd+bwd --T 16384 \
    "${L[@]}" --json $OUT/run246${gated/--/_}.json --plot '' 2>&1 | grep -v "^\s*$" | tail -16
  echo "done at $SECONDS s"
done
