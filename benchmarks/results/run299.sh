# Round 46, run 299: the final tree after run 298's fixes (launch.attention_launch's DOT given twice at feature dims
# under 64; a GPU test leaving a memoised op's schedule "two_pass"; p = 3's gradient test at H = 1, T = 4096; bound
# replays of training calls on the attention form) -- the quick GPU suite, the attention tests' slow (d = 128)
# cases, and linear fwd + bwd at the short lengths the rule takes the attention form, now bound.
set -u
export TRITON_CACHE_DIR=/tmp/hl/triton HLADSL_CACHE_DIR=/tmp/hl/hladsl
bench() { timeout $1 python3 -m hladsl bench "${@:2}" --plot '' 2>&1 | grep -v "^wrote\|compiling " | tail -40; echo "[bench done at $SECONDS s]"; }
OUT=$OUT/t GPU_TESTS_BUDGET=270 bash benchmarks/gpu_tests.sh -m "gpu and not slow" -n 12 2>&1 | tail -1
timeout 100 python3 -m pytest -q -p no:cacheprovider -n 4 -m "gpu and slow" -s tests/gpu/test_gpu_attention.py 2>&1 \
  | grep "^power\|^linear\|passed\|failed\|Error" | cut -c1-600
echo "[slow attention tests done at $SECONDS s]"
bench 45 --specs linear --gated --baselines --modes fwd+bwd --d 64 --T 512 1024 --launch ATTENTION_FORM=never \
  --json $OUT/run299_linear.json
