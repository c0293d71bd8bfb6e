# Time HLA3's carried form (product summaries) beside fla, and the 8-warp gradient rule at d = 128.
# Kernels are compiled first by parallel warm-up processes (one per variant and shape; their
# timings are discarded), so that the timed processes below start with a warm cache.
set -u
export TRITON_CACHE_DIR=/tmp/hl/triton HLADSL_CACHE_DIR=/tmp/hl/hladsl
mkdir -p /tmp/hl/w
for T in 4096 16384 65536; do
  HLADSL_LAUNCH="CARRY_PRODUCTS=true" timeout 290 python3 -m hladsl bench --baselines --plot '' --specs hla3 --modes fwd fwd+bwd --T $T --json /tmp/hl/w/h$T.json > /tmp/hl/w/h$T.log 2>&1 &
done
i=0
for spec in linear hla2 ahla; do
  for v in "" "WIDE_GRAD_WARPS=4 CARRY_DERIVED=false" "CARRY_DERIVED=false"; do
    i=$((i+1))
    HLADSL_LAUNCH="$v" timeout 290 python3 -m hladsl bench --baselines --plot '' --specs $spec --modes fwd+bwd --T 16384 --d 128 --json /tmp/hl/w/d$i.json > /tmp/hl/w/d$i.log 2>&1 &
  done
done
wait
echo "warm-up done at $SECONDS s"; tail -n 2 /tmp/hl/w/*.log | grep -v "^$" | cut -c1-200
# (1) HLA3 with product summaries (launch.CARRY_PRODUCTS=true for the whole process), fla beside it
HLADSL_LAUNCH="CARRY_PRODUCTS=true" timeout 150 python3 -m hladsl bench --specs hla3 --baselines fla --modes fwd fwd+bwd \
  --T 4096 16384 65536 --json $OUT/run243_hla3.json --plot '' 2>&1 | grep -v "^\s*$" | tail -16
echo "hla3 done at $SECONDS s"
# (2) the 8-warp gradient rule at d = 128 against 4 warps (as written), and as written at 8 warps
timeout $((560 - SECONDS)) python3 -m hladsl bench --specs linear hla2 ahla --baselines fla --modes fwd+bwd --T 16384 --d 128 \
  --launch WIDE_GRAD_WARPS=4 CARRY_DERIVED=false --launch CARRY_DERIVED=false --json $OUT/run243_d128.json --plot '' 2>&1 | grep -v "^\s*$" | tail -14
echo "all done at $SECONDS s"
