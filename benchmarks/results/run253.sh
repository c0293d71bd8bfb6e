# Round 37, last call: decay masks formed where they multiply (Block._decay_product: x * E *...* E, one
# [C, C] tile of E = [c <= r] exp(Λ_r − Λ_c) a kernel holds) in the backward's kernels, against the
# committed tree (.whl/old = git archive fc50f8c hladsl), gated hla3 and hla3_masked; their gated
# numerics cases (stateless: the carried hla3, hla3_masked as written) on this tree.
set -u
export TRITON_CACHE_DIR=/tmp/hl/triton HLADSL_CACHE_DIR=/tmp/hl/hladsl
mkdir -p /tmp/hl/w $OUT/t
NEW=$PYTHONPATH; OLD=/tmp/site:$PWD/.whl/old:$PWD/tests/gpu
B() { timeout 200 python3 -m hladsl bench --baselines --plot '' --specs hla3 hla3_masked --gated --modes fwd fwd+bwd --T 16384 "$@"; }
(B > /tmp/hl/w/new.log 2>&1) &
(PYTHONPATH=$OLD B > /tmp/hl/w/old.log 2>&1) &
OUT=$OUT/t GPU_TESTS_BUDGET=200 bash benchmarks/gpu_tests.sh -m gpu -n 2 \
  -k "bf16-gated-plain-two_pass-nostate-d64 and (hla3 or hla3_masked)" 2>&1 | tail -2
wait
echo "tests + warm-up done at $SECONDS s"
for v in new old; do
  P=$NEW; [ $v = old ] && P=$OLD
  PYTHONPATH=$P timeout $(( (300 - SECONDS) / 2 )) python3 -m hladsl bench --specs hla3 hla3_masked --gated --baselines \
    --modes fwd fwd+bwd --T 16384 --json $OUT/run253_$v.json --plot '' 2>&1 | grep -E "^fwd" | cut -c1-100
  echo "$v done at $SECONDS s"
done
