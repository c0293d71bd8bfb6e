# Round 45, run 291: the attention kernel's launch variants at d = 128 (chunk 64 / 128, warps, stages), power
# p = 2 ungated and p = 3, linear (gated, d = 64 and 128): the rule, the chunk form and the attention form.
set -u
export TRITON_CACHE_DIR=/tmp/hl/triton HLADSL_CACHE_DIR=/tmp/hl/hladsl
bench() { timeout $1 python3 -m hladsl bench "${@:2}" --plot '' 2>/dev/null | grep -v "^wrote" | tail -40; echo "[bench done at $SECONDS s]"; }
A=ATTENTION_FORM=always
bench 150 --specs power:p=2 --gated --modes fwd --d 128 --T 16384 --launch $A --launch $A ATTENTION_STAGES=3 \
  --launch $A ATTENTION_WARPS=8 --launch $A ATTENTION_CHUNK=128 ATTENTION_WARPS=8 --launch $A ATTENTION_CHUNK=128 ATTENTION_WARPS=8 ATTENTION_STAGES=3 \
  --launch $A ATTENTION_STAGES=1 --json $OUT/run291_variants.json
bench 150 --specs power:p=2 --modes fwd --d 64 128 --T 4096 16384 --launch ATTENTION_FORM=never --launch $A --json $OUT/run291_ungated.json
bench 120 --specs power:p=3 --gated --modes fwd --d 64 --T 4096 16384 --launch ATTENTION_FORM=never --launch $A --json $OUT/run291_p3.json
bench 150 --specs linear --gated --baselines fla --modes fwd --d 64 128 --T 4096 16384 65536 --launch $A --json $OUT/run291_linear.json
