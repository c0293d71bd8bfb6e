# Round 45, run 290: the attention form (ir.attention) on the GPU -- its GPU tests, then power p = 2's
# forward (gated) at d = 64 and 128 with the rule ("auto"), the chunk form ("never") and the attention
# form ("always") side by side with retention; the attention kernel's launch variants at d = 128.
set -u
export TRITON_CACHE_DIR=/tmp/hl/triton HLADSL_CACHE_DIR=/tmp/hl/hladsl
bench() { timeout $1 python3 -m hladsl bench "${@:2}" --plot '' 2>/dev/null | grep -v "^wrote" | tail -40; echo "[bench done at $SECONDS s]"; }
timeout 200 python3 -m pytest -q -p no:cacheprovider -x tests/gpu/test_gpu_attention.py 2>&1 | tail -6
echo "[tests done at $SECONDS s]"
bench 300 --specs power:p=2 --gated --baselines retention --modes fwd --d 64 128 --T 4096 16384 65536 \
  --launch ATTENTION_FORM=never --launch ATTENTION_FORM=always --json $OUT/run290_power.json
