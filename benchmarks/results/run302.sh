# Round 47, call 3: the final tree's GPU suite; the attention tests' slow cases with ratios; the normalised
# attention-form training after den's networks share num's last products and products with d den pulled out
# (normalised power: 5 -> 3 dots a key chunk in the query kernel, 6 -> 4 in the key kernel; run 301: 1.988 / 26.48 ms).
set -u
export TRITON_CACHE_DIR=/tmp/hl/triton HLADSL_CACHE_DIR=/tmp/hl/hladsl
bench() { timeout $1 python3 -m hladsl bench "${@:2}" --plot '' 2>&1 | grep -v "^wrote\|compiling " | tail -40; echo "[bench done at $SECONDS s]"; }
OUT=$OUT/t GPU_TESTS_BUDGET=300 bash benchmarks/gpu_tests.sh -m "gpu and not slow" -n 12 2>&1 | tail -1
echo "[suite done at $SECONDS s]"
timeout 120 python3 -m pytest -q -p no:cacheprovider -n 0 -s -m "gpu and slow" tests/gpu/test_gpu_attention.py -k backward 2>&1 \
  | grep "^power\|^linear\|passed\|failed\|Error\|assert" | cut -c1-900
echo "[slow tests done at $SECONDS s]"
bench 150 --specs power:p=2 power:p=2,normalize=true --gated --baselines --modes fwd+bwd --d 64 --T 4096 16384 \
  --launch ATTENTION_FORM=always --json $OUT/run302_normalised.json
