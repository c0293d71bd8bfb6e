# Round 36: dΛ networks ride with their inputs' gradient groups. GPU suite (gated cases, every spec),
# then fwd + bwd gated and ungated, this tree against round 35's (a84db9b, .whl/old) in the same run.
set -u
export TRITON_CACHE_DIR=/tmp/hl/triton HLADSL_CACHE_DIR=/tmp/hl/hladsl
mkdir -p /tmp/hl/w $OUT/t
NEW=$PYTHONPATH; OLD=/tmp/site:$PWD/.whl/old
B() { timeout 300 python3 -m hladsl bench --baselines --plot '' --modes fwd+bwd --T 16384 "$@"; }
for g in "" "--gated"; do
  (B --specs hla3 hla3_masked $g > /tmp/hl/w/n3$g.log 2>&1) &
  (PYTHONPATH=$OLD B --specs hla3 hla3_masked $g > /tmp/hl/w/o3$g.log 2>&1) &
  (B --specs linear hla2 ahla power:p=2 $g > /tmp/hl/w/n1$g.log 2>&1) &
  (PYTHONPATH=$OLD B --specs linear hla2 ahla power:p=2 $g > /tmp/hl/w/o1$g.log 2>&1) &
done
OUT=$OUT/t GPU_TESTS_BUDGET=300 bash benchmarks/gpu_tests.sh -m "gpu and not slow" -n 8 -k "gated" 2>&1 | tail -2
wait
echo "tests + warm-up done at $SECONDS s"
for g in "--gated" ""; do
  for v in new old; do
    P=$NEW; [ $v = old ] && P=$OLD
    PYTHONPATH=$P timeout $(( (590 - SECONDS) / 3 )) python3 -m hladsl bench --specs linear hla2 ahla hla3_masked hla3 power:p=2 $g --baselines fla \
      --modes fwd+bwd --T 16384 --json $OUT/run247_${v}${g/--/_}.json --plot '' 2>&1 | grep -E "^fwd" | cut -c1-110
    echo "$v $g done at $SECONDS s"
  done
done
