# Round 37, second call: the gradient groups' new run-length rule (whole, else runs of 8 where their kernels
# do not spill past 1 KB, else runs of 4: launch.grad_fitting_parts) against the old one (GRAD_LONG_RUN=0),
# same process, hla3 and hla3_masked gated and not; the GPU suite's hla3 cases on this tree.
set -u
export TRITON_CACHE_DIR=/tmp/hl/triton HLADSL_CACHE_DIR=/tmp/hl/hladsl
mkdir -p /tmp/hl/w $OUT/t
i=0
for gated in "" "--gated"; do
  for v in "" "GRAD_LONG_RUN=0"; do
    i=$((i+1))
    HLADSL_LAUNCH="$v" timeout 330 python3 -m hladsl bench --baselines --plot '' --specs hla3 hla3_masked $gated --modes fwd fwd+bwd --T 16384 > /tmp/hl/w/w$i.log 2>&1 &
  done
  timeout 330 python3 -m hladsl bench --baselines fla --plot '' --specs linear $gated --modes fwd fwd+bwd --T 16384 > /tmp/hl/w/f$gated.log 2>&1 &
done
OUT=$OUT/t GPU_TESTS_BUDGET=290 bash benchmarks/gpu_tests.sh -m "gpu and not slow" -n 6 -k "hla3" 2>&1 | tail -2
wait
echo "tests + warm-up done at $SECONDS s"
for gated in "" "--gated"; do
  timeout $(((590 - SECONDS) / 2)) python3 -m hladsl bench --specs hla3 hla3_masked $gated --baselines fla --modes fwd fwd+bwd --T 16384 \
    --launch GRAD_LONG_RUN=0 --json $OUT/run251${gated/--/_}.json --plot '' 2>&1 | grep -E "^(fwd|---)" | cut -c1-120
  echo "done at $SECONDS s"
done
