# Round 36, first GPU call (H200): the GPU cases not yet run (hla3's short sequences and varlen,
# stateless varlen, T = 65536 stateless), then where hla3's and hla3_masked's fwd + bwd time goes.
set -u
export TRITON_CACHE_DIR=/tmp/hl/triton HLADSL_CACHE_DIR=/tmp/hl/hladsl
mkdir -p /tmp/hl/w $OUT/t
P() { python3 benchmarks/profile_kernels.py "$@"; }
# warm-up (compiles) beside the tests; timed again alone below
for s in hla3 hla3_masked; do
  (timeout 400 python3 benchmarks/profile_kernels.py $s --d 64 --T 16384 --mode fwd+bwd > /tmp/hl/w/$s.log 2>&1; \
   timeout 100 python3 benchmarks/profile_kernels.py $s --d 64 --T 16384 --mode fwd > /tmp/hl/w/$s-f.log 2>&1) &
done
OUT=$OUT/t GPU_TESTS_BUDGET=390 bash benchmarks/gpu_tests.sh -m gpu -n 12 \
  -k "(hla3 and not masked and (short or varlen)) or stateless or (test_gpu_long and nostate)" 2>&1 | tail -3
wait
echo "tests + warm-up done at $SECONDS s"; tail -n 3 /tmp/hl/w/*.log | cut -c1-160
for s in hla3 hla3_masked; do
  for m in fwd+bwd fwd; do
    timeout 60 python3 benchmarks/profile_kernels.py $s --d 64 --T 16384 --mode $m --json $OUT/run245_prof_${s}_${m/+/_}.json 2>&1 | tail -30
  done
done
echo "profiles done at $SECONDS s"
timeout $((585 - SECONDS)) python3 -m hladsl bench --specs hla3 hla3_masked --baselines fla --modes fwd fwd+bwd --T 16384 \
  --json $OUT/run245_bench.json --plot '' 2>&1 | grep -v "^\s*$" | tail -8
echo "all done at $SECONDS s"
