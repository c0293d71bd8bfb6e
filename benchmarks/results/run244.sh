# Round 35's last GPU call: HLA3's carried form (now the default for stateless calls) through the
# GPU suite's hla3 stateless cases (d = 16, 64, 128, scan, fp16, normalised, varlen, short), timed at
# d = 128 and against hla3 as written (CARRY_PRODUCTS=false) in the same process.
set -u
export TRITON_CACHE_DIR=/tmp/hl/triton HLADSL_CACHE_DIR=/tmp/hl/hladsl
mkdir -p /tmp/hl/w $OUT/t
W() { timeout 270 python3 -m hladsl bench --baselines --plot '' "$@"; }
W --specs hla3 --modes fwd fwd+bwd --T 16384 --d 128 --json /tmp/hl/w/a.json > /tmp/hl/w/a.log 2>&1 &
(export HLADSL_LAUNCH="CARRY_PRODUCTS=false"; W --specs hla3 --modes fwd --T 16384 65536 --json /tmp/hl/w/b.json > /tmp/hl/w/b.log 2>&1) &
W --specs hla3 --modes fwd --T 16384 65536 --json /tmp/hl/w/c.json > /tmp/hl/w/c.log 2>&1 &
OUT=$OUT/t GPU_TESTS_BUDGET=270 bash benchmarks/gpu_tests.sh -m gpu -n 12 \
  -k "(hla3 and not masked and (nostate or short or varlen)) or (hla2 and gated-norm and state and d128)" 2>&1 | tail -3
wait
echo "warm-up and tests done at $SECONDS s"; tail -n 2 /tmp/hl/w/*.log | grep -v "^$" | cut -c1-160
timeout 110 python3 -m hladsl bench --specs hla3 --baselines fla --modes fwd fwd+bwd --T 16384 --d 128 \
  --json $OUT/run244_d128.json --plot '' 2>&1 | grep -v "^\s*$" | tail -6
timeout $((570 - SECONDS)) python3 -m hladsl bench --specs hla3 --baselines fla --modes fwd --T 16384 65536 \
  --launch CARRY_PRODUCTS=false --json $OUT/run244_d64.json --plot '' 2>&1 | grep -v "^\s*$" | tail -8
echo "all done at $SECONDS s"
