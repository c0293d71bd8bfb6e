# Round 46, run 298: the final tree -- the quick GPU suite (the attention backward's non-slow cases in it); power
# p = 2 gated fwd + bwd, the attention form against the chunk form at d = 64 (T = 4k-64k) and by the rule at
# d = 128 (its backward at 1 stage: launch.ATTENTION_BWD_WIDE_STAGES); linear at the short lengths the rule takes
# the form. (Retention and fla compiled past the budget on a cold machine in run 297: their rows are run 295's.)
set -u
export TRITON_CACHE_DIR=/tmp/hl/triton HLADSL_CACHE_DIR=/tmp/hl/hladsl
bench() { timeout $1 python3 -m hladsl bench "${@:2}" --plot '' 2>&1 | grep -v "^wrote\|compiling " | tail -40; echo "[bench done at $SECONDS s]"; }
OUT=$OUT/t GPU_TESTS_BUDGET=270 bash benchmarks/gpu_tests.sh -m "gpu and not slow" -n 12 2>&1 | tail -2
bench 90 --specs power:p=2 --gated --baselines --modes fwd+bwd --d 64 --T 4096 16384 65536 \
  --launch ATTENTION_FORM=always --launch ATTENTION_FORM=never --json $OUT/run298_power64.json
bench 40 --specs power:p=2 --gated --baselines --modes fwd+bwd --d 128 --T 4096 16384 --json $OUT/run298_power128.json
bench 40 --specs linear --gated --baselines --modes fwd+bwd --d 64 --T 512 1024 --launch ATTENTION_FORM=always \
  --launch ATTENTION_FORM=never --json $OUT/run298_linear.json
