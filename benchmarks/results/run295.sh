# Round 45, prepared for the next session (not run: the device time was spent): the final rule's own rows
# (ATTENTION_MAC_RATIO 3.5, 3 stages) -- power p = 2 gated and p = 3 beside retention; linear at the short
# lengths where the rule now takes the attention form (512, 1024 tokens; the rule's ratio there is extrapolated
# from T >= 4k), against the chunk form; then the quick GPU suite and the attention form's slow cases.
set -u
export TRITON_CACHE_DIR=/tmp/hl/triton HLADSL_CACHE_DIR=/tmp/hl/hladsl
bench() { timeout $1 python3 -m hladsl bench "${@:2}" --plot '' 2>/dev/null | grep -v "^wrote" | tail -30; echo "[bench done at $SECONDS s]"; }
bench 200 --specs power:p=2 --gated --baselines retention --modes fwd --d 64 128 --T 4096 16384 65536 \
  --launch ATTENTION_FORM=never --json $OUT/run295_power.json
bench 100 --specs linear --gated --baselines fla --modes fwd --d 64 128 --T 512 1024 --launch ATTENTION_FORM=never \
  --json $OUT/run295_linear_short.json
OUT=$OUT/t GPU_TESTS_BUDGET=280 bash benchmarks/gpu_tests.sh -m "gpu and not slow" -n 12 2>&1 | tail -1
