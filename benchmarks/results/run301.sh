# Round 47, call 2: the form-tuning GPU test mended (run 300: a bound replay hid the routed form from its spy;
# linear at B = 1, H = 4 host-bound), the attention tests' slow cases with their ratios printed; then the
# cost of the kept fp32 o (power p = 2 normalised against plain, the attention form forced, fwd + bwd), and
# hla3's forward at d = 64 / 128 up to 64k (issue 13's d = 128 bar at 64k, never measured).
set -u
export TRITON_CACHE_DIR=/tmp/hl/triton HLADSL_CACHE_DIR=/tmp/hl/hladsl
bench() { timeout $1 python3 -m hladsl bench "${@:2}" --plot '' 2>&1 | grep -v "^wrote\|compiling " | tail -40; echo "[bench done at $SECONDS s]"; }
timeout 150 python3 -m pytest -q -p no:cacheprovider -n 0 -s tests/gpu/test_gpu_form_tuning.py 2>&1 \
  | grep "^power\|^linear\|passed\|failed\|Error\|assert" | cut -c1-900
echo "[tuning tests done at $SECONDS s]"
timeout 150 python3 -m pytest -q -p no:cacheprovider -n 0 -s -m "gpu and slow" tests/gpu/test_gpu_attention.py -k backward 2>&1 \
  | grep "^power\|^linear\|passed\|failed\|Error\|assert" | cut -c1-900
echo "[slow tests done at $SECONDS s]"
bench 120 --specs power:p=2 power:p=2,normalize=true --gated --baselines --modes fwd+bwd --d 64 --T 4096 16384 \
  --launch ATTENTION_FORM=always --json $OUT/run301_kept_o.json
bench 200 --specs hla3 --gated --baselines --modes fwd --d 64 128 --T 16384 65536 --json $OUT/run301_hla3.json
