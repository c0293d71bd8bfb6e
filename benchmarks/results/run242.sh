# Round 35's first GPU call: HLA3's carried form on the GPU (numerics, then time), then the
# cases round 34 could not run.
set -u
export TRITON_CACHE_DIR=/tmp/hladsl-gpu-tests/triton HLADSL_CACHE_DIR=/tmp/hladsl-gpu-tests/hladsl
# (1) hla3 with product summaries (CARRY_PRODUCTS): bf16 numerics against fp32, T = 8192 (slow cases)
mkdir -p $OUT/t1 $OUT/t2
OUT=$OUT/t1 GPU_TESTS_BUDGET=200 bash benchmarks/gpu_tests.sh -m gpu -n 15 -k "products" 2>&1 | tail -3
# (2) HLA3's carried form against it as written (forward, fwd + bwd), fla alongside
timeout 260 python3 -m hladsl bench --specs hla3 --baselines fla --modes fwd fwd+bwd --T 4096 16384 \
  --launch CARRY_PRODUCTS=true --json $OUT/run242_hla3.json --plot '' 2>&1 | grep -v "^\s*$" | tail -12
# (3) what round 34 could not run, in what time is left
OUT=$OUT/t2 GPU_TESTS_BUDGET=110 bash benchmarks/gpu_tests.sh -m gpu -n 15 \
  -k "(direct and training) or (hla2 and gated-norm and d128) or (nostate and (norm or fp16)) or (two_kv and ungated and nostate and d64)" 2>&1 | tail -3
