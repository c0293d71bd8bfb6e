# Round 45, run 292: the attention kernel at 2 and 3 pipeline stages beside the chunk form, power p = 2 gated
# (d = 64, 128; T = 4k, 16k, 64k) and p = 3 (d = 64), with retention and fla in the same process; the kernel
# now forms a term of token t alone once, before its key loop (none in the shipped specs).
set -u
export TRITON_CACHE_DIR=/tmp/hl/triton HLADSL_CACHE_DIR=/tmp/hl/hladsl
bench() { timeout $1 python3 -m hladsl bench "${@:2}" --plot '' 2>/dev/null | grep -v "^wrote" | tail -45; echo "[bench done at $SECONDS s]"; }
bench 330 --specs power:p=2 --gated --baselines retention fla --modes fwd --d 64 128 --T 4096 16384 65536 \
  --launch ATTENTION_FORM=never --launch ATTENTION_FORM=always ATTENTION_STAGES=2 --launch ATTENTION_FORM=always ATTENTION_STAGES=3 \
  --json $OUT/run292_power.json
bench 150 --specs power:p=3 --gated --modes fwd --d 64 --T 65536 --launch ATTENTION_FORM=always ATTENTION_STAGES=3 --json $OUT/run292_p3.json
timeout 100 python3 -m pytest -q -p no:cacheprovider -n0 tests/gpu/test_gpu_attention.py 2>&1 | tail -3
