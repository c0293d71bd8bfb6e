# Round 46, run 297: dΛ's pair tiles in each kernel's orientation (run 296's key kernel transposed them: d = 64,
# 16k 15.93 -> 18.87 ms). The backward's GPU tests; power p = 2 fwd + bwd beside the chunk form and retention
# (TRITON_NO_AUTOTUNE=1) at d = 64; d = 128 launch variants; linear at the lengths the rule takes the form.
set -u
export TRITON_CACHE_DIR=/tmp/hl/triton HLADSL_CACHE_DIR=/tmp/hl/hladsl
bench() { timeout $1 python3 -m hladsl bench "${@:2}" --plot '' 2>&1 | grep -v "^wrote\|compiling " | tail -40; echo "[bench done at $SECONDS s]"; }
timeout 150 python3 -m pytest -q -p no:cacheprovider -n 4 -m gpu -s tests/gpu/test_gpu_attention.py -k backward 2>&1 \
  | grep "^power\|^linear\|^\[(\|passed\|failed\|Error\|error" | cut -c1-700
echo "[tests done at $SECONDS s]"
bench 200 --specs power:p=2 --gated --baselines retention --modes fwd+bwd --d 64 --T 4096 16384 65536 \
  --launch ATTENTION_FORM=always --launch ATTENTION_FORM=never --json $OUT/run297_power64.json
bench 150 --specs power:p=2 --gated --baselines --modes fwd+bwd --d 128 --T 4096 16384 --launch ATTENTION_BWD_WARPS=8 \
  --launch ATTENTION_BWD_STAGES=1 --launch ATTENTION_BWD_WARPS=8 ATTENTION_BWD_STAGES=1 --json $OUT/run297_power128.json
bench 100 --specs linear --gated --baselines fla --modes fwd+bwd --d 64 128 --T 512 1024 4096 --launch ATTENTION_FORM=always \
  --launch ATTENTION_FORM=never --json $OUT/run297_linear.json
