# Round 46, run 296: after run 295 -- the key kernel's masked read of the chunk before its own (an out-of-bounds
# read at chunk 0: run 295's illegal address), dΛ from the pair products [t, n] (run 295: dg 1.2e-2 for linear
# gated normalised). The backward's GPU tests; power p = 3 and d = 128 fwd + bwd; launch variants at d = 64.
set -u
export TRITON_CACHE_DIR=/tmp/hl/triton HLADSL_CACHE_DIR=/tmp/hl/hladsl
bench() { timeout $1 python3 -m hladsl bench "${@:2}" --plot '' 2>&1 | grep -v "^wrote" | tail -40; echo "[bench done at $SECONDS s]"; }
timeout 150 python3 -m pytest -q -p no:cacheprovider -n 4 -m gpu -s tests/gpu/test_gpu_attention.py -k backward 2>&1 \
  | grep "power\|linear\|passed\|failed\|Error\|error" | cut -c1-400
echo "[tests done at $SECONDS s]"
bench 100 --specs power:p=3 --gated --baselines --modes fwd+bwd --d 64 --T 4096 16384 --json $OUT/run296_p3.json
bench 120 --specs power:p=2 --gated --baselines --modes fwd+bwd --d 128 --T 4096 16384 --launch ATTENTION_FORM=always \
  --json $OUT/run296_power128.json
bench 150 --specs power:p=2 --gated --baselines --modes fwd+bwd --d 64 --T 16384 --launch ATTENTION_FORM=always \
  --launch ATTENTION_FORM=always ATTENTION_BWD_WARPS=8 --launch ATTENTION_FORM=always ATTENTION_BWD_STAGES=1 \
  --launch ATTENTION_FORM=always ATTENTION_BWD_STAGES=3 --json $OUT/run296_variants.json
