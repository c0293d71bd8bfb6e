# Round 46, prepared for the next session (not run: the device time was spent). The review's mends (after run 299:
# CPU only; the shipped specs' modules are unchanged) on the GPU: the quick suite; the attention tests' slow d = 128
# cases with their ratios printed (no xdist: it swallows -s); power p = 2 gated fwd + bwd at d = 128 on the chunk
# form (never timed) beside the attention form, up to 64k; retention at d = 64 fwd + bwd up to 64k (its cold compile
# outran run 297's limit: give it 300 s). Over one call's 600 s: run the suite and tests in one call, the benches in another.
set -u
export TRITON_CACHE_DIR=/tmp/hl/triton HLADSL_CACHE_DIR=/tmp/hl/hladsl
bench() { timeout $1 python3 -m hladsl bench "${@:2}" --plot '' 2>&1 | grep -v "^wrote\|compiling " | tail -40; echo "[bench done at $SECONDS s]"; }
OUT=$OUT/t GPU_TESTS_BUDGET=270 bash benchmarks/gpu_tests.sh -m "gpu and not slow" -n 12 2>&1 | tail -1
timeout 120 python3 -m pytest -q -p no:cacheprovider -p no:xdist -m "gpu and slow" -s tests/gpu/test_gpu_attention.py \
  -k backward 2>&1 | grep "^power\|^linear\|passed\|failed\|Error" | cut -c1-700
bench 200 --specs power:p=2 --gated --baselines --modes fwd+bwd --d 128 --T 4096 16384 65536 --launch ATTENTION_FORM=always \
  --launch ATTENTION_FORM=never --json $OUT/run300_power128.json
bench 300 --specs power:p=2 --gated --baselines retention --modes fwd+bwd --d 64 --T 4096 16384 65536 \
  --json $OUT/run300_retention.json
