# Round 46, run 295: the attention form's backward (training on it) -- its GPU tests (every gradient against
# the fp32 torch path, T = 8192, the slow d = 128 cases included), then fwd + bwd of power p = 2 gated beside
# the chunk form and retention (TRITON_NO_AUTOTUNE=1), p = 3, and linear at short lengths.
set -u
export TRITON_CACHE_DIR=/tmp/hl/triton HLADSL_CACHE_DIR=/tmp/hl/hladsl
bench() { timeout $1 python3 -m hladsl bench "${@:2}" --plot '' 2>&1 | grep -v "^wrote" | tail -40; echo "[bench done at $SECONDS s]"; }
timeout 200 python3 -m pytest -q -p no:cacheprovider -n 4 -m gpu -s tests/gpu/test_gpu_attention.py -k backward 2>&1 \
  | grep "power\|linear\|passed\|failed\|Error\|error" | cut -c1-400
echo "[tests done at $SECONDS s]"
bench 240 --specs power:p=2 --gated --baselines retention --modes fwd+bwd --d 64 --T 4096 16384 \
  --launch ATTENTION_FORM=always --launch ATTENTION_FORM=never --json $OUT/run295_power64.json
bench 150 --specs power:p=2 --gated --baselines retention --modes fwd+bwd --d 128 --T 4096 16384 \
  --launch ATTENTION_FORM=always --json $OUT/run295_power128.json
bench 100 --specs power:p=3 --gated --baselines --modes fwd+bwd --d 64 --T 4096 16384 --launch ATTENTION_FORM=always \
  --json $OUT/run295_p3.json
