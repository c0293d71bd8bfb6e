# Prepared in round 42, not run (the session's device time was spent): the stored-dtype rules against
# fp32 storage for the specs they also reach (hla2, ahla, linear) and gated hla3 / hla3_masked, same process.
set -u
export TRITON_CACHE_DIR=/tmp/hl/triton HLADSL_CACHE_DIR=/tmp/hl/hladsl
timeout 250 python3 -m hladsl bench --specs hla2 ahla linear --baselines fla --modes fwd+bwd --T 16384 65536 \
  --launch STARTS_IN_SDOT=false STATELESS_D_STATES_IN_SDOT=false --json $OUT/run276_a.json --plot '' 2>&1 | grep "fwd+bwd"
timeout $((540 - SECONDS)) python3 -m hladsl bench --specs hla3_masked hla3 --gated --modes fwd fwd+bwd --T 16384 \
  --json $OUT/run276_b.json --plot '' 2>&1 | grep -E "^(fwd|fwd\+bwd) "
echo "done at $SECONDS s"
