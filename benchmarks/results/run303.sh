# Round 47, call 4: where training on the attention form beats the chunk form (the forward's MAC-ratio rule, 3.5,
# is the training rule too): gated fwd + bwd, d = 64, the rule / the form forced / the chunk form forced, around
# the break-even -- linear at 1k-3k (MAC ratio 4.2-12.2), power p = 2 at 16k-24k (5.7-8.6), normalised at 16k-24k
# (9.2-13.7).
set -u
export TRITON_CACHE_DIR=/tmp/hl/triton HLADSL_CACHE_DIR=/tmp/hl/hladsl
bench() { timeout $1 python3 -m hladsl bench "${@:2}" --plot '' 2>&1 | grep -v "^wrote\|compiling \|^\[" | tail -40; echo "[bench done at $SECONDS s]"; }
bench 150 --specs linear --gated --baselines --modes fwd+bwd --d 64 --T 1024 1536 2048 3072 \
  --launch ATTENTION_FORM=always --launch ATTENTION_FORM=never --json $OUT/run303_linear.json
bench 200 --specs power:p=2 power:p=2,normalize=true --gated --baselines --modes fwd+bwd --d 64 --T 16384 20480 24576 \
  --launch ATTENTION_FORM=always --launch ATTENTION_FORM=never --json $OUT/run303_power.json
